"""The block pool of the hash prefix cache under LRU eviction (vLLM v1's configuration) with its
state in arrays and each call's per-block loop compiled (kvbench.memory.compiled).

It is kvbench.memory.block_pool.BlockPool, for the one prefix mode (hash) and cache policy (lru) it
serves, call for call: the same blocks handed out in the same order, the same victims, hits and
counters (tests/test_array_pool.py holds them equal on random operation sequences and whole
replays). vLLM's ``BlockPool`` keeps free and cached blocks in one doubly linked queue threaded
through its block objects (``FreeKVCacheBlockQueue``); here the cached blocks are such a list over
two int32 arrays (``PREV``/``NEXT``), and the empty ones a stack, as BlockPool's are. The replay
releases ~9 M blocks through a pool on the whole Mooncake trace; a few dict and list operations per
block in Python were half its time, and here are a few array accesses.

Python code reads ``refcnt`` and ``fill`` per block (the scheduler's decode fast path, commits,
copy-on-write): they are memoryviews of the compiled code's arrays, as cheap to index as a list.
Block tables may be lists or int32 ``array.array``s (PagedKV gives its sequences the latter: ``new_table``):
an array's blocks reach the compiled calls without a copy, where a list's are converted (~19 ns a
block, four times in a block's life: Mooncake's 9 M blocks, ~0.7 s).
``key`` reads a block's key as BlockPool's list does (None when it has none); ``index`` and
``_free`` build BlockPool's structures, for tests.
"""
from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import MutableSequence, Sequence

# compiled.py's counter and row indices, restated for the Python side's reads (checked on import)
USED, LIVE, EVICTIONS, NFREE, NCACHED, VIRTUAL = range(6)
REFCNT, FREE = 0, 3


def compiled():
    """kvbench.memory.compiled, imported on first use (numba costs ~0.2 s to import)."""
    from kvbench.memory import compiled as module
    assert (module.USED, module.LIVE, module.EVICTIONS, module.NFREE, module.NCACHED, module.VIRTUAL,
            module.REFCNT, module.FREE) == (USED, LIVE, EVICTIONS, NFREE, NCACHED, VIRTUAL, REFCNT, FREE)
    return module


class _Keys:
    """``pool.key[b]``: the block's prefix key, or None (BlockPool's list, read from the arrays)."""

    def __init__(self, pool: "ArrayBlockPool"):
        self._key, self._cached = pool._s64[compiled().KEY], pool._cached

    def __getitem__(self, b: int):
        return int(self._key[b]) if self._cached[b] else None


_NONE_FRESH = np.zeros(0, dtype=np.int64)  # register_run's answers for no block and one new block
_FIRST_FRESH = np.zeros(1, dtype=np.int64)
_NONE_FRESH.flags.writeable = _FIRST_FRESH.flags.writeable = False


class ArrayBlockPool:
    """BlockPool's interface for hash mode and lru (``enable_cache`` False: no index at all)."""

    keys_as_arrays = True  # a sequence's keys stay a uint64 array (BlockPool: a list of ints)

    def __init__(self, num_blocks: int, block_size: int, *, enable_cache: bool = True,
                 physical: int | None = None):
        """``physical``: see BlockPool."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        cc = compiled()
        self._cc = cc
        self.num_blocks = num_blocks
        physical = num_blocks if physical is None else min(num_blocks, physical)
        self.physical = physical
        self.block_size = block_size
        self.enable_cache = enable_cache
        n = physical
        s32 = np.zeros((8, n + 1), dtype=np.int32)
        s32[cc.FREE, :n] = np.arange(n - 1, -1, -1, dtype=np.int32)  # the stack's top hands out block 0 first
        s32[cc.PREV, n] = s32[cc.NEXT, n] = n  # the LRU list: empty, its sentinel at n
        self._s32 = s32
        self._s64 = np.zeros((2, n), dtype=np.uint64)
        size = 1 << max(4, (2 * n - 1).bit_length()) if enable_cache else 1  # at most half full
        self._hk = np.zeros(size, dtype=np.uint64)
        self._hv = np.full(size, -1, dtype=np.int32)
        self._c = np.zeros(8, dtype=np.int64)
        self._c[cc.NFREE] = n
        self._c[cc.VIRTUAL] = num_blocks - physical  # free blocks never materialised
        self._n = self._c.data  # the counters, as Python reads them (ints, list-fast): a memoryview
        self._cached = s32[cc.CACHED]
        self.refcnt = s32[cc.REFCNT, :n].data
        self.fill = s32[cc.FILL, :n].data
        self._free_mv = s32[cc.FREE].data
        self.key = _Keys(self)
        # Tokens of registered blocks, to confirm hits. Rows are written on register only.
        self.tokens = np.zeros((n, block_size), dtype=np.int32) if enable_cache else None
        self._scratch = np.empty(n, dtype=np.int32)
        self._vkeys = np.empty(n, dtype=np.uint64)
        self._vparents = np.empty(n, dtype=np.uint64)
        self._vgone = np.empty(n, dtype=np.uint8)
        self.clock: float = 0  # logical time for policies (lru reads none)
        self.events: list | None = None  # KV events for a router's index, as BlockPool's
        self.spill = None  # write-back tiers, as BlockPool's
        self.kids = None  # leaves-only and node eviction are radix mode's (BlockPool)
        self.nodes = None

    @staticmethod
    def new_table() -> array:
        """An empty block table whose blocks the compiled calls read in place (int32)."""
        return array("i")

    # -- state ------------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self._n[USED]

    @property
    def tokens_live(self) -> int:
        """Sum of fill over used blocks (a shared block counted once)."""
        return self._n[LIVE]

    @tokens_live.setter
    def tokens_live(self, value: int) -> None:
        self._n[LIVE] = value

    @property
    def evictions(self) -> int:
        return self._n[EVICTIONS]

    @property
    def num_free(self) -> int:
        n = self._n
        return n[NFREE] + n[VIRTUAL]

    @property
    def num_cached(self) -> int:
        return self._n[NCACHED]

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free plus cached ones."""
        n = self._n
        return n[NFREE] + n[VIRTUAL] + n[NCACHED]

    @property
    def index(self) -> dict[int, int]:
        """The prefix index as a dict, key -> block (built from the table: for tests)."""
        live = self._hv >= 0
        return dict(zip(self._hk[live].tolist(), self._hv[live].tolist()))

    @property
    def _free(self) -> list[int]:
        """The free stack, bottom first (BlockPool's list: for tests)."""
        return self._s32[self._cc.FREE, :self._c[self._cc.NFREE]].tolist()

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(s32, s64, hk, hv, rows, c): the compiled state, for compiled code that works on the pool
        within a larger call (kvbench.scheduler.compiled); ``rows`` is a dummy row without a cache."""
        rows = self.tokens if self.tokens is not None else np.zeros((1, self.block_size), dtype=np.int32)
        return self._s32, self._s64, self._hk, self._hv, rows, self._c

    # -- transitions ------------------------------------------------------------------------
    def alloc(self) -> int:
        """Take a block for new content (refcount 1). Evicts a cached block when none is free."""
        got: list[int] = []
        self.alloc_into(got, 1)
        return got[0]

    def alloc_into(self, table: MutableSequence[int], n: int) -> None:
        """Append ``n`` newly allocated blocks to ``table`` (refcount 1 each): free blocks first, then
        cached ones in LRU order. Raises IndexError when nothing is evictable."""
        if n <= 0:
            return
        counts = self._n
        if n == 1 and counts[NFREE]:  # one block off the free stack (a decode's next block): no call
            top = counts[NFREE] - 1
            b = self._free_mv[top]
            counts[NFREE] = top
            counts[USED] += 1
            self.refcnt[b] = 1
            table.append(b)
            return
        if n > self.physical:  # (more than the scratch row holds: short either way)
            raise self._short(n)
        out = self._scratch[:n]
        evicted = self._cc.alloc(self._s32, self._s64, self._hk, self._hv, self._c, n, out, self._vkeys,
                                 self._vparents, self._vgone)
        if evicted < 0:
            raise self._short(n)
        if type(table) is array and table.typecode == "i":
            table.frombytes(out.tobytes())  # (array.extend converts a list one item at a time)
        else:
            table.extend(out.tolist())
        if evicted and (self.events is not None or self.spill is not None):  # (read before the spill runs)
            keys = self._vkeys[:evicted].tolist()
            if self.events is not None:  # a key leaves the cache with its last block
                self.events.append((False, [k for k, gone in zip(keys, self._vgone[:evicted].tolist()) if gone]))
            if self.spill is not None:  # the victims' KV is still in their blocks until the forward
                self.spill(out[n - evicted:].tolist(), keys, self._vparents[:evicted].tolist())

    def _short(self, n: int) -> Exception:
        """BlockPool's error for an allocation of ``n`` that the pool cannot serve (nothing changed)."""
        if counts := self._n[VIRTUAL]:
            return RuntimeError(f"the pool's {self.physical:,} materialised blocks were all taken ({counts:,} more "
                                "counted free): the bound given as `physical` was too small")
        return IndexError(f"no evictable block ({n:,} wanted, {self.num_available:,} free or cached)")

    def incref_many(self, blocks) -> None:
        """Take another reference to each block, in order; a cached one becomes used again."""
        if self._cc.incref(self._s32, self._c, np.asarray(blocks, dtype=np.int32)) < 0:
            raise KeyError("incref of a free block")

    def decref(self, b: int) -> None:
        """Drop a reference. At 0 the block becomes cached (if registered) or free."""
        self.release_all((b,))

    def release_all(self, blocks) -> None:
        """``decref`` every block of a sequence (list or tuple), in its order: the blocks whose refcount
        falls to 0 become cached (registered: the LRU tail, in this order) or free."""
        if len(blocks):
            self._cc.release(self._s32, self._c, np.asarray(blocks, dtype=np.int32))

    def add_fill(self, b: int, n: int) -> None:
        """``n`` more tokens of KV were written into used block ``b``."""
        self.fill[b] += n
        self._n[LIVE] += n

    def add_fill_many(self, blocks: list[int], n: int) -> None:
        """``add_fill(b, n)`` for each of these blocks."""
        if len(blocks):
            self._cc.add_fill(self._s32, self._c, np.asarray(blocks, dtype=np.int32), n)

    # -- prefix cache -----------------------------------------------------------------------
    def register_run(self, blocks: Sequence[int], keys, parent_key: int, tokens: np.ndarray,
                     next_uses=None, parent_block: int = -1, extend: bool = False) -> np.ndarray:
        """Cache consecutive computed blocks (``tokens`` holds exactly their ids, in order);
        ``keys[i]`` is ``blocks[i]``'s key, ``parent_key`` the key before the first. A block whose key
        another block caches already is cached beside it (vLLM's BlockPool). Returns the positions
        whose key is new to the cache (int64, read-only when shared). Keys are chained, so none
        repeats within a run (BlockPool assumes it too). (lru reads no next use; radix links are
        BlockPool's.)"""
        if not self.enable_cache or not len(blocks):
            return _NONE_FRESH
        if len(blocks) == 1:  # a decode step's block: no arrays to build
            if len(tokens) != self.block_size:
                raise ValueError(f"a block of {self.block_size} tokens, not {len(tokens)}")
            n = self._cc.register_one(self._s32, self._s64, self._hk, self._hv, self.tokens, blocks[0],
                                      np.uint64(keys[0]), np.uint64(parent_key), tokens)
            if n and self.events is not None:
                self.events.append((True, [int(keys[0])]))
            return _FIRST_FRESH if n else _NONE_FRESH
        if len(tokens) != len(blocks) * self.block_size or len(keys) < len(blocks):
            raise ValueError(f"{len(blocks)} blocks need {len(blocks)} keys and {len(blocks) * self.block_size} tokens")
        keys = np.asarray(keys, dtype=np.uint64)
        out = self._scratch[:len(blocks)]  # (a run's blocks are distinct: at most physical)
        n = self._cc.register(self._s32, self._s64, self._hk, self._hv, self.tokens,
                              np.asarray(blocks, dtype=np.int32), keys, np.uint64(parent_key),
                              np.asarray(tokens, dtype=np.int32), out)
        if n and self.events is not None:
            self.events.append((True, keys[out[:n]].tolist()))
        return out[:n].astype(np.int64)  # (a copy: the scratch row is reused)

    def match(self, keys, tokens: np.ndarray, n_max: int, parent_key: int) -> list[int]:
        """The blocks caching the longest run of ``keys[:n_max]``, confirmed against tokens.

        ``tokens`` must hold at least ``n_max * block_size`` ids. Takes no references.
        """
        if not self.enable_cache or n_max <= 0:
            return []
        keys, tokens, out = self._match_args(keys, tokens, n_max)
        n = self._cc.match(self._s64, self._hk, self._hv, self.tokens, keys, tokens, n_max, np.uint64(parent_key), out)
        return out[:n].tolist()

    def _match_args(self, keys, tokens, n_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A match's keys and tokens as the compiled calls take them, and the array its hits go to."""
        if n_max > len(keys) or len(tokens) < n_max * self.block_size:
            raise ValueError(f"a match of {n_max} blocks needs as many keys and {n_max * self.block_size} tokens")
        out = self._scratch[:n_max] if n_max <= len(self._scratch) else np.empty(n_max, dtype=np.int32)
        return np.asarray(keys, dtype=np.uint64), np.asarray(tokens, dtype=np.int32), out

    def fresh_need(self, keys, tokens: np.ndarray, n_max: int, parent_key: int, num_tokens: int, chunk: int,
                   whole: bool) -> int:
        """The blocks an empty table admitting a sequence of ``num_tokens`` tokens takes now, with its
        prefix hits (``match(keys, tokens, n_max, parent_key)``) taken: blocks for its first ``chunk`` tokens
        past the hits (``whole``: for all of them), plus the hits no sequence holds. One compiled call,
        for a waiting sequence retried every step while memory is short. (A pool without a prefix
        cache has no hits to count: PagedKV's plain floor is exact there.)"""
        if not self.enable_cache:
            raise ValueError("fresh_need counts prefix hits: the pool has no prefix cache")
        keys, tokens, out = self._match_args(keys, tokens, n_max)  # (n_max >= 0: lookup_blocks')
        return self._cc.fresh_need(self._s32, self._s64, self._hk, self._hv, self.tokens, keys, tokens, n_max,
                                   np.uint64(parent_key), out, num_tokens, chunk, whole)

    def touch(self, blocks: Sequence[int], next_uses=None) -> None:
        """A hit: lru orders by release only."""

    # -- checks -----------------------------------------------------------------------------
    def dup_chains(self) -> dict[int, list[int]]:
        """Keys cached by several blocks -> those blocks, the one found first (for tests)."""
        dnext = self._s32[self._cc.DNEXT]
        out = {}
        for k, head in self.index.items():
            ring, b = [head], int(dnext[head])
            while b != head:
                ring.append(b)
                assert len(ring) <= self.physical, "a key's ring has a cycle"
                b = int(dnext[b])
            if len(ring) > 1:
                out[k] = ring
        return out

    def lru_order(self) -> list[int]:
        """The cached blocks, next victim first (for tests; O(cached))."""
        nxt, n = self._s32[self._cc.NEXT], self.physical
        lru, b = [], int(nxt[n])
        while b != n:
            lru.append(b)
            assert len(lru) <= n, "the LRU list has a cycle"
            b = int(nxt[b])
        return lru

    def recount(self) -> dict:
        """Recompute the counters from scratch, and check the LRU list, the free stack and the index
        against the blocks' states (for tests; O(num_blocks))."""
        cc, n = self._cc, self.physical
        refcnt = self._s32[cc.REFCNT, :n]
        cached = self._cached[:n].astype(bool)
        fill = self._s32[cc.FILL, :n]
        used = refcnt > 0
        lru = self.lru_order()
        assert sorted(lru) == np.flatnonzero(~used & cached).tolist(), "the LRU list is not the cached blocks"
        free = self._free
        assert sorted(free) == np.flatnonzero(~used & ~cached).tolist(), "the free stack is not the empty blocks"
        assert not fill[free].any(), "a free block holds tokens"
        index = self.index
        assert len(index) == int((self._hv >= 0).sum()), "the index holds a key twice"
        key = self._s64[cc.KEY, :n]
        assert all(cached[b] and int(key[b]) == k for k, b in index.items()), "an index entry is stale"
        chains = self.dup_chains()
        rings = [b for k, b in index.items() for b in chains.get(k, [b])]
        assert sorted(rings) == np.flatnonzero(cached).tolist(), "the rings are not the keyed blocks, once each"
        assert all(int(key[b]) == k for k, ring in chains.items() for b in ring), "a ring holds another key"
        return {"num_used": int(used.sum()), "tokens_live": int(fill[used].sum()),
                "num_cached": len(lru), "num_free": self.num_blocks - int(used.sum()) - len(lru)}
