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

fifo, lfu and belady keep a binary heap with lazy deletion: O(log n) per operation. Ties in their
priority go to the block released longest ago (lru's order): for belady, blocks that the same future
request needs are then given up tail first, and no decision depends on which physical block id holds
a prefix, so a caller may number blocks as it likes (kvbench.whatif numbers them by prefix key).
The same classes serve the replay engine and ``kvbench trace whatif``. The ``*_many`` forms do what
the one-block calls do, block by block in order, with the per-call overhead paid once.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import islice

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
    name = "lru"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._q: OrderedDict[int, None] = OrderedDict()

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
        victims = list(islice(q, n))
        for b in victims:
            del q[b]
        return victims

    def __len__(self) -> int:
        return len(self._q)


_BITS = 40  # release sequence numbers and block ids each fit in 40 bits
_LOW = (1 << _BITS) - 1


class _HeapPolicy(CachePolicy):
    """Evict the evictable block with the smallest ``_priority`` (an int >= 0), ties to the block
    released longest ago.

    A heap entry is one int, ``priority << 80 | release seq << 40 | block``: heapq compares ints
    several times faster than tuples. An entry is live while its block is evictable and its seq is
    the block's latest release; pop skips the others, and the heap is rebuilt from the live ones
    when stale entries outnumber them (a cache that never evicts would otherwise keep one per hit).
    """

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._heap: list[int] = []
        self._seq_of = [0] * num_blocks  # seq of each block's latest release
        self._evictable = [False] * num_blocks
        self._n = 0
        self._seq = 0

    def _priority(self, block: int) -> int:
        raise NotImplementedError

    def release_many(self, blocks) -> None:
        heap, seq_of, ev, prio = self._heap, self._seq_of, self._evictable, self._priority
        push = heapq.heappush
        seq = first = self._seq
        for b in blocks:
            seq += 1
            seq_of[b] = seq
            ev[b] = True
            push(heap, (prio(b) << 80) | (seq << _BITS) | b)
        self._seq = seq
        self._n += seq - first
        if len(heap) > 2 * self._n + 4096:
            self._compact()

    def reuse_many(self, blocks) -> None:
        ev = self._evictable
        n = 0
        for b in blocks:
            ev[b] = False
            n += 1
        self._n -= n

    def pop_many(self, n: int) -> list[int]:
        heap, seq_of, ev, pop = self._heap, self._seq_of, self._evictable, heapq.heappop
        victims: list[int] = []
        while len(victims) < n:
            e = pop(heap)
            b = e & _LOW
            if ev[b] and (e >> _BITS) & _LOW == seq_of[b]:
                ev[b] = False
                victims.append(b)
        self._n -= n
        return victims

    def _compact(self) -> None:
        seq_of, ev = self._seq_of, self._evictable
        live = [e for e in self._heap if ev[e & _LOW] and (e >> _BITS) & _LOW == seq_of[e & _LOW]]
        heapq.heapify(live)
        self._heap = live

    def __len__(self) -> int:
        return self._n


class FIFOPolicy(_HeapPolicy):
    name = "fifo"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._inserted = [0] * num_blocks
        self._inserts = 0

    def on_insert_many(self, blocks, now: int, next_uses=None) -> None:
        inserted, k = self._inserted, self._inserts
        for b in blocks:
            k += 1
            inserted[b] = k
        self._inserts = k

    def _priority(self, block: int) -> int:
        return self._inserted[block]


class LFUPolicy(_HeapPolicy):
    name = "lfu"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._count = [0] * num_blocks
        self._last = [0] * num_blocks
        self._tick = 0

    def on_insert_many(self, blocks, now: int, next_uses=None) -> None:
        count, last, tick = self._count, self._last, self._tick
        for b in blocks:
            count[b] = 1
            tick += 1
            last[b] = tick
        self._tick = tick

    def on_use_many(self, blocks, now: int, next_uses=None) -> None:
        count, last, tick = self._count, self._last, self._tick
        for b in blocks:
            count[b] += 1
            tick += 1
            last[b] = tick
        self._tick = tick

    def _priority(self, block: int) -> int:
        return (self._count[block] << _BITS) | self._last[block]


class BeladyPolicy(_HeapPolicy):
    name = "belady"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._next = [NEVER] * num_blocks

    def on_insert_many(self, blocks, now: int, next_uses=None) -> None:
        nxt = self._next
        if next_uses is None:
            for b in blocks:
                nxt[b] = NEVER
        else:
            for b, nu in zip(blocks, next_uses):
                nxt[b] = nu

    on_use_many = on_insert_many

    def on_recompute_many(self, blocks, now: int, next_uses=None) -> None:
        self.on_insert_many(blocks, now, next_uses)
        waiting = [b for b in blocks if self._evictable[b]]
        self.reuse_many(waiting)  # re-queued under the new priority
        self.release_many(waiting)

    def _priority(self, block: int) -> int:
        return NEVER - self._next[block]  # furthest next use = smallest priority = evicted first


POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy, "belady": BeladyPolicy,
}


def make_policy(name: str, num_blocks: int) -> CachePolicy:
    try:
        return POLICIES[name](num_blocks)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})") from None
