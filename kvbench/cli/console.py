"""What the commands print: tables on stdout that stay readable at 80 columns and whole when piped,
and the rich progress bar on stderr (only when stderr is a terminal).

A table that fits the terminal is drawn as a table; one that does not is printed one record per
block (``name`` then ``label  value`` lines), so no cell is ever cut to ``pag…``. Piped output is a
plain table as wide as its content, never cut.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass


@dataclass
class Column:
    label: str
    right: bool = True  # numbers align right


def _term_width() -> int:
    return shutil.get_terminal_size((80, 24)).columns


def print_table(title: str, columns: list[Column], rows: list[list[str]], caption: str = "",
                file=None, width: int | None = None) -> None:
    """Print ``rows`` (cells as text) under ``columns``. On a terminal narrower than the table, one
    block per row instead; piped (not a terminal), a borderless table of its full width."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    out = file or sys.stdout
    tty = out.isatty() if hasattr(out, "isatty") else False
    need = _natural_width(columns, rows)
    if not tty and width is None:
        t = Table(title=title, caption=caption or None, caption_justify="left", box=box.SIMPLE_HEAD,
                  title_justify="left")
        for c in columns:
            t.add_column(c.label, justify="right" if c.right else "left", no_wrap=True, overflow="fold")
        for row in rows:
            t.add_row(*row)
        import io

        buf = io.StringIO()
        Console(file=buf, width=max(need, len(title), 40), no_color=True, highlight=False,
                soft_wrap=False).print(t)
        out.write("\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n")
        return
    width = width or _term_width()
    console = Console(file=out, width=width, highlight=False)
    if need <= width:
        t = Table(title=title, caption=caption or None, caption_justify="left")
        for c in columns:
            t.add_column(c.label, justify="right" if c.right else "left", no_wrap=True)
        for row in rows:
            t.add_row(*row)
        console.print(t)
        return
    # too wide: one block per record, its cells packed as "label value" pairs into the width
    console.print(f"[bold]{title}[/bold]")
    for row in rows:
        console.print(row[0], style="bold", soft_wrap=True, markup=False)
        line = " "
        for c, cell in zip(columns[1:], row[1:]):
            pair = f"{c.label} {cell}"
            if len(line) > 1 and len(line) + 3 + len(pair) > width:
                console.print(line, soft_wrap=True, markup=False)
                line = " "
            line += (" · " if len(line) > 1 else " ") + pair
        if len(line) > 1:
            console.print(line, soft_wrap=True, markup=False)
    if caption:
        console.print(caption, markup=False)


def _natural_width(columns: list[Column], rows: list[list[str]]) -> int:
    """Characters a bordered table of these cells takes without cutting any."""
    widths = [len(c.label) for c in columns]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    return sum(widths) + 3 * len(widths) + 1


def progress_bar(label: str, *info_columns: str):
    """A transient rich progress bar on stderr: label, bar, done/total, elapsed, remaining, info."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=Console(stderr=True),
                    transient=True)


def say_compiling(modules) -> bool:
    """Say on stderr that the numba cores a command needs compile now (their first run on this
    install), so a quiet half minute is explained; -> whether they do."""
    import click

    from kvbench.jit import compile_notice

    line = compile_notice(modules)
    if line:
        click.echo(f"kvbench: {line}", err=True)
    return line is not None


def working(text: str, enabled: bool):
    """A spinner on stderr with ``text`` while a block runs (only on a terminal), else nothing."""
    import contextlib

    if not (enabled and sys.stderr.isatty()):
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(text)
