"""``kvbench report``: runs, sweeps and what-if tables -> PNG charts and one offline index.html."""
from __future__ import annotations

import os

import click

from kvbench.errors import InputError
from kvbench.jsonio import dumps

DEFAULT_DIR = "runs"  # where replay (runs/<trace>-<timestamp>) and sweep (runs/<trace>-sweep-<hash>) write


@click.command(epilog="""
\b
Examples:
  kvbench report                                # everything under runs/ -> reports/runs/index.html
  kvbench report runs/chat-sweep-1a2b3c4d --out reports/chat
  kvbench report runs/chat-paged runs/chat-slab runs/agent-paged --out reports/compare
Runs are compared only with runs of the same trace and requests, model, executor, GPU, time scale
and KV pool: each such group gets its own section.
""")
@click.argument("dirs", nargs=-1, type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="report directory [default: reports/<name of the first DIR>]")
@click.option("--title", default="kvbench report", show_default=True, help="the page's title")
@click.option("--on-bad-run", "on_bad", type=click.Choice(["skip", "stop"]), default="skip", show_default=True,
              help="a run, sweep or what-if table that cannot be read: leave it out (one line on stderr) or stop")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
def report(dirs, out, title, on_bad, as_json):
    """Write PNG charts and a self-contained index.html (opens offline) for DIRS: run directories,
    sweep directories, `kvbench trace whatif` directories, or directories holding any of those
    [default: runs/, where replay and sweep write]."""
    from kvbench.report.html import build_report

    if not dirs:
        if not os.path.isdir(DEFAULT_DIR):
            raise InputError("no DIRS given and no runs/ here: run kvbench replay or kvbench sweep first, "
                             "or name the directories to report", file=DEFAULT_DIR)
        dirs = (DEFAULT_DIR,)
    out = out or os.path.join("reports", os.path.basename(os.path.abspath(dirs[0])))
    rep = build_report(list(dirs), out, title=title, on_bad=on_bad)
    for line in rep.skipped:
        click.echo(f"kvbench report: left out: {line}", err=True)
    if as_json:
        click.echo(dumps({"index": rep.index, "charts": [os.path.join(out, c) for c in rep.charts],
                          "skipped": rep.skipped}))
    else:
        click.echo(rep.index)
        click.echo(f"kvbench report: {len(rep.charts)} charts in {out}", err=True)


@click.command(epilog="""
\b
Examples:
  kvbench export runs/chat-paged                 # requests.csv, steps.csv, summary.csv beside the parquet
  kvbench export runs/chat-sweep-1a2b3c4d --out csv/chat
""")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["csv"]), default="csv", show_default=True,
              help="what to write")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="directory for the files [default: beside each run's parquet files; with several "
                   "DIRS, one folder per DIR under --out]")
def export(dirs, fmt, out):
    """Write a run's or a sweep's tables as CSV (requests, steps, sweep, and summary.json as one row),
    for a spreadsheet; the parquet files stay the source of truth."""
    from kvbench.report.export import export_csv

    for d in dirs:
        dest = None if out is None else (out if len(dirs) == 1 else os.path.join(out, os.path.basename(
            os.path.normpath(d))))
        for path in export_csv(d, dest):
            click.echo(path)


COMMANDS = [report, export]
