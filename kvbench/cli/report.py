"""``kvbench report``: runs, sweeps and what-if tables -> PNG charts and one offline index.html."""
from __future__ import annotations

import json
import os

import click


@click.command(epilog="""
\b
Examples:
  kvbench report sweeps/chat-1a2b3c4d --out reports/chat
  kvbench report runs/chat-paged runs/chat-slab runs/agent-paged --out reports/compare
  kvbench report runs/ --out reports/all        # every run and sweep directly under runs/
""")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="report directory [default: reports/<name of the first DIR>]")
@click.option("--title", default="kvbench report", show_default=True, help="the page's title")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
def report(dirs, out, title, as_json):
    """Write PNG charts and a self-contained index.html (opens offline) for DIRS: run directories,
    sweep directories, `kvbench trace whatif` directories, or directories holding any of those."""
    from kvbench.report.html import build_report

    out = out or os.path.join("reports", os.path.basename(os.path.normpath(dirs[0])))
    rep = build_report(list(dirs), out, title=title)
    if as_json:
        click.echo(json.dumps({"index": rep.index, "charts": [os.path.join(out, c) for c in rep.charts]}))
    else:
        click.echo(rep.index)
        click.echo(f"kvbench report: {len(rep.charts)} charts in {out}", err=True)


COMMANDS = [report]
