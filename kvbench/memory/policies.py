"""Cache policies: which cached-but-unused block to reclaim first (``--cache-policy``).

A policy holds the *evictable* set: blocks whose refcount is 0 but whose KV is still cached under a
prefix key. The block pool tells it when a block is registered, used, released (refcount -> 0),
reused (refcount 0 -> 1) and forgotten; the policy answers ``pop()`` with the victim.

- lru: least recently released first. An OrderedDict is a doubly linked list in C, so release,
  reuse and pop are O(1). Within one request blocks are released tail first, so a sequence's last
  blocks go before its shared prefix (vLLM's order).
- fifo: the block registered longest ago first.
- lfu: fewest uses first, ties by least recent use.
- belady: the block whose next use lies furthest in the future (never used again = infinitely far),
  the offline optimum; the caller passes each block's next use (a request index) when it uses it.

fifo, lfu and belady are bucket queues of OrderedDicts, since their priorities are small ints (a
count, a request index; fifo needs only one bucket): insert, release, reuse and pop cost O(1)
dict operations in C, which matters when nearly every block is inserted and then evicted. Ties in
priority go to the block released longest ago (lru's order): for belady, blocks that the same
future request needs are then given up tail first, and no decision depends on which physical block
id holds a prefix, so a caller may number blocks as it likes (kvbench.whatif.curve numbers them by prefix
key); fifo and lfu never tie. tests/test_policies.py holds every policy to this rule, evaluated by
brute force. The same classes serve the replay engine and ``kvbench trace whatif``. The ``*_many``
forms do what the one-block calls do, block by block in order, with the per-call overhead paid once.

Radix mode with ``--radix-eviction node`` (the default) replaces the policy by
kvbench.memory.radix.RadixNodes, SGLang's node-granular LRU. With ``--radix-eviction block`` it
evicts leaves only (kvbench.memory.block_pool): a released block that a cached block
continues is ``hold``-ed — released for ordering, not evictable — and ``unhold``-en when its last
cached child is evicted. lru and the touch-ordered queues (fifo, lfu) give it the place its release
(or touch) gave it — lru keeps held blocks in its queue and skips them; belady re-queues it at its
unhold, so among blocks of the same next use it goes last rather than by release.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from itertools import groupby, islice, repeat

NEVER = 1 << 62  # next use of a block no later request looks up


class CachePolicy:
    """Interface. Block ids are ints in [0, num_blocks).

    Subclasses implement the batch forms (``*_many``); each one-block call is the batch of one, so
    the replay's per-block calls and the what-if's batches run the same code.
    """

    name = "base"

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks

    def on_insert(self, block: int, now: int, next_use: int = NEVER) -> None:
        """A block was registered in the cache (it is in use)."""
        self.on_insert_many((block,), now, (next_use,))

    def on_use(self, block: int, now: int, next_use: int = NEVER) -> None:
        """A cached block was hit (it is in use)."""
        self.on_use_many((block,), now, (next_use,))

    def release(self, block: int) -> None:
        """The block's refcount fell to 0: it becomes evictable."""
        self.release_many((block,))

    def reuse(self, block: int) -> None:
        """An evictable block is taken again (hit): it is no longer evictable."""
        self.reuse_many((block,))

    def pop(self) -> int:
        """Remove and return the victim among evictable blocks (the caller checks len first)."""
        return self.pop_many(1)[0]

    # -- leaves-only eviction (radix mode): a cached block that another cached block continues ---
    def hold(self, block: int) -> None:
        """The block's refcount fell to 0 but it is not evictable yet: a cached block continues it.
        It is released *now* for ordering purposes; ``unhold`` makes it evictable in that place."""

    def unhold(self, block: int) -> None:
        """A held block's last cached child was evicted: it becomes evictable."""
        self.release(block)

    def reuse_held(self, block: int) -> None:
        """A held block is taken again (hit)."""

    # -- batch forms: the one-block call applied to every block, in order ----------------------
    def on_insert_many(self, blocks, now: int, next_uses=None) -> None:
        """``next_uses[i]`` belongs to ``blocks[i]``; None means NEVER for all."""

    def on_use_many(self, blocks, now: int, next_uses=None) -> None:
        pass

    def on_recompute_many(self, blocks, now: int, next_uses=None) -> None:
        """Cached blocks that a request computed again because a miss came before them: not a use
        (no other policy counts it), but their next use moved on, and belady must know it or it keeps
        them for a use that has passed."""

    def release_many(self, blocks) -> None:
        raise NotImplementedError

    def reuse_many(self, blocks) -> None:
        raise NotImplementedError

    def pop_many(self, n: int) -> list[int]:
        """Remove and return the next ``n`` victims in eviction order (``n <= len(self)``)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LRUPolicy(CachePolicy):
    """Held blocks (leaves-only eviction) take their place in the queue at release and stay there,
    skipped by ``pop`` until unheld: their release order is kept exactly. The pool releases a
    sequence tail first and every user of a cached child holds its parent, so a held block lies
    behind its children and is unheld before the front reaches it; the skip is only a safeguard."""

    name = "lru"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
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

    def on_insert(self, block: int, now: int, next_use: int = NEVER) -> None:
        pass  # lru orders by release only; the block pool skips this call on its hot path

    def on_use(self, block: int, now: int, next_use: int = NEVER) -> None:
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


_consume = deque(maxlen=0).extend  # runs a map for its side effects, in C
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

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
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
        if key < self._min:
            self._min = key

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

    def on_insert_many(self, blocks, now: int, next_uses=None) -> None:
        self._queue(blocks, 0)


class LFUPolicy(_TouchOrder):
    name = "lfu"

    def on_insert_many(self, blocks, now: int, next_uses=None) -> None:
        _consume(map(self._key.__setitem__, blocks, repeat(1)))
        self._queue(blocks, 1)

    def on_use_many(self, blocks, now: int, next_uses=None) -> None:
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

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._next = [NEVER] * num_blocks
        self._n = 0  # evictable blocks
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._keys: list[int] = []

    def on_insert_many(self, blocks, now: int, next_uses=None) -> None:
        _consume(map(self._next.__setitem__, blocks, repeat(NEVER) if next_uses is None else next_uses))

    on_use_many = on_insert_many

    def on_recompute_many(self, blocks, now: int, next_uses=None) -> None:
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


CACHE_POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy, "belady": BeladyPolicy,
}


def make_policy(name: str, num_blocks: int) -> CachePolicy:
    try:
        return CACHE_POLICIES[name](num_blocks)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (choose from {', '.join(CACHE_POLICIES)})") from None
