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

fifo, lfu and belady keep a binary heap with lazy deletion: O(log n) per operation.
The same classes serve the replay engine and ``kvbench trace whatif``.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

NEVER = 1 << 62  # next use of a block no later request looks up


class CachePolicy:
    """Interface. Block ids are ints in [0, num_blocks)."""

    name = "base"

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks

    def on_insert(self, block: int, now: int, next_use: int = NEVER) -> None:
        """A block was registered in the cache (it is in use)."""

    def on_use(self, block: int, now: int, next_use: int = NEVER) -> None:
        """A cached block was hit (it is in use)."""

    def release(self, block: int) -> None:
        """The block's refcount fell to 0: it becomes evictable."""
        raise NotImplementedError

    def reuse(self, block: int) -> None:
        """An evictable block is taken again (hit): it is no longer evictable."""
        raise NotImplementedError

    def pop(self) -> int:
        """Remove and return the victim among evictable blocks (the caller checks len first)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._q: OrderedDict[int, None] = OrderedDict()

    def release(self, block: int) -> None:
        self._q[block] = None

    def reuse(self, block: int) -> None:
        del self._q[block]

    def pop(self) -> int:
        return self._q.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._q)


class _HeapPolicy(CachePolicy):
    """Evict the evictable block with the smallest ``_priority``; stale heap entries are skipped."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._heap: list[tuple] = []
        self._stamp = [0] * num_blocks  # bumps invalidate older heap entries of a block
        self._evictable = [False] * num_blocks
        self._n = 0

    def _priority(self, block: int) -> tuple:
        raise NotImplementedError

    def release(self, block: int) -> None:
        self._evictable[block] = True
        self._n += 1
        heapq.heappush(self._heap, (*self._priority(block), self._stamp[block], block))

    def reuse(self, block: int) -> None:
        self._evictable[block] = False
        self._stamp[block] += 1
        self._n -= 1

    def pop(self) -> int:
        heap, stamp, ev = self._heap, self._stamp, self._evictable
        while True:
            entry = heapq.heappop(heap)
            b = entry[-1]
            if ev[b] and entry[-2] == stamp[b]:
                ev[b] = False
                stamp[b] += 1
                self._n -= 1
                return b

    def __len__(self) -> int:
        return self._n


class FIFOPolicy(_HeapPolicy):
    name = "fifo"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._inserted = [0] * num_blocks
        self._seq = 0

    def on_insert(self, block: int, now: int, next_use: int = NEVER) -> None:
        self._seq += 1
        self._inserted[block] = self._seq

    def _priority(self, block: int) -> tuple:
        return (self._inserted[block],)


class LFUPolicy(_HeapPolicy):
    name = "lfu"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._count = [0] * num_blocks
        self._last = [0] * num_blocks
        self._tick = 0

    def on_insert(self, block: int, now: int, next_use: int = NEVER) -> None:
        self._count[block] = 1
        self._tick += 1
        self._last[block] = self._tick

    def on_use(self, block: int, now: int, next_use: int = NEVER) -> None:
        self._count[block] += 1
        self._tick += 1
        self._last[block] = self._tick

    def _priority(self, block: int) -> tuple:
        return (self._count[block], self._last[block])


class BeladyPolicy(_HeapPolicy):
    name = "belady"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._next = [NEVER] * num_blocks

    def on_insert(self, block: int, now: int, next_use: int = NEVER) -> None:
        self._next[block] = next_use

    on_use = on_insert

    def _priority(self, block: int) -> tuple:
        return (-self._next[block],)


POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy, "belady": BeladyPolicy,
}


def make_policy(name: str, num_blocks: int) -> CachePolicy:
    try:
        return POLICIES[name](num_blocks)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})") from None
