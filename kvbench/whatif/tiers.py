"""The tiered what-if (``kvbench trace whatif --tiers``) and the external-store semantics
(``--budget-counts cache``): prefix hit rate per tier (GPU pool, host DRAM, local NVMe) for every
combination of tier sizes and cache policy, from the trace alone, with the ceiling beside it. The GPU
tier is kvbench.whatif.curve.simulate; each lower tier is a ``Store`` of cached blocks only. Lookup,
write-through and write-back, belady's bypass and what the tests hold: docs/architecture.md,
"Layer 7, whatif" ("Tiers and external stores in the what-if").
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbench.errors import InputError
from kvbench.memory.policies import BeladyPolicy, make_policy, needs_future
from kvbench.memory.policy_base import NEVER, CachePolicy
from kvbench.trace.format import Request
from kvbench.trace.pieces import Pieces
from kvbench.trace.tokens import TokenStreams
from kvbench.whatif import output
from kvbench.whatif.blocktrace import BlockTrace, DenseView, HashedTrace, prepare
from kvbench.whatif.curve import Budget, Point, gap_closed, simulate
from kvbench.whatif.output import WhatIf, WhatIfHead, head

TIERS = ("gpu", "cpu", "disk")  # fastest first: a lookup walks them in this order
LOWER = TIERS[1:]
OFFLOAD = ("write-through", "write-back")
BUDGET_COUNTS = ("pool", "cache")


# --------------------------------------------------------------------------------- --tiers

def parse_tiers(text: str, field: str = "--tiers") -> dict[str, list[tuple[int, str]]]:
    """'gpu=16GiB,32GiB,cpu=0,512GiB' -> {'gpu': [(bytes, '16GiB'), ...], 'cpu': [(0, '0'), ...],
    'disk': [(0, '0')]}: an item with ``name=`` starts a tier, bare items extend its list; a tier
    not named is absent (0); gpu is required and holds at least one byte. InputError otherwise."""
    from kvbench.engine.sizes import parse_size

    tiers: dict[str, list[tuple[int, str]]] = {}
    current = None
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        name, eq, size = item.rpartition("=")
        if eq:
            name = name.strip().lower()
            if name not in TIERS:
                raise InputError(f"unknown tier {name[:30]!r} (choose from {', '.join(TIERS)})", field=field)
            if name in tiers:
                raise InputError(f"tier {name!r} given twice (list its sizes after one {name}=)", field=field)
            current = tiers[name] = []
        elif current is None:
            raise InputError(f"{item[:30]!r} names no tier: start with gpu=SIZE", field=field)
        size = size.strip()
        nbytes = parse_size(size, field, allow_zero=current is not tiers.get("gpu"))  # 0 in any unit: no tier
        if any(nbytes == b for b, _ in current):
            raise InputError(f"size {size[:30]!r} given twice in one tier (each combination is one row)", field=field)
        current.append((nbytes, size if nbytes else "0"))
    if "gpu" not in tiers:
        raise InputError("no gpu tier: give gpu=SIZE first (e.g. gpu=16GiB,cpu=512GiB)", field=field)
    for name in LOWER:
        tiers.setdefault(name, [(0, "0")])
    return {name: tiers[name] for name in TIERS}


# --------------------------------------------------------------------------------- a store

def _furthest(pol: BeladyPolicy) -> int:
    """The furthest next use among belady's evictable blocks (-1 if none). BeladyPolicy keeps a heap
    of next uses over its buckets; a bucket emptied by reuse stays until it reaches the top, and is
    dropped here as pop_many would drop it."""
    keys, buckets = pol._keys, pol._buckets
    while keys and not buckets.get(-keys[0]):
        buckets.pop(-heapq.heappop(keys), None)
    return -keys[0] if keys else -1


class Store:
    """One lower tier: ``capacity`` blocks of cached KV and nothing else (an external store)."""

    def __init__(self, capacity: int, policy: str | CachePolicy, bt: BlockTrace):
        self.capacity = capacity
        n_ids = max(bt.distinct_blocks, 1)
        self.pol = make_policy(policy, n_ids, capacity) if isinstance(policy, str) else policy
        self.pol.bind(DenseView(bt))
        self.bypass = isinstance(self.pol, BeladyPolicy)
        self.cached = np.zeros(n_ids, dtype=bool)
        self.n = 0  # blocks cached
        self.evicted = 0

    def put(self, run: np.ndarray, now: float, next_uses: np.ndarray | None) -> list[int]:
        """Store a run of one request's blocks (chain order, distinct): touch those held, insert as
        many new ones as fit (belady: those it does not bypass), evicting among the other blocks;
        release the run tail first. Returns the evicted blocks, in eviction order."""
        if not len(run):
            return []
        pol = self.pol
        held = self.cached[run]
        old, new = run[held].tolist(), run[~held]
        nu_old = None if next_uses is None else next_uses[held].tolist()
        if old:
            pol.reuse_many(old)
            pol.on_use_many(old, now, nu_old)
        room = self.capacity - self.n
        take = min(len(new), room + len(pol))  # held ones are in use now: not evictable
        victims: list[int] = []
        if self.bypass and take > room:
            # belady: a new block (next uses grow along a chain) displaces the furthest block only
            # if it is needed sooner; the first one that is not ends the run, and so do the rest
            nu_new = next_uses[~held]
            k = room
            while k < take:
                far = _furthest(pol)
                if nu_new[k] >= far:
                    break
                victims += pol.pop_many(1)
                k += 1
            take = k
        elif take > room:
            victims = pol.pop_many(take - room)
        if victims:
            self.cached[victims] = False
            self.evicted += len(victims)
        new = new[:take]
        if len(new):
            self.cached[new] = True
            pol.on_insert_many(new.tolist(), now, None if next_uses is None else next_uses[~held][:take].tolist())
        self.n += len(new) - len(victims)
        stored = run[self.cached[run]]  # the held and the new, in chain order
        pol.release_many(stored[::-1].tolist())
        return victims


# --------------------------------------------------------------------------------- the GPU

@dataclass(slots=True)
class GpuStream:
    """What the GPU pool did, request by request: the hit blocks, the blocks the request ran with
    (its first ``budget`` blocks), and (write-back) the blocks evicted while it allocated."""

    hits: np.ndarray  # int64 [requests]
    ran: np.ndarray  # int64 [requests]
    victims: list[list[int]] | None = None  # None: not recorded (write-back then stores nothing)
    evicted: int = 0  # blocks the pool evicted (simulate's evicted_blocks)


def gpu_stream(bt: BlockTrace, budget_blocks: int, policy: str, victims: bool = False) -> GpuStream:
    """``simulate`` at one budget, recording each request's hits (and, with ``victims``, what it
    evicted: the policy's pop_many is wrapped, so the decisions are simulate's own)."""
    hits = np.zeros(bt.requests, dtype=np.int64)
    evicted: list[list[int]] = []
    pending: list[int] = []

    def on_request(i: int, h: int) -> None:
        hits[i] = h
        if victims:
            evicted.append(pending.copy())
            pending.clear()

    pol: str | CachePolicy = policy
    if victims:
        pol = make_policy(policy, max(bt.distinct_blocks, 1), budget_blocks)
        pop = pol.pop_many

        def recorded(n: int) -> list[int]:
            out = pop(n)
            pending.extend(out)
            return out

        pol.pop_many = recorded
    pt = simulate(bt, budget_blocks, pol, on_request=on_request)
    ran = np.minimum(np.diff(bt.starts), budget_blocks)
    return GpuStream(hits, ran, evicted if victims else None, pt.evicted_blocks)


# --------------------------------------------------------------------------------- one point

@dataclass(frozen=True, slots=True)
class TierPoint:
    budgets: tuple[int, ...]  # blocks per tier (gpu, cpu, disk; 0: absent)
    policy: str  # the GPU's
    hit_tokens: tuple[int, ...]  # per tier, in the window
    evicted_blocks: tuple[int, ...]
    wall_s: float = field(default=0.0, compare=False)


def run_stores(bt: BlockTrace, gpu: GpuStream | None, stores: Sequence[Store | None],
               offload: str = "write-through", future: np.ndarray | None = None,
               on_request=None) -> list[int]:
    """Drive the lower tiers behind a GPU stream (None: no GPU, every block computed is stored:
    ``--budget-counts cache``). Returns the hit blocks per lower tier in the window;
    ``on_request(i, hit_blocks_per_tier)`` is called for every request (tests)."""
    if offload not in OFFLOAD:
        raise ValueError(f"unknown offload {offload!r} (choose from {', '.join(OFFLOAD)})")
    live = [(t, s) for t, s in enumerate(stores) if s is not None and s.capacity > 0]
    hits = [0] * len(stores)
    ids, starts, lookups = bt.ids, bt.starts.tolist(), bt.lookups.tolist()
    arrival = bt.arrival_s.tolist() if bt.arrival_s is not None else [float(i) for i in range(bt.requests)]
    sizes = np.diff(bt.starts).tolist()
    nxt = None  # write-back: each block's next use as of the last request that held it
    if future is not None and gpu is not None and gpu.victims is not None:
        nxt = np.full(max(bt.distinct_blocks, 1), NEVER, dtype=np.int64)
    write_back = offload == "write-back" and gpu is not None
    for i in range(bt.requests):
        s = starts[i]
        n = sizes[i] if gpu is None else int(gpu.ran[i])
        h = 0 if gpu is None else int(gpu.hits[i])
        blocks = ids[s:s + n]
        nu = None if future is None else future[s:s + n]
        if nxt is not None:
            nxt[blocks] = nu
        # the continuation, block by block: the fastest lower tier holding it, up to a block in none
        cont = blocks[h:min(lookups[i], n)]
        where = np.full(len(cont), -1, dtype=np.int64)
        for t, st in reversed(live):
            where[st.cached[cont]] = t
        missing = np.flatnonzero(where < 0)
        loaded = int(missing[0]) if len(missing) else len(cont)
        where = where[:loaded]
        got = [0] * len(stores)
        for t, st in live:
            mine = where == t
            got[t] = int(mine.sum())
            run = blocks[h:h + loaded][mine]  # touched where they were found
            run_nu = None if nu is None else nu[h:h + loaded][mine]
            if not write_back:  # ... and what the request computes stored everywhere
                run = np.concatenate((run, blocks[h + loaded:]))
                run_nu = None if nu is None else np.concatenate((run_nu, nu[h + loaded:]))
            st.put(run, arrival[i], run_nu)
        down = gpu.victims[i] if write_back and gpu.victims is not None else None
        for t, st in live if down else ():
            # each tier takes what the tier above evicted, most recently used first (the tier above
            # released a chain tail first, so its prefix comes first and is what a small tier keeps)
            run = np.asarray(down[::-1], dtype=np.int64)
            down = st.put(run, arrival[i], None if nxt is None else nxt[run])
            if not down:
                break
        if i >= bt.window_start:
            for t in range(len(stores)):
                hits[t] += got[t]
        if on_request is not None:
            on_request(i, got)
    return hits


def simulate_tiers(bt: BlockTrace, budgets: Sequence[int], policy: str, tier_policy: str = "lru",
                   offload: str = "write-through", gpu: GpuStream | None = None) -> TierPoint:
    """One point: a GPU pool of ``budgets[0]`` blocks evicting by ``policy`` and lower tiers of
    ``budgets[1:]`` blocks evicting by ``tier_policy`` (0: absent). ``gpu``: the GPU's stream at
    this budget and policy, if already run (it does not depend on the lower tiers)."""
    t0 = time.perf_counter()
    if gpu is None:
        gpu = gpu_stream(bt, budgets[0], policy, victims=offload == "write-back")
    belady = any(b > 0 for b in budgets[1:]) and needs_future(tier_policy)
    # the tiers only see a request's first budgets[0] blocks, and a chained block sits at one depth
    # in every request, so their next uses are bt.future(budgets[0])'s without recounting
    future = bt.next_use if belady else None
    stores = [Store(b, tier_policy, bt) if b > 0 else None for b in budgets[1:]]
    lower = run_stores(bt, gpu, stores, offload, future)
    hit_blocks = [int(gpu.hits[bt.window_start:].sum())] + lower
    evicted = [gpu.evicted] + [s.evicted if s is not None else 0 for s in stores]
    return TierPoint(tuple(budgets), policy, tuple(h * bt.block_size for h in hit_blocks), tuple(evicted),
                     time.perf_counter() - t0)


def simulate_store(bt: BlockTrace, budget_blocks: int, policy: str | CachePolicy,
                   on_request=None) -> Point:
    """``--budget-counts cache``: an external store of ``budget_blocks`` blocks, every request's
    computed blocks offered to it (belady may bypass them); requests run outside it."""
    if budget_blocks < 1:
        raise ValueError("budget_blocks must be >= 1")
    t0 = time.perf_counter()
    store = Store(budget_blocks, policy, bt)
    future = bt.next_use if store.bypass else None
    if store.bypass and future is None:
        raise ValueError("belady needs the BlockTrace built with future=True")
    cb = None if on_request is None else (lambda i, got: on_request(i, got[0]))
    hit = run_stores(bt, None, [store], "write-through", future, cb)[0]
    label = policy if isinstance(policy, str) else policy.name
    return Point(budget_blocks, label, hit * bt.block_size, store.evicted, 0, time.perf_counter() - t0)


# --------------------------------------------------------------------------------- the tables

TIER_COLUMNS = ["budget_bytes", "budget_blocks", "policy", "hit_rate", "ceiling",
                "hit_rate_gpu", "hit_rate_cpu", "hit_rate_disk",
                "gpu_bytes", "cpu_bytes", "disk_bytes", "gpu_blocks", "cpu_blocks", "disk_blocks",
                "tier_policy", "offload"]


@dataclass(slots=True)
class TieredWhatIf(WhatIfHead):
    """The tiered table and its settings: what ``--json``, the table and the parquet show."""

    tier_policy: str
    offload: str
    rows: list[dict]


def whatif_tiers(requests: Sequence[Request] | Pieces | HashedTrace, *, trace: str, model: str, kv_dtype: str,
                 kv_bytes_per_token: int, block_size: int, tiers: dict[str, list[tuple[int, str]]],
                 policies: Sequence[str], tier_policy: str = "lru", offload: str = "write-through",
                 warmup: float = 0.5, streams: TokenStreams | None = None) -> TieredWhatIf:
    """Every (gpu, cpu, disk) size combination and GPU policy: the hit rate per tier. ``requests``: a
    trace's requests, its Pieces or its HashedTrace, as blocktrace.prepare takes them."""
    block_bytes = kv_bytes_per_token * block_size
    future = any(needs_future(p) for p in policies) or needs_future(tier_policy)
    bt = prepare(requests, block_size, warmup, future=future, streams=streams)
    prompt = bt.window_prompt_tokens
    rows = []
    for g in tiers["gpu"]:
        gpu_blocks = g[0] // block_bytes
        for p in policies:
            stream = gpu_stream(bt, gpu_blocks, p, victims=offload == "write-back")
            for c, d in itertools.product(tiers["cpu"], tiers["disk"]):
                sizes = (g, c, d)
                blocks = [x[0] // block_bytes for x in sizes]
                pt = simulate_tiers(bt, blocks, p, tier_policy, offload, stream)
                rates = [h / prompt if prompt else 0.0 for h in pt.hit_tokens]
                row = {"budget_bytes": g[0], "budget_blocks": blocks[0], "policy": p,
                       "hit_rate": sum(rates), "ceiling": bt.ceiling}
                for name, r, x, b, h, e in zip(TIERS, rates, sizes, blocks, pt.hit_tokens, pt.evicted_blocks):
                    row |= {f"hit_rate_{name}": r, f"{name}_bytes": x[0], f"{name}_blocks": b, f"{name}": x[1],
                            f"hit_tokens_{name}": h, f"evicted_blocks_{name}": e}
                rows.append(row | {"tier_policy": tier_policy, "offload": offload})
    return TieredWhatIf(**head(bt, trace=trace, model=model, kv_dtype=kv_dtype,
                                  kv_bytes_per_token=kv_bytes_per_token, block_size=block_size, warmup=warmup),
                        tier_policy=tier_policy, offload=offload, rows=rows)


def whatif_cache(requests: Sequence[Request] | Pieces | HashedTrace, *, trace: str, model: str, kv_dtype: str,
                 kv_bytes_per_token: int, block_size: int, budgets: Sequence[Budget],
                 policies: Sequence[str], warmup: float = 0.5,
                 streams: TokenStreams | None = None) -> WhatIf:
    """``--budget-counts cache``: the what-if's table (curve.WhatIf, its table and outputs) with
    each budget an external store (``simulate_store``) instead of a pool."""
    bt = prepare(requests, block_size, warmup, future=any(needs_future(p) for p in policies), streams=streams)
    points = {(b.blocks, p): simulate_store(bt, b.blocks, p) for b in budgets for p in policies}
    prompt = bt.window_prompt_tokens
    rows = []
    for b in budgets:
        for p in policies:
            pt = points[(b.blocks, p)]
            rows.append({"budget_bytes": b.bytes, "budget_blocks": b.blocks, "policy": p, "budget": b.label,
                         "hit_rate": pt.hit_tokens / prompt if prompt else 0.0, "ceiling": bt.ceiling,
                         "hit_tokens": pt.hit_tokens, "gap_closed": gap_closed(points, b.blocks, p),
                         "evicted_blocks": pt.evicted_blocks, "too_large_requests": 0,
                         "budget_counts": "cache"})
    return WhatIf(**head(bt, trace=trace, model=model, kv_dtype=kv_dtype,
                               kv_bytes_per_token=kv_bytes_per_token, block_size=block_size, warmup=warmup),
                     rows=rows)


def write_outputs(w: TieredWhatIf, out_dir: str) -> list[str]:
    """``whatif.parquet`` (one row per tier sizes and policy) and ``whatif.json``."""
    return output.write_outputs(w, out_dir, TIER_COLUMNS, chart=False)


