"""The recurrent-state groups of a hybrid model (Mamba-2, Mamba-1, Gated DeltaNet layers: vLLM's
MambaSpec under ``MambaManager`` in "align" mode), the rules HybridKV (kvbench.memory.hybrid) runs for
them, from vLLM 0.34 (``vllm/v1/core/single_type_kv_cache_manager.py: MambaManager``,
``vllm/v1/core/sched/scheduler.py: Scheduler._mamba_block_aligned_split``). A state group's block j
holds the state after (j + 1) x bs tokens; every state group does the same thing at the same time, so
one set of per-sequence fields (GroupTables: state_from, retired, state_held, checkpoint) serves them all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbench.memory.contracts import SeqKV
from kvbench.memory.groups import cdiv

if TYPE_CHECKING:
    from kvbench.memory.block_pool import BlockPool

NULL = -1  # a table position whose block was freed (left the window), or whose state was never kept


@dataclass(slots=True, eq=False)
class GroupTables:
    """A sequence's per-group state: ``tables[g]`` its blocks by position (NULL where freed),
    ``cached[g]`` vLLM's num_cached_block (positions already offered to the cache; None before the
    first), ``keys[g]`` its blocks' keys salted for group g (built on first need)."""

    tables: list[list[int]]
    cached: list[int | None]
    keys: list[list[int] | None]
    boundary: int = 0  # the shared-prefix junction of the last lookup (vLLM shared_prefix_boundary)
    shared: bool = False  # forked: a sample's tail may be shared with its siblings (copy on write)
    # Mamba groups (the same in each): MambaManager's last_state_block_idx, _num_retired_blocks, whether
    # the request is in _allocated_block_reqs, and the index of this allocation's checkpoint block (-1: none)
    state_from: int = -1
    retired: int = 0
    state_held: bool = False
    checkpoint: int = -1


class StateGroups:
    """HybridKV's rules for its recurrent-state groups (``_states``: their indices)."""

    pool: BlockPool
    block_size: int
    num_blocks: int
    prefix_cache: bool
    max_batched_tokens: int
    _states: list[int]
    state_checkpoints: bool
    _step_keys: set[int]

    def _state(self, s: SeqKV) -> GroupTables:
        raise NotImplementedError

    def _keys(self, s: SeqKV, g: int, n_blocks: int) -> list[int]:
        raise NotImplementedError

    def _state_to_allocate(self, s: SeqKV, g: int, st: GroupTables, num_tokens: int, hit: list[int],
                           computed: int) -> int:
        """MambaManager.get_num_blocks_to_allocate (align mode): at most one new block (and a checkpoint's)
        whatever the tokens, and the hit's block if no sequence holds it; a hit on a state cached during
        this step cannot be taken before the next (more blocks than the pool has)."""
        table = st.tables[g]
        if not self.prefix_cache:  # "none" mode: one block (of max_model_len tokens) for the sequence's life
            return 0 if table else 1
        if hit and self._step_keys and self._keys(s, g, len(hit))[len(hit) - 1] in self._step_keys:
            return self.num_blocks + 1
        new = cdiv(num_tokens, self.block_size) - len(hit) - len(table)
        if new > 0:
            new = min(new, 1 + (self._checkpoint_at(s, st, g, computed, num_tokens) >= 0))
        return new + (1 if hit and hit[-1] != NULL and self.pool.refcnt[hit[-1]] == 0 else 0)

    def _checkpoint_at(self, s: SeqKV, st: GroupTables, g: int, start: int, end: int) -> int:
        """The block a prefill chunk from ``start`` to ``end`` exports its checkpoint into, or -1
        (MambaManager._needs_internal_checkpoint: the chunk reaching the prefill's end, and the state at
        the last block boundary below it valid to export; is_mamba_prefill_checkpoint_valid)."""
        if not self.state_checkpoints or end < max(s.prompt_len, s.num_tokens - 1):
            return -1
        bs = self.block_size
        if not _checkpoint_valid(start, end, max(0, (end - 1) // bs * bs), bs):
            return -1
        idx, table = cdiv(end, bs) - 2, st.tables[g]
        return idx if idx >= 0 and (idx >= len(table) or table[idx] == NULL) else -1

    def _alloc_states(self, st: GroupTables, end: int) -> None:
        """MambaManager.allocate_new_blocks (align mode) in every state group: nothing while the step
        stays within the running state's block; else the running state's block becomes the copy source
        (freed at the next allocation), nulls up to the block the step ends in, and one new block there
        (two with a checkpoint, the one before it receiving the exported state)."""
        p, bs = self.pool, self.block_size
        if not self.prefix_cache:
            for g in self._states:
                if not st.tables[g]:
                    p.alloc_into(st.tables[g], 1)
                    p.add_fill(st.tables[g][0], bs)
            return
        required, ckpt = cdiv(end, bs), int(st.checkpoint >= 0)
        for g in self._states:
            table = st.tables[g]
            if required <= len(table) and not ckpt:
                continue
            prev = len(table)
            if prev:
                st.state_from = prev - 1  # (held: the running state; a new request: its hit's state)
            if prev < required - 1 - ckpt:
                table.extend([NULL] * (required - 1 - ckpt - prev))
            more = required - len(table)
            if more > 0:
                p.alloc_into(table, more)
                p.add_fill_many(table[-more:], bs)  # (a state fills its page: a block's worth of live KV)
        st.state_held = True

    def split(self, s: SeqKV, computed: int, num_new: int) -> int:
        """The tokens of a prefill chunk from ``computed`` the scheduler may run, ``num_new`` at most, so
        that it ends where a state must be kept (vLLM Scheduler._mamba_block_aligned_split): a chunk
        before the prefill's end ends on a block boundary (0 tokens when the budget does not reach one),
        and never runs past the last boundary below the sequence's last token (unless the prefill
        exports that checkpoint itself), a boundary when it starts mid-block, or the junction."""
        st, bs = self._state(s), self.block_size
        start, end = computed, computed + num_new
        prefill_end = max(s.prompt_len, s.num_tokens - 1)
        if start >= prefill_end:
            return num_new
        last = max(0, (s.num_tokens - 1) // bs * bs)
        inside = False
        if self.state_checkpoints and end >= prefill_end:
            inside = _checkpoint_valid(start, end, max(0, (prefill_end - 1) // bs * bs), bs)
            if inside:
                last = 0
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= self.max_batched_tokens:
                end = aligned
        junction = st.boundary
        stops = ((start // bs + 1) * bs if start % bs and not inside else 0, last,
                 start + (junction - start) // bs * bs if start < junction < end else 0)
        end = min((x for x in stops if start < x < end), default=end)
        return max(end - start, 0)

    def new_step(self) -> None:
        """A scheduler step begins: states cached in the last one may be hit (MambaManager.new_step_starts)."""
        self._step_keys.clear()

    def _state_skips(self, st: GroupTables, computed: int) -> tuple[int, int, int] | None:
        """(first, last, copy source) of what the state groups free now: every block before the one
        holding the state after ``computed - 1`` tokens not yet retired, and the copy source once the
        state has moved past it (MambaManager.remove_skipped_blocks, _remove_blocks_in_range); None:
        nothing (most steps: a decode within its block)."""
        if not self.prefix_cache:
            return None
        bs = self.block_size
        first = st.retired
        last = min((computed - 1) // bs if computed > 1 else 0, len(st.tables[self._states[0]]))
        src = st.state_from if 0 <= st.state_from < cdiv(computed, bs) - 1 else -1
        return (first, last, src) if first < last or src >= 0 else None

    @staticmethod
    def _states_dropped(st: GroupTables, states: tuple[int, int, int]) -> None:
        """After every state group freed ``states``: the blocks retired, the copy source gone (vLLM keeps
        its index over a null block: freeing it again would do nothing)."""
        first, last, src = states
        if first < last:
            st.retired = last
        if src >= 0:
            st.state_from = -1

    def _drop_states(self, st: GroupTables, g: int, first: int, last: int, src: int) -> None:
        table = st.tables[g]
        last = min(last, len(table))
        if first < last:
            freed = []
            for j in range(last - 1, first - 1, -1):
                if table[j] != NULL:
                    freed.append(table[j])
                    table[j] = NULL
            if freed:
                self.pool.release_all(freed)
        if 0 <= src < len(table) and table[src] != NULL:
            self.pool.release_all((table[src],))
            table[src] = NULL


def _checkpoint_valid(start: int, end: int, position: int, bs: int) -> bool:
    """Whether a prefill chunk from ``start`` to ``end`` can export the state at ``position`` itself
    (vLLM is_mamba_prefill_checkpoint_valid, hash block = state block = alignment = bs): the chunk
    starts on a boundary, spans at least two more blocks, and holds the position a whole block in."""
    return (start % bs == 0 and cdiv(end, bs) - 2 > (start - 1) // bs and start + bs <= position
            and start < position < end and (position - start) % bs == 0)


__all__ = ["NULL", "GroupTables", "StateGroups"]
