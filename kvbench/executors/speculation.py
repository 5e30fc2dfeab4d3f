"""InfiniGen's look-ahead on the model executor: before a decode step, score the tokens held in the
CPU pool against the coming decode's query, so the evictor can recall those attention will turn to.

Every layer's query is approximated by that layer's query projection of the coming token's embedding
(InfiniGen projects the previous layer's input with partial query weights; the embedding stands in for
every layer's input, which is exact for layer 0 and close while the residual stream is dominated by
it) and rotated to its position. On the device, restricted to the partial key dims
(kvbench.eviction.host_kv), it is scored against the pooled tokens' partial keys and, through the
decode kernel over the sequence's block table, against the kept tokens and its own key, whose
log-sum-exp normalises the pooled scores: a pooled token's weight is relative to the kept tokens'
total of 1 in the same partial scores.
"""
from __future__ import annotations

import numpy as np
import torch

from kvbench import kernels
from kvbench.eviction.host_kv import HostKV


@torch.inference_mode()
def speculate(net, host: HostKV, last, items: list[tuple[int, int, int, np.ndarray]]
              ) -> dict[int, np.ndarray] | None:
    """Scores for the coming step. ``net``: the PagedLlama; ``last``: (AttentionMetadata, pool view,
    decode seq ids) of the step just run, or None; ``items``: (seq_id, next input token, its position,
    the host positions to score: the CPU pool's tokens of the sequence).

    -> seq_id -> float64 weight of each position asked, or None when there was nothing to score (no
    step run yet, no pooled keys, or none of the sequences decoded in the step just run)."""
    if last is None or host.dims is None:
        return None
    meta, pool, ids = last
    row_of = {sid: i for i, sid in enumerate(ids)}
    items = [it for it in items if it[0] in row_of and it[0] in host.pk]
    if not items:
        return None
    device = pool.device
    toks = torch.tensor([it[1] for it in items], device=device)
    h = net.model.embed_tokens(toks)  # [S, hidden]
    cos, sin = net.rope(torch.tensor([it[2] for it in items], device=device), h.dtype)
    rows = torch.tensor([row_of[it[0]] for it in items], device=device)
    tables, lens = meta.decode_block_tables[rows], meta.decode_seq_lens[rows]
    kept = None if meta.decode_kept is None else meta.decode_kept[rows]
    qs, lses = [], []
    for i, layer in enumerate(net.model.layers):
        attn = layer.self_attn
        group = attn.num_heads // attn.num_kv_heads
        q, k = attn.rotary_qk(layer.input_layernorm(h), cos, sin)  # q: [S, Hq, D], k: [S, Hkv, D]
        keep = host.dim_mask[i]  # [Hkv, D]
        q = q.float() * keep.repeat_interleave(group, dim=0)  # partial dims only
        k = k.float() * keep
        _, lse = kernels.decode_attention(q.to(pool.dtype), pool[2 * i], pool[2 * i + 1], tables, lens,
                                          attn.scale, meta.max_decode_len, kept=kept, backend=attn.backend)
        # the coming token attends to its own key too (not written yet): add it to the kept total
        own = torch.einsum("shgd,shd->shg", q.view(len(items), attn.num_kv_heads, group, -1), k)
        qs.append(q)
        lses.append(torch.logaddexp(lse.float(), own.reshape(len(items), -1) * attn.scale))
    return host.speculate([it[0] for it in items], torch.stack(qs), torch.stack(lses),
                          net.model.layers[0].self_attn.scale, [it[3] for it in items])
