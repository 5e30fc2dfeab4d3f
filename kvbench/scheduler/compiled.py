"""The compiled cores of kvbench.scheduler.lane (numba, ``cache=True``): the running batch's decodes
scheduled, committed and updated in one call each a step, not a few Python statements a sequence.

Imported on first use (``lane.compiled()``), as kvbench.memory.compiled is. The lane's state, one
column (or row) per slot: ``ints`` (int64 rows ``KV`` ... ``TOKEN_LEN``, and two rows indexed by
running position, ``ORDER`` and ``SCHED``), ``floats`` (``EMIT``, ``ITL_MAX``), ``ext`` (blocks the
lane appended to a table, not yet in the sequence's own table), ``pkeys`` and ``ptok`` (the keys and tokens of
the next blocks a sequence's decodes will register), ``io`` (the pass's position, running count,
budget, scheduled count, block size). The pool's state is the compiled block pool's
(kvbench.memory.compiled).
"""
from __future__ import annotations

import numpy as np

from kvbench.jit import numba
from kvbench.memory.compiled import FILL, LIVE, NCACHED, NFREE, REFCNT, VIRTUAL, alloc, register_one

# rows of ``ints`` per slot: KV computed tokens (= slots held: no token eviction in a lane), TOKENS
# prompt + generated, OUT generated, OUT_LEN the request's output_len, BLOCKS len(table), TAIL
# table[-1], REG_AT the token count at which a decode registers a block (NEVER: none can), OK 1 when
# the sequence may run in the lane (one sample), OUT_TOTAL the request's output_tokens, SEQ_ID,
# NREG num_registered, NEXT blocks in ``ext``, PIDX the next prepared block, NPREP blocks prepared,
# PBASE num_registered when they were prepared, TOKEN_LEN len(tokens); per running position: ORDER
# the slot there; per decode the lane scheduled this step, in running order: SCHED its slot, DEC_ID
# its seq id, DEC_POS its position (the step's batch)
(KV, TOKENS, OUT, OUT_LEN, BLOCKS, TAIL, REG_AT, OK, OUT_TOTAL, SEQ_ID, NREG, NEXT, PIDX, NPREP, PBASE,
 TOKEN_LEN, ORDER, SCHED, DEC_ID, DEC_POS) = range(20)
NUM_INTS = 20
EMIT, ITL_MAX = range(2)  # rows of ``floats``: when it last emitted a token, its longest gap (NaN: none)
NUM_FLOATS = 2
POS, RUNNING, BUDGET, COUNT, BS = range(5)  # entries of ``io``
NEVER = 1 << 62


@numba.njit(cache=True)
def advance(ints, ext, pkeys, ptok, io, s32, s64, hk, hv, rows, c):
    """Scheduler.schedule's pass over the running sequences from position ``io[POS]``, for as long
    as each is a decode the lane can take: what PagedKV.allocate does for a decode (a block from the
    pool when the token opens one, free first, else the least recently released cached one; the
    block it fills registered in the prefix cache), a token of the budget each, the slot appended to
    ``SCHED``. Stops at the first position the Python path must take (a prefill chunk, a first or
    last token, a sample of n > 1, a block it cannot take or register here, a short pool: the
    Python path preempts), at the end of the running list, or when the budget is spent; every check
    is made before anything changes, so the Python path finds the sequence as it was."""
    i, n, budget, m, bs = io[POS], io[RUNNING], io[BUDGET], io[COUNT], io[BS]
    order, sched, dec_id, dec_pos = ints[ORDER], ints[SCHED], ints[DEC_ID], ints[DEC_POS]
    refcnt = s32[REFCNT]
    room = ext.shape[1]
    one = np.empty(1, dtype=np.int32)
    vkeys = np.empty(1, dtype=np.uint64)
    vparents = np.empty(1, dtype=np.uint64)
    vgone = np.empty(1, dtype=np.uint8)
    while i < n and budget > 0:
        k = order[i]
        kv = ints[KV, k]
        out = ints[OUT, k]
        nb = ints[BLOCKS, k]
        if ints[OK, k] == 0 or ints[TOKENS, k] - kv != 1 or out < 1 or out + 1 >= ints[OUT_LEN, k]:
            break
        grow = kv == nb * bs  # the token opens a block (allocate: alloc_into(table, 1))
        if grow:
            if ints[NEXT, k] >= room or not (c[NFREE] > 0 or (c[VIRTUAL] == 0 and c[NCACHED] > 0)):
                break
        elif kv // bs != nb - 1 or (kv % bs != 0 and refcnt[ints[TAIL, k]] != 1):
            break  # (allocate's fast path: room in an unshared last block)
        reg = kv + 1 >= ints[REG_AT, k]  # the token fills a block a decode registers
        if reg and (kv + 1 != ints[REG_AT, k] or ints[PIDX, k] >= ints[NPREP, k]):
            break
        if grow:
            alloc(s32, s64, hk, hv, c, 1, one, vkeys, vparents, vgone)
            e = ints[NEXT, k]
            ext[k, e] = one[0]
            ints[NEXT, k] = e + 1
            ints[BLOCKS, k] = nb + 1
            ints[TAIL, k] = one[0]
        if reg:
            p = ints[PIDX, k]
            register_one(s32, s64, hk, hv, rows, ints[TAIL, k], pkeys[k, p + 1], pkeys[k, p],
                         ptok[k, p * bs:(p + 1) * bs])
            ints[PIDX, k] = p + 1
            r = ints[NREG, k] + 1
            ints[NREG, k] = r
            ints[REG_AT, k] = (r + 1) * bs if (r + 1) * bs <= ints[TOKEN_LEN, k] else NEVER
        sched[m] = k
        dec_id[m] = ints[SEQ_ID, k]
        dec_pos[m] = kv
        m += 1
        budget -= 1
        i += 1
    io[POS], io[BUDGET], io[COUNT] = i, budget, m


@numba.njit(cache=True)
def step(ints, floats, m, s32, c, now, gaps, counts):
    """The lane's ``m`` scheduled slots (``SCHED``) computed one token each, at time ``now``: the
    commit (PagedKV.commit_all: the fill of the block it wrote, the pool's live tokens) and the
    update (Scheduler.update: the gap since its last token, its longest gap, one more token). The
    gaps' distinct values go to ``gaps``, their counts to ``counts``, in the order first seen ->
    how many distinct values."""
    sched = ints[SCHED]
    nd = 0
    for j in range(m):
        k = sched[j]
        s32[FILL, ints[TAIL, k]] += 1
        ints[KV, k] += 1
        ints[TOKENS, k] += 1
        ints[OUT, k] += 1
        ints[OUT_TOTAL, k] += 1
        g = now - floats[EMIT, k]
        d = 0
        while d < nd and gaps[d] != g:
            d += 1
        if d == nd:
            gaps[nd] = g
            counts[nd] = 0
            nd += 1
        counts[d] += 1
        if not g <= floats[ITL_MAX, k]:  # (NaN: no gap yet)
            floats[ITL_MAX, k] = g
        floats[EMIT, k] = now
    c[LIVE] += m
    return nd
