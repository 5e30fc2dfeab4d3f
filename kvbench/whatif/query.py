"""The what-if as the command asks it (``whatif``): prepare the trace once, run every (budget, policy)
point, one cache per budget or one per replica (kvbench.whatif.replicas), and gather the table with
its settings and the ceiling (``WhatIf``)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbench.memory.policies import check_policy, needs_future
from kvbench.trace.format import Request
from kvbench.trace.pieces import Pieces
from kvbench.trace.tokens import TokenStreams
from kvbench.whatif import replicas as rep
from kvbench.whatif.blocktrace import HashedTrace, prepare
from kvbench.whatif.curve import (
    Budget,
    StackCurve,
    SummedCurve,
    check_mode,
    full_curve,
    gap_closed,
    run_points,
)
from kvbench.whatif.output import WhatIf, head


def whatif(requests: Sequence[Request] | Pieces | HashedTrace, *, trace: str, model: str, kv_dtype: str,
           kv_bytes_per_token: int, block_size: int, budgets: Sequence[Budget],
           policies: Sequence[str], warmup: float = 0.5, jobs: int = 1,
           streams: TokenStreams | None = None, prefix_mode: str = "hash", replicas: int = 1,
           router: str = "round-robin", router_prefix_blocks: int = 4) -> WhatIf:
    """The table: every (budget, policy) point, one cache per budget, or with ``replicas`` > 1 one cache
    of the budget per replica and the requests routed by ``router`` (kvbench.whatif.replicas).
    ``requests``: as ``prepare`` takes them."""
    for p in policies:
        check_policy(p)
    check_mode(prefix_mode, policies)
    future = any(needs_future(p) for p in policies)
    bt = prepare(requests, block_size, warmup, future=future, streams=streams)
    curves: list[StackCurve] = []
    blocks = [b.blocks for b in budgets]
    cluster = {}
    if replicas > 1:
        where = rep.route(bt, replicas, router, router_prefix_blocks)
        subs = rep.split(bt, where, replicas, future)
        parts, part_curves = [], []
        for sub in subs:
            got: list[StackCurve] = []
            parts.append(run_points(sub, blocks, policies, jobs, prefix_mode, got.append))
            part_curves.append(got[0] if got else None)
        points = rep.combine(parts, blocks, policies)
        if part_curves and all(c is not None for c in part_curves):
            curves.append(SummedCurve(part_curves, bt))
        p_all = bt.window_prompt_tokens
        cluster = {"replicas": replicas, "router": router,
                   "replica_requests": np.bincount(where, minlength=replicas).tolist(),
                   "replicas_ceiling": sum(s.ceiling_hit_tokens for s in subs) / p_all if p_all else 0.0}
    else:
        points = run_points(bt, blocks, policies, jobs, prefix_mode, curves.append)
    prompt = bt.window_prompt_tokens
    rows = []
    for b in budgets:
        for p in policies:
            pt = points[(b.blocks, p)]
            rows.append({"budget_bytes": b.bytes, "budget_blocks": b.blocks, "policy": p,
                         "budget": b.label,
                         "hit_rate": pt.hit_tokens / prompt if prompt else 0.0,
                         "ceiling": bt.ceiling, "hit_tokens": pt.hit_tokens,
                         "gap_closed": gap_closed(points, b.blocks, p),
                         "evicted_blocks": pt.evicted_blocks, "too_large_requests": pt.too_large})
    return WhatIf(**head(bt, trace=trace, model=model, kv_dtype=kv_dtype, kv_bytes_per_token=kv_bytes_per_token,
                         block_size=block_size, warmup=warmup),
                  rows=rows, prefix_mode=prefix_mode,
                  lru_curve=full_curve(curves[0], budgets, kv_bytes_per_token * block_size) if curves else None,
                  **cluster)
