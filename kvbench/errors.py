"""The error types every layer raises, and how the CLI turns them into exit codes.

InputError is bad input from the user (a trace, a flag, a file): exit 2 with one line naming the
file, line and field. RunError is a run that could not go on (e.g. a pool that can hold no request):
exit 1, or 2 where the cause is the user's settings (``usage=True``).
"""
from __future__ import annotations


class InputError(Exception):
    """Bad user input. ``str()`` is the one-line message the CLI prints."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None):
        self.file, self.line, self.field, self.reason = file, line, field, message
        where = ""
        if file is not None:
            where = f"{file}:{line}: " if line is not None else f"{file}: "
        what = f"field '{field}': " if field is not None else ""
        super().__init__(f"{where}{what}{message}")


class RunError(Exception):
    """A run that cannot continue. ``usage`` marks causes that lie in the user's settings (exit 2)."""

    def __init__(self, message: str, *, usage: bool = False):
        self.usage = usage
        super().__init__(message)
