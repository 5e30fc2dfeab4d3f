"""Layer 7, the cache what-if: prefix hit rate against KV budget and cache policy from the trace
alone, without the engine: the trace's model (blocktrace), one point and lru's whole curve (curve,
over the compiled cores in compiled), the command's question (query), replicas, tiers and external
stores (replicas, tiers), outputs (output), and the learned policy's fit (fit).

Each name below is imported on first use, and numba only when a compiled core runs: a what-if's
records and tables (output) load without it."""
from __future__ import annotations

import importlib

_PUBLIC = {
    "BlockTrace": "blocktrace", "HashedTrace": "blocktrace", "prepare": "blocktrace",
    "read_hashed_cached": "blocktrace",
    "Budget": "curve", "Point": "curve", "budgets_from_blocks": "curve", "budgets_from_bytes": "curve",
    "run_points": "curve", "simulate": "curve",
    "WhatIf": "output", "WhatIfHead": "output", "format_bytes": "output", "gap_table": "output", "head": "output",
    "table": "output", "write_outputs": "output", "TextTable": "output", "tiers_table": "output",
    "versus_lru": "output",
    "whatif": "query",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    try:
        module = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'kvbench.whatif' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"kvbench.whatif.{module}"), name)
    globals()[name] = value
    return value
