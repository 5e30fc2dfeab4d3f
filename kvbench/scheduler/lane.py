"""The decode lane: the running batch as a struct of arrays, so that a step's decodes cost one
compiled call, not a few microseconds of Python each.

Most of a replay's sequence-steps are decodes that need nothing of Python: one token computed into
the last block of a table nobody shares, or into a block taken from the pool, the block it fills
registered in the prefix cache; no first token, fork or finish. For them Scheduler.schedule's pass
(PagedKV.allocate), build_batch's decode entry, PagedKV.commit_all and Scheduler.update's emit come to
a few integer updates, which the lane makes in arrays, one column per running sequence (its
``slot``; kvbench.scheduler.compiled), in the scheduler's order: the pool hands out and registers
blocks in the same order as the Python path, so the replay is the same, step for step. Every other
sequence-step (a prefill chunk, a first or last token, a fork, a preemption, a sample of n > 1) runs
the Python path, unchanged, on the Sequence object.

Which copy is the truth: for a running sequence the lane can take, the arrays hold ``num_kv``,
``num_tokens``, ``num_out``, ``last_emit_s``, ``num_registered``, the blocks appended to its table and
its request's ``output_tokens`` and ``itl_max_s``; ``pull`` writes them to the objects before the
Python path reads them, and ``push`` writes the objects' values back after it changed them (and
prepares the keys and tokens of the next blocks its decodes will register). The ``ORDER`` row lists
the running sequences' slots in the scheduler's ``running`` order; the scheduler keeps the two in
step (``enter``, ``pop``, ``reorder``).

The lane serves the configurations whose running sequences nothing else reads mid-run: the paged
layout on the compiled pool (hash prefix cache or none, lru), no tiers, no token eviction, no KV
events for a router, an executor that takes no tokens (the sim), no per-step log or hook
(Scheduler.enable_lane). The replay's outputs are the same with or without it (tests/test_lane.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvbench.trace.tokens import ROOT_KEY

if TYPE_CHECKING:
    from kvbench.memory.array_pool import ArrayBlockPool
    from kvbench.memory.paged import PagedKV
    from kvbench.scheduler.request import Sequence

PREPARED_TOKENS = 8192  # the tokens of the blocks prepared per sequence (at most 32 blocks)
POS, RUNNING, BUDGET, COUNT = range(4)  # compiled.py's entries of ``io``, restated (checked on import)


def compiled():
    """kvbench.scheduler.compiled, imported on first use (numba costs ~0.2 s to import)."""
    from kvbench.scheduler import compiled as module
    assert (module.POS, module.RUNNING, module.BUDGET, module.COUNT) == (POS, RUNNING, BUDGET, COUNT)
    return module


class DecodeLane:
    """The running sequences' decode state in arrays, one column (slot) a sequence; the scheduler's
    steady decodes computed in it (see the module's docstring)."""

    def __init__(self, kv: PagedKV, pool: ArrayBlockPool, capacity: int = 256):
        """``pool``: ``kv``'s (the lane runs on the compiled pool's arrays)."""
        cc = compiled()
        self._cc = cc
        self.kv = kv
        self.block_size = bs = kv.block_size
        self.registers = kv.prefix_cache
        self.prepared = max(1, min(32, PREPARED_TOKENS // bs))  # blocks prepared per sequence
        self._pool = pool.arrays()
        self._c = self._pool[-1]
        self.io = np.zeros(5, dtype=np.int64)
        self.io[cc.BS] = bs
        self._io = self.io.data  # (Python reads and writes it as a list, the kernel as an array)
        self.count = 0  # slots the lane scheduled this step (ints[SCHED, :count])
        self.taken = 0  # sequence-steps the lane computed, over the run
        self.cap = 0
        self.ints: np.ndarray  # (the arrays _alloc makes)
        self.floats: np.ndarray
        self.ext: np.ndarray
        self.pkeys: np.ndarray
        self.ptok: np.ndarray
        self._alloc(max(8, capacity))

    def _alloc(self, cap: int) -> None:
        """Arrays for ``cap`` slots; a grown lane keeps its slots' columns, the new slots free."""
        cc, have, bs = self._cc, self.cap, self.block_size
        ints = np.zeros((cc.NUM_INTS, cap), dtype=np.int64)
        floats = np.full((cc.NUM_FLOATS, cap), np.nan)
        ext = np.zeros((cap, self.prepared + 1), dtype=np.int64)  # (a full row sends it to the Python path)
        pkeys = np.zeros((cap, self.prepared + 1), dtype=np.uint64)
        ptok = np.zeros((cap, self.prepared * bs), dtype=np.int32)
        if have:
            ints[:, :have], floats[:, :have] = self.ints, self.floats
            ext[:have], pkeys[:have], ptok[:have] = self.ext, self.pkeys, self.ptok
        self.cap, self.ints, self.floats, self.ext, self.pkeys, self.ptok = cap, ints, floats, ext, pkeys, ptok
        self._free = list(range(cap - 1, have - 1, -1))  # lowest slot first (grown only when none was free)
        self._gaps = np.zeros(cap, dtype=np.float64)
        self._counts = np.zeros(cap, dtype=np.int64)
        r = [ints[f].data for f in range(cc.NUM_INTS)]
        (self._kv, self._tokens, self._num_out, self._out_len, self._blocks, self._tail, self._reg_at,
         self._ok, self._out_total, self._seq_id, self._nreg, self._next, self._pidx, self._nprep,
         self._pbase, self._token_len, self._order, _, _, _) = r
        self._emit, self._itl_max = floats[cc.EMIT].data, floats[cc.ITL_MAX].data

    # -- the running list's changes, mirrored ------------------------------------------------
    def enter(self, s: Sequence) -> None:
        """``s`` is appended to the running list (admitted, or forked): a slot at the end of ORDER,
        its object the truth until ``push`` (the scheduler's, after the step's update for an admitted
        sequence, at once for a forked one)."""
        if not self._free:
            self._alloc(2 * self.cap)
        k = self._free.pop()
        s.lane = k
        io, cc = self._io, self._cc
        self._order[io[cc.RUNNING]] = k
        io[cc.RUNNING] += 1
        self._ok[k] = 0  # (pull leaves the object as it is until then)
        self._nprep[k] = 0  # nothing prepared for this sequence yet

    def pop(self, s: Sequence) -> None:
        """The running list's last sequence, ``s``, leaves it (a preemption's victim): its object made
        current, its slot freed."""
        self.pull(s)
        self._io[self._cc.RUNNING] -= 1
        self.release(s)

    def release(self, s: Sequence) -> None:
        """``s`` left the running list (finished, or popped): its slot is free. (ORDER is rebuilt by
        ``reorder`` when sequences leave from inside the list.)"""
        self._free.append(s.lane)
        s.lane = -1

    def reorder(self, running: list[Sequence]) -> None:
        """The running list after sequences left it from the inside (finished)."""
        n = len(running)
        self.ints[self._cc.ORDER, :n] = [s.lane for s in running]
        self._io[self._cc.RUNNING] = n

    # -- object <-> arrays ---------------------------------------------------------------------
    def push(self, s: Sequence) -> None:
        """The arrays take the object's state (after the Python path changed it)."""
        k, rs, table, bs = s.lane, s.rs, s.table, self.block_size
        ok = rs.req.n == 1 and s.dropped == 0
        self._ok[k] = ok
        if not ok:  # never in the lane: the object stays the truth
            return
        self._kv[k] = s.num_kv
        self._tokens[k] = s.num_tokens
        self._num_out[k] = s.num_out
        self._out_len[k] = rs.req.output_len
        self._blocks[k] = len(table)
        self._tail[k] = table[-1] if table else 0
        self._out_total[k] = rs.output_tokens
        self._seq_id[k] = s.seq_id
        self._emit[k] = s.last_emit_s
        self._itl_max[k] = rs.itl_max_s
        j = s.num_registered
        self._nreg[k] = j
        self._next[k] = 0
        tokens = s.tokens
        if not self.registers or tokens is None or (j + 1) * bs > len(tokens):
            self._reg_at[k] = self._cc.NEVER
            return
        self._reg_at[k] = (j + 1) * bs
        if s.num_out < 1:  # a prompt still in prefill: the lane takes no first token, and the Python
            self._nprep[k] = 0  # path pushes it again after each chunk; nothing prepared (the lane
            return  # leaves a block to register unprepared to the Python path)
        base = self._pbase[k]
        if base <= j < base + self._nprep[k]:  # still within what was prepared for it
            self._pidx[k] = j - base
            return
        # the keys and tokens of the blocks its next decodes fill, as PagedKV._register takes them
        n = min(self.prepared, len(tokens) // bs - j)
        keys = self.kv._keys(s, j + n)
        self.pkeys[k, 0] = keys[j - 1] if j else ROOT_KEY
        self.pkeys[k, 1:n + 1] = keys[j:j + n]
        self.ptok[k, :n * bs] = tokens[j * bs:(j + n) * bs]
        self._pbase[k], self._pidx[k], self._nprep[k] = j, 0, n
        self._token_len[k] = len(tokens)

    def pull(self, s: Sequence) -> None:
        """The object takes what the lane changed (before the Python path reads it)."""
        k = s.lane
        if not self._ok[k]:  # never in the lane: the object is the truth
            return
        s.num_kv = self._kv[k]
        s.num_tokens = self._tokens[k]
        s.num_out = self._num_out[k]
        s.last_emit_s = self._emit[k]
        s.num_registered = self._nreg[k]
        e = self._next[k]
        if e:  # blocks the lane took for it
            s.table.extend(self.ext[k, :e].tolist())
            self._next[k] = 0
        rs = s.rs
        rs.output_tokens = self._out_total[k]
        rs.itl_max_s = self._itl_max[k]

    # -- a step --------------------------------------------------------------------------------
    def begin(self) -> None:
        """A step's scheduling begins: nothing scheduled in the lane yet."""
        self.count = 0

    def advance(self, i: int, budget: int) -> tuple[int, int]:
        """The scheduler's pass from running position ``i`` with ``budget`` tokens: the lane takes
        the decodes it can (compiled.advance) -> (the first position it left to the Python path, or
        where the pass ended; the budget left)."""
        io, cc = self._io, self._cc
        io[POS], io[BUDGET], io[COUNT] = i, budget, self.count
        cc.advance(self.ints, self.ext, self.pkeys, self.ptok, self.io, *self._pool)
        self.count = io[COUNT]
        return io[POS], io[BUDGET]

    def step(self, now_s: float, gaps: dict[float, int]) -> None:
        """The lane's scheduled decodes computed their token at ``now_s`` (the commit and the update);
        their gaps counted into ``gaps``."""
        nd = self._cc.step(self.ints, self.floats, self.count, self._pool[0], self._c, now_s, self._gaps,
                           self._counts)
        for g, n in zip(self._gaps[:nd].tolist(), self._counts[:nd].tolist()):
            gaps[g] = gaps.get(g, 0) + n
        self.taken += self.count
        self.count = 0

    def decodes(self) -> tuple[list[int], list[int]]:
        """(seq ids, positions) of the lane's scheduled decodes, for the step's batch."""
        m, cc = self.count, self._cc
        return self.ints[cc.DEC_ID, :m].tolist(), self.ints[cc.DEC_POS, :m].tolist()
