"""Torch references for every paged-KV kernel: the definition the Triton kernels are tested against,
and the attention path on CPU (or anywhere with ``backend="torch"``).

Cache layout (per layer): K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]``. A
sequence's logical position ``p`` lives in physical block ``block_table[p // block_size]`` at offset
``p % block_size``; its slot is ``block * block_size + offset``. ``kept`` masks are per sequence over
logical positions (True/nonzero = the token is still in the cache), so a shared block can be kept by
one sequence and dropped by another. Scores and softmax are computed in float32 whatever the cache dtype.
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


def gather_slots(block_table: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Slots of logical positions [0, ctx_len) of one sequence. block_table: int [max_blocks] -> int64 [ctx_len]."""
    pos = torch.arange(ctx_len, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


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


def _allowed(q_pos: torch.Tensor, ctx_len: int, kept: torch.Tensor | None) -> torch.Tensor:
    """Causal (and kept) mask. q_pos: int64 [M] -> bool [M, ctx_len]."""
    kv_pos = torch.arange(ctx_len, device=q_pos.device)
    ok = kv_pos[None, :] <= q_pos[:, None]
    if kept is not None:
        ok = ok & kept[:ctx_len].bool()[None, :]
    return ok


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, starts: torch.Tensor,
                          scale: float, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of prefill chunks whose K/V (cached prefix and the chunk itself) are in the cache.

    q: [T, Hq, D] (chunks concatenated); cu_seqlens_q: int32 [S+1]; starts: int32 [S] (tokens cached
    before each chunk); block_tables: int32 [S, max_blocks]; kept: bool/int8 [S, >= ctx] or None
    -> out [T, Hq, D]. Query i of chunk s sits at position starts[s] + i and sees positions 0..itself.
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu, st = cu_seqlens_q.tolist(), starts.tolist()
    for s in range(len(st)):
        lo, hi, start = cu[s], cu[s + 1], st[s]
        ctx = start + hi - lo
        slots = gather_slots(block_tables[s], ctx, block_size)
        k = k_cache.view(-1, *k_cache.shape[2:])[slots][None]  # [1, ctx, Hkv, D]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots][None]
        for t0 in range(lo, hi, _REF_Q_TILE):
            t1 = min(hi, t0 + _REF_Q_TILE)
            q_pos = torch.arange(start + t0 - lo, start + t1 - lo, device=q.device)
            allowed = _allowed(q_pos, ctx, None if kept is None else kept[s])
            out[t0:t1] = _attend(q[None, t0:t1], k, v, allowed[None], scale)[0][0]
    return out


def _gather_padded(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """K or V of every sequence padded to max_len. cache: [NB, BS, Hkv, D] -> [S, max_len, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(max_len, device=cache.device)
    nblk = (max_len + block_size - 1) // block_size
    slots = block_tables[:, :nblk].long()[:, pos // block_size] * block_size + pos % block_size
    # Padding rows of a block table may hold anything; their positions are masked out later.
    slots = slots.clamp_(0, cache.shape[0] * block_size - 1)
    return cache.view(-1, *cache.shape[2:])[slots]


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence at position seq_lens-1, attending to positions [0, seq_lens).

    q: [S, Hq, D]; block_tables: int32 [S, max_blocks]; seq_lens: int32 [S]; kept: [S, >= max_len] or None
    -> out [S, Hq, D], lse [S, Hq] float32.
    """
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    k = _gather_padded(k_cache, block_tables, max_len)  # [S, L, Hkv, D]
    v = _gather_padded(v_cache, block_tables, max_len)
    allowed = _decode_allowed(seq_lens, max_len, kept)  # [S, L]
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
