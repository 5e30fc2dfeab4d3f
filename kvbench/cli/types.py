"""Click parameter types shared by the commands: numbers that must be finite and bounded.

click's FloatRange lets ``nan`` through (every comparison with it is false) and ``inf`` through an
open upper end; a NaN time scale hangs a replay and a NaN rate writes a trace kvbench then rejects.
"""
from __future__ import annotations

import math

import click

from kvbench.trace.format import MAX_REQUEST_TOKENS

MAX_FLOAT = 1e9  # the largest value any float option takes when it names no bound of its own


class Finite(click.FloatRange):
    """A float in a range, never NaN or infinite."""

    def __init__(self, min=None, max=MAX_FLOAT, min_open=False, max_open=False):
        super().__init__(min=min, max=MAX_FLOAT if max is None else max, min_open=min_open, max_open=max_open)

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


def Count(min: int = 1, max: int = MAX_REQUEST_TOKENS) -> click.IntRange:
    """An integer with both ends bounded (a size that allocates must have a ceiling)."""
    return click.IntRange(min=min, max=max)


class PD(click.ParamType):
    """``P:D`` (prefill and decode instances, each at least 1), or ``none``/``off``: no disaggregation."""

    name = "P:D"

    def convert(self, value, param, ctx):
        if value is None:
            return None
        text = str(value).strip().lower()
        if text in ("none", "off", "0:0"):
            return None
        parts = text.split(":")
        if len(parts) == 2 and all(p.isdigit() and int(p) >= 1 for p in parts):
            return f"{int(parts[0])}:{int(parts[1])}"
        self.fail(f"{value!r} is not P:D (prefill and decode instances, each at least 1) or none", param, ctx)
