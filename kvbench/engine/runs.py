"""Which replay a configuration runs: the mixed engine (engine.replay: one or more replicas that each do
both phases) or disaggregated prefill and decode instances (engine.disagg)."""
from __future__ import annotations

from kvbench.engine.config import ReplayConfig
from kvbench.engine.disagg import DisaggReplay
from kvbench.engine.replay import Replay
from kvbench.provenance import Invocation
from kvbench.trace.format import Request


def replay_class(cfg: ReplayConfig) -> type[Replay]:
    return DisaggReplay if cfg.disaggregated else Replay


def replay(trace_path: str, cfg: ReplayConfig, out_dir: str, on_progress=None,
           requests: list[Request] | None = None, force: bool = False, trace_label: str | None = None,
           invocation: Invocation | None = None) -> dict:
    """Replay a trace under one configuration into ``out_dir``; return summary.json's contents."""
    return replay_class(cfg)(trace_path, cfg, out_dir, requests, force=force, trace_label=trace_label,
                             invocation=invocation).run(on_progress)
