"""Torch references for every paged-KV kernel: the definition the Triton kernels are tested against,
and the attention path on CPU (or anywhere with ``backend="torch"``).

Cache layout (per layer): K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]``. A
sequence's logical position ``p`` lives in physical block ``block_table[p // block_size]`` at offset
``p % block_size``; its slot is ``block * block_size + offset``. ``kept`` masks are per sequence over
logical positions (True/nonzero = the token is still in the cache), so a shared block can be kept by
one sequence and dropped by another. Scores and softmax are computed in float32 whatever the cache dtype.

Sliding windows (``window`` W > 0): a query at position p sees positions p - W + 1 .. p, W tokens itself
included (vLLM's and transformers' convention: ``kv_idx > q_idx - W``). Positions before a query's
window are never gathered: their block-table entries may be -1 (a block the KV manager freed when it
left the window), so the references, like the kernels, read only what some query can see.
"""
from __future__ import annotations

import torch

# Query rows per reference prefill tile: bounds the [heads, rows, ctx] score tensor on long prompts.
_REF_Q_TILE = 1024


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store new K/V rows into their slots. k, v: [T, Hkv, D]; slot_mapping: int64 [T], -1 = skip."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # k_cache: [NB, BS, Hkv, D] -> [NB*BS, Hkv, D], a view, so index_copy_ writes the pool itself.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def copy_blocks_ref(pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks for copy-on-write. pool: [planes, num_blocks, ...] (planes = layers x {K,V});
    pairs: int64 [P, 2] of (src, dst)."""
    if pairs.numel():
        pool[:, pairs[:, 1]] = pool[:, pairs[:, 0]]


def slots_at(block_table: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of logical positions ``pos`` (int64 [n]) of one sequence. block_table: int [max_blocks] -> int64 [n]."""
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def gather_slots(block_table: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Slots of logical positions [0, ctx_len) of one sequence. block_table: int [max_blocks] -> int64 [ctx_len]."""
    return slots_at(block_table, torch.arange(ctx_len, device=block_table.device), block_size)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GQA attention of a batch of padded rows.

    q: [B, M, Hq, D]; k, v: [B, N, Hkv, D]; allowed: bool [B, M, N]
    -> out [B, M, Hq, D] (q's dtype), lse [B, M, Hq] float32 (natural log of sum exp(scale * q.k)).
    """
    b, m, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, m, hkv, hq // hkv, d)
    s = torch.einsum("bmhgd,bnhd->bhgmn", qg, k.float()) * scale  # [B, Hkv, G, M, N]
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, M]
    # A row with nothing allowed (padding) gets lse -inf; keep its probabilities 0, not NaN.
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    out = torch.einsum("bhgmn,bnhd->bmhgd", p, v.float()).reshape(b, m, hq, d)
    return out.to(q.dtype), lse.permute(0, 3, 1, 2).reshape(b, m, hq)


def window_start(pos: int, window: int) -> int:
    """The first position a query at ``pos`` sees: 0, or pos - window + 1 under a sliding window."""
    return max(0, pos - window + 1) if window > 0 else 0


def _allowed(q_pos: torch.Tensor, kv_pos: torch.Tensor, kept: torch.Tensor | None, window: int) -> torch.Tensor:
    """Causal, windowed (and kept) mask. q_pos: int64 [M]; kv_pos: int64 [N] -> bool [M, N]."""
    ok = kv_pos[None, :] <= q_pos[:, None]
    if window > 0:
        ok = ok & (kv_pos[None, :] > q_pos[:, None] - window)
    if kept is not None:
        ok = ok & kept[kv_pos].bool()[None, :]
    return ok


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, starts: torch.Tensor,
                          scale: float, kept: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of prefill chunks whose K/V (cached prefix and the chunk itself) are in the cache.

    q: [T, Hq, D] (chunks concatenated); cu_seqlens_q: int32 [S+1]; starts: int32 [S] (tokens cached
    before each chunk); block_tables: int32 [S, max_blocks]; kept: bool/int8 [S, >= ctx] or None
    -> out [T, Hq, D]. Query i of chunk s sits at position starts[s] + i and sees positions 0..itself
    (its last ``window`` of them under a sliding window).
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu, st = cu_seqlens_q.tolist(), starts.tolist()
    for s in range(len(st)):
        lo, hi, start = cu[s], cu[s + 1], st[s]
        for t0 in range(lo, hi, _REF_Q_TILE):
            t1 = min(hi, t0 + _REF_Q_TILE)
            first, ctx = start + t0 - lo, start + t1 - lo
            kv_pos = torch.arange(window_start(first, window), ctx, device=q.device)
            slots = slots_at(block_tables[s], kv_pos, block_size)
            k = k_cache.view(-1, *k_cache.shape[2:])[slots][None]  # [1, N, Hkv, D]
            v = v_cache.view(-1, *v_cache.shape[2:])[slots][None]
            q_pos = torch.arange(first, ctx, device=q.device)
            allowed = _allowed(q_pos, kv_pos, None if kept is None else kept[s], window)
            out[t0:t1] = _attend(q[None, t0:t1], k, v, allowed[None], scale)[0][0]
    return out


def _gather_padded(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int,
                   lo: torch.Tensor | None = None, ctx: torch.Tensor | None = None) -> torch.Tensor:
    """K or V of every sequence at positions lo .. lo + max_len - 1, padded: cache [NB, BS, Hkv, D]
    -> [S, max_len, Hkv, D]. lo: int64 [S] (None: 0). A position at or past ``ctx`` (int [S]; None:
    every one is read) is padding: zeros, its block-table entry never read."""
    block_size = cache.shape[1]
    s_ = block_tables.shape[0]
    pos = torch.arange(max_len, device=cache.device).expand(s_, max_len)  # [S, L]
    if lo is not None:
        pos = pos + lo[:, None]
    valid = torch.ones_like(pos, dtype=torch.bool) if ctx is None else pos < ctx[:, None].long()
    # Padding rows of a block table may hold anything (-1 where a block was freed): never indexed.
    idx = torch.where(valid, pos // block_size, 0).clamp_(max=block_tables.shape[1] - 1)
    blocks = block_tables.long().gather(1, idx)
    slots = (blocks * block_size + pos % block_size).clamp_(0, cache.shape[0] * block_size - 1)
    out = cache.view(-1, *cache.shape[2:])[slots]
    return out if ctx is None else torch.where(valid[..., None, None], out, torch.zeros((), dtype=out.dtype))


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         kept: torch.Tensor | None = None, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence at position seq_lens-1, attending to positions [0, seq_lens) (the
    last ``window`` of them under a sliding window: [seq_lens - window, seq_lens)).

    q: [S, Hq, D]; block_tables: int32 [S, max_blocks]; seq_lens: int32 [S]; kept: [S, >= max_len] or None
    -> out [S, Hq, D], lse [S, Hq] float32.
    """
    lens = seq_lens.long()
    max_len = int(lens.max()) if lens.numel() else 0
    lo = (lens - window).clamp_(min=0) if window > 0 else torch.zeros_like(lens)
    width = int((lens - lo).max()) if lens.numel() else 0
    k = _gather_padded(k_cache, block_tables, width, lo, lens)  # [S, L, Hkv, D]: positions lo .. lo + L - 1
    v = _gather_padded(v_cache, block_tables, width, lo, lens)
    pos = lo[:, None] + torch.arange(width, device=lens.device)[None, :]  # [S, L]
    allowed = pos < lens[:, None]
    if kept is not None:
        allowed = allowed & kept[:, :max_len].bool().gather(1, pos.clamp(max=max(max_len - 1, 0)))
    out, lse = _attend(q[:, None], k, v, allowed[:, None], scale)
    return out[:, 0], lse[:, 0]


def _decode_allowed(seq_lens: torch.Tensor, max_len: int, kept: torch.Tensor | None) -> torch.Tensor:
    ok = torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None].long()
    if kept is not None:
        ok = ok & kept[:, :max_len].bool()
    return ok


def attention_weights_ref(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, lse: torch.Tensor, scale: float, max_len: int,
                          kept: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention probabilities recomputed from the decode's lse, summed per KV group.

    q: [S, Hq, D]; lse: float32 [S, Hq] -> float32 [S, Hkv, max_len] (0 past seq_len and where not kept).
    """
    s_, hq, d = q.shape
    hkv = k_cache.shape[2]
    k = _gather_padded(k_cache, block_tables, max_len).float()  # [S, L, Hkv, D]
    qg = q.float().view(s_, hkv, hq // hkv, d)
    logits = torch.einsum("shgd,slhd->shgl", qg, k) * scale
    p = torch.exp(logits - lse.view(s_, hkv, hq // hkv, 1))
    p = p * _decode_allowed(seq_lens, max_len, kept)[:, None, None]
    return p.sum(2)
