"""What the commands print: tables on stdout that stay readable at 80 columns and whole when piped,
and the rich progress bar on stderr (only when stderr is a terminal).

A table that fits the terminal is drawn as a table; one that does not is printed one record per
block (``name`` then ``label  value`` lines), so no cell is ever cut to ``pag…``. Piped output is a
plain table as wide as its content, never cut.
"""
from __future__ import annotations

import shutil
import sys
from collections.abc import Collection
from dataclasses import dataclass


@dataclass
class Column:
    label: str
    right: bool = True  # numbers align right


def _term_width() -> int:
    return shutil.get_terminal_size((80, 24)).columns


def print_table(title: str, columns: list[Column], rows: list[list[str]], caption: str = "",
                file=None, width: int | None = None, bold: Collection[tuple[int, int]] = ()) -> None:
    """Print ``rows`` (cells as text, never markup) under ``columns``. On a terminal narrower than the
    table, one block per row instead; piped (not a terminal), a borderless table of its full width.
    ``bold``: (row, column) of cells drawn bold on a terminal (a row's best figure)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def cell(i: int, j: int, text: str) -> Text:
        return Text(text, style="bold" if (i, j) in bold else "")

    out = file or sys.stdout
    tty = out.isatty() if hasattr(out, "isatty") else False
    need = _natural_width(columns, rows)
    if not tty and width is None:  # the title and caption as lines of their own: never wrapped to the table
        t = Table(box=box.SIMPLE_HEAD)
        for c in columns:
            t.add_column(Text(c.label), justify="right" if c.right else "left", no_wrap=True, overflow="fold")
        for row in rows:
            t.add_row(*map(Text, row))
        import io

        buf = io.StringIO()
        Console(file=buf, width=max(need, 40), no_color=True, highlight=False, soft_wrap=False).print(t)
        lines = [title, *buf.getvalue().splitlines(), *(caption.splitlines() if caption else [])]
        out.write("\n".join(line.rstrip() for line in lines) + "\n")
        return
    width = width or _term_width()
    console = Console(file=out, width=width, highlight=False)
    if need <= width:
        t = Table(title=Text(title), caption=Text(caption) if caption else None, caption_justify="left")
        for c in columns:
            t.add_column(Text(c.label), justify="right" if c.right else "left", no_wrap=True)
        for i, row in enumerate(rows):
            t.add_row(*(cell(i, j, x) for j, x in enumerate(row)))
        console.print(t)
        return
    # too wide: one block per record, its cells packed as "label value" pairs into the width
    console.print(Text(title, style="bold"))
    for i, row in enumerate(rows):
        console.print(cell(i, 0, row[0]), style="bold", soft_wrap=True)
        line = Text(" ")
        for j, (c, x) in enumerate(zip(columns[1:], row[1:]), 1):
            pair = Text(f"{c.label} ").append(cell(i, j, x))
            if len(line) > 1 and len(line) + 3 + len(pair) > width:
                console.print(line, soft_wrap=True)
                line = Text(" ")
            line.append(" · " if len(line) > 1 else " ").append(pair)
        if len(line) > 1:
            console.print(line, soft_wrap=True)
    if caption:
        console.print(Text(caption))


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
