"""The ``kvbench`` command line: a click group; each command lives in a cli_* module of its own,
imported when the command is run or listed (``COMMANDS``), so a command pays only for its own imports
(``kvbench trace whatif`` never loads the engine, pandas, pyarrow or torch).

Errors: InputError and click usage errors print one line on stderr and exit 2; RunError exits 1
(2 where it blames the settings). Data goes to stdout, progress and logs to stderr.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import sys

import click

from kvbench import __version__
from kvbench.errors import InputError, RunError, one_line

EXAMPLES = """
\b
Examples:
  kvbench trace inspect traces/chat.jsonl --block-size 16
  kvbench replay traces/chat.jsonl --executor sim --model llama-3-8b
  kvbench sweep traces/chat.jsonl --block-size 8,16,32 --layout paged,slab -j 2
  kvbench report runs/* --out reports/mine
"""


# every top-level command: name -> "module:attribute" (each module's COMMANDS, and the trace group)
COMMANDS = {
    "trace": "kvbench.cli.trace:trace",
    "replay": "kvbench.cli.replay:replay",
    "sweep": "kvbench.cli.sweep:sweep",
    "report": "kvbench.cli.report:report",
    "export": "kvbench.cli.report:export",
    "selfcheck": "kvbench.cli.model:selfcheck",
    "calibrate": "kvbench.cli.model:calibrate",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use, by name, from ``COMMANDS`` (click's lazy
    loading pattern): ``kvbench trace ...`` imports kvbench.cli.trace and nothing of the others;
    ``kvbench --help`` imports them all, for their one-line help."""

    def list_commands(self, ctx) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx, name: str):
        if name not in self.commands and name in COMMANDS:
            module, attribute = COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), name)
        return self.commands.get(name)


@click.group(cls=LazyGroup, epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvbench")
def cli():
    """Replay LLM request traces through a real paged-KV engine and compare KV-cache choices."""


def _register() -> None:
    """Import every command now (for callers that read ``cli.commands``)."""
    for name in COMMANDS:
        cli.get_command(None, name)


def _fail(message: str, code: int) -> None:
    click.echo(f"kvbench: error: {one_line(message)}", err=True)
    sys.exit(code)


def _leave_heap_at_exit() -> None:
    """At exit the interpreter collects cycles while it tears the modules down, walking every object
    still alive, numba's typing registries among them (some 10^5 objects, once a compiled core has
    run): frozen, they are left to the process's end, as the rest of its memory is. Not where triton
    is loaded: nanobind, under it, reports each of its objects not collected as a leak."""
    if "triton" not in sys.modules:
        gc.freeze()


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv``; without one, this process's own (the kvbench script, python -m
    kvbench), after which the process ends (``_leave_heap_at_exit``)."""
    if argv is None:
        atexit.register(_leave_heap_at_exit)
    try:
        rv = cli.main(args=argv, prog_name="kvbench", standalone_mode=False)
    except InputError as e:
        _fail(str(e), 2)
    except click.exceptions.Abort:
        _fail("interrupted", 130)
    except click.exceptions.NoSuchOption as e:
        _fail(e.format_message(), 2)
    except click.UsageError as e:
        if type(e).__name__ != "NoArgsIsHelpError" or e.ctx is None:  # click >= 8.2: a bare group
            ctx = e.ctx
            _fail(f"{ctx.command_path + ': ' if ctx is not None else ''}{e.format_message()}", e.exit_code or 2)
        click.echo(e.ctx.get_help())  # a bare group asks for its help: on stdout, exit 0
        return
    except click.ClickException as e:
        code = e.exit_code if e.exit_code else 1
        ctx = getattr(e, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        _fail(f"{where}{e.format_message()}", code)
    except RunError as e:
        _fail(str(e), 2 if e.usage else 1)
    except BrokenPipeError:
        sys.exit(0)
    if isinstance(rv, int) and rv:
        sys.exit(rv)


if __name__ == "__main__":
    main()
