"""The live replay: a trace sent to a running OpenAI-compatible server (vLLM, SGLang, any
``/v1/completions`` that takes token ids), measured from the client, written as a run directory like
a simulated run's. The server schedules; kvbench only issues requests (kvbench.engine.issuer: the
trace's times, ``--max-concurrency`` slots and dependent turns) and times what comes back.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LiveOptions:
    """How to reach the server and what to send it (the ReplayConfig holds the workload's settings)."""

    endpoint: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    api: str = "completions"  # or "chat" (/v1/chat/completions)
    served_model: str | None = None  # the "model" field of each request [default: the server's first]
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    warmup: int = 0  # requests sent first and left out of every statistic
    max_seconds: float | None = None  # stop issuing after this many seconds (wall clock)
    max_requests: int | None = None  # stop after issuing this many (warm-up excluded)
    request_timeout_s: float = 600.0
    retries: int = 2  # a request that fails before its first byte is sent again at most this often
    metrics_interval_s: float = 1.0  # /metrics scraped every so often during the run (0: before and after only)
    remap_vocab: bool = False  # map token ids above the served model's vocabulary onto it, keeping the sharing


def replay_live(trace_path: str, cfg, opts: LiveOptions, out_dir: str, *, force: bool = False,
                unique: bool = False, invocation=None, quiet: bool = False) -> tuple[dict, str]:
    """Send the trace to ``opts.endpoint`` and write the run directory; -> (summary, run directory)."""
    from kvbench.errors import RunError

    raise RunError("the live replay (--endpoint) is not built yet", usage=True)
