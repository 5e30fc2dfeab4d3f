"""Statistics of a trace for ``kvbench trace inspect``: counts, token totals, length percentiles,
distinct shared segments and the ideal prefix hit rate (kvbench.trace.ideal), in one streaming pass."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import numpy as np

from kvbench.trace.format import Request, iter_trace
from kvbench.trace.ideal import ideal_hits, radix_ideal_hits
from kvbench.trace.tokens import TokenStreams

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class TraceStats:
    requests: int
    sessions: int  # distinct ``session`` values; requests without one are not counted
    samples: int  # sum of ``n``: sequences to generate
    duration_s: float  # last arrival minus first arrival
    prompt_tokens: int
    output_tokens: int  # sum of output_len x n: every sample generates its own answer
    prompt_len: dict  # p50/p90/p99/max/mean of per-request prompt length, tokens
    output_len: dict  # the same for output_len (per sample)
    shared_segments: int  # distinct shared stream names
    shared_tokens: int  # tokens of shared segments, counting each name at its longest use
    block_size: int
    ideal_hit_tokens: int
    ideal_hit_rate: float

    def to_dict(self) -> dict:
        return asdict(self)


def _summary(x: np.ndarray) -> dict:
    if x.size == 0:
        return {f"p{p}": 0 for p in PERCENTILES} | {"max": 0, "mean": 0.0}
    qs = np.percentile(x, PERCENTILES)
    return ({f"p{p}": float(q) for p, q in zip(PERCENTILES, qs)}
            | {"max": int(x.max()), "mean": float(x.mean())})


def trace_stats(requests: Iterable[Request], block_size: int = 16,
                streams: TokenStreams | None = None, prefix_mode: str = "hash") -> TraceStats:
    """Statistics of requests taken in the given (trace) order; the ideal hit rate in whole blocks
    (``prefix_mode`` hash) or to the token (radix)."""
    prompt_lens: list[int] = []
    output_lens: list[int] = []
    sessions: set[str] = set()
    shared: dict[str, int] = {}
    tally = {"samples": 0, "output": 0, "t_min": float("inf"), "t_max": float("-inf")}

    def observe(reqs: Iterable[Request]) -> Iterator[Request]:
        # Feeds ideal_hits while collecting everything else, so the trace is read once.
        for r in reqs:
            prompt_lens.append(r.prompt_len if r.prompt_len >= 0 else sum(s.length for s in r.prompt))
            output_lens.append(r.output_len)
            tally["samples"] += r.n
            tally["output"] += r.output_len * r.n
            tally["t_min"] = min(tally["t_min"], r.t)
            tally["t_max"] = max(tally["t_max"], r.t)
            if r.session is not None:
                sessions.add(r.session)
            for s in r.prompt:
                if s.kind == "shared" and s.length > shared.get(s.name, 0):
                    shared[s.name] = s.length
            yield r

    if prefix_mode == "radix":  # two passes over the requests: keep them
        reqs = list(observe(requests))
        hits = radix_ideal_hits(reqs, block_size, streams)
    else:
        hits = ideal_hits(observe(requests), block_size, streams)
    n = len(prompt_lens)
    return TraceStats(
        requests=n, sessions=len(sessions), samples=tally["samples"],
        duration_s=round(tally["t_max"] - tally["t_min"], 6) if n else 0.0,
        prompt_tokens=hits.prompt_tokens, output_tokens=tally["output"],
        prompt_len=_summary(np.asarray(prompt_lens)), output_len=_summary(np.asarray(output_lens)),
        shared_segments=len(shared), shared_tokens=sum(shared.values()), block_size=block_size,
        ideal_hit_tokens=hits.hit_tokens, ideal_hit_rate=round(hits.hit_rate, 6))


def inspect_trace(path: str | os.PathLike, block_size: int = 16, prefix_mode: str = "hash") -> TraceStats:
    """Read and validate a trace file and return its statistics."""
    return trace_stats(iter_trace(path), block_size, prefix_mode=prefix_mode)
