"""The memory layer's contracts, declared: what the scheduler, the evictor and the engine may ask of a
KV layout (``KVManager``: PagedKV, SlabKV), what a paged layout asks of its block pool
(``BlockPoolAPI``: BlockPool, ArrayBlockPool), and the records that cross layers (``SeqKV``, the
per-sequence state the scheduler holds; ``Compaction``; ``KVStats``).

A capability is a declared member, never probed: a layout that cannot shrink a sequence says so
(``can_compact``), and the evictor refuses it. mypy (a CI step of its own) holds every implementation
to its Protocol -- make_kv returns a KVManager, PagedKV's pool is a BlockPoolAPI -- and the callers
to the members declared here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from collections.abc import MutableSequence, Sequence

    from kvbench.memory.tiers import TierMatch, Tiers


@dataclass(slots=True, eq=False)
class SeqKV:
    """A sequence's KV state. ``tokens``: the ids known in advance (prompt, plus a named answer),
    the only ones whose blocks can ever be hit; None when prefix caching is off.
    ``next_use``: per full block of ``tokens``, the next request index that looks it up (belady)."""

    tokens: np.ndarray | None = None
    next_use: np.ndarray | None = None
    table: Any = field(default_factory=list)  # block ids (a range for a slab)
    num_kv: int = 0  # tokens whose KV is written
    keys: Any = None  # the chained keys of its full blocks: list of ints, or a uint64 array
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    reserve: int = 0  # slab: slots to reserve (max_model_len or prompt+output)
    base: int = -1  # slab: first block of the reservation
    fork_bases: list[int] = field(default_factory=list)  # slab: slabs reserved for samples to fork
    partial_block: int = -1  # radix: cached block whose first partial_len tokens the last lookup matched
    partial_len: int = 0
    open_block: int = -1  # node eviction: the tail of the node this sequence's decode steps extend
    dropped: int = 0  # computed tokens evicted from the slots (token eviction)
    compacted: bool = False  # slots no longer hold positions 0..num_kv-1: never register again
    tier_match: TierMatch | None = None  # the last lookup's hits in the tiers behind the pool
    prompt_len: int = 0  # tokens of its prompt (a sliding window caches where a resend would hit)
    num_tokens: int = 0  # prompt and generated tokens so far (a recurrent state's chunks end by them)
    groups: Any = None  # several KV cache groups: a table per group (kvbench.memory.hybrid.GroupTables)


@dataclass(slots=True)
class Compaction:
    """What ``KVManager.compact`` did. Logical arrays index the sequence's slots (old layout for
    ``src``, new for ``dst`` and ``append``); physical ones are pool slots (block * block_size +
    offset), int64. The executor copies ``src_phys -> dst_phys`` (gather all, then scatter) before the
    next forward; ``append_phys`` are reserved slots the caller fills (recalled tokens)."""

    src: np.ndarray
    dst: np.ndarray
    append: np.ndarray
    src_phys: np.ndarray
    dst_phys: np.ndarray
    append_phys: np.ndarray


class KVStats(NamedTuple):
    """A layout's memory at one moment (steps.parquet's columns), O(1) to read."""

    blocks_used: int
    blocks_cached: int
    blocks_free: int
    slots_allocated: int
    tokens_live: int


KVEvent = tuple[bool, list[int]]  # (True: keys stored | False: keys that left the cache), in order


@runtime_checkable
class KVManager(Protocol):
    """What the scheduler, the evictor and the engine ask of a KV layout, per sequence and per step."""

    layout: str
    block_size: int
    num_blocks: int
    prefix_cache: bool
    can_compact: bool  # token eviction can shrink a sequence's slots (a slab's reservation cannot)
    watermark_frac: float  # the share of blocks kept free at admission for running sequences to grow
    tiers: Tiers | None
    last_loaded: TierMatch | None  # after a successful allocate: the tier hits it loaded
    aligned_split: bool  # prefill chunks must end where a recurrent state is kept (``split``)

    @property
    def capacity_tokens(self) -> int: ...

    @property
    def keys_as_arrays(self) -> bool:
        """A sequence's keys are a uint64 array (else a list of ints)."""
        ...

    @property
    def cache_evictions(self) -> int:
        """Cached blocks reclaimed for new content so far."""
        ...

    @property
    def cow_copies(self) -> int: ...

    @property
    def partial_hit_tokens(self) -> int: ...

    def stats(self) -> KVStats: ...

    def admission_floor(self, s: SeqKV, num_tokens: int, budget: int, full: bool = True) -> tuple[int, int]:
        """(a lower bound on the blocks admitting ``s`` takes, the blocks available)."""
        ...

    def lookup(self, s: SeqKV, num_tokens: int) -> Any:
        """What a sequence's first tokens hit (no references taken): an opaque record the caller hands
        back to ``num_cached_tokens`` and ``allocate`` (the cached blocks; per KV cache group for a
        hybrid model)."""
        ...

    def num_cached_tokens(self, s: SeqKV, hits: Any) -> int: ...

    def probe_cached_tokens(self, s: SeqKV, num_tokens: int) -> int:
        """The tokens a lookup would serve from the pool now, changing nothing (no references, no
        tier state): what cache-aware admission ranks waiting requests by."""
        ...

    @property
    def usage(self) -> float:
        """The share of the pool's blocks sequences hold."""
        ...

    def allocate(self, s: SeqKV, num_new: int, hits: Any = (), watermark: int = 0,
                 must_fit: int = 0, forks: int = 0, external: int = 0,
                 load: bool = False) -> bool:
        """Take the hits and blocks for ``num_new`` more tokens; False, changing nothing, if short.
        ``external``: tokens after the hits whose KV was computed elsewhere (a KV connector's load,
        vLLM's num_external_computed_tokens): allocated, holding KV at once, counted as computed.
        ``load``: the external tokens' KV arrives later (an async load: vLLM's delay_cache_blocks):
        their blocks are not cached until ``loaded``."""
        ...

    def loaded(self, s: SeqKV) -> None:
        """An async load of ``s``'s external tokens has ended: their blocks are cached, and the last
        token is computed again (vLLM _update_waiting_for_remote_kv), so ``num_kv`` is one less."""
        ...

    def trim(self, s: SeqKV) -> None:
        """Free the blocks no group attends to any more after ``s``'s computed tokens (a finished
        request whose blocks a KV connector holds: vLLM _connector_finished's remove_skipped_blocks)."""
        ...

    def group_blocks(self, s: SeqKV, start: int, end: int) -> list[int]:
        """Per KV cache group, the blocks ``s`` holds at positions [start, end) (a window's dropped
        positions hold none): what a KV connector reads or writes for those blocks."""
        ...

    def commit(self, s: SeqKV, n: int) -> None: ...

    def commit_all(self, seqs: Sequence[SeqKV], nums: Sequence[int]) -> None: ...

    def free(self, s: SeqKV) -> None: ...

    def fork(self, s: SeqKV, child: SeqKV) -> None: ...

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies (copy-on-write, a slab's fork) the executor performs before the next forward."""
        ...

    def take_tier_ops(self) -> tuple[list[tuple], list[tuple]]:
        """(transfers before the forward, transfers after it) with the tiers behind the pool."""
        ...

    def attach_tiers(self, tiers: Tiers) -> None: ...

    def compact(self, s: SeqKV, keep: np.ndarray, append: int = 0) -> Compaction | None:
        """Keep only slots ``keep`` of the sequence (token eviction); only where ``can_compact``."""
        ...

    def slots_of(self, s: SeqKV, logical: np.ndarray) -> np.ndarray:
        """Pool slots (block * block_size + offset) of a sequence's logical slots."""
        ...

    def set_clock(self, now: float) -> None:
        """The time the cache policies and tiers are told (learned: seconds since a use)."""
        ...

    def split(self, s: SeqKV, computed: int, num_new: int) -> int:
        """The tokens of a chunk from ``computed`` (at most ``num_new``) the scheduler may run: all of
        them, unless a recurrent state must be kept inside (kvbench.memory.states); 0: none this step."""
        ...

    def new_step(self) -> None:
        """A scheduler step begins (what was cached in the last one may now be hit)."""
        ...

    def enable_events(self) -> None:
        """Start recording KV events (a router's index learns what the cache holds from them)."""
        ...

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call (none unless enabled)."""
        ...


@runtime_checkable
class BlockPoolAPI(Protocol):
    """What PagedKV asks of its block pool in hash mode (radix mode's tree is BlockPool's own)."""

    num_blocks: int
    physical: int
    block_size: int
    enable_cache: bool
    keys_as_arrays: bool
    clock: float
    events: list[KVEvent] | None
    spill: Any  # write-back tiers: called with (blocks, keys, parent keys) of the victims
    refcnt: Any  # per block: a list or a memoryview of ints
    fill: Any
    key: Any  # per block: its prefix key, or None
    tokens: np.ndarray | None
    tokens_live: int  # sum of fill over used blocks; PagedKV.commit_all adds what it writes in place

    @property
    def num_used(self) -> int: ...

    @property
    def num_cached(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_available(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    def alloc(self) -> int: ...

    def alloc_into(self, table: MutableSequence[int], n: int) -> None: ...

    def incref_many(self, blocks: Sequence[int]) -> None: ...

    def decref(self, b: int) -> None: ...

    def release_all(self, blocks: Sequence[int]) -> None: ...

    def add_fill(self, b: int, n: int) -> None: ...

    def add_fill_many(self, blocks: list[int], n: int) -> None: ...

    def register_run(self, blocks: Sequence[int], keys: Any, parent_key: int, tokens: np.ndarray,
                     next_uses: Any = None, parent_block: int = -1, extend: bool = False) -> Sequence[int] | np.ndarray:
        """Cache computed blocks; -> the positions whose key is new to the cache."""
        ...

    def match(self, keys: Any, tokens: np.ndarray, n_max: int, parent_key: int) -> list[int]: ...

    def touch(self, blocks: Sequence[int], next_uses: Any = None) -> None: ...

    def dup_chains(self) -> dict[int, list[int]]: ...

    def recount(self) -> dict: ...
