"""``kvbench trace ...``: generate, convert and inspect traces."""
from __future__ import annotations

import click


@click.group()
def trace():
    """Generate, convert and inspect request traces."""
