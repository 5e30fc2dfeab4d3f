"""The cache what-if (``kvbench trace whatif``): prefix hit rate against KV budget and cache policy,
straight from a trace, with the infinite-cache ceiling beside it. ``simulate`` runs one (budget, policy)
point, requests one at a time through the replay's own policy classes; ``lru_curve`` gives lru at every
budget in one stack-distance pass, equal to ``simulate`` at each; radix mode is SGLang's node eviction.
The model, what it shares with the replay and what it restates, and its costs: docs/architecture.md,
"Layer 7, whatif" ("The what-if's model").
"""
from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvbench.memory.policies import make_policy
from kvbench.memory.policy_base import CachePolicy
from kvbench.memory.radix import RadixNodes
from kvbench.whatif.blocktrace import BlockTrace, DenseView
from kvbench.whatif.output import format_bytes

# --------------------------------------------------------------------------------- one point

@dataclass(frozen=True, slots=True)
class Point:
    budget_blocks: int
    policy: str
    hit_tokens: int  # in the window
    evicted_blocks: int
    too_large: int  # requests in the window with more whole blocks than the budget
    wall_s: float = field(default=0.0, compare=False)


PREFIX_MODES = ("hash", "radix")
# stack policies: one pass (lru_curve) gives their hits at every budget, and simulate refreshes a
# cached block past the first miss so that the two agree
STACK_POLICIES = ("lru",)


def simulate(bt: BlockTrace, budget_blocks: int, policy: str | CachePolicy,
             on_request=None, prefix_mode: str = "hash") -> Point:
    """Replay ``bt`` through a cache of ``budget_blocks`` blocks evicting by ``policy`` (a
    ``--cache-policy`` value, or a policy built for ``bt.distinct_blocks`` ids; radix: by node,
    least recently used: ``policy`` must be lru).

    ``on_request(i, hit_blocks)``, if given, is called for every request (tests compare it with a
    PagedKV replay).
    """
    if budget_blocks < 1:
        raise ValueError("budget_blocks must be >= 1")
    label = policy if isinstance(policy, str) else policy.name
    check_mode(prefix_mode, [label])
    if prefix_mode == "radix":
        return _simulate_radix(bt, budget_blocks, on_request)
    from kvbench.whatif.compiled import COMPILED

    t0 = time.perf_counter()
    if isinstance(policy, str) and policy in COMPILED and bt.requests < 1 << 22:
        hits, evicted = _simulate_compiled(bt, budget_blocks, policy)
        if on_request is not None:
            for i, h in enumerate(hits.tolist()):
                on_request(i, h)
        too_large = int((np.diff(bt.starts)[bt.window_start:] > budget_blocks).sum())
        return Point(budget_blocks, policy, int(hits[bt.window_start:].sum()) * bt.block_size, int(evicted),
                     too_large, time.perf_counter() - t0)
    pol = make_policy(policy, max(bt.distinct_blocks, 1), budget_blocks) if isinstance(policy, str) else policy
    cached = np.zeros(bt.distinct_blocks, dtype=bool)
    pol.bind(DenseView(bt))
    future = bt.future(budget_blocks) if pol.needs_future else None
    refresh = pol.name in STACK_POLICIES
    n_cached = hit_blocks = evicted = too_large = 0
    ids, first = bt.ids, bt.window_start
    starts, lookups = bt.starts.tolist(), bt.lookups.tolist()
    arrival = bt.arrival_s.tolist() if bt.arrival_s is not None else [float(i) for i in range(bt.requests)]
    for i in range(bt.requests):
        s, e = starts[i], starts[i + 1]
        if e - s > budget_blocks:  # too large to run whole: it runs as its first budget_blocks blocks
            too_large += i >= first
            e = s + budget_blocks
        n = e - s
        now = arrival[i]
        blocks = ids[s:e]
        # lookup: the longest cached run of the first lookups[i] blocks
        look = cached[blocks[:lookups[i]]]
        h = len(look) if look.all() else int(look.argmin())
        hits = blocks[:h]
        if h:  # allocate: take the hits (PagedKV.allocate -> incref, touch)
            hl = hits.tolist()
            pol.reuse_many(hl)
            pol.on_use_many(hl, now, None if future is None else future[s:s + h].tolist())
        rest = blocks[h:]
        if refresh:  # lru: a cached block past the first miss is taken too, and released in its place
            fresh = ~cached[rest]
            again = rest[~fresh]
            if len(again):
                pol.reuse_many(again.tolist())
            short = int(fresh.sum()) - (budget_blocks - n_cached)
        else:  # the pool's rule: a block for each of the rest
            short = n - h - (budget_blocks - n_cached)
        if short > 0:  # ... evicting cached ones (alloc_into)
            victims = pol.pop_many(short)
            cached[victims] = False
            n_cached -= short
            evicted += short
        if not refresh:
            # commit: store the blocks whose key is not cached (register_run; a key still cached
            # past the first miss keeps its block, and the request's copy is dropped at free). The
            # pool indexes a run's keys before it tells the policy, so parents read as cached.
            fresh = ~cached[rest]
            if future is not None and not fresh.all():
                pol.on_recompute_many(rest[~fresh].tolist(), now, future[s + h:e][~fresh].tolist())
        new = rest if fresh.all() else rest[fresh]
        if len(new):
            cached[new] = True
            nu = None if future is None else future[s + h:e][fresh].tolist()
            pol.on_insert_many(new.tolist(), now, nu)
            n_cached += len(new)
        # free: release the stored blocks, tail first (lru: all of them)
        pol.release_many((blocks if refresh else np.concatenate((hits, new)))[::-1].tolist())
        if i >= first:
            hit_blocks += h
        if on_request is not None:
            on_request(i, h)
    return Point(budget_blocks, label, hit_blocks * bt.block_size, evicted, too_large,
                 time.perf_counter() - t0)


@dataclass(frozen=True, slots=True)
class StackCurve:
    """lru at every budget from one pass (``lru_curve``): ``hits_by_depth[d]``: lookups in the window
    of a block at stack depth d (0: the most recently released); ``held_by_depth[d]``: blocks of
    any request found at depth d (a budget above d holds them: they need no new block)."""

    bt: BlockTrace
    hits_by_depth: np.ndarray  # int64 [distinct blocks + 1]
    held_by_depth: np.ndarray  # int64 [distinct blocks + 1]
    wall_s: float

    def hit_tokens(self, budget_blocks: np.ndarray) -> np.ndarray:
        """lru's hit tokens in the window at each budget (int64 [budgets])."""
        below = np.concatenate(([0], np.cumsum(self.hits_by_depth)))  # below[b]: depths < b
        return below[np.minimum(budget_blocks, len(self.hits_by_depth))] * self.bt.block_size

    def point(self, budget_blocks: int) -> Point:
        """What ``simulate(bt, budget_blocks, "lru")`` returns, read off the histograms."""
        bt, b = self.bt, budget_blocks
        sizes = np.diff(bt.starts)
        hit = int(self.hits_by_depth[:b].sum())
        # every block a request runs with is either held already or stored; the cache ends full
        stored = int(np.minimum(sizes, b).sum()) - int(self.held_by_depth[:b].sum())
        too_large = int((sizes[bt.window_start:] > b).sum())
        return Point(b, "lru", hit * bt.block_size, stored - min(b, bt.distinct_blocks), too_large,
                     self.wall_s)


def lru_curve(bt: BlockTrace) -> StackCurve:
    """lru's hits at every budget in one pass (Mattson et al., 1970: LRU is a stack algorithm).

    Why one pass is exact: ``simulate``'s lru releases every block a request runs with, tail first,
    so each block is released whenever its parent is and just before it: a prefix is always more
    recent than its continuation, and blocks are ranked by one recency order at every budget. A
    budget of B blocks then holds exactly the B most recent blocks (a request too large for it runs
    as its first B blocks, which is what these are after it), so a block is cached at B iff its
    stack depth is < B, and a request hits at B the leading lookups whose depth is < B (depth grows
    along a request's blocks).

    The depth of block j of request i, last released by request p, is the number of blocks released
    since: those whose last release is a request in (p, i), plus the blocks before j that p released
    after it and nobody released since (ancestors of j, whose last release is p). The pass is compiled
    (``compiled.lru_depths``); the state is one int per block and a Fenwick tree over requests of how many
    blocks each was the last to release, so the count over (p, i) costs O(log requests) however far
    back p is.
    """
    from kvbench.whatif.compiled import lru_depths

    t0 = time.perf_counter()
    hits_by_depth, held_by_depth = lru_depths(bt.ids, bt.starts, bt.lookups, bt.window_start,
                                               bt.distinct_blocks)
    return StackCurve(bt, hits_by_depth, held_by_depth, time.perf_counter() - t0)


def _simulate_compiled(bt: BlockTrace, budget_blocks: int, policy: str) -> tuple[np.ndarray, int]:
    """(hit blocks per request, evicted blocks) of ``policy`` at a budget, compiled."""
    from kvbench.whatif.compiled import COMPILED, run_compiled

    n_ids = max(bt.distinct_blocks, 1)
    if policy == "belady":
        # request indices, NEVER as one past the last request: the bucket is (never - next use)
        future = np.minimum(bt.future(budget_blocks), bt.requests)
    else:
        future = np.zeros(0, dtype=np.int64)
    # buckets: fifo one; lfu 1 + most hits; belady 0 .. never
    size = n_ids + (1 if policy == "fifo" else bt.requests + 2)
    links = np.int32 if size < 2**31 else np.int64  # half the memory where it fits
    return run_compiled(COMPILED[policy], bt.ids, bt.starts, bt.lookups, future, budget_blocks, n_ids,
                         bt.requests, np.arange(size, dtype=links), np.arange(size, dtype=links))


def check_mode(prefix_mode: str, policies) -> None:
    if prefix_mode not in PREFIX_MODES:
        raise ValueError(f"unknown prefix mode {prefix_mode!r} (choose from {', '.join(PREFIX_MODES)})")
    if prefix_mode == "radix" and any(p != "lru" for p in policies):
        raise ValueError("radix mode evicts whole nodes by recency (SGLang's lru): give only lru")


def _simulate_radix(bt: BlockTrace, budget_blocks: int, on_request=None) -> Point:
    """``simulate`` with SGLang's radix cache: the calls PagedKV's radix mode (node eviction, whole
    blocks) makes for one request, on dense ids: take the hits and split their last node where the
    match ends (allocate), evict whole LRU leaf nodes for the rest (alloc_into), link the stored
    blocks into one node (register_run; a block whose key is cached already keeps the cached copy,
    which SGLang's insert walks: ``reinsert``), release them tail first (free). A sequence ending
    inside a block holds that block too while it runs, as SGLang holds the partial last page."""
    t0 = time.perf_counter()
    n_ids = max(bt.distinct_blocks, 1)
    ref = [0] * n_ids  # 1 while the current request holds the block
    nodes = RadixNodes(n_ids, ref)
    cached = np.zeros(bt.distinct_blocks, dtype=bool)
    n_cached = hit_blocks = evicted = too_large = 0
    ids, first = bt.ids, bt.window_start
    starts, lookups = bt.starts.tolist(), bt.lookups.tolist()
    partial = bt.partial.tolist() if bt.partial is not None else [False] * bt.requests
    for i in range(bt.requests):
        s, e = starts[i], starts[i + 1]
        n = e - s + partial[i]  # the partial last block too, freed at the end
        if n > budget_blocks:
            too_large += i >= first
            if on_request is not None:
                on_request(i, 0)
            continue
        blocks = ids[s:e]
        look = cached[blocks[:lookups[i]]]
        h = len(look) if look.all() else int(look.argmin())
        hl = blocks[:h].tolist()
        for b in hl:
            ref[b] = 1
        if h:
            nodes.reuse_many(hl)
            nodes.split_after(hl[-1])
        short = n - h - (budget_blocks - n_cached)
        if short > 0:
            victims = nodes.pop_many(short)  # whole nodes: often more than the shortfall
            cached[victims] = False
            n_cached -= len(victims)
            evicted += len(victims)
        links, new = [], []
        parent, again = (hl[-1] if h else -1), False
        for b in blocks[h:].tolist():
            if cached[b]:  # computed again: the request's copy stays private
                if not again:
                    nodes.reinsert(b, parent)
                again, parent = True, -1  # what follows hangs off a private block: a root
                continue
            links.append((b, parent))
            new.append(b)
            ref[b] = 1
            parent = b
        if links:
            nodes.link_run(links, False)
            cached[new] = True
            n_cached += len(new)
        done = hl + new
        for b in done:
            ref[b] = 0
        nodes.release_many(done[::-1])
        if i >= first:
            hit_blocks += h
        if on_request is not None:
            on_request(i, h)
    return Point(budget_blocks, "lru", hit_blocks * bt.block_size, evicted, too_large,
                 time.perf_counter() - t0)


# --------------------------------------------------------------------------------- the curve

@dataclass(frozen=True, slots=True)
class Budget:
    bytes: int
    blocks: int
    label: str  # as the user wrote it ('1024GiB'), or formatted from the bytes


def budgets_from_bytes(sizes: Sequence[int], block_bytes: int,
                       labels: Sequence[str] | None = None) -> list[Budget]:
    labels = labels or [format_bytes(b) for b in sizes]
    return [Budget(b, b // block_bytes, lab) for b, lab in zip(sizes, labels)]


def budgets_from_blocks(counts: Sequence[int], block_bytes: int) -> list[Budget]:
    return [Budget(n * block_bytes, n, format_bytes(n * block_bytes)) for n in counts]


_SHARED: BlockTrace | None = None  # what forked workers inherit instead of a pickled copy


def _run_point(args: tuple[int, str, str]) -> Point:
    b, p, mode = args
    return simulate(_SHARED, b, p, prefix_mode=mode)


def run_points(bt: BlockTrace, budget_blocks: Sequence[int], policies: Sequence[str],
               jobs: int = 1, prefix_mode: str = "hash", on_curve=None) -> dict[tuple[int, str], Point]:
    """Every (budget, policy) point: lru's (hash mode) from one pass at every budget (lru_curve,
    handed to ``on_curve`` if given), the others' by simulation, in ``jobs`` processes (forked:
    they share ``bt``)."""
    global _SHARED
    check_mode(prefix_mode, policies)
    stack = [p for p in policies if p in STACK_POLICIES] if prefix_mode == "hash" else []
    points = sorted({(b, p) for b in budget_blocks for p in policies if p not in stack})
    out: dict[tuple[int, str], Point] = {}
    pool = None
    if jobs > 1 and len(points) > 1 and "fork" in multiprocessing.get_all_start_methods():
        _SHARED = bt
        pool = multiprocessing.get_context("fork").Pool(min(jobs, len(points)))
        pending = pool.map_async(_run_point, [(b, p, prefix_mode) for b, p in points], chunksize=1)
    try:
        if stack:  # in this process, while the workers simulate
            curve = lru_curve(bt)
            if on_curve is not None:
                on_curve(curve)
            share = curve.wall_s / len(set(budget_blocks))
            for b in budget_blocks:
                out[(b, "lru")] = replace(curve.point(b), wall_s=share)
        if pool is None:
            out.update({(b, p): simulate(bt, b, p, prefix_mode=prefix_mode) for b, p in points})
        else:
            out.update({(pt.budget_blocks, pt.policy): pt for pt in pending.get()})
    finally:
        if pool is not None:  # every result is in (or an error is on its way up)
            pool.terminate()
            pool.join()
            _SHARED = None
    return out


@dataclass(slots=True)
class SummedCurve:
    """The replicas' LRU curves as one (hits add up; the prompt tokens are the whole window's)."""

    parts: list
    bt: BlockTrace

    def hit_tokens(self, budget_blocks: np.ndarray) -> np.ndarray:
        return sum(c.hit_tokens(budget_blocks) for c in self.parts)


CURVE_POINTS = 200


def full_curve(curve: StackCurve, budgets: Sequence[Budget], block_bytes: int) -> dict:
    lo = max(1, min(b.blocks for b in budgets))
    hi = max(lo, max(b.blocks for b in budgets))
    blocks = np.unique(np.concatenate((np.geomspace(lo, hi, CURVE_POINTS).round().astype(np.int64),
                                       [max(1, b.blocks) for b in budgets])))
    hits = curve.hit_tokens(blocks)
    prompt = curve.bt.window_prompt_tokens
    return {"budget_bytes": (blocks * block_bytes).tolist(),
            "hit_rate": (hits / prompt if prompt else hits * 0.0).tolist()}


def gap_closed(points: dict[tuple[int, str], Point], budget_blocks: int, policy: str) -> float | None:
    """The share of the lru -> belady gap ``policy`` closes at a budget: (hits - lru's) / (belady's -
    lru's); 0 for lru, 1 for belady, negative below lru. None without both, or with no gap."""
    lru, opt = points.get((budget_blocks, "lru")), points.get((budget_blocks, "belady"))
    if lru is None or opt is None or opt.hit_tokens <= lru.hit_tokens:
        return None
    return (points[(budget_blocks, policy)].hit_tokens - lru.hit_tokens) / (opt.hit_tokens - lru.hit_tokens)


