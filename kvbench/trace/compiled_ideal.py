"""The compiled cores of kvbench.trace.ideal (numba, ``cache=True``): IdealCounter's kept keys and
their expiry, one compiled call per request (``add``), and ``block_expiry``.

Imported on first use (``keys._ideal_core()``), as kvbench.trace.compiled is. ``add`` does what a Python
set of keys with a heap of expiry -> key arrays did (tests/test_ideal.py holds the figures equal to
a plain set's), in a few arrays so that a call pays numba's per-argument dispatch only a few times:

- ``tk``/``occ``: the kept keys, an open-addressing table with linear probing (uint64 keys; ``occ`` 1
  where a slot holds one, so no key value marks an empty slot), at most half full, deleted by
  backward shift so no tombstone ever slows a probe; grown by ``rehash`` (the caller's ``grow``);
- ``nkey``/``nnext``: a pool of list nodes, (key, next node; -1 ends a list), the free ones a list of
  their own from ``c[FREE]``;
- ``heap``: int64 [2, capacity], a min-heap of (expiry, first node of its keys): each run of a
  request's new keys with one expiry is one entry, so a request adds one entry per piece, not one
  per key; the entries whose expiry has come are popped and their keys let go;
- ``c``: int64 counters (``N`` ... ``HEAP``).

Integer care: numba turns ``uint64 op int64`` into a float, so keys stay uint64 and table positions
int64, each masked with its own type.
"""
from __future__ import annotations

import numpy as np

from kvbench.jit import numba

N, FREE, NFREE, HEAP = range(4)  # counters: keys kept, free-list head, free nodes, heap entries
NEVER = np.iinfo(np.int64).max  # an expiry that never comes (kvbench.trace.ideal.NEVER)


@numba.njit(cache=True, inline="always")
def _find(tk, occ, key):
    """The slot of ``key`` in the table, or of the empty slot where its probe ends."""
    mask = len(occ) - 1
    i = np.int64(key & np.uint64(mask))
    while occ[i] and tk[i] != key:
        i = (i + 1) & mask
    return i


@numba.njit(cache=True, inline="always")
def _delete_at(tk, occ, i):
    """Empty slot ``i`` (occupied): later entries of its probe run shift back into the hole, so every
    remaining key stays reachable from its home slot without tombstones."""
    mask = len(occ) - 1
    occ[i] = 0
    j = i
    while True:
        j = (j + 1) & mask
        if not occ[j]:
            return
        home = np.int64(tk[j] & np.uint64(mask))
        # the entry at j may fill the hole at i when i lies on its probe path, home .. j (cyclic)
        if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
            tk[i] = tk[j]
            occ[i] = 1
            occ[j] = 0
            i = j


@numba.njit(cache=True, inline="always")
def _contains(tk, occ, key):
    return occ[_find(tk, occ, key)] != 0


@numba.njit(cache=True, inline="always")
def _heap_push(heap, c, e, head):
    exp, heads = heap[0], heap[1]
    i = c[HEAP]
    c[HEAP] = i + 1
    while i > 0:
        parent = (i - 1) >> 1
        if exp[parent] <= e:
            break
        exp[i] = exp[parent]
        heads[i] = heads[parent]
        i = parent
    exp[i] = e
    heads[i] = head


@numba.njit(cache=True, inline="always")
def _heap_pop(heap, c):
    """Remove the root entry (the heap is not empty)."""
    exp, heads = heap[0], heap[1]
    n = c[HEAP] - 1
    c[HEAP] = n
    if n == 0:
        return
    e, head = exp[n], heads[n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and exp[child + 1] < exp[child]:
            child += 1
        if exp[child] >= e:
            break
        exp[i] = exp[child]
        heads[i] = heads[child]
        i = child
    exp[i] = e
    heads[i] = head


@numba.njit(cache=True)
def add(tk, occ, nkey, nnext, heap, c, keys, expires, end, at, expiring):
    """One request (IdealCounter.add): let go of the keys whose expiry is below ``at``; find the
    longest prefix of ``keys`` kept (by the binary search of ideal._seen_prefix, probe for probe);
    keep ``keys[m:end]``, and, when ``expiring``, note each of them under its ``expires`` (NEVER: not
    noted). Returns (m, keys newly kept); (-1, room) when the arrays lack room for ``room`` more keys:
    nothing was kept then, and the call is made again once the caller has grown them (``grow``)."""
    # keys whose last user has been counted (expiry < at) leave the table, their nodes the lists
    exp = heap[0]
    while c[HEAP] > 0 and exp[0] < at:
        head = heap[1, 0]
        _heap_pop(heap, c)
        node, last, count = head, np.int64(-1), np.int64(0)
        while node >= 0:
            i = _find(tk, occ, nkey[node])
            if occ[i]:
                _delete_at(tk, occ, i)
                c[N] -= 1
            last = node
            node = nnext[node]
            count += 1
        nnext[last] = c[FREE]
        c[FREE] = head
        c[NFREE] += count
    # the kept prefix: the table is prefix-closed (ideal._seen_prefix says why)
    n = len(keys)
    if n == 0 or not _contains(tk, occ, keys[0]):
        m = np.int64(0)
    else:
        lo, hi = np.int64(1), np.int64(n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _contains(tk, occ, keys[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        m = lo
    if m >= end:
        return m, np.int64(0)
    room = end - m
    if 2 * (c[N] + room) > len(occ) or (expiring and (c[NFREE] < room or c[HEAP] + room > heap.shape[1])):
        return np.int64(-1), room
    new = np.int64(0)
    for j in range(m, end):
        k = keys[j]
        i = _find(tk, occ, k)
        if not occ[i]:
            tk[i] = k
            occ[i] = 1
            new += 1
    c[N] += new
    if expiring:  # every key of keys[m:end] (as the set's buckets held them), a list per run of one expiry
        j = m
        while j < end:
            e = expires[j]
            if e == NEVER:
                j += 1
                continue
            head = c[FREE]
            node, last, count = head, np.int64(-1), np.int64(0)
            while j < end and expires[j] == e:
                nkey[node] = keys[j]
                last = node
                node = nnext[node]
                count += 1
                j += 1
            nnext[last] = -1
            c[FREE] = node
            c[NFREE] -= count
            _heap_push(heap, c, e, head)
    return m, new


@numba.njit(cache=True)
def rehash(tk, occ, new_tk, new_occ):
    """Move every key of the table into a larger (empty) one."""
    for i in range(len(occ)):
        if occ[i]:
            j = _find(new_tk, new_occ, tk[i])
            new_tk[j] = tk[i]
            new_occ[j] = 1


@numba.njit(cache=True)
def contains(tk, occ, key):
    return _contains(tk, occ, key)


@numba.njit(cache=True)
def index_names(name_seeds, name_last, nk, nocc, nv):
    """SharedNames' sorted seeds and last uses as a table of their own (``nk``/``nocc`` as ``tk``/
    ``occ``, ``nv`` the last use; empty, at most half full): of equal seeds the first is kept, the
    one numpy.searchsorted finds."""
    for i in range(len(name_seeds)):
        s = name_seeds[i]
        j = _find(nk, nocc, s)
        if not nocc[j]:
            nk[j] = s
            nocc[j] = 1
            nv[j] = name_last[i]


@numba.njit(cache=True)
def keep_shared(seeds, lengths, literal_at, memo, pieces_at, answers, nk, nocc, by_table, out):
    """Requests' pieces (kvbench.trace.keys._flatten's): where ``by_table``, a named stream (``memo``
    True) whose seed the names table (``index_names``) lacks is used by one request only, and its
    ``memo`` is cleared, in place. ``out[r]``: the prompt tokens of request r before its first piece of
    its own (a unique stream, or a named one no other request names: memo False, not literal), -1 if
    none: what PrefixKeys.shareable_blocks counts. A request's answer piece (``answers[r]`` > 0: its
    last piece) is never its prompt's."""
    for r in range(len(pieces_at) - 1):
        end = pieces_at[r + 1]
        prompt_end = end - 1 if answers[r] > 0 else end
        first, pos = np.int64(-1), np.int64(0)
        for p in range(pieces_at[r], end):
            if memo[p]:
                own = by_table and not nocc[_find(nk, nocc, seeds[p])]
                if own:
                    memo[p] = False
            else:
                own = literal_at[p] < 0
            if own and first < 0 and p < prompt_end and lengths[p] > 0:
                first = pos
            pos += lengths[p]
        out[r] = first


@numba.njit(cache=True)
def block_expiry(lengths, literal_at, seeds, nk, nocc, nv, per_piece, n_blocks, block_size):
    """ideal.block_expiry: per whole block, the expiry of the piece its last token lies in (the first
    piece whose end lies past it, as numpy.searchsorted(ends, token, "right") finds it): NEVER for
    literal tokens, else the name's last use, -1 for a name not shared (the table of ``index_names``;
    or, where ``per_piece`` is not empty, its own entry, given per piece)."""
    out = np.empty(n_blocks, dtype=np.int64)
    pieces = len(lengths)
    b, p, end = np.int64(0), np.int64(-1), np.int64(0)
    while b < n_blocks:
        p += 1
        if p >= pieces:
            raise IndexError("block_expiry: more blocks than the pieces' tokens")
        end += lengths[p]
        stop = min(end // block_size, n_blocks)  # the blocks whose last token lies before ``end``
        if stop <= b:
            continue
        if literal_at[p] >= 0:
            cur = NEVER
        elif len(per_piece):
            cur = per_piece[p]
        else:
            j = _find(nk, nocc, seeds[p])
            cur = nv[j] if nocc[j] else np.int64(-1)
        out[b:stop] = cur
        b = stop
    return out
