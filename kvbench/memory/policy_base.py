"""What every cache policy is (``CachePolicy``: the calls the block pool and the what-if make, each one
block or a batch), what it may read of the cache (``CacheView``: a block's prefix key and its parent),
and a base for policies that rank a block when it becomes evictable (``ReleaseKeyed``). The policies
themselves and their registry are kvbench.memory.policies; the learned one kvbench.memory.learned."""
from __future__ import annotations

import heapq

NEVER = 1 << 62  # next use of a block no later request looks up


class CacheView:
    """What a policy may read about cached blocks besides the calls it gets. Unbound, it knows no
    key (no ghost entry ever matches) and no parent (every block is a root)."""

    block_size: int | None = None

    def key_of(self, block: int):
        """The block's prefix key: the identity of its content, which outlives the physical block."""
        return

    def parent_of(self, block: int) -> int:
        """The cached block holding the block's parent key, or -1 (a root, or a parent not cached)."""
        return -1


class PoolView(CacheView):
    """A BlockPool's keys and index, read when a block is inserted or evicted (the pool sets a
    block's key before ``on_insert_many`` and clears it after ``pop_many``)."""

    def __init__(self, pool):
        self._pool = pool
        self.block_size = pool.block_size

    def key_of(self, block: int):
        return self._pool.key[block]

    def parent_of(self, block: int) -> int:
        p = self._pool
        return p.index.get(p.parent[block], -1)


class CachePolicy:
    """Interface. Block ids are ints in [0, num_blocks).

    Subclasses implement the batch forms (``*_many``); each one-block call is the batch of one, so
    the replay's per-block calls and the what-if's batches run the same code.
    """

    name = "base"
    needs_future = False  # it ranks blocks by their next use, which the caller computes from the trace
    takes_arg = False  # ``name:ARG`` (learned:FILE): the constructor's third argument, read by check_arg

    @staticmethod
    def check_arg(arg: str) -> None:
        """ValueError in one line unless ``arg`` suits the policy (one that ``takes_arg``)."""

    def __init__(self, num_blocks: int, capacity: int | None = None):
        self.num_blocks = num_blocks
        self.capacity = capacity if capacity is not None else num_blocks  # blocks the cache holds
        self.view = CacheView()

    def bind(self, view: CacheView) -> None:
        """Read block keys and parents through ``view`` (BlockPool: PoolView)."""
        self.view = view

    def on_insert(self, block: int, now: float, next_use: int = NEVER) -> None:
        """A block was registered in the cache (it is in use)."""
        self.on_insert_many((block,), now, (next_use,))

    def on_use(self, block: int, now: float, next_use: int = NEVER) -> None:
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
    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        """``next_uses[i]`` belongs to ``blocks[i]``; None means NEVER for all."""

    def on_use_many(self, blocks, now: float, next_uses=None) -> None:
        pass

    def on_recompute_many(self, blocks, now: float, next_uses=None) -> None:
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


class ReleaseKeyed(CachePolicy):
    """Evict the evictable block with the smallest key, computed when it becomes evictable (release,
    or unhold); ties go to the block that became evictable longest ago (lru's order).

    A heap of ``(key, seq, block)`` with lazy deletion: ``_entry[b]`` is the seq of the block's live
    entry (0 when it is not evictable), so ``reuse`` costs nothing and ``pop`` skips entries whose
    block was taken again or queued anew: O(log n) per block. ``_ended`` sees every end of a use (a
    release, or a hold, which ends a use without making the block evictable) before ``_key`` is
    read. A key depends only on state that stays put while the block waits, or ``_requeue`` queues
    it again, as released now (learned: a new continuation).
    """

    def __init__(self, num_blocks: int, capacity: int | None = None):
        super().__init__(num_blocks, capacity)
        self._heap: list[tuple] = []
        self._entry = [0] * num_blocks
        self._seq = 0
        self._n = 0

    def _ended(self, b: int, seq: int) -> None:
        """A use of ``b`` ended at ``seq`` (its release, or its hold)."""

    def _key(self, b: int):
        raise NotImplementedError

    def _push(self, b: int) -> None:
        self._seq += 1
        self._entry[b] = self._seq
        heapq.heappush(self._heap, (self._key(b), self._seq, b))

    def release_many(self, blocks) -> None:
        heap, entry, key, seq = self._heap, self._entry, self._key, self._seq
        ended = None if type(self)._ended is ReleaseKeyed._ended else self._ended
        push = heapq.heappush
        n = 0
        for b in blocks:  # _push, inlined: the hot path
            seq += 1
            if ended is not None:
                ended(b, seq)
            entry[b] = seq
            push(heap, (key(b), seq, b))
            n += 1
        self._seq = seq
        self._n += n

    def hold(self, block: int) -> None:
        self._seq += 1
        self._ended(block, self._seq)

    def unhold(self, block: int) -> None:
        self._push(block)
        self._n += 1

    def reuse_held(self, block: int) -> None:
        pass

    def reuse_many(self, blocks) -> None:
        entry = self._entry
        n = 0
        for b in blocks:
            entry[b] = 0
            n += 1
        self._n -= n
        self._compact()

    def _requeue(self, b: int) -> None:
        """An evictable block's key changed: queue it again, as released now."""
        if self._entry[b]:
            self._push(b)  # the old entry no longer matches _entry[b]: skipped by pop
            self._compact()

    def _compact(self) -> None:
        if len(self._heap) > 2 * self._n + 4096:  # entries of blocks taken again or requeued
            entry = self._entry
            self._heap = [e for e in self._heap if entry[e[2]] == e[1]]
            heapq.heapify(self._heap)

    def pop_many(self, n: int) -> list[int]:
        if n > self._n:
            raise IndexError(f"pop {n} of {self._n} evictable blocks")
        heap, entry = self._heap, self._entry
        victims: list[int] = []
        while len(victims) < n:
            _, seq, b = heapq.heappop(heap)
            if entry[b] == seq:
                entry[b] = 0
                victims.append(b)
        self._n -= n
        return victims

    def __len__(self) -> int:
        return self._n
