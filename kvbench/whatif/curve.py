"""The cache what-if (``kvbench trace whatif``): prefix hit rate against KV budget and cache policy,
straight from a trace, with the infinite-cache ceiling beside it; and the curve's table, parquet and PNG.

The model: requests in trace order, one at a time, no decode. Each request looks up its longest cached
run of whole blocks (a miss ends it; never the block holding the last prompt token), takes those hits,
stores its other whole blocks (the prompt's, and a named answer's computed part, as the ideal hit rate
counts them), evicting by the policy when the budget is full, then releases all of them tail first:
the calls PagedKV makes for one request of a replay (lookup, allocate, commit, free). A request with
more whole blocks than the budget B runs as its first B blocks (it looks up at most B, and the cache
then holds its first B): a pool refuses it, so the rule is ours to choose, and this one keeps lru a
stack algorithm; its prompt tokens all count. The hit rate is hit tokens / prompt tokens over the
requests after the warm-up fraction; the requests before it only warm the cache.

lru is computed for every budget at once (``lru_curve``, a Mattson stack-distance pass), and
``simulate`` agrees with it exactly at any one budget (tests/test_whatif_curve.py) because its lru
releases every block the request runs with, tail first: a block past the first miss whose key is
still cached is taken and released with the others rather than left where it was (the pool leaves
it, and computes a private copy). Tail-first release then makes every prefix more recent than its
continuation, at every budget. The other policies keep the pool's rule.

``prefix_mode="radix"`` answers the same question for SGLang's radix cache at page size = block size:
whole blocks matched, as above, and node-granular LRU eviction (kvbench.memory.radix.RadixNodes, the
class PagedKV's radix mode evicts with): a request's new blocks form a node, a match ending inside a
node splits it, and eviction frees whole least recently used leaf nodes. Driven one request at a
time, it gives SGLang 0.5.23's own RadixCache's hits (benchmarks/sglang_reference). Its ceiling is
the block-granular ideal: without partial-block matching, that is all a radix cache of whole pages can
reach.

Every cache policy of the registry runs here as in a replay (``learned:FILE`` too, a model fitted
by ``kvbench trace fit-policy``, kvbench.whatif.fit); policies are told the request's arrival as the
time, and read keys and parents through DenseView. Each row carries the share of the lru -> belady
gap the policy closes at its budget (``gap_closed``).

Shared with the replay, not copied: the block keys (kvbench.trace.ideal.PrefixKeys), the lookup rule
(lookup_blocks), the ceiling (IdealCounter's rule, over dense ids: kvbench.trace.compiled.ideal_hit_blocks,
held equal to it) and the eviction decisions: the kvbench.memory.policies
classes, driven through their batch calls in the order PagedKV drives them. Two restatements are
compiled (numba) for speed, and tests/test_whatif_curve.py holds each to its original: fifo, lfu and
belady by name (``_run_compiled``; a policy object, e.g. a test's, still drives the class), request
by request, and belady's future over dense ids (``_next_uses``; kvbench.memory.future's over keys).
What is not shared is the block pool's bookkeeping (free list, refcounts, token checks): with one
request at a time every cached block is evictable between requests, so a block is named by its
prefix key, remapped to a dense id 0..D-1, and one bool array says what is
cached. The policies break ties by release order, never by block id, so these ids make the same
decisions as a pool's physical ones; tests/test_whatif.py holds the two to equal hits request by request.

Speed (see benchmarks/bench_whatif.py): lru costs one compiled pass whatever the budgets (lru_curve:
O(log requests) per run of a request's blocks that one request last released); fifo, lfu and belady
are compiled (lists by key, O(1) per block); every request's keys are computed once, factorised into
one flat int array of dense ids and shared by all (budget, policy) points (forked
workers inherit it); belady's next uses come from one backward pass (another only for a budget below
some request's lookups: it looks up only its first B there); the other policies are driven once per
request per kind of call (a batch); points run in processes (``jobs``), the lru pass in the parent
meanwhile. The keys of a whole trace come from one compiled pass (kvbench.trace.compiled.trace_keys:
token streams, xxh3 and a memo of the segments that recur after the same parent); on the whole Mooncake
trace at block 512 reading the trace now takes longer than preparing and running every point.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from kvbench.jit import numba
import numpy as np

from kvbench.jsonio import dumps
from kvbench.memory.policies import (
    NEVER,
    CachePolicy,
    CacheView,
    check_policy,
    make_policy,
    split_policy,
)
from kvbench.memory.radix import RadixNodes
from kvbench.trace.format import Request
from kvbench.trace.ideal import (
    PrefixKeys,
    dense_block_ids,
    ideal_hit_blocks,
    lookup_blocks,
    parent_block_ids,
)
from kvbench.trace.pieces import Pieces
from kvbench.trace.tokens import TokenStreams

COLUMNS = ["budget_bytes", "budget_blocks", "policy", "hit_rate", "ceiling"]  # read by kvbench report
PARQUET = "whatif.parquet"
PREPARE_STREAM_TOKENS = 2**20  # the token streams' memo while prepare hashes the trace (4 MB)
PNG = "whatif.png"


@dataclass(slots=True)
class BlockTrace:
    """A trace reduced to what the what-if needs, built once and shared by every point.

    ``ids[starts[i]:starts[i+1]]``: request i's whole blocks as dense ids (0..distinct_blocks-1, in
    order of first appearance); ``lookups[i]``: how many leading ones it may hit; ``next_use``
    (aligned with ``ids``, only for belady): the next request that looks each block up;
    ``partial[i]``: its sequence ends inside a block (radix mode reserves that block too, as SGLang
    allocates the partial last page, and frees it at the end). ``arrival_s[i]``: its arrival, the
    time policies are told; ``parent[d]``: the id before block d in every request that holds it
    (-1 for a first block), since keys are chained.
    """

    block_size: int
    ids: np.ndarray  # int64 [total blocks]
    starts: np.ndarray  # int64 [requests + 1]
    lookups: np.ndarray  # int64 [requests]
    prompt_lens: np.ndarray  # int64 [requests]
    distinct_blocks: int
    window_start: int  # first request counted (after the warm-up)
    ceiling_hit_tokens: int  # infinite cache, same window
    next_use: np.ndarray | None = None  # int64 [total blocks]
    partial: np.ndarray | None = None  # bool [requests]
    arrival_s: np.ndarray | None = None  # float64 [requests]
    parent: np.ndarray | None = None  # int64 [distinct blocks]
    keys: np.ndarray | None = None  # uint64 [distinct blocks]: the block key behind each dense id

    @property
    def requests(self) -> int:
        return len(self.lookups)

    @property
    def window_prompt_tokens(self) -> int:
        return int(self.prompt_lens[self.window_start:].sum())

    @property
    def ceiling(self) -> float:
        p = self.window_prompt_tokens
        return self.ceiling_hit_tokens / p if p else 0.0

    def future(self, budget_blocks: int) -> np.ndarray:
        """Belady's next uses at a budget: a request too large to run whole there looks up only its
        first ``budget_blocks`` blocks (else belady would keep blocks for lookups that never happen)."""
        if self.next_use is None:
            raise ValueError("belady needs the BlockTrace built with future=True")
        if not (self.lookups > budget_blocks).any():
            return self.next_use
        return _next_uses(self.ids, self.starts, np.minimum(self.lookups, budget_blocks))


def window_start(requests: int, warmup: float) -> int:
    """Index of the first request after the warm-up fraction (the window keeps at least one)."""
    return min(int(warmup * requests), max(requests - 1, 0))


def prepare(requests: Sequence[Request] | Pieces, block_size: int, warmup: float = 0.0, *,
            future: bool = True, streams: TokenStreams | None = None) -> BlockTrace:
    """Hash every request once, remap the keys to dense ids, count the ceiling; ``future``: also
    belady's next uses. ``requests``: a trace's requests, or its Pieces (kvbench.trace.pieces.read_pieces
    reads them from a file, without a Request per line)."""
    # PrefixKeys hashes the whole trace in one compiled pass, memoising the keys of repeated
    # block-aligned segments, so the streams' own memo serves only literal segments: keep it small
    # streams one request uses are not memoised (p.memoise: PrefixKeys.count_once's rule)
    p = requests if isinstance(requests, Pieces) else Pieces.from_requests(
        requests, streams or TokenStreams(max_cached_tokens=PREPARE_STREAM_TOKENS))
    flat, starts = PrefixKeys(block_size).keys_of_pieces(p.seeds, p.lengths, p.literal_at, p.memoise, p.pieces_at,
                                                         p.literals, seq_lens=p.seq_lens)
    prompt_lens = p.prompt_lens
    blocks = np.diff(starts)
    lookups = np.minimum(lookup_blocks(prompt_lens, block_size), blocks)
    ids, distinct = dense_block_ids(flat)
    del flat
    start = window_start(len(p), warmup)
    hit_blocks = ideal_hit_blocks(ids, starts, lookups)  # IdealCounter's figures
    parent = parent_block_ids(ids, starts, len(distinct))
    bt = BlockTrace(block_size, ids, starts, lookups, prompt_lens, len(distinct), start,
                    int(hit_blocks[start:].sum()) * block_size, partial=p.seq_lens % block_size != 0,
                    arrival_s=p.arrival_s, parent=parent, keys=distinct)
    if future:
        bt.next_use = _next_uses(bt.ids, starts, bt.lookups)
    return bt


def _next_uses(ids: np.ndarray, starts: np.ndarray, lookups: np.ndarray) -> np.ndarray:
    """kvbench.memory.future.next_uses_from_keys's backward pass, over dense ids and compiled (its
    dict of keys and per-request lists cost ~1 GB and 3 s on Mooncake at block 16), flattened like
    ``ids``; tests/test_whatif_curve.py holds the two equal."""
    n_ids = int(ids.max()) + 1 if len(ids) else 1
    return _next_uses_compiled(ids, starts, lookups, n_ids, NEVER)


@numba.njit(cache=True)
def _next_uses_compiled(ids, starts, lookups, n_ids, never):
    nxt = np.full(n_ids, never, dtype=np.int64)  # the next request that looks each block up
    out = np.empty(len(ids), dtype=np.int64)
    for i in range(len(lookups) - 1, -1, -1):
        s, e = starts[i], starts[i + 1]
        for k in range(s, e):
            out[k] = nxt[ids[k]]
        for k in range(s, s + lookups[i]):
            nxt[ids[k]] = i
    return out


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


class DenseView(CacheView):
    """What a policy reads in the what-if: a block is named by its prefix key's dense id, so its key
    is its id, and its parent is the id before it: the answers PoolView gives for a pool's physical
    blocks. A parent is always cached when its child is inserted (the request hit it, or inserts it
    first), and policies read parents only then."""

    def __init__(self, bt: BlockTrace):
        self._parent = bt.parent.tolist()
        self.block_size = bt.block_size

    def key_of(self, block: int) -> int:
        return block

    def parent_of(self, block: int) -> int:
        return self._parent[block]


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
    future = bt.future(budget_blocks) if pol.name == "belady" else None
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
    (``_lru_depths``); the state is one int per block and a Fenwick tree over requests of how many
    blocks each was the last to release, so the count over (p, i) costs O(log requests) however far
    back p is.
    """
    t0 = time.perf_counter()
    hits_by_depth, held_by_depth = _lru_depths(bt.ids, bt.starts, bt.lookups, bt.window_start,
                                               bt.distinct_blocks)
    return StackCurve(bt, hits_by_depth, held_by_depth, time.perf_counter() - t0)


@numba.njit(cache=True)
def _lru_depths(ids, starts, lookups, first, n_ids):
    """(hits_by_depth, held_by_depth) of ``lru_curve``: int64 [n_ids + 1] each."""
    requests = len(lookups)
    last = np.full(n_ids, -1, dtype=np.int64)  # request that last released each block
    # Fenwick tree (1-based) over requests: released[r], the blocks whose last release is request r
    tree = np.zeros(requests + 1, dtype=np.int64)
    total = 0  # released[0..i-1] summed: every block released so far, once
    hits_by_depth = np.zeros(n_ids + 1, dtype=np.int64)
    held_by_depth = np.zeros(n_ids + 1, dtype=np.int64)
    for i in range(requests):
        s, e = starts[i], starts[i + 1]
        look = s + lookups[i] if i >= first else s  # blocks before look count as hits
        j = s
        # the leading blocks released before, in runs of one last release p (non-increasing along
        # the request: a block is released whenever its parent is)
        while j < e and last[ids[j]] >= 0:
            p = last[ids[j]]
            below = 0  # released[0..p]
            q = p + 1
            while q > 0:
                below += tree[q]
                q -= q & -q
            # released[p+1..i-1] as it was before request i: the runs taken off so far have a larger
            # p (in the tree above p, not below it), and total is left as it was until the request ends
            since = total - below
            k = j
            while k < e and last[ids[k]] == p:
                depth = since + (k - j)
                if depth < 0 or depth >= n_ids:  # a wrong count: fail, rather than write past the arrays
                    raise AssertionError("lru_curve: a stack depth outside 0..distinct blocks - 1")
                held_by_depth[depth] += 1
                if k < look:
                    hits_by_depth[depth] += 1
                k += 1
            q = p + 1  # these k - j blocks are released by i now, not by p (total: below)
            while q <= requests:
                tree[q] -= k - j
                q += q & -q
            j = k
        for k in range(s, e):
            last[ids[k]] = i
        q = i + 1
        while q <= requests:
            tree[q] += e - s
            q += q & -q
        total += e - j  # the blocks released for the first time: the others were counted already
    return hits_by_depth, held_by_depth


# ------------------------------------------------------------------ compiled core: fifo, lfu, belady

# fifo, lfu and belady at one budget, compiled (numba, cached on disk: the first run on a machine
# compiles for a few seconds). Their rules are the kvbench.memory.policies classes' (the victim is
# the evictable block with the smallest (key, tick): fifo (0, insert), lfu (uses, last insert or
# use), belady (furthest next use, then release order)). Keys are small ints (belady's: never - next
# use, request indices) and each new tick is the largest, so no heap is needed: the cached blocks are
# kept in one list per key (a bucket), each in order of tick, and the victim is the first unpinned
# block of the lowest bucket that holds any (a pinned one is passed over and keeps its place), found
# from a bitmap of the buckets that hold blocks: O(1) per block, O(buckets / 1024) per search at
# worst. tests/test_whatif_curve.py holds it to ``simulate`` driving the classes, request by
# request, and tests/test_whatif.py both to PagedKV.
COMPILED = {"fifo": 0, "lfu": 1, "belady": 2}


@numba.njit(cache=True)
def _mark(bits, words, u, holds):
    """Bucket u now holds blocks (``holds``) or none: its bit in bits[:words] (32 a word), and its
    word's in the summary after them."""
    w = u >> 5
    if holds:
        bits[w] |= 1 << (u & 31)
        bits[words + (w >> 5)] |= 1 << (w & 31)
    else:
        bits[w] &= ~(1 << (u & 31))
        if bits[w] == 0:
            bits[words + (w >> 5)] &= ~(1 << (w & 31))


@numba.njit(cache=True)
def _low_bit(x):
    """The index of the lowest bit set in x (0 < x < 2**32)."""
    i = 0
    for width in (16, 8, 4, 2, 1):
        if x & ((1 << width) - 1) == 0:
            x >>= width
            i += width
    return i


@numba.njit(cache=True)
def _first_filled(bits, words, u):
    """The lowest bucket >= u that holds blocks, or -1."""
    w = u >> 5
    if w >= words:
        return -1
    x = bits[w] >> (u & 31)
    if x:
        return u + _low_bit(x)
    w += 1  # the first word after it with a bit set, from the summary
    for sw in range(w >> 5, len(bits) - words):
        y = bits[words + sw]
        if sw == w >> 5:
            y = (y >> (w & 31)) << (w & 31)
        if y:
            w = (sw << 5) + _low_bit(y)
            return (w << 5) + _low_bit(bits[w])
    return -1


@numba.njit(cache=True)
def _append(nxt, prv, head, b):
    """Block b at the tail of the list whose head and tail is ``head``; whether it was empty. (The
    caller marks the bucket: with the bitmap passed in, these calls cost 5x as much.)"""
    last = prv[head]
    nxt[last] = b
    prv[b] = last
    nxt[b] = head
    prv[head] = b
    return last == head


@numba.njit(cache=True)
def _unlink(nxt, prv, b):
    """Block b out of its list; whether the list is empty now (b's neighbours both its head)."""
    before, after = prv[b], nxt[b]
    nxt[before] = after
    prv[after] = before
    return before == after


@numba.njit(cache=True)
def _run_compiled(kind, ids, starts, lookups, future, budget, n_ids, never, nxt, prv):
    """``nxt``, ``prv``: arange(n_ids + buckets) (int32 or int64): every bucket's list, empty."""
    requests = len(lookups)
    hits = np.zeros(requests, dtype=np.int64)
    cached = np.zeros(n_ids, dtype=np.bool_)
    pinned = np.zeros(n_ids, dtype=np.bool_)
    key = np.zeros(n_ids, dtype=np.int64)  # a cached block's bucket: fifo 0; lfu uses; belady never - next use
    words = (len(nxt) - n_ids + 31) >> 5
    bits = np.zeros(words + ((words + 31) >> 5), dtype=np.int64)
    n_cached = 0
    evicted = 0
    for i in range(requests):
        s = starts[i]
        n = min(starts[i + 1] - s, budget)
        look = min(lookups[i], n)
        h = 0
        while h < look and cached[ids[s + h]]:
            h += 1
        hits[i] = h
        for j in range(h):  # take the hits (belady: its next use is filed at release)
            b = ids[s + j]
            pinned[b] = True
            if kind == 1:  # lfu: a use, to the tail of the next bucket
                if _unlink(nxt, prv, b):
                    _mark(bits, words, key[b], False)
                key[b] += 1
                if _append(nxt, prv, n_ids + key[b], b):
                    _mark(bits, words, key[b], True)
        short = n - h - (budget - n_cached)
        u = -1
        b = n_ids
        while short > 0:  # evict
            if b >= n_ids:  # the end of bucket u: on to the next that holds blocks
                v = _first_filled(bits, words, u + 1)
                if v <= u:  # none left (-1), or a wrong search: fail, rather than read past or loop
                    raise AssertionError("nothing evictable")
                u = v
                b = nxt[n_ids + u]
                continue
            after = nxt[b]
            if not pinned[b]:
                if _unlink(nxt, prv, b):
                    _mark(bits, words, u, False)
                cached[b] = False
                n_cached -= 1
                evicted += 1
                short -= 1
            b = after
        for j in range(h, n):  # store the rest (a key still cached keeps its block)
            b = ids[s + j]
            if cached[b]:
                if kind == 2:  # belady: its next use moved on; filed again, as released now
                    if _unlink(nxt, prv, b):
                        _mark(bits, words, key[b], False)
                    key[b] = never - future[s + j]
                    if _append(nxt, prv, n_ids + key[b], b):
                        _mark(bits, words, key[b], True)
                continue
            cached[b] = True
            pinned[b] = True
            n_cached += 1
            if kind == 2:  # filed at release
                key[b] = never - future[s + j]
                continue
            key[b] = kind  # fifo 0, lfu 1 (one use)
            if _append(nxt, prv, n_ids + key[b], b):
                _mark(bits, words, key[b], True)
        for j in range(n - 1, -1, -1):  # release, tail first
            b = ids[s + j]
            if not pinned[b]:
                continue
            pinned[b] = False
            if kind == 2:  # belady: filed by its next use, in release order
                if j < h:
                    if _unlink(nxt, prv, b):
                        _mark(bits, words, key[b], False)
                    key[b] = never - future[s + j]
                if _append(nxt, prv, n_ids + key[b], b):
                    _mark(bits, words, key[b], True)
    return hits, evicted


def _simulate_compiled(bt: BlockTrace, budget_blocks: int, policy: str) -> tuple[np.ndarray, int]:
    """(hit blocks per request, evicted blocks) of ``policy`` at a budget, compiled."""
    n_ids = max(bt.distinct_blocks, 1)
    if policy == "belady":
        # request indices, NEVER as one past the last request: the bucket is (never - next use)
        future = np.minimum(bt.future(budget_blocks), bt.requests)
    else:
        future = np.zeros(0, dtype=np.int64)
    # buckets: fifo one; lfu 1 + most hits; belady 0 .. never
    size = n_ids + (1 if policy == "fifo" else bt.requests + 2)
    links = np.int32 if size < 2**31 else np.int64  # half the memory where it fits
    return _run_compiled(COMPILED[policy], bt.ids, bt.starts, bt.lookups, future, budget_blocks, n_ids,
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
class WhatIfHead:
    """What every what-if result opens with (WhatIf, kvbench.whatif.tiers.TieredWhatIf): the
    settings and the prepared trace's counts. ``head`` fills it."""

    trace: str
    model: str
    kv_dtype: str
    kv_bytes_per_token: int
    block_size: int
    warmup: float
    requests: int
    window_requests: int
    window_prompt_tokens: int
    distinct_blocks: int
    ceiling: float
    ceiling_hit_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def head(bt: BlockTrace, *, trace: str, model: str, kv_dtype: str, kv_bytes_per_token: int, block_size: int,
         warmup: float) -> dict:
    """WhatIfHead's fields for a prepared trace: the settings given and the trace's counts."""
    return {"trace": trace, "model": model, "kv_dtype": kv_dtype, "kv_bytes_per_token": kv_bytes_per_token,
            "block_size": block_size, "warmup": warmup, "requests": bt.requests,
            "window_requests": bt.requests - bt.window_start, "window_prompt_tokens": bt.window_prompt_tokens,
            "distinct_blocks": bt.distinct_blocks, "ceiling": bt.ceiling, "ceiling_hit_tokens": bt.ceiling_hit_tokens}


@dataclass(slots=True)
class WhatIf(WhatIfHead):
    """The curve and its settings: what ``--json``, the table, the parquet and the PNG show."""

    rows: list[dict]
    prefix_mode: str = "hash"
    # lru at every budget between the smallest and the largest asked for (log-spaced, at most
    # CURVE_POINTS): {"budget_bytes": [...], "hit_rate": [...]}; None without lru (or in radix mode)
    lru_curve: dict | None = None
    replicas: int = 1  # caches of the budget each, requests routed by router (kvbench.whatif.replicas)
    router: str | None = None
    replica_requests: list[int] | None = None  # requests each replica was sent
    replicas_ceiling: float | None = None  # one infinite cache per replica: the routed ceiling


def whatif(requests: Sequence[Request] | Pieces, *, trace: str, model: str, kv_dtype: str,
           kv_bytes_per_token: int, block_size: int, budgets: Sequence[Budget],
           policies: Sequence[str], warmup: float = 0.5, jobs: int = 1,
           streams: TokenStreams | None = None, prefix_mode: str = "hash", replicas: int = 1,
           router: str = "round-robin", router_prefix_blocks: int = 4) -> WhatIf:
    """The table: every (budget, policy) point, one cache per budget, or with ``replicas`` > 1 one cache
    of the budget per replica and the requests routed by ``router`` (kvbench.whatif.replicas)."""
    for p in policies:
        check_policy(p)
    check_mode(prefix_mode, policies)
    future = "belady" in policies
    bt = prepare(requests, block_size, warmup, future=future, streams=streams)
    curves: list[StackCurve] = []
    blocks = [b.blocks for b in budgets]
    cluster = {}
    if replicas > 1:
        from kvbench.whatif import replicas as rep

        where = rep.route(bt, requests, replicas, router, router_prefix_blocks)
        subs = rep.split(bt, where, replicas, future)
        parts, part_curves = [], []
        for sub in subs:
            got: list[StackCurve] = []
            parts.append(run_points(sub, blocks, policies, jobs, prefix_mode, got.append))
            part_curves.append(got[0] if got else None)
        points = rep.combine(parts, blocks, policies)
        if part_curves and all(c is not None for c in part_curves):
            curves.append(_SummedCurve(part_curves, bt))
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
                  lru_curve=_full_curve(curves[0], budgets, kv_bytes_per_token * block_size) if curves else None,
                  **cluster)


@dataclass(slots=True)
class _SummedCurve:
    """The replicas' LRU curves as one (hits add up; the prompt tokens are the whole window's)."""

    parts: list
    bt: BlockTrace

    def hit_tokens(self, budget_blocks: np.ndarray) -> np.ndarray:
        return sum(c.hit_tokens(budget_blocks) for c in self.parts)


CURVE_POINTS = 200


def _full_curve(curve: StackCurve, budgets: Sequence[Budget], block_bytes: int) -> dict:
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


def column_names(policies: Sequence[str]) -> dict[str, str]:
    """A short header per policy: the registry name (``learned`` for ``learned:FILE``), or the
    whole value when two values share a name."""
    base = {p: split_policy(p)[0] for p in policies}
    return {p: b if list(base.values()).count(b) == 1 else p for p, b in base.items()}


# --------------------------------------------------------------------------------- outputs

def format_bytes(n: int) -> str:
    """8589934592 -> '8GiB'; sizes that are no whole binary unit keep two decimals."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.2f}{unit}"
    return f"{n}B"


def to_frame(w: WhatIf):
    import pandas as pd

    df = pd.DataFrame(w.rows)
    for name in ("block_size", "model", "kv_dtype", "kv_bytes_per_token", "warmup", "trace", "prefix_mode"):
        df[name] = getattr(w, name)
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]


def write_outputs(w: WhatIf, out_dir: str) -> list[str]:
    """``whatif.parquet`` (one row per budget and policy), ``whatif.png`` and ``whatif.json``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in (PARQUET, PNG, "whatif.json")]
    to_frame(w).to_parquet(paths[0], index=False)
    plot(w, paths[1])
    with open(paths[2], "w", encoding="utf-8") as fh:
        fh.write(dumps(w.to_dict(), indent=1))  # null, never NaN, where there is no figure
    return paths


def plot(w: WhatIf, path: str) -> None:
    """Hit rate against budget (log x), one line per policy, the ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    policies = list(dict.fromkeys(r["policy"] for r in w.rows))
    for p, name in column_names(policies).items():
        rows = sorted((r for r in w.rows if r["policy"] == p), key=lambda r: r["budget_bytes"])
        ax.plot([r["budget_bytes"] / 2**30 for r in rows], [r["hit_rate"] for r in rows],
                marker="o", label=name)
    if w.lru_curve is not None:  # lru between the points: one pass gives every budget
        ax.plot([b / 2**30 for b in w.lru_curve["budget_bytes"]], w.lru_curve["hit_rate"], color="gray",
                linewidth=0.8, label="lru, every budget")
    ax.axhline(w.ceiling, color="black", linestyle="--", label=f"ceiling (infinite cache) {w.ceiling:.3f}")
    ax.set_xscale("log", base=2)
    sizes = sorted({(r["budget_bytes"], r["budget"]) for r in w.rows})
    ax.set_xticks([b / 2**30 for b, _ in sizes], [label for _, label in sizes], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(f"KV cache budget (bytes, log scale; {w.model} {w.kv_dtype}: "
                  f"{format_bytes(w.kv_bytes_per_token)}/token)")
    ax.set_ylabel("prefix hit rate (hit tokens / prompt tokens)")
    ax.set_ylim(0, max(0.05, w.ceiling * 1.1, *(r["hit_rate"] * 1.1 for r in w.rows)))
    ax.set_title(f"Prefix hit rate vs KV budget: {os.path.basename(w.trace)}\n"
                 f"{'radix (SGLang: nodes, lru), ' if w.prefix_mode == 'radix' else ''}block size {w.block_size}, last {w.window_requests:,} of {w.requests:,} requests "
                 f"(warm-up {w.warmup:g})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(w: WhatIf):
    """A rich Table: one row per budget, one column per policy, then the ceiling."""
    from rich.table import Table

    policies = list(dict.fromkeys(r["policy"] for r in w.rows))
    t = Table(title=f"prefix hit rate: {os.path.basename(w.trace)}"
                    + (" (radix: SGLang's node eviction)" if w.prefix_mode == "radix" else ""),
              caption=f"block {w.block_size} tokens; {w.model} {w.kv_dtype}: "
                      f"{w.kv_bytes_per_token:,} B of KV per token; last {w.window_requests:,} of "
                      f"{w.requests:,} requests counted (warm-up {w.warmup:g})")
    t.add_column("budget", justify="right", min_width=7)
    t.add_column("blocks", justify="right")
    for p, name in column_names(policies).items():
        t.add_column(name, justify="right")
    t.add_column("ceiling", justify="right", style="dim", min_width=7)
    by_budget: dict[int, dict] = {}
    for r in w.rows:
        cells = by_budget.setdefault(r["budget_bytes"], {"blocks": r["budget_blocks"], "label": r["budget"]})
        cells[r["policy"]] = r
    for size, cells in sorted(by_budget.items()):
        best = max(cells[p]["hit_rate"] for p in policies)
        row = [cells["label"], f"{cells['blocks']:,}"]
        for p in policies:
            v = cells[p]["hit_rate"]
            row.append(f"[bold]{v:.4f}[/bold]" if v == best else f"{v:.4f}")
        row.append(f"{w.ceiling:.4f}")
        t.add_row(*row)
    return t


def gap_table(w: WhatIf):
    """A rich Table of the share of the lru -> belady gap each other policy closes, one row per
    budget (a budget with no gap, where belady does no better than lru, shows a dash); None
    without lru and belady among the policies."""
    from rich.table import Table

    policies = [p for p in dict.fromkeys(r["policy"] for r in w.rows) if p not in ("lru", "belady")]
    if not policies or not any(r.get("gap_closed") is not None for r in w.rows):
        return None
    t = Table(title="share of the lru -> belady gap closed",
              caption="(hit rate - lru's) / (belady's - lru's) at each budget: 0% is lru, 100% belady")
    t.add_column("budget", justify="right")
    for name in column_names(policies).values():
        t.add_column(name, justify="right")
    by_budget: dict[int, dict] = {}
    for r in w.rows:
        by_budget.setdefault(r["budget_bytes"], {"label": r["budget"]})[r["policy"]] = r.get("gap_closed")
    for _, cells in sorted(by_budget.items()):
        gaps = [cells[p] for p in policies]
        best = max((g for g in gaps if g is not None), default=None)
        t.add_row(cells["label"], *("-" if g is None else f"[bold]{g:.0%}[/bold]" if g == best else f"{g:.0%}"
                                    for g in gaps))
    return t
