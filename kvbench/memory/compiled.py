"""The compiled cores of kvbench.memory.array_pool (numba, ``cache=True``): the block pool of the hash
prefix cache under LRU, every per-block loop of one pool call in one compiled function.

Imported on first use (``array_pool.compiled()``), as kvbench.trace.compiled is. Each function does
what kvbench.memory.block_pool.BlockPool (with kvbench.memory.policies.LRUPolicy) does for the same
call, block by block in the same order: tests/test_array_pool.py holds the two pools equal.

The state, in a few arrays so that a call pays numba's per-argument dispatch only a few times:
- ``s32``: int32 [8, num_blocks + 1], one row per field (``REFCNT`` ... ``DNEXT``); the LRU list's
  sentinel is entry num_blocks of ``PREV`` and ``NEXT``; ``DPREV``/``DNEXT`` ring the blocks cached
  under one key in the order they were cached (a block alone is its own ring), vLLM's
  BlockHashToBlockMap keeping several blocks per key: the index names the first, a lookup finds it,
  and when it is evicted the next takes the key over;
- ``s64``: uint64 [2, num_blocks], a block's prefix key and its parent's key (``KEY``, ``PARENT``);
- ``hk``/``hv``: the prefix index, key -> block, an open-addressing table with linear probing
  (uint64 keys, int32 blocks, -1 an empty slot; at most half full), deleted by backward shift so no
  tombstone ever slows a probe;
- ``rows``: int32 [num_blocks, block_size], the tokens of every registered block (hits are confirmed
  against them, so a key collision can never return wrong KV);
- ``c``: int64 counters (``USED`` ... ``VIRTUAL``).

Integer care: numba turns ``uint64 op int64`` into a float, so keys stay uint64 and table positions
int64, each masked with its own type.
"""
from __future__ import annotations

import numpy as np

from kvbench.jit import numba

REFCNT, FILL, CACHED, FREE, PREV, NEXT, DPREV, DNEXT = range(8)  # rows of s32 (CACHED: 1 when it has a key)
KEY, PARENT = range(2)  # rows of s64
USED, LIVE, EVICTIONS, NFREE, NCACHED, VIRTUAL = range(6)  # counters
SHORT, NOT_CACHED = -1, -2  # error returns


@numba.njit(cache=True, inline="always")
def _find(hk, hv, key):
    """The slot of ``key`` in the index, or of the empty slot where its probe ends."""
    mask = len(hv) - 1
    i = np.int64(key & np.uint64(mask))
    while hv[i] >= 0 and hk[i] != key:
        i = (i + 1) & mask
    return i


@numba.njit(cache=True, inline="always")
def _delete(hk, hv, key):
    """Remove ``key`` (present) from the index: later entries of its probe run shift back into the
    hole, so every remaining key stays reachable from its home slot without tombstones."""
    mask = len(hv) - 1
    i = _find(hk, hv, key)
    hv[i] = -1
    j = i
    while True:
        j = (j + 1) & mask
        if hv[j] < 0:
            return
        home = np.int64(hk[j] & np.uint64(mask))
        # the entry at j may fill the hole at i when i lies on its probe path, home .. j (cyclic)
        if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
            hk[i] = hk[j]
            hv[i] = hv[j]
            hv[j] = -1
            i = j


@numba.njit(cache=True, inline="always")
def _lru_remove(s32, b):
    prev, nxt = s32[PREV], s32[NEXT]
    p, n = prev[b], nxt[b]
    nxt[p] = n
    prev[n] = p


@numba.njit(cache=True, inline="always")
def _lru_append(s32, b):
    prev, nxt = s32[PREV], s32[NEXT]
    tail = len(prev) - 1  # the sentinel
    last = prev[tail]
    nxt[last] = b
    prev[b] = last
    nxt[b] = tail
    prev[tail] = b


@numba.njit(cache=True, inline="always")
def _unindex(s32, hk, hv, key, b):
    """Forget cached block ``b`` under ``key``: the next block of its ring takes the key over, or
    the key leaves the index. Returns 1 when the key left."""
    dprev, dnext = s32[DPREV], s32[DNEXT]
    n = dnext[b]
    if n == b:
        _delete(hk, hv, key)
        return 1
    p = dprev[b]
    dnext[p] = n
    dprev[n] = p
    dprev[b] = b
    dnext[b] = b
    slot = _find(hk, hv, key)
    if hv[slot] == b:  # the first cached went: the next in caching order is found now
        hv[slot] = n
    return 0


@numba.njit(cache=True, inline="always")
def _index(s32, hk, hv, slot, k, b):
    """Cache ``b`` under ``k``, whose probe ends at ``slot``: a new key, or the last of its ring.
    Returns 1 for a new key, 0 for a block cached beside another."""
    dprev, dnext = s32[DPREV], s32[DNEXT]
    head = hv[slot]
    if head < 0:
        hk[slot] = k
        hv[slot] = b
        dprev[b] = b
        dnext[b] = b
        return 1
    last = dprev[head]
    dnext[last] = b
    dprev[b] = last
    dnext[b] = head
    dprev[head] = b
    return 0


@numba.njit(cache=True)
def alloc(s32, s64, hk, hv, c, n, out, vkeys, vparents, vgone):
    """Write ``n`` newly allocated blocks (refcount 1) to ``out``: free ones first (the top of the
    free stack first), then cached ones in LRU order (least recently released first), forgotten by
    the index. Returns how many were evicted (their keys and parents' keys are then in ``vkeys`` and
    ``vparents``, and ``vgone`` is 1 where the key left the cache with it), or SHORT (nothing
    changed) when the blocks are not there: too few cached, or the free blocks beyond the
    materialised ones (VIRTUAL) wanted."""
    refcnt, fill, cached, free, nxt = s32[REFCNT], s32[FILL], s32[CACHED], s32[FREE], s32[NEXT]
    nfree = c[NFREE]
    take = min(n, nfree)
    need = n - take
    if need and (c[VIRTUAL] or need > c[NCACHED]):
        return SHORT
    for i in range(take):
        b = free[nfree - 1 - i]
        refcnt[b] = 1
        out[i] = b
    c[NFREE] = nfree - take
    sentinel = len(nxt) - 1
    key, parent = s64[KEY], s64[PARENT]
    for i in range(need):
        b = nxt[sentinel]
        _lru_remove(s32, b)
        vkeys[i] = key[b]
        vparents[i] = parent[b]
        vgone[i] = _unindex(s32, hk, hv, key[b], b)
        cached[b] = 0
        fill[b] = 0
        refcnt[b] = 1
        out[take + i] = b
    c[NCACHED] -= need
    c[EVICTIONS] += need
    c[USED] += n
    return need


@numba.njit(cache=True)
def release(s32, c, blocks):
    """Drop a reference to each block, in order: one whose refcount falls to 0 joins the LRU tail
    when it has a key, else the free stack (emptied)."""
    refcnt, fill, cached, free = s32[REFCNT], s32[FILL], s32[CACHED], s32[FREE]
    nfree = c[NFREE]
    used = live = ncached = 0
    for i in range(len(blocks)):
        b = blocks[i]
        r = refcnt[b] - 1
        refcnt[b] = r
        if r:
            continue
        used += 1
        live += fill[b]
        if cached[b]:
            _lru_append(s32, b)
            ncached += 1
        else:
            fill[b] = 0
            free[nfree] = b
            nfree += 1
    c[NFREE] = nfree
    c[USED] -= used
    c[LIVE] -= live
    c[NCACHED] += ncached


@numba.njit(cache=True)
def incref(s32, c, blocks):
    """Take another reference to each block; a cached one with none leaves the LRU list. Returns
    NOT_CACHED (at the first such block, earlier ones taken) for a block with no reference and no
    key: it is free, and only the allocator may hand it out."""
    refcnt, fill, cached = s32[REFCNT], s32[FILL], s32[CACHED]
    for i in range(len(blocks)):
        b = blocks[i]
        if refcnt[b] == 0:
            if not cached[b]:
                return NOT_CACHED
            _lru_remove(s32, b)
            c[NCACHED] -= 1
            c[USED] += 1
            c[LIVE] += fill[b]
        refcnt[b] += 1
    return 0


@numba.njit(cache=True)
def register(s32, s64, hk, hv, rows, blocks, keys, parent_key, tokens, fresh):
    """Cache consecutive computed blocks: ``keys[i]`` is ``blocks[i]``'s chained key, ``parent_key``
    the key before the first, ``tokens`` their ids (block_size each). A block that has a key already
    is skipped; one whose key is cached already is cached beside it. Writes the positions whose key
    is new to the cache to ``fresh``; returns how many."""
    cached, key, parent = s32[CACHED], s64[KEY], s64[PARENT]
    bs = rows.shape[1]
    par = parent_key
    n = 0
    for i in range(len(blocks)):
        b = blocks[i]
        k = keys[i]
        if not cached[b]:
            if _index(s32, hk, hv, _find(hk, hv, k), k, b):
                fresh[n] = i
                n += 1
            key[b] = k
            parent[b] = par
            cached[b] = 1
            o = i * bs
            for t in range(bs):  # (an explicit loop: numba's slice assignment costs ~20 ns a block more)
                rows[b, t] = tokens[o + t]
        par = k
    return n


@numba.njit(cache=True)
def register_one(s32, s64, hk, hv, rows, b, k, parent_key, tokens):
    """``register`` of one block (a decode step's): 1 if its key is new to the cache, else 0."""
    cached = s32[CACHED]
    if cached[b]:
        return 0
    fresh = _index(s32, hk, hv, _find(hk, hv, k), k, b)
    s64[KEY, b] = k
    s64[PARENT, b] = parent_key
    cached[b] = 1
    for t in range(rows.shape[1]):
        rows[b, t] = tokens[t]
    return fresh


@numba.njit(cache=True)
def match(s64, hk, hv, rows, keys, tokens, n_max, parent_key, out):
    """The blocks caching the longest run of ``keys[:n_max]`` whose parents chain from
    ``parent_key``, cut at the first whose stored tokens differ from ``tokens``: written to ``out``;
    returns how many."""
    parent = s64[PARENT]
    par = parent_key
    n = 0
    for j in range(n_max):
        k = keys[j]
        b = hv[_find(hk, hv, k)]
        if b < 0 or parent[b] != par:
            break
        out[n] = b
        n += 1
        par = k
    bs = rows.shape[1]
    for j in range(n):
        b = out[j]
        for t in range(bs):
            if rows[b, t] != tokens[j * bs + t]:
                return j
    return n


@numba.njit(cache=True)
def fresh_need(s32, s64, hk, hv, rows, keys, tokens, n_max, parent_key, out, num_tokens, chunk, whole):
    """The blocks an empty table takes to admit a sequence of ``num_tokens`` tokens now, its prefix hits
    (``match``'s, written to ``out``) apart: the first ``chunk`` tokens past the hits, or (``whole``)
    every token past them, plus the hits no one holds (they leave the evictable set). What
    kvbench.memory.paged.PagedKV.allocate checks against the blocks available, for an empty table
    with neither radix copies nor tiers."""
    n = match(s64, hk, hv, rows, keys, tokens, n_max, parent_key, out)
    bs = rows.shape[1]
    refcnt = s32[REFCNT]
    revived = 0
    for j in range(n):
        if refcnt[out[j]] == 0:
            revived += 1
    rest = num_tokens - n * bs
    need = (min(rest, chunk) + bs - 1) // bs
    if whole:
        need = max(need, (rest + bs - 1) // bs)
    return need + revived


@numba.njit(cache=True)
def add_fill(s32, c, blocks, n):
    """``n`` more tokens of KV written into each of these used blocks."""
    fill = s32[FILL]
    for i in range(len(blocks)):
        fill[blocks[i]] += n
    c[LIVE] += n * len(blocks)
