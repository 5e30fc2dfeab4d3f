"""The slab baseline: one contiguous reservation per sequence, no sharing, no prefix cache.

The pool has the same bytes as the paged one and is addressed in the same blocks, so the same
executor kernels read it through a table of consecutive block ids. A sequence reserves
``SeqKV.reserve`` slots at admission (``max_model_len``, or prompt+output with ``--slab-reserve
exact``), rounded up to whole blocks; reservations are placed first-fit in the address space, so
variable-size (exact) slabs also show external fragmentation. Free extents are kept sorted and
merged on release: O(number of holes) per reservation, once per sequence, never per token.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvbench.memory.contracts import Compaction, KVEvent, KVStats, SeqKV
from kvbench.memory.groups import KVLayout

if TYPE_CHECKING:
    from kvbench.memory.tiers import TierMatch, Tiers


class SlabKV:
    """The slab layout: a KVManager (kvbench.memory.contracts) of one reservation per sequence."""

    layout = "slab"
    prefix_cache = False
    can_compact = False  # a reservation never shrinks: evicting tokens would free nothing
    watermark_frac = 0.0  # a reservation never grows: no room to keep for growth
    tiers: Tiers | None = None  # no prefix cache, so no tiers behind it
    last_loaded: TierMatch | None = None
    keys_as_arrays = False
    cache_evictions = 0  # nothing is cached
    partial_hit_tokens = 0
    cow_copies = 0  # a fork copies into a slab of its own: counted as the batch's copies, not here

    def __init__(self, num_blocks: int, block_size: int, kv_layout: KVLayout | None = None, **_ignored):
        """``kv_layout``: a model with several KV cache groups reserves, per sequence, each group's
        slots (a window's ring for a sliding group, a chunk for a chunked one; KVLayout.slab_blocks)
        in one slab, and counts the slots its tokens fill in each group."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_layout = kv_layout if kv_layout is not None and kv_layout.is_hybrid else None
        self._starts: list[int] = [0]  # free extents, sorted by start
        self._lens: list[int] = [num_blocks]
        self.blocks_reserved = 0
        self.tokens_live = 0
        self.copies: list[tuple[int, int]] = []
        self.last_shortfall = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def stats(self) -> KVStats:
        r = self.blocks_reserved
        return KVStats(r, 0, self.num_blocks - r, r * self.block_size, self.tokens_live)

    def admission_floor(self, s: SeqKV, num_tokens: int, budget: int, full: bool = True) -> tuple[int, int]:
        free = self.num_blocks - self.blocks_reserved
        return (0 if s.base >= 0 else -(-s.reserve // self.block_size)), free

    def lookup(self, s: SeqKV, num_tokens: int) -> list[int]:
        return []

    def num_cached_tokens(self, s: SeqKV, hits: list[int]) -> int:
        return 0

    def _take(self, n: int) -> int:
        for i, ln in enumerate(self._lens):
            if ln >= n:
                start = self._starts[i]
                if ln == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                return start
        return -1

    def _give(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        starts, lens = self._starts, self._lens
        if i > 0 and starts[i - 1] + lens[i - 1] == start:  # merge with the hole before
            i -= 1
            lens[i] += n
        else:
            starts.insert(i, start)
            lens.insert(i, n)
        if i + 1 < len(starts) and starts[i] + lens[i] == starts[i + 1]:  # and the one after
            lens[i] += lens[i + 1]
            del starts[i + 1], lens[i + 1]

    def allocate(self, s: SeqKV, num_new: int, hits: Sequence[int] = (), watermark: int = 0,
                 must_fit: int = 0, forks: int = 0, external: int = 0,
                 load: bool = False) -> bool:
        """Reserve the sequence's slab, and one for each of the ``forks`` samples it will fork, on
        first call (a slab always holds the whole sequence, so ``must_fit`` holds by construction);
        later calls only check the tokens fit."""
        layout = self.kv_layout
        if external:
            raise ValueError("a slab takes no KV computed elsewhere: it has no prefix to continue")
        if s.base < 0:
            n = -(-s.reserve // self.block_size) if layout is None else int(layout.slab_blocks(s.reserve))
            want = n * (1 + forks)
            self.last_shortfall = want + watermark
            if want > self.num_blocks - self.blocks_reserved - watermark:
                return False
            bases: list[int] = []
            for _ in range(1 + forks):
                base = self._take(n)
                if base < 0:  # enough free blocks, but no hole big enough: wait for a release
                    for b in bases:
                        self._give(b, n)
                    self.last_shortfall = self.num_blocks - self.blocks_reserved + 1
                    return False
                bases.append(base)
            s.base = bases[0]
            s.table = range(s.base, s.base + n)
            s.fork_bases = bases[1:]
            self.blocks_reserved += want
        if s.num_kv + num_new > (len(s.table) * self.block_size if layout is None else s.reserve):
            raise ValueError(f"sequence outgrew its slab of {s.reserve} slots")
        return True

    def _live(self, num_kv: int) -> int:
        """Slots ``num_kv`` tokens of a sequence fill (in every group of a hybrid model)."""
        return num_kv if self.kv_layout is None else self.kv_layout.slab_live(num_kv)

    def commit(self, s: SeqKV, n: int) -> None:
        self.commit_all((s,), (n,))

    def commit_all(self, seqs, nums) -> None:
        if self.kv_layout is None:
            for s, n in zip(seqs, nums):
                s.num_kv += n
            self.tokens_live += sum(nums)
            return
        for s, n in zip(seqs, nums):
            self.tokens_live += self._live(s.num_kv + n) - self._live(s.num_kv)
            s.num_kv += n

    def loaded(self, s: SeqKV) -> None:
        raise ValueError("a slab takes no KV computed elsewhere")

    def trim(self, s: SeqKV) -> None:
        """(A slab frees nothing before the sequence ends.)"""

    def group_blocks(self, s: SeqKV, start: int, end: int) -> list[int]:
        raise ValueError("a slab has no blocks a KV connector moves")

    def free(self, s: SeqKV) -> None:
        if s.base >= 0:
            n = len(s.table)
            self._give(s.base, n)
            for b in s.fork_bases:  # slabs reserved for samples not forked yet
                self._give(b, n)
            self.blocks_reserved -= n * (1 + len(s.fork_bases))
            self.tokens_live -= self._live(s.num_kv)
        s.base = -1
        s.table = []
        s.fork_bases = []
        s.num_kv = 0

    def fork(self, s: SeqKV, child: SeqKV) -> None:
        """Give ``child`` (an empty SeqKV) one of the slabs ``s`` reserved for its samples, holding a
        copy of the parent's KV."""
        child.reserve = s.reserve
        n = len(s.table)
        child.base = s.fork_bases.pop()
        child.table = range(child.base, child.base + n)
        nb = -(-self._live(s.num_kv) // self.block_size)  # (a hybrid slab: its groups' filled slots)
        self.copies.extend(zip(s.table[:nb], child.table[:nb]))
        child.num_kv = s.num_kv
        self.tokens_live += self._live(s.num_kv)

    def take_copies(self) -> list[tuple[int, int]]:
        c, self.copies = self.copies, []
        return c

    def take_tier_ops(self) -> tuple[list[tuple], list[tuple]]:
        return [], []

    def probe_cached_tokens(self, s: SeqKV, num_tokens: int) -> int:
        return 0

    @property
    def usage(self) -> float:
        return self.blocks_reserved / self.num_blocks

    def attach_tiers(self, tiers) -> None:
        raise ValueError("prefix-cache tiers hold cached prefix blocks: a slab has no prefix cache")

    def compact(self, s: SeqKV, keep: np.ndarray, append: int = 0) -> Compaction | None:
        raise ValueError("a slab cannot shrink a reservation: token eviction needs the paged layout")

    def slots_of(self, s: SeqKV, logical: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return (s.base + logical // bs) * bs + logical % bs

    aligned_split = False  # no recurrent state: a chunk is never cut (KVManager.split)

    def split(self, s: SeqKV, computed: int, num_new: int) -> int:
        return num_new

    def new_step(self) -> None:
        pass

    def set_clock(self, now: float) -> None:
        """Nothing in a slab reads the time."""

    def enable_events(self) -> None:
        """A slab caches nothing: it has no KV events to publish."""

    def take_events(self) -> list[KVEvent]:
        return []
