"""What the scheduler hands an executor each step (StepBatch) and what comes back (StepResult).

A step's batch holds prefill chunks and decode sequences. Sequences are named by integer ``seq_id``;
their KV lives in the pool through their block tables (lists of physical block ids, or int32
arrays under the compiled pool: kvbench.memory.paged's new_table; owned by the
memory layer and passed by reference: an executor must not change them). For the slab layout every
sequence has a one-entry table and ``block_size`` is the slab length, so the same kernels run both.

These are the scheduler's output, as vLLM v1's ``SchedulerOutput`` is (vllm/v1/core/sched/output.py):
the executors (layer 5) import them from here, never the other way round.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class StepBatch:
    """One engine step's work. Parallel lists, one entry per prefill chunk / per decode sequence.

    Positions are absolute token positions in the sequence (rotary positions). A prefill chunk
    computes positions [start, start + len) whose tokens are ``prefill_tokens[i]``; positions before
    ``start`` are already in the KV cache (prefix hits or earlier chunks). A decode sequence feeds its
    last token at ``decode_positions[i]`` and attends to positions [0, decode_positions[i]].

    Token eviction: once a sequence is compacted its slot i no longer holds position i. Then its
    decode writes slot ``decode_slots[i]`` of its table and attends to slots [0, decode_slots[i]]
    (the kept tokens, each K already rotated at its own position), while the query keeps its true
    rotary position ``decode_positions[i]``. ``decode_slots`` empty means slot = position. Before
    the forward, in this order, the executor: copies ``offload`` slots' KV to host memory (every
    evicted token: a CPU pool when ``offload_is_transfer``, else only a shadow for measuring the
    attention mass kept), moves ``slot_moves`` (gather every source, then scatter), writes
    ``recall`` tokens' host KV into their slots, forgets ``host_release`` sequences' host KV, and
    performs the copy-on-write ``copies``.
    """

    block_size: int
    prefill_seq_ids: list[int] = field(default_factory=list)
    prefill_starts: list[int] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    prefill_last: list[bool] = field(default_factory=list)  # chunk ends the prompt: sample a token
    prefill_tokens: list[np.ndarray] = field(default_factory=list)  # int32 [len]; needs_tokens only
    decode_seq_ids: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)  # needs_tokens only
    decode_slots: list[int] = field(default_factory=list)  # slot index of the new token; [] = positions
    block_tables: dict[int, Sequence[int]] = field(default_factory=dict)  # needs_tokens only
    # needs_tokens only, a model with several KV cache groups (kvbench.memory.hybrid): per sequence, its
    # block table in each group, -1 where a window freed the block; layer l reads the table of the group
    # the executor was bound to for it (Executor.bind_pool's layer_groups)
    group_tables: dict[int, list[Sequence[int]]] = field(default_factory=dict)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    # Token eviction: per sequence, a bool mask over its slots (True = token kept); None = all kept.
    kept_masks: dict[int, np.ndarray] = field(default_factory=dict)
    slot_moves: tuple[np.ndarray, np.ndarray] | None = None  # (src, dst) int64 pool slots
    offload: list = field(default_factory=list)  # (seq_id, positions int64 [n], pool slots int64 [n])
    recall: list = field(default_factory=list)  # (seq_id, positions int64 [n], pool slots int64 [n])
    host_release: list[int] = field(default_factory=list)  # seq ids whose host KV is dropped
    pool_dropped: list = field(default_factory=list)  # (seq_id, positions): left the CPU pool for good
    offload_is_transfer: bool = False  # offloads are PCIe traffic (InfiniGen), not just a shadow
    pcie_bytes: int = 0  # bytes this batch moves between host and device (offload + recall)
    # Prefix-cache tiers (kvbench.memory.tiers): block transfers (src tier, index, dst tier, index),
    # "gpu" indexes being pool blocks. ``tier_pre`` before the forward, in order (write-back stores,
    # demotions, loads into fresh blocks), ``tier_post`` after it (write-through stores).
    tier_pre: list = field(default_factory=list)
    tier_post: list = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_lens)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seq_ids)

    def decode_context_total(self) -> int:
        """Slots the step's decodes attend to, summed (each its own new slot included)."""
        return sum(self.decode_slots or self.decode_positions) + len(self.decode_seq_ids)

    def __len__(self) -> int:
        return len(self.prefill_seq_ids) + len(self.decode_seq_ids)


@dataclass(slots=True)
class StepResult:
    """What an executor returns. ``duration_s`` advances the engine clock.

    ``sampled`` maps seq_id -> next token for every decode sequence and every prefill chunk with
    ``prefill_last`` (None from executors that produce no tokens). ``attention`` (optional) maps
    seq_id -> float array of this step's attention weight per cached position, summed over heads,
    for token-eviction policies. ``mass_kept`` (model executor):
    seq_id -> share of the full-cache attention on the kept tokens, per decode. ``pcie_s``: time the
    step spent moving KV between host and device.
    """

    duration_s: float
    sampled: dict[int, int] | None = None
    attention: dict[int, np.ndarray] | None = None
    mass_kept: dict[int, float] | None = None
    pcie_s: float = 0.0
    tier_s: float = 0.0  # time the step spent on tier transfers before its forward (loads, write-backs)
    tier_post_s: float = 0.0  # time of its write-through stores (overlapping the forward in the sim)
