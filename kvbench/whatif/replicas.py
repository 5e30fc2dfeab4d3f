"""The what-if across replicas (``kvbench trace whatif --replicas N --router NAME``): the prefix hit rate
of N caches, one per replica, each holding what the requests routed to it stored, without the engine.

The what-if has no time and no concurrency, so each router is its engine rule (kvbench.engine.routing)
with what a request-at-a-time model can see: ``round-robin`` as in the engine; ``least-loaded``: the
replica that has been sent the fewest requests so far (one request at a time, that is round-robin);
``session``: the session hashed to a replica, as in the engine; ``prefix``: the same consistent-hash ring
over the request's first ``prefix_blocks`` blocks; ``kv-aware``: the replica holding the longest
run of the request's leading blocks according to an index that learns from routing decisions and never
forgets (Dynamo's approximate indexer without expiry: evictions are not seen), ties to the replica sent
the fewest requests, unless the requests sent are out of balance (BALANCE_ABS, BALANCE_REL): then the
replica sent the fewest. Routing then depends on the requests alone, not on any budget or policy, so the trace
is split into one sub-trace per replica and every (budget, policy) point — LRU's one-pass curve included —
runs on each as it does on a single cache; the hits add up.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbench.engine.routing import ROUTERS, Router
from kvbench.trace.ideal import ideal_hit_blocks
from kvbench.whatif.blocktrace import BlockTrace
from kvbench.whatif.curve import Point

# kv-aware without time: affinity would send every request that shares a first block to one replica,
# so, as SGLang's cache-aware router does, the load is balanced first: when the replica sent the most
# requests has more than BALANCE_ABS and BALANCE_REL times as many as the least, the least gets it.
BALANCE_ABS = 32
BALANCE_REL = 1.5


def route(bt: BlockTrace, replicas: int, router: str, prefix_blocks: int = 4) -> np.ndarray:
    """The replica each request of ``bt`` goes to (int64 [requests]); the session router reads
    ``bt.sessions``."""
    if router not in ROUTERS or router == "conductor":  # (the conductor times prefills: a replay's)
        raise ValueError(f"unknown router {router!r}")
    if router == "session" and bt.sessions is None:
        raise ValueError("the session router reads the trace's sessions: a BlockTrace from prepare")
    n = bt.requests
    out = np.zeros(n, dtype=np.int64)
    if replicas == 1:
        return out
    sent = [0] * replicas
    ring = Router("prefix", replicas, prefix_blocks=prefix_blocks) if router == "prefix" else None
    sessions = Router("session", replicas)
    seen = np.zeros((replicas, max(bt.distinct_blocks, 1)), dtype=bool) if router == "kv-aware" else None
    starts, lookups, ids = bt.starts, bt.lookups, bt.ids
    for i in range(n):
        blocks = ids[starts[i]:starts[i + 1]]
        fewest = min(range(replicas), key=lambda r: (sent[r], r))
        if router == "round-robin":
            r = i % replicas
        elif router == "least-loaded":
            r = fewest
        elif router == "session":
            s = bt.sessions[i]
            r = fewest if s is None else sessions.route(0.0, s, (), 0, None)[0]
        elif router == "prefix":  # the engine's ring over the same block keys of the blocks it can hit
            look = bt.keys[blocks[:lookups[i]]]
            r = ring.route(0.0, None, look.tolist(), len(look), [(sent[x], 0, 0) for x in range(replicas)])[0]
        elif max(sent) - sent[fewest] > BALANCE_ABS and max(sent) > BALANCE_REL * sent[fewest]:
            r = fewest  # kv-aware, the load out of balance: the least-loaded replica
        else:  # kv-aware: the longest run of leading blocks the index has seen on a replica
            look = blocks[:lookups[i]]
            best, r = -1, fewest
            for x in range(replicas):
                have = seen[x][look]
                h = len(have) if have.all() else int(have.argmin())
                if h > best or (h == best and (sent[x], x) < (sent[r], r)):
                    best, r = h, x
            seen[r][blocks] = True
        out[i] = r
        sent[r] += 1
    return out


def split(bt: BlockTrace, where: np.ndarray, replicas: int, future: bool) -> list[BlockTrace]:
    """One sub-trace per replica: its requests in trace order, its blocks renumbered densely (in order
    of first appearance, parents with them), the warm-up window where the whole trace's begins, and its
    own ceiling (an infinite cache of the replica's own)."""
    import pandas as pd

    from kvbench.whatif.compiled import next_uses_dense

    out = []
    sizes = np.diff(bt.starts)
    for r in range(replicas):
        idx = np.flatnonzero(where == r)
        starts = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(sizes[idx], out=starts[1:])
        old = (np.concatenate([bt.ids[bt.starts[i]:bt.starts[i + 1]] for i in idx])
               if len(idx) else np.zeros(0, dtype=np.int64))
        ids, uniq = pd.factorize(old)
        ids = ids.astype(np.int64, copy=False)
        parent = None
        if bt.parent is not None:
            new_of = np.full(max(bt.distinct_blocks, 1), -1, dtype=np.int64)
            new_of[uniq] = np.arange(len(uniq))
            up = bt.parent[uniq]
            parent = np.where(up >= 0, new_of[np.maximum(up, 0)], -1)
        lookups = bt.lookups[idx]
        first = int((idx < bt.window_start).sum())
        sub = BlockTrace(bt.block_size, ids, starts, lookups, bt.prompt_lens[idx], len(uniq), first,
                         _ceiling(ids, starts, lookups, first, bt.block_size),
                         partial=None if bt.partial is None else bt.partial[idx],
                         arrival_s=None if bt.arrival_s is None else bt.arrival_s[idx], parent=parent)
        if future:
            sub.next_use = next_uses_dense(ids, starts, lookups)
        out.append(sub)
    return out


def _ceiling(ids, starts, lookups, first, block_size) -> int:
    """Hit tokens of an infinite cache over these requests, counted from ``first`` on (the ideal hit
    rate's rule over dense ids: kvbench.trace.ideal.ideal_hit_blocks)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return int(ideal_hit_blocks(ids, starts, lookups)[first:].sum()) * block_size


def combine(parts: list[dict], budget_blocks: Sequence[int], policies: Sequence[str]) -> dict:
    """The replicas' points at each (budget, policy) as one: hits, evictions and too-large requests add up."""
    out = {}
    for b in budget_blocks:
        for p in policies:
            pts = [part[(b, p)] for part in parts]
            out[(b, p)] = Point(b, p, sum(x.hit_tokens for x in pts), sum(x.evicted_blocks for x in pts),
                                sum(x.too_large for x in pts), sum(x.wall_s for x in pts))
    return out
