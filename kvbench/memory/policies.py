"""Cache policies: which cached-but-unused block to reclaim first (``--cache-policy``), and their
registry (``CACHE_POLICIES``, ``make_policy``, ``needs_future``).

Each is a kvbench.memory.policy_base.CachePolicy over the pool's evictable set (refcount 0, still
indexed); the same classes serve the replay and ``kvbench trace whatif``. Ties go to the block released
longest ago, never to a block id. Each class's docstring states its rule and source; the policies, their
costs and the radix modes: docs/architecture.md, "Layer 2, memory" ("Cache policies").
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from itertools import groupby, islice, repeat

from kvbench.memory.learned import LearnedPolicy
from kvbench.memory.policy_base import NEVER, CachePolicy, ReleaseKeyed


class LRUPolicy(CachePolicy):
    """Held blocks (leaves-only eviction) take their place in the queue at release and stay there,
    skipped by ``pop`` until unheld: their release order is kept exactly. The pool releases a
    sequence tail first and every user of a cached child holds its parent, so a held block lies
    behind its children and is unheld before the front reaches it; the skip is only a safeguard."""

    name = "lru"

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self._q: OrderedDict[int, None] = OrderedDict()
        self._held: set[int] = set()  # in _q, not evictable

    def hold(self, block: int) -> None:
        self._q[block] = None
        self._held.add(block)

    def unhold(self, block: int) -> None:
        self._held.discard(block)

    def reuse_held(self, block: int) -> None:
        self._held.discard(block)
        del self._q[block]

    def on_insert(self, block: int, now: float, next_use: int = NEVER) -> None:
        pass  # lru orders by release only; the block pool skips this call on its hot path

    def on_use(self, block: int, now: float, next_use: int = NEVER) -> None:
        pass

    def release(self, block: int) -> None:
        self._q[block] = None  # one dict operation: cheaper than a batch of one

    def release_many(self, blocks) -> None:
        q = self._q
        for b in blocks:
            q[b] = None

    def reuse_many(self, blocks) -> None:
        q = self._q
        for b in blocks:
            del q[b]

    def pop_many(self, n: int) -> list[int]:
        q = self._q
        held = self._held
        if not held or not held.intersection(islice(q, n)):  # the usual case: no held block up front
            victims = list(islice(q, n))
        else:
            victims = list(islice((b for b in q if b not in held), n))
        if len(victims) < n:
            raise IndexError("no evictable block")
        for b in victims:
            del q[b]
        return victims

    def __len__(self) -> int:
        return len(self._q) - len(self._held)


_consume = deque[object](maxlen=0).extend  # runs a map for its side effects, in C
_BITS = 40  # park sequence numbers and block ids each fit in 40 bits
_LOW = (1 << _BITS) - 1


class _TouchOrder(CachePolicy):
    """Evict the evictable block with the smallest ``(key, tick)``: both are set when the block is
    inserted or used (fifo: key 0; lfu: key = uses), and the tick counts those calls, so no two
    blocks tie and release order never matters.

    A bucket queue: ``_buckets[key]`` is an OrderedDict (a linked list in C) of the cached blocks
    with that key in tick order, in use or not: a block takes its place when touched, and touches
    come in tick order. Release and reuse only update the evictable set, so a hit costs no queue
    operation. ``pop`` walks the smallest non-empty bucket from its front; a block it finds there in
    use is *parked* (taken out), and once released it goes to ``_late``, a heap of
    ``key << 80 | park seq << 40 | block``. What is parked from a bucket was at its front, so it
    comes before everything in that bucket and blocks are parked in tick order: a late block with a
    key <= the smallest bucket's goes first, and park order stands in for tick order. A late entry
    is stale once its block is used again (lfu) and leaves ``_late_seq``.

    Protocol (what BlockPool and kvbench.whatif.curve keep): ``on_insert`` only for blocks not cached,
    ``on_use`` and ``release`` for blocks in use, ``reuse`` for evictable ones.
    """

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self._buckets: list[OrderedDict[int, None]] = [OrderedDict(), OrderedDict()]
        self._key = [0] * num_blocks
        self._min = 0  # no bucket below it holds a block
        self._ev: set[int] = set()
        self._parked: dict[int, int] = {}  # block in use -> park seq; in no bucket, not in _late
        self._late: list[int] = []
        self._late_seq: dict[int, int] = {}  # block -> park seq of its live _late entry
        self._parks = 0

    def _queue(self, blocks, key: int) -> None:
        """Blocks not cached before join bucket ``key``, in order."""
        _consume(map(self._buckets[key].__setitem__, blocks, repeat(None)))
        self._min = min(self._min, key)

    def release_many(self, blocks) -> None:
        self._ev.update(blocks)
        parked = self._parked
        if parked:
            back = parked.keys() & blocks
            late, key = self._late, self._key
            for b in back:
                seq = self._late_seq[b] = parked.pop(b)
                heapq.heappush(late, (key[b] << 80) | (seq << _BITS) | b)
            if len(late) > 2 * len(self._late_seq) + 4096:  # stale entries of blocks used again
                self._late = [e for e in late if self._late_seq.get(e & _LOW) == (e >> _BITS) & _LOW]
                heapq.heapify(self._late)

    def reuse_many(self, blocks) -> None:
        self._ev.difference_update(blocks)

    def pop_many(self, n: int) -> list[int]:
        if n > len(self._ev):
            raise IndexError(f"pop {n} of {len(self._ev)} evictable blocks")
        buckets, ev, late, late_seq, parked = (self._buckets, self._ev, self._late, self._late_seq,
                                               self._parked)
        victims: list[int] = []
        c = self._min
        while len(victims) < n:
            while c < len(buckets) and not buckets[c]:
                c += 1
            while late and late_seq.get(late[0] & _LOW) != (late[0] >> _BITS) & _LOW:
                heapq.heappop(late)
            if late and (c == len(buckets) or late[0] >> 80 <= c):
                b = heapq.heappop(late) & _LOW
                seq = late_seq.pop(b)
                if b in ev:
                    ev.discard(b)
                    victims.append(b)
                else:
                    parked[b] = seq
                continue
            bucket = buckets[c]
            front = list(islice(bucket, n - len(victims)))
            _consume(map(bucket.__delitem__, front))
            if ev.issuperset(front):  # the usual case: no block in use up front
                ev.difference_update(front)
                victims += front
                continue
            for b in front:
                if b in ev:
                    ev.discard(b)
                    victims.append(b)
                else:
                    parked[b] = self._parks
                    self._parks += 1
        self._min = c
        return victims

    def __len__(self) -> int:
        return len(self._ev)


class FIFOPolicy(_TouchOrder):
    name = "fifo"

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        self._queue(blocks, 0)


class LFUPolicy(_TouchOrder):
    name = "lfu"

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        _consume(map(self._key.__setitem__, blocks, repeat(1)))
        self._queue(blocks, 1)

    def on_use_many(self, blocks, now: float, next_uses=None) -> None:
        buckets, key, low = self._buckets, self._key, self._min
        for b in blocks:
            c = key[b]
            if b in buckets[c]:
                del buckets[c][b]
            elif self._parked.pop(b, None) is None:
                del self._late_seq[b]  # its _late entry is stale now
            c += 1
            if c == len(buckets):
                buckets.append(OrderedDict())
            buckets[c][b] = None
            key[b] = c
            if c < low:  # a parked block's bucket may lie below the smallest queued one
                low = c
        self._min = low


class BeladyPolicy(CachePolicy):
    """Evict the block whose next use is furthest, ties to the block released longest ago.

    A bucket queue keyed by next use, filled at release: ``_buckets[t]`` holds the evictable blocks
    whose next use is ``t`` in release order (an OrderedDict: append, delete and pop-first in C), and
    ``_keys`` is a heap of ``-t`` over the buckets that exist, so the furthest is on top. A heap
    entry per bucket, not per block: a request's blocks mostly share their next use. A bucket that
    ``reuse`` empties stays until it reaches the top. An evictable block's next use only changes
    through ``on_recompute``, which takes it out first, so ``_next`` always names its bucket.
    """

    name = "belady"
    needs_future = True

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self._next = [NEVER] * num_blocks
        self._n = 0  # evictable blocks
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._keys: list[int] = []

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        _consume(map(self._next.__setitem__, blocks, repeat(NEVER) if next_uses is None else next_uses))

    on_use_many = on_insert_many

    def on_recompute_many(self, blocks, now: float, next_uses=None) -> None:
        buckets, nxt = self._buckets, self._next
        waiting = [b for b in blocks if b in buckets.get(nxt[b], ())]
        self.reuse_many(waiting)  # out of the bucket of the old next use ...
        self.on_insert_many(blocks, now, next_uses)
        self.release_many(waiting)  # ... into the new one's, as released now

    def release_many(self, blocks) -> None:
        buckets = self._buckets
        for t, run in groupby(blocks, self._next.__getitem__):
            bucket = buckets.get(t)
            if bucket is None:
                bucket = buckets[t] = OrderedDict()
                heapq.heappush(self._keys, -t)
            _consume(map(bucket.__setitem__, run, repeat(None)))
        self._n += len(blocks)
        if len(self._keys) > 2 * self._n + 4096:  # buckets emptied by reuse
            self._buckets = {t: q for t, q in buckets.items() if q}
            self._keys = [-t for t in self._buckets]
            heapq.heapify(self._keys)

    def reuse_many(self, blocks) -> None:
        buckets = self._buckets
        for t, run in groupby(blocks, self._next.__getitem__):
            _consume(map(buckets[t].__delitem__, run))
        self._n -= len(blocks)

    def pop_many(self, n: int) -> list[int]:
        if n > self._n:
            raise IndexError(f"pop {n} of {self._n} evictable blocks")
        buckets, keys = self._buckets, self._keys
        victims: list[int] = []
        while len(victims) < n:
            t = -keys[0]
            bucket = buckets[t]
            if n - len(victims) >= len(bucket):
                victims += bucket
                del buckets[t]
                heapq.heappop(keys)
            else:
                front = list(islice(bucket, n - len(victims)))
                _consume(map(bucket.__delitem__, front))
                victims += front
        self._n -= n
        return victims

    def __len__(self) -> int:
        return self._n


class LRU2Policy(ReleaseKeyed):
    """LRU-K with K = 2 (O'Neil, O'Neil & Weikum, "The LRU-K page replacement algorithm for database
    disk buffering", SIGMOD '93): evict the block whose second-most-recent use lies furthest back;
    a block with one use since it entered has none (infinitely far back) and goes first, among such
    blocks by lru's order. A use ends at its release (or hold), so the clock is the release order:
    the key is the seq that ended the block's previous use, 0 for none. The paper's correlated
    reference period is not modelled: uses that overlap (a block shared by running sequences) end
    together, at the last release."""

    name = "lru2"

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self._last = [0] * num_blocks  # seq that ended the block's last use
        self._prev = [0] * num_blocks  # ... and the use before it

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        last, prev = self._last, self._prev
        for b in blocks:  # new content: no use ended yet
            last[b] = prev[b] = 0

    def _ended(self, b: int, seq: int) -> None:
        self._prev[b] = self._last[b]
        self._last[b] = seq

    def _key(self, b: int) -> int:
        return self._prev[b]


class PrefixPolicy(ReleaseKeyed):
    """Deepest first, ties by lru's order: a prefix block serves every continuation, so the blocks
    furthest from the root go before the prefixes they continue. Depth is fixed at insert: 0 for a
    block whose parent key no cached block holds, else its cached parent's depth + 1 (the pool tells
    a run's blocks in chain order, parents first)."""

    name = "prefix"

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self._depth = [0] * num_blocks

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        depth, parent_of = self._depth, self.view.parent_of
        for b in blocks:
            p = parent_of(b)
            depth[b] = depth[p] + 1 if p >= 0 else 0

    def _key(self, b: int) -> int:
        return -self._depth[b]


class ARCPolicy(CachePolicy):
    """ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST '03, Fig. 4),
    over the pool's calls. T1 holds the cached blocks not hit since they entered, T2 those hit since;
    B1 and B2 are ghosts: the keys of blocks evicted from T1 and T2, oldest first.

    - insert, key in B1: p += max(|B2|/|B1|, 1) (at most c), the key leaves B1, the block joins T2;
      key in B2: p -= max(|B1|/|B2|, 1) (at least 0), the key leaves B2, the block joins T2; else
      it joins T1 and the oldest ghosts go until |T1| + |B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c,
      B1's first (the paper's case IV).
    - use (a hit): the block moves to T2.
    - pop (the paper's REPLACE): from T1 if |T1| > p, else from T2; the victim is the list's
      evictable block released longest ago (ARC's LRU end, with recency counted at release as lru
      does), from the other list when this one has none; its key joins the end of B1 (from T1) or B2.

    Where the pool differs from the paper's cache: eviction happens before the new block's key is
    known (the pool allocates, then registers), so REPLACE cannot read "x in B2" and the paper's
    tie case (|T1| = p) goes to T2; blocks in use cannot be evicted, so the list named may yield
    to the other. ``c`` is ``capacity``, the cache's size in blocks. O(1) dict operations per block.
    """

    name = "arc"

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self.p = 0.0  # target size of T1
        self._list = [0] * num_blocks  # 1: T1, 2: T2, 0: not cached
        self._size = [0, 0, 0]  # cached blocks in T1, T2 (in use or not)
        self._q: tuple[OrderedDict, ...] = (OrderedDict(), OrderedDict(), OrderedDict())  # evictable; [0] unused
        self._ghost: tuple[OrderedDict, ...] = (OrderedDict(), OrderedDict(), OrderedDict())  # [1]: B1, [2]: B2

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        key_of, lst, size = self.view.key_of, self._list, self._size
        _, b1, b2 = self._ghost
        c = self.capacity
        for b in blocks:
            k = key_of(b)
            if k is not None and k in b1:
                self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
                del b1[k]
                where = 2
            elif k is not None and k in b2:
                self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
                del b2[k]
                where = 2
            else:
                where = 1
            lst[b] = where
            size[where] += 1
            if where == 1:  # a new key: the directory may exceed c (T1 + B1) or 2c (all four)
                while size[1] + len(b1) > c and b1:
                    b1.popitem(last=False)
                while size[1] + size[2] + len(b1) + len(b2) > 2 * c and b2:
                    b2.popitem(last=False)

    def on_use_many(self, blocks, now: float, next_uses=None) -> None:
        lst, size = self._list, self._size
        for b in blocks:
            if lst[b] == 1:
                lst[b] = 2
                size[1] -= 1
                size[2] += 1

    def release_many(self, blocks) -> None:
        lst, q = self._list, self._q
        for b in blocks:
            q[lst[b]][b] = None

    def reuse_many(self, blocks) -> None:
        lst, q = self._list, self._q
        for b in blocks:
            del q[lst[b]][b]

    def pop_many(self, n: int) -> list[int]:
        if n > len(self):
            raise IndexError(f"pop {n} of {len(self)} evictable blocks")
        q, ghost, lst, size, key_of = self._q, self._ghost, self._list, self._size, self.view.key_of
        victims: list[int] = []
        for _ in range(n):
            where = 1 if q[1] and (size[1] > self.p or not q[2]) else 2
            b = q[where].popitem(last=False)[0]
            size[where] -= 1
            lst[b] = 0
            k = key_of(b)
            if k is not None:
                ghost[where][k] = None
            victims.append(b)
        return victims

    def __len__(self) -> int:
        return len(self._q[1]) + len(self._q[2])


class S3FIFOPolicy(CachePolicy):
    """S3-FIFO (Yang, Zhang, Qiu, Yue & Rashmi, "FIFO queues are all you need for cache eviction",
    SOSP '23; as libCacheSim's S3FIFO.c evicts), over the pool's calls. Two FIFO queues of cached
    blocks, S (small, 10% of c) and M (main, the rest), a ghost FIFO G of up to 0.9c keys, and a
    hit count per block (capped at 3: two bits).

    - insert: into M if the block's key is in G (it leaves G), else into S; count 0.
    - use (a hit): count + 1.
    - pop: from M if |M| > c - |S|max or S is empty, else from S. From S: its oldest block goes to
      M's end with count 0 if hit since it entered, else it is the victim and its key joins G (the
      oldest key leaves G past 0.9c); repeat until a victim. From M: its oldest block goes back to
      M's end with count - 1 if its count is > 0, else it is the victim.

    Where the pool differs: a block in use cannot be evicted. One found at the front with count 0
    is set aside (out of its queue) and re-enters its queue's end when released, as if inserted
    then. When the queue named yields no victim, the other is tried, then the first again. O(1) dict
    operations per block, amortised (a block's count falls at every pass over it).
    """

    name = "s3fifo"
    SMALL = 0.1  # libCacheSim's small-size-ratio
    GHOST = 0.9  # ghost-size-ratio
    MAX_COUNT = 3

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self._small_max = max(1, int(self.capacity * self.SMALL))
        self._main_max = self.capacity - self._small_max
        self._ghost_max = max(1, int(self.capacity * self.GHOST))
        self._count = [0] * num_blocks
        self._where = [0] * num_blocks  # 1: S, 2: M, 0: not cached
        self._size = [0, 0, 0]  # cached blocks of S, M (set-aside ones included)
        self._q: tuple[OrderedDict, ...] = (OrderedDict(), OrderedDict(), OrderedDict())  # [0] unused
        self._ev: set[int] = set()
        self._aside: set[int] = set()
        self._ghost: OrderedDict = OrderedDict()

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        key_of, ghost, count, where, size, q = (self.view.key_of, self._ghost, self._count, self._where,
                                                self._size, self._q)
        for b in blocks:
            k = key_of(b)
            w = 1
            if k is not None and k in ghost:
                del ghost[k]
                w = 2
            count[b] = 0
            where[b] = w
            size[w] += 1
            q[w][b] = None

    def on_use_many(self, blocks, now: float, next_uses=None) -> None:
        count, top = self._count, self.MAX_COUNT
        for b in blocks:
            if count[b] < top:
                count[b] += 1

    def release_many(self, blocks) -> None:
        self._ev.update(blocks)
        aside = self._aside
        if aside:
            q, where = self._q, self._where
            for b in blocks:
                if b in aside:
                    aside.discard(b)
                    q[where[b]][b] = None

    def reuse_many(self, blocks) -> None:
        self._ev.difference_update(blocks)

    def _evict(self, b: int, w: int) -> int:
        self._ev.discard(b)
        self._where[b] = 0
        self._size[w] -= 1
        return b

    def _from_small(self) -> int:
        small, main, count, ev, size = self._q[1], self._q[2], self._count, self._ev, self._size
        while small:
            b = small.popitem(last=False)[0]
            if count[b]:  # hit since it entered: on to M
                count[b] = 0
                self._where[b] = 2
                size[1] -= 1
                size[2] += 1
                main[b] = None
            elif b in ev:
                k = self.view.key_of(b)
                if k is not None:
                    ghost = self._ghost
                    ghost.pop(k, None)
                    ghost[k] = None
                    if len(ghost) > self._ghost_max:
                        ghost.popitem(last=False)
                return self._evict(b, 1)
            else:
                self._aside.add(b)
        return -1

    def _from_main(self) -> int:
        main, count, ev = self._q[2], self._count, self._ev
        while main:
            b = main.popitem(last=False)[0]
            if count[b]:
                count[b] -= 1
                main[b] = None
            elif b in ev:
                return self._evict(b, 2)
            else:
                self._aside.add(b)
        return -1

    def pop_many(self, n: int) -> list[int]:
        if n > len(self._ev):
            raise IndexError(f"pop {n} of {len(self._ev)} evictable blocks")
        victims: list[int] = []
        for _ in range(n):
            if self._size[2] > self._main_max or not self._size[1]:
                first, second = self._from_main, self._from_small
            else:
                first, second = self._from_small, self._from_main
            b = first()
            if b < 0:
                b = second()
                if b < 0:  # S moved its hit blocks to M: M has them now
                    b = first()
            victims.append(b)
        return victims

    def __len__(self) -> int:
        return len(self._ev)


CACHE_POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy, "lru2": LRU2Policy, "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy, "prefix": PrefixPolicy,
}


def split_policy(spec: str) -> tuple[str, str | None]:
    """'learned:policy.json' -> ('learned', 'policy.json'); 'lru' -> ('lru', None)."""
    name, sep, arg = spec.partition(":")
    return name, (arg if sep else None)


def check_policy(spec: str, load: bool = False) -> str:
    """``spec`` if it names a policy (``name``, or ``name:ARG`` for one that takes an argument),
    else ValueError in one line. ``load``: also read the argument (learned: the model file)."""
    base, arg = split_policy(spec)
    cls = CACHE_POLICIES.get(base)
    if cls is None:
        raise ValueError(f"unknown cache policy {spec!r} (choose from {', '.join(CACHE_POLICIES)}; "
                         "learned:FILE for a fitted one)")
    if arg is not None and (not cls.takes_arg or not arg):
        raise ValueError(f"cache policy {base!r} takes no argument (got {spec!r})" if arg
                         else f"{spec!r}: give the file after the colon")
    if load and arg is not None:
        cls.check_arg(arg)
    return spec


def make_policy(name: str, num_blocks: int, capacity: int | None = None) -> CachePolicy:
    """The policy a ``--cache-policy`` value names: a registry name, or ``name:ARG`` for a policy
    that takes an argument (``learned:policy.json``). ``capacity``: the cache's size in blocks
    (default ``num_blocks``, the pool's)."""
    base, arg = split_policy(check_policy(name))
    cls = CACHE_POLICIES[base]
    if arg is None:
        return cls(num_blocks, capacity)
    return cls(num_blocks, capacity, arg)  # type: ignore[call-arg]  # a takes_arg policy's constructor takes ARG


CACHE_POLICIES["learned"] = LearnedPolicy
CACHE_POLICIES["belady"] = BeladyPolicy  # last: the optimum the others are measured against


def needs_future(spec: str) -> bool:
    """Whether the policy a ``--cache-policy`` value names ranks blocks by their next use (belady)."""
    return CACHE_POLICIES[split_policy(spec)[0]].needs_future
