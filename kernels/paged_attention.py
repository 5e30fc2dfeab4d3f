"""Triton attention over paged KV: prefill (causal, variable-length chunks over a cached prefix), split-KV
decode with its log-sum-exp merge, and the second pass that recomputes decode attention weights from
the decode's lse (for H2O-style statistics). References: kernels/reference.py.

All three attention kernels share one inner loop (`_attend_range`): a tile of query rows, each row one
(token, query head) pair of a single KV head's group, streams KV positions [lo, hi) in tiles of
BLOCK_N through the block table with an online softmax. BLOCK_SIZE (tokens per KV block) is a
compile-time constant, so a position's block and offset are a shift and a mask (a multiply for a
size that is not a power of two), and a tile that lies inside one block (BLOCK_SIZE a multiple of
BLOCK_N: blocks of 64 tokens or more, or one block per sequence) reads one block-table entry, not one
per position. Paged and slab tables run the very same code; each block size is its own compiled kernel.

Sliding windows: ``window`` W > 0 lets a query at position p see p - W + 1 .. p (W tokens, itself
included: vLLM's and transformers' convention). A program streams only from the first position its
lowest query sees; the tiles before it are never visited, and positions before it in the first tile
are masked out of every load, so neither their block-table entries (-1 once the KV manager freed a
block that left the window) nor their K/V are read. W is a runtime argument the JIT does not
specialise on (``do_not_specialize``): full attention (W = 0) and every window run one compiled
kernel, and the window costs no extra work per score (the causal and window tests are one unsigned
comparison, ``_visible``).

GQA: one program serves every query head of a KV head, so each K/V tile is read once per group.
Rows are padded to at least 16 (tl.dot's minimum on GPU); padded rows have q_pos = -1 and see nothing.
Softmax runs in base 2 (exp2) with the scale folded in; lse is returned in natural log units.
Warps and stages per launch come from kernels/tuning.py; so does the decode's split plan.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.kernels import tuning
from kvbench.kernels.dispatch import check_kv_dtype

LOG2E = 1.4426950408889634
# Running max starts finite so a fully masked tile gives exp2(-inf - m) = 0, never NaN.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _tile_offsets(block_tables_ptr, bt_row, start, pos_ok, stride_cb, stride_ct, kv_head_off,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets (int64) [BLOCK_N] of positions start + arange(BLOCK_N) for one KV head.
    ``start`` is a multiple of BLOCK_N; ``bt_row`` the sequence's row offset in the block table;
    ``pos_ok``: the positions the tile reads (some position of the tile is one)."""
    if BLOCK_SIZE % BLOCK_N == 0:
        # The tile lies inside one block: one table entry, then consecutive slots. The block holds a
        # position the caller reads, so its entry is a live block.
        blk = tl.load(block_tables_ptr + bt_row + start // BLOCK_SIZE).to(tl.int64)
        slot = (start % BLOCK_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
        return blk * stride_cb + slot * stride_ct + kv_head_off
    else:
        # Blocks smaller than the tile (or not dividing it): each position reads its block's entry,
        # pos // BLOCK_SIZE being a shift for a power of two. Lanes of a warp reading the same entry
        # share one transaction; loading the tile's BLOCK_N / BLOCK_SIZE entries once and broadcasting
        # them took ~30 more registers in the AOT compile, for no fewer transactions.
        pos = start + tl.arange(0, BLOCK_N)
        blk = tl.load(block_tables_ptr + bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        return blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_ct + kv_head_off


@triton.jit
def _span(window):
    """Positions a query sees back from itself, itself included: the window, or all (2^31 - 1)."""
    return tl.where(window > 0, window, 0x7FFFFFFF).to(tl.uint32)


@triton.jit
def _visible(q_pos, pos, span):
    """[M, N]: key position pos[n] is in query q_pos[m]'s causal window, i.e. 0 <= q_pos - pos < span,
    as one unsigned comparison (a key after the query wraps to a huge distance; so does any key of a
    padding row, q_pos = -1)."""
    return (q_pos[:, None] - pos[None, :]).to(tl.uint32, bitcast=True) < span


@triton.jit
def _attend_range(acc, l_i, m_i, q, q_pos, lo, hi, span, bt_row, kept_row, kv_head,
                  k_cache_ptr, v_cache_ptr, block_tables_ptr, kept_ptr,
                  stride_cb, stride_ct, stride_ch, qk_scale,
                  HAS_KEPT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    # q: [BLOCK_M, BLOCK_D]; q_pos: [BLOCK_M] (-1 = padding row); acc: [BLOCK_M, BLOCK_D] f32;
    # l_i, m_i: [BLOCK_M] f32 (base-2 running sum and max). Positions [lo, hi) are streamed, in tiles
    # aligned to BLOCK_N; positions before lo are neither loaded nor their table entries read.
    # span: _span(window), what each row sees back from its own position.
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical positions
        pos_ok = (pos >= lo) & (pos < hi)
        offs = _tile_offsets(block_tables_ptr, bt_row, start, pos_ok, stride_cb, stride_ct, kv_head_off,
                             BLOCK_SIZE, BLOCK_N)
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        ok = pos_ok[None, :] & _visible(q_pos, pos, span)
        if HAS_KEPT:
            kept = tl.load(kept_ptr + kept_row + pos, mask=pos_ok, other=0)
            ok = ok & (kept[None, :] != 0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_ptr, starts_ptr, kept_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_ct, stride_ch, stride_kept, qk_scale, window,
                    GROUP: tl.constexpr, TOKENS: tl.constexpr, HAS_KEPT: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    # Grid (chunk, kv_head, query tile). Row r of the tile = token r // GROUP, head r % GROUP of the group.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_lo = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_lo
    start = tl.load(starts_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    q_pos = tl.where(row_ok, start + tok, -1)
    d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    t_abs = (q_lo + tok).to(tl.int64)
    q = tl.load(q_ptr + t_abs[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    # Causal: this tile's last token sees up to its own position; an empty tile streams nothing. Under
    # a window the tile's first token sees the furthest back.
    hi = tl.maximum(tl.max(q_pos, 0) + 1, 0)
    lo = tl.where(window > 0, tl.maximum(start + tile * TOKENS - window + 1, 0), 0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    seq64 = seq.to(tl.int64)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, q_pos, lo, hi, _span(window), seq64 * stride_bt,
                                  seq64 * stride_kept, kv_head,
                                  k_cache_ptr, v_cache_ptr, block_tables_ptr, kept_ptr,
                                  stride_cb, stride_ct, stride_ch, qk_scale,
                                  HAS_KEPT, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + t_abs[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["window"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, splits_ptr, kept_ptr,
                         out_ptr, lse_ptr, mid_o_ptr, mid_lse_ptr,
                         stride_qs, stride_qh, stride_bt, stride_cb, stride_ct, stride_ch, stride_kept,
                         stride_os, stride_oh, stride_ls,
                         stride_mo_s, stride_mo_h, stride_mo_p, stride_ml_s, stride_ml_h, qk_scale, window,
                         GROUP: tl.constexpr, HAS_KEPT: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, SINGLE_SPLIT: tl.constexpr):
    # Grid (seq, kv_head, split < max splits): the split's KV range, for all GROUP query heads of the
    # KV head. A sequence has splits_ptr[seq] splits over what its query sees (under a window, the last
    # ``window`` positions); programs past them return at once.
    # SINGLE_SPLIT: the whole context in one program, written straight to out/lse (no merge launch).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the first position the query sees
    if SINGLE_SPLIT:
        lo = first
        hi = ctx
    else:
        n_splits = tl.load(splits_ptr + seq)
        if split >= n_splits:
            return
        # Split length rounded to whole tiles from the tile holding ``first``, so only the last split
        # of a sequence has a ragged tile.
        base = first // BLOCK_N * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(ctx - base, n_splits), BLOCK_N) * BLOCK_N
        lo = tl.maximum(base + split * split_len, first)
        hi = tl.minimum(base + (split + 1) * split_len, ctx)
    g = tl.arange(0, BLOCK_G)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qs + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    q_pos = tl.where(row_ok, ctx - 1, -1)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _M_INIT, dtype=tl.float32)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, q_pos, lo, hi, _span(window), seq64 * stride_bt,
                                  seq64 * stride_kept, kv_head, k_cache_ptr, v_cache_ptr, block_tables_ptr, kept_ptr,
                                  stride_cb, stride_ct, stride_ch, qk_scale,
                                  HAS_KEPT, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, PRECISION)
    # Base-2 lse of the split; -inf where the split saw no kept position (merged with weight 0).
    lse2 = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        tl.store(out_ptr + seq64 * stride_os + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
        tl.store(lse_ptr + seq64 * stride_ls + head, lse2 / 1.4426950408889634, mask=row_ok)
    else:
        mo = mid_o_ptr + seq64 * stride_mo_s + head[:, None] * stride_mo_h + split * stride_mo_p + d[None, :]
        tl.store(mo, out, mask=io_mask)
        tl.store(mid_lse_ptr + seq64 * stride_ml_s + head * stride_ml_h + split, lse2, mask=row_ok)


@triton.jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, splits_ptr, out_ptr, lse_ptr,
                         stride_mo_s, stride_mo_h, stride_mo_p, stride_ml_s, stride_ml_h,
                         stride_os, stride_oh, stride_ls,
                         HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # Grid (seq, q_head): out = sum_p w_p o_p / sum_p w_p with w_p = 2^(lse_p - max lse), over the
    # sequence's own splits_ptr[seq] splits.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < tl.load(splits_ptr + seq)
    d = tl.arange(0, BLOCK_D)
    lse2 = tl.load(mid_lse_ptr + seq * stride_ml_s + head * stride_ml_h + p, mask=p_ok, other=float("-inf"))
    m = tl.max(lse2, 0)
    w = tl.exp2(lse2 - m)  # [BLOCK_P]; empty splits weigh 0
    o = tl.load(mid_o_ptr + seq * stride_mo_s + head * stride_mo_h + p[:, None] * stride_mo_p + d[None, :],
                mask=p_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / total
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    tl.store(lse_ptr + seq * stride_ls + head, (m + tl.log2(total)) / 1.4426950408889634)


@triton.jit
def _weights_kernel(q_ptr, k_cache_ptr, block_tables_ptr, seq_lens_ptr, lse_ptr, kept_ptr, w_ptr,
                    stride_qs, stride_qh, stride_bt, stride_cb, stride_ct, stride_ch, stride_kept,
                    stride_ls, stride_ws, stride_wh, max_len, qk_scale,
                    GROUP: tl.constexpr, HAS_KEPT: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    # Grid (seq, kv_head, position tile): p = 2^(s - lse2) summed over the group's heads. Only K is read;
    # a tile past the sequence's end leaves its zeros.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    start = tl.program_id(2) * BLOCK_N
    ctx = tl.load(seq_lens_ptr + seq)
    if start >= ctx:
        return
    pos = start + tl.arange(0, BLOCK_N)
    pos_ok = pos < ctx
    g = tl.arange(0, BLOCK_G)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qs + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse2 = tl.load(lse_ptr + seq64 * stride_ls + head, mask=row_ok, other=0.0) * 1.4426950408889634
    offs = _tile_offsets(block_tables_ptr, seq64 * stride_bt, start, pos_ok, stride_cb, stride_ct,
                         kv_head.to(tl.int64) * stride_ch, BLOCK_SIZE, BLOCK_N)
    k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
    ok = row_ok[:, None] & pos_ok[None, :]
    if HAS_KEPT:
        kept = tl.load(kept_ptr + seq64 * stride_kept + pos, mask=pos_ok, other=0)
        ok = ok & (kept[None, :] != 0)
    p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)
    tl.store(w_ptr + seq64 * stride_ws + kv_head * stride_wh + pos, tl.sum(p, 0), mask=pos < max_len)


# ---------------------------------------------------------------------------------------------
# Launchers


def _precision(dtype: torch.dtype) -> str:
    # float32 caches are for checking: full-precision dot products, not tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, kept: torch.Tensor | None):
    """Shared launch arguments. q: [*, Hq, D]; caches [NB, BS, Hkv, D] with the same strides."""
    check_kv_dtype(q, k_cache)
    hq, d = q.shape[-2:]
    hkv = k_cache.shape[2]
    assert hq % hkv == 0 and q.stride(-1) == 1 and k_cache.stride(3) == 1
    assert v_cache is None or v_cache.stride() == k_cache.stride()
    if kept is not None:
        kept = kept.to(torch.int8) if kept.dtype == torch.bool else kept
        assert kept.stride(1) == 1
    return dict(group=hq // hkv, kept=kept, block_d=max(16, triton.next_power_of_2(d)),
                precision=_precision(k_cache.dtype), head_dim=d, block_size=k_cache.shape[1])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, starts: torch.Tensor, scale: float, max_q_len: int,
                      kept: torch.Tensor | None = None, block_m: int = 64, block_n: int = 64,
                      window: int = 0) -> torch.Tensor:
    """Causal prefill over cached prefix + chunk; K/V of the chunk must already be written.

    q: [T, Hq, D]; block_tables: int32 [S, MB]; cu_seqlens_q: int32 [S+1]; starts: int32 [S];
    kept: [S, >= max ctx] or None; window: a sliding window's tokens, 0 for none -> out [T, Hq, D]
    """
    c = _common(q, k_cache, v_cache, kept)
    out = torch.empty_like(q)
    num_seqs = starts.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    group = c["group"]
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    tokens = block_m // group
    kept = c["kept"]
    grid = (num_seqs, k_cache.shape[2], triton.cdiv(max_q_len, tokens))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, starts, kept if kept is not None else starts,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), kept.stride(0) if kept is not None else 0,
        scale * LOG2E, window,
        GROUP=group, TOKENS=tokens, HAS_KEPT=kept is not None, HEAD_DIM=c["head_dim"],
        BLOCK_SIZE=c["block_size"], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=c["block_d"],
        PRECISION=c["precision"], **tuning.launch_options("prefill", c["head_dim"], q.device))
    return out


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int = 64) -> int:
    """Splits of a batch of ``num_seqs`` sequences all ``max_seq_len`` long (the plan's uniform case)."""
    return int(tuning.plan_decode_splits([max_seq_len] * max(1, num_seqs), num_kv_heads, block_n=block_n)[0])


def _split_plan(num_splits, max_splits: int | None, seq_lens: torch.Tensor, num_kv_heads: int,
                block_n: int, window: int = 0) -> tuple[torch.Tensor, int]:
    """-> (splits per sequence int32 [S] on the device, grid size >= their max)."""
    if isinstance(num_splits, torch.Tensor):
        return num_splits, int(max_splits if max_splits is not None else num_splits.max())
    if num_splits is None:  # plan from the lengths: a host read (metadata builders pass a plan instead)
        plan = tuning.plan_decode_splits(tuning.attended_lens(seq_lens.tolist(), window), num_kv_heads,
                                         tuning.device_sms(seq_lens.device), block_n)
        return torch.from_numpy(plan).to(seq_lens.device), int(plan.max())
    n = max(1, int(num_splits))
    return torch.full(seq_lens.shape, n, dtype=torch.int32, device=seq_lens.device), n


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                     num_splits: int | torch.Tensor | None = None, kept: torch.Tensor | None = None,
                     block_n: int = 64, max_splits: int | None = None,
                     window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode: one query token per sequence at position seq_lens-1.

    q: [S, Hq, D]; block_tables: int32 [S, MB]; seq_lens: int32 [S] -> out [S, Hq, D], lse f32 [S, Hq]
    num_splits: None (planned from seq_lens, read on the host), an int for every sequence, or int32
    [S] per sequence with ``max_splits`` >= its largest (no host read: safe under CUDA-graph capture).
    One split in all runs one kernel, writing out and lse directly; more add the merge kernel.
    window: a sliding window's tokens (0: none); each sequence's splits then cover its last ``window``
    positions only.
    """
    c = _common(q, k_cache, v_cache, kept)
    s_, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(s_, hq, dtype=torch.float32, device=q.device)
    if s_ == 0:
        return out, lse
    splits, grid_splits = _split_plan(num_splits, max_splits, seq_lens, hkv, block_n, window)
    single = grid_splits == 1
    # Partial results stay float32: [S, Hq, splits, D] and base-2 lse [S, Hq, splits].
    mid_o = out if single else torch.empty(s_, hq, grid_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = lse if single else torch.empty(s_, hq, grid_splits, dtype=torch.float32, device=q.device)
    mo_strides = (0, 0, 0) if single else mid_o.stride()[:3]
    ml_strides = (0, 0) if single else mid_lse.stride()[:2]
    kept = c["kept"]
    _decode_split_kernel[(s_, hkv, grid_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, splits, kept if kept is not None else seq_lens,
        out, lse, mid_o, mid_lse,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), kept.stride(0) if kept is not None else 0,
        out.stride(0), out.stride(1), lse.stride(0), *mo_strides, *ml_strides, scale * LOG2E, window,
        GROUP=c["group"], HAS_KEPT=kept is not None, HEAD_DIM=d, BLOCK_SIZE=c["block_size"],
        BLOCK_G=max(16, triton.next_power_of_2(c["group"])), BLOCK_N=block_n, BLOCK_D=c["block_d"],
        PRECISION=c["precision"], SINGLE_SPLIT=single, **tuning.launch_options("decode", d, q.device))
    if not single:
        _decode_merge_kernel[(s_, hq)](
            mid_o, mid_lse, splits, out, lse, *mo_strides, *ml_strides,
            out.stride(0), out.stride(1), lse.stride(0),
            HEAD_DIM=d, BLOCK_P=triton.next_power_of_2(grid_splits), BLOCK_D=c["block_d"],
            **tuning.launch_options("merge", d, q.device))
    return out, lse


def attention_weights(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      lse: torch.Tensor, scale: float, max_len: int, kept: torch.Tensor | None = None,
                      block_n: int = 64) -> torch.Tensor:
    """Decode attention probabilities from the decode's lse, summed over each KV group's heads.

    q: [S, Hq, D]; lse: f32 [S, Hq] -> f32 [S, Hkv, max_len] (0 past seq_len and where not kept)
    """
    c = _common(q, k_cache, None, kept)
    s_, hkv = q.shape[0], k_cache.shape[2]
    w = torch.zeros(s_, hkv, max_len, dtype=torch.float32, device=q.device)
    if s_ == 0 or max_len == 0:
        return w
    kept = c["kept"]
    lse = lse.contiguous()
    _weights_kernel[(s_, hkv, triton.cdiv(max_len, block_n))](
        q, k_cache, block_tables, seq_lens, lse, kept if kept is not None else seq_lens, w,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), kept.stride(0) if kept is not None else 0,
        lse.stride(0), w.stride(0), w.stride(1), max_len, scale * LOG2E,
        GROUP=c["group"], HAS_KEPT=kept is not None, HEAD_DIM=c["head_dim"], BLOCK_SIZE=c["block_size"],
        BLOCK_G=max(16, triton.next_power_of_2(c["group"])), BLOCK_N=block_n, BLOCK_D=c["block_d"],
        PRECISION=c["precision"], **tuning.launch_options("weights", c["head_dim"], q.device))
    return w

