"""The what-if's compiled cores (numba, ``cache=True``): belady's next uses over dense ids, lru's stack
depths (``lru_curve``'s one pass), and fifo, lfu and belady as per-bucket linked lists
(``run_compiled``); tests/test_whatif_curve.py holds each to the Python it restates."""
from __future__ import annotations

import numpy as np

from kvbench.jit import numba
from kvbench.memory.policy_base import NEVER


def next_uses_dense(ids: np.ndarray, starts: np.ndarray, lookups: np.ndarray) -> np.ndarray:
    """kvbench.memory.future.next_uses_from_keys's backward pass, over dense ids and compiled (its
    dict of keys and per-request lists of Python ints grow with the whole trace), flattened like
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


@numba.njit(cache=True)
def lru_depths(ids, starts, lookups, first, n_ids):
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
def run_compiled(kind, ids, starts, lookups, future, budget, n_ids, never, nxt, prv):
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
