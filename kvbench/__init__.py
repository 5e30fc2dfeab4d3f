"""kvbench: replay LLM request traces through a real paged-KV engine.

The public face, for scripts and notebooks (each name is imported on first use, so ``kvbench --help``
stays fast)::

    import kvbench
    cfg = kvbench.ReplayConfig(executor="sim", model="llama-3-8b", layout="slab")
    summary = kvbench.replay("traces/chat.jsonl", cfg, "runs/chat-slab")

Layers (docs/architecture.md), each a package that imports only the ones before it:
trace -> memory -> eviction -> scheduler -> executors -> engine -> sweep/whatif/report -> cli.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Request": "kvbench.trace", "Segment": "kvbench.trace", "load_trace": "kvbench.trace",
    "write_trace": "kvbench.trace", "TokenStreams": "kvbench.trace", "ideal_hits": "kvbench.trace",
    "PagedKV": "kvbench.memory", "SlabKV": "kvbench.memory", "BlockPool": "kvbench.memory",
    "Scheduler": "kvbench.scheduler", "SchedulerConfig": "kvbench.scheduler",
    "make_executor": "kvbench.executors",
    "ReplayConfig": "kvbench.engine.config", "Replay": "kvbench.engine.replay", "replay": "kvbench.engine.replay",
    "run_sweep": "kvbench.sweep", "build_report": "kvbench.report",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    try:
        module = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'kvbench' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
