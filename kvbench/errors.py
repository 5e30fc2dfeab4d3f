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
        if field is not None and field.startswith("--"):  # an option, and the path it was given
            text = f"{field} {file}: {message}" if file is not None else f"{field}: {message}"
        else:
            where = ""
            if file is not None:
                where = f"{file}:{line}: " if line is not None else f"{file}: "
            what = f"field '{field}': " if field is not None else ""
            text = f"{where}{what}{message}"
        super().__init__(one_line(text))


def one_line(text: str) -> str:
    """The message on one line, whatever the bad input put in it: control characters escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class RunError(Exception):
    """A run that cannot continue. ``usage`` marks causes that lie in the user's settings (exit 2)."""

    def __init__(self, message: str, *, usage: bool = False):
        self.usage = usage
        super().__init__(message)
