"""A Llama-family transformer (Llama, Qwen2, Mistral) whose attention reads and writes paged KV.

One forward takes a flattened batch: prefill chunks first, then one token per decoding sequence
(``ForwardInputs``, built by ``build_inputs``), writes every token's K/V into its slot, and attends
through block tables with kvbench.kernels (Triton on GPU, torch references on CPU, or forced with
``attention=``). Parameter names are transformers' LlamaForCausalLM / Qwen2ForCausalLM names, so a
state dict moves between the two unchanged (the selfcheck relies on it).

Sliding-window layers (a ModelSpec's ``layer_kinds``) attend to their last ``sliding_window`` positions,
the query included, as transformers' and vLLM's do. A model whose layers fall into several KV cache
groups (kvbench.memory.groups) is bound to them (``PagedLlama.bind_kv_groups``): layer l reads the
block tables of its group (``ForwardInputs.group_metas``) and keeps its K/V in its group's share of
the pool, as vLLM lays a hybrid pool out: layer i of every group in one pair of planes
(``kv_planes``), so a block costs the largest group's layers.

Refused (``check_runnable``): chunked-local and MLA layers and quantized checkpoints, which this
forward would run as something else (the sim models them; the model executor refuses a mixture of
experts too, whose shape this module still builds densely). Not modelled: rope scaling other than
Llama 3's ("llama3", read from a model folder's config.json; presets carry none, which changes
nothing for random weights).
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
from torch import nn

from kvbench import kernels
from kvbench.errors import InputError
from kvbench.executors.presets import ModelSpec, get_model
from kvbench.kernels.tuning import attended_lens, device_sms, plan_decode_splits

log = logging.getLogger(__name__)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPU (what serving uses); float32 on CPU (no fast bf16 there, and exact checks)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# ---------------------------------------------------------------------------------------------
# Flattened step inputs


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to. T = P prefill tokens + D decodes."""

    slot_mapping: torch.Tensor  # int64 [T]
    num_prefill_tokens: int  # P: rows [0, P) are prefill tokens, rows [P, T) decode tokens
    prefill_cu_seqlens: torch.Tensor  # int32 [C+1], chunk boundaries in rows
    prefill_starts: torch.Tensor  # int32 [C], tokens already cached before each chunk
    prefill_block_tables: torch.Tensor  # int32 [C, MB]
    max_prefill_len: int
    decode_block_tables: torch.Tensor  # int32 [D, MB]
    decode_seq_lens: torch.Tensor  # int32 [D], context length including the new token
    max_decode_len: int
    sample_indices: torch.Tensor  # int64 [N], rows whose logits the forward returns
    prefill_kept: torch.Tensor | None = None  # int8 [C, >= max ctx], 1 = token kept
    decode_kept: torch.Tensor | None = None  # int8 [D, >= max_decode_len]
    # Split-KV plan of the decodes (kvbench.kernels.tuning.plan_decode_splits), made once per step on
    # the host: splits per sequence int32 [D] and their maximum (the kernel's grid). None: the kernel
    # plans from decode_seq_lens itself (a host read per layer).
    decode_num_splits: torch.Tensor | None = None
    max_decode_splits: int | None = None
    # When set, each layer appends (q [D, Hq, D_h], lse f32 [D, Hq]) of its decode rows here.
    decode_records: list | None = None


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], absolute (rotary) positions
    meta: AttentionMetadata  # the only group's, or group 0's of several
    # Several KV cache groups: each group's metadata (its block tables, slots and decode split plan;
    # group_metas[0] is meta), read by the layers bound to it (PagedLlama.bind_kv_groups).
    group_metas: list[AttentionMetadata] | None = None


def _slots(table: Sequence[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of logical positions through a block table. positions: int64 [n] -> int64 [n]."""
    tbl = np.asarray(table, dtype=np.int64)
    return tbl[positions // block_size] * block_size + positions % block_size


def _table_tensor(tables: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Ragged block tables -> int32 [n, max_blocks], padded with block 0 (never read: masked by length).
    A -1 entry (a block a sliding window freed) stays -1: the kernels never read before the window."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return torch.from_numpy(out).to(device)


def _kept_tensor(masks: Sequence[np.ndarray | None], ctx_lens: Sequence[int], device) -> torch.Tensor | None:
    """Per-sequence kept masks over logical positions -> int8 [n, max ctx]; positions past a mask's
    end (tokens written this step) count as kept."""
    if not masks or all(m is None for m in masks):
        return None
    out = np.ones((len(masks), max(ctx_lens)), dtype=np.int8)
    for i, m in enumerate(masks):
        if m is not None:
            n = min(len(m), out.shape[1])
            out[i, :n] = np.asarray(m[:n], dtype=np.int8)
    return torch.from_numpy(out).to(device)


def build_inputs(block_size: int, device: torch.device | str,
                 prefill_tokens: Sequence[np.ndarray] = (), prefill_starts: Sequence[int] = (),
                 prefill_tables: Sequence[Sequence[int]] = (), prefill_sample: Sequence[bool] = (),
                 decode_tokens: Sequence[int] = (), decode_positions: Sequence[int] = (),
                 decode_tables: Sequence[Sequence[int]] = (), decode_slots: Sequence[int] = (),
                 prefill_kept: Sequence[np.ndarray | None] = (), decode_kept: Sequence[np.ndarray | None] = (),
                 logits_for_all_tokens: bool = False, num_kv_heads: int = 0,
                 group_windows: Sequence[int] = (), prefill_group_tables: Sequence[Sequence[Sequence[int]]] = (),
                 decode_group_tables: Sequence[Sequence[Sequence[int]]] = ()) -> ForwardInputs:
    """Flatten one step's prefill chunks and decodes (parallel lists, as in StepBatch).

    Logits come back for the last token of each chunk with ``prefill_sample`` set, then for every
    decode, in that order (or for every row with ``logits_for_all_tokens``). ``decode_slots`` (token
    eviction): the slot index each decode writes, attending to that many slots plus its own; empty
    means slot = position. ``num_kv_heads`` > 0: plan the decodes' split-KV once here (per step) rather
    than in every layer's kernel call.

    Several KV cache groups (``group_windows``: each group's sliding window, 0 for full attention):
    ``prefill_group_tables`` / ``decode_group_tables`` give each sequence's table per group (-1 where a
    window freed a block) in place of ``prefill_tables`` / ``decode_tables``; each group gets its own
    metadata (``ForwardInputs.group_metas``): its tables, its slots, its decodes' splits planned over
    what its window sees.
    """
    ids, pos, sample = [], [], []
    row = 0
    for tokens, start, want in zip(prefill_tokens, prefill_starts, prefill_sample):
        ids.append(np.asarray(tokens, dtype=np.int64))
        pos.append(np.arange(start, start + len(tokens), dtype=np.int64))
        row += len(tokens)
        if want:
            sample.append(row - 1)
    num_prefill = row
    dpos = np.asarray(decode_positions, dtype=np.int64)
    dslot = np.asarray(decode_slots, dtype=np.int64) if len(decode_slots) else dpos
    ids.append(np.asarray(decode_tokens, dtype=np.int64))
    pos.append(dpos)
    sample.extend(range(num_prefill, num_prefill + len(dpos)))
    if logits_for_all_tokens:
        sample = list(range(num_prefill + len(dpos)))
    lens = [len(t) for t in prefill_tokens]
    prefill_ctx = [s + n for s, n in zip(prefill_starts, lens)]
    decode_ctx = (dslot + 1).tolist()

    def t(a, dtype):
        return torch.as_tensor(np.asarray(a), dtype=dtype).to(device)

    shared = AttentionMetadata(
        slot_mapping=torch.empty(0), num_prefill_tokens=num_prefill,
        prefill_cu_seqlens=t(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), torch.int32),
        prefill_starts=t(list(prefill_starts), torch.int32),
        prefill_block_tables=torch.empty(0), max_prefill_len=max(lens, default=0),
        decode_block_tables=torch.empty(0), decode_seq_lens=t(decode_ctx, torch.int32),
        max_decode_len=max(decode_ctx, default=0), sample_indices=t(sample, torch.int64),
        prefill_kept=_kept_tensor(prefill_kept, prefill_ctx, device),
        decode_kept=_kept_tensor(decode_kept, decode_ctx, device))

    def for_tables(p_tables: Sequence[Sequence[int]], d_tables: Sequence[Sequence[int]],
                   window: int) -> AttentionMetadata:
        """The shared metadata with one set of block tables: their slots, and the split plan."""
        slots = [_slots(table, p, block_size) for table, p in zip(p_tables, pos)]
        slots.append(np.array([_slots(tbl, dslot[i:i + 1], block_size)[0] for i, tbl in enumerate(d_tables)],
                              dtype=np.int64))
        meta = replace(shared, slot_mapping=t(np.concatenate(slots), torch.int64),
                       prefill_block_tables=_table_tensor(p_tables, device),
                       decode_block_tables=_table_tensor(d_tables, device))
        if num_kv_heads and decode_ctx:
            plan = plan_decode_splits(attended_lens(decode_ctx, window), num_kv_heads, device_sms(device))
            meta.decode_num_splits, meta.max_decode_splits = t(plan, torch.int32), int(plan.max())
        return meta

    metas = ([for_tables([tb[g] for tb in prefill_group_tables], [tb[g] for tb in decode_group_tables], w)
              for g, w in enumerate(group_windows)] if group_windows
             else [for_tables(prefill_tables, decode_tables, 0)])
    return ForwardInputs(t(np.concatenate(ids), torch.int64), t(np.concatenate(pos), torch.int64), metas[0],
                         group_metas=metas if group_windows else None)


def kv_planes(layer_groups: Sequence[int]) -> list[int]:
    """Each layer's K/V plane pair in a pool shared by KV cache groups: layer l is the i-th layer of its
    group and keeps its K/V in planes 2i and 2i + 1, shared by the i-th layer of every group (vLLM's
    hybrid pool: a block belongs to one group at a time, so a block id names one group's slot in each
    shared tensor)."""
    seen: dict[int, int] = {}
    out = []
    for g in layer_groups:
        out.append(seen.get(g, 0))
        seen[g] = out[-1] + 1
    return out


def make_kv_pool(spec: ModelSpec, num_blocks: int, block_size: int, device, dtype: torch.dtype,
                 layer_groups: Sequence[int] | None = None) -> torch.Tensor:
    """The whole KV pool as one tensor [2 * layers, num_blocks, block_size, Hkv, D]: plane 2l is layer
    l's K, 2l+1 its V. One tensor lets a block copy move a block in every layer with one launch. With
    KV cache groups (``layer_groups``: each layer's group), 2 planes per layer of the largest group
    (``kv_planes``)."""
    planes = max(kv_planes(layer_groups)) + 1 if layer_groups else spec.num_layers
    return torch.zeros(2 * planes, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                       dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# The model


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Rotary inverse frequencies, float32 [head_dim / 2]; ``scaling`` = a config's llama3 rope scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        log.warning("rope scaling %r is not modelled; using plain rotary frequencies", kind)
        return inv
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    ramp = ((old_len / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    return inv / factor * (1 - ramp) + inv * ramp


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as transformers does, so bf16 matches too).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PagedAttention(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str, window: int = 0):
        """``window``: a sliding-window layer's tokens (a query sees itself and the window - 1 before it);
        0 for full attention."""
        super().__init__()
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.q_proj = nn.Linear(spec.hidden_size, hq * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, hkv * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, hkv * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(hq * d, spec.hidden_size, bias=False)
        self.scale = d ** -0.5
        self.backend = attention
        self.window = window

    def rotary_qk(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys of x: [T, hidden], rotated by cos, sin: [T, D] -> q [T, Hq, D], k [T, Hkv, D]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; cos, sin: [T, D]; k_cache, v_cache: [NB, BS, Hkv, D] -> [T, hidden]
        t = x.shape[0]
        q, k = self.rotary_qk(x, cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        # Write first: every query then reads its own chunk's K/V from the cache like any cached token.
        kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, backend=self.backend)
        p = meta.num_prefill_tokens
        parts = []
        if p:
            parts.append(kernels.prefill_attention(
                q[:p], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens,
                meta.prefill_starts, self.scale, meta.max_prefill_len, meta.prefill_kept, backend=self.backend,
                window=self.window))
        if t > p:
            q_dec = q[p:].contiguous()
            out, lse = kernels.decode_attention(
                q_dec, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                meta.max_decode_len, num_splits=meta.decode_num_splits, kept=meta.decode_kept,
                backend=self.backend, max_splits=meta.max_decode_splits, window=self.window)
            if meta.decode_records is not None:
                meta.decode_records.append((q_dec, lse))
            parts.append(out)
        o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str, window: int = 0):
        super().__init__()
        self.self_attn = PagedAttention(spec, attention, window)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, h, cos, sin, k_cache, v_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, attention, spec.window(kind)) for kind in spec.kinds)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class PagedLlama(nn.Module):
    """Llama-family causal LM over a paged KV pool. Submodule names match transformers'."""

    def __init__(self, spec: ModelSpec, attention: str = "auto", rope_scaling: dict | None = None):
        super().__init__()
        if attention not in kernels.BACKENDS:
            raise InputError(f"unknown attention {attention!r} (choose from {', '.join(kernels.BACKENDS)})",
                             field="--attention")
        self.spec = spec
        self.model = Backbone(spec, attention)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(spec.head_dim, spec.rope_theta, rope_scaling),
                             persistent=False)
        self.layer_groups: list[int] | None = None  # bind_kv_groups
        self.layer_planes = list(range(spec.num_layers))
        self.group_windows: list[int] = []

    def bind_kv_groups(self, layer_groups: Sequence[int] | None) -> None:
        """Layer l reads the tables of KV cache group ``layer_groups[l]`` (ForwardInputs.group_metas) and
        keeps its K/V in the planes ``kv_planes`` gives it (a pool made by make_kv_pool with the same
        groups); None: one group, ForwardInputs.meta, a plane pair per layer. ``group_windows``: each
        group's sliding window (0: full attention), its layers' own."""
        n = self.spec.num_layers
        if layer_groups is None:
            self.layer_groups, self.layer_planes, self.group_windows = None, list(range(n)), []
            return
        if len(layer_groups) != n:
            raise ValueError(f"{len(layer_groups)} layer groups for {n} layers")
        windows: dict[int, set[int]] = {}
        for layer, g in zip(self.model.layers, layer_groups):
            windows.setdefault(g, set()).add(layer.self_attn.window)
        if sorted(windows) != list(range(len(windows))) or any(len(w) > 1 for w in windows.values()):
            raise ValueError(f"KV cache groups {list(layer_groups)} do not group layers of one window each")
        self.layer_groups = list(layer_groups)
        self.layer_planes = kv_planes(layer_groups)
        self.group_windows = [windows[g].pop() for g in range(len(windows))]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of positions: int64 [T]; angles in float32, then ``dtype``, as transformers does."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, kv_pool: torch.Tensor) -> torch.Tensor:
        """inputs: T flattened tokens; kv_pool: [2L, NB, BS, Hkv, D] -> float32 logits [N, vocab]
        for the rows in inputs.meta.sample_indices."""
        return self.logits(self.hidden(inputs, kv_pool))

    @torch.inference_mode()
    def hidden(self, inputs: ForwardInputs, kv_pool: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states of the sampled rows, [N, hidden]: the part a CUDA graph
        captures (its output is small; the vocabulary-wide logits are computed after it)."""
        h = self.model.embed_tokens(inputs.input_ids)  # [T, hidden]
        cos, sin = self.rope(inputs.positions, h.dtype)
        groups, metas = self.layer_groups, inputs.group_metas
        if (groups is None) != (metas is None):
            raise ValueError("a model bound to KV cache groups takes each group's metadata (build_inputs's "
                             "group_windows), and only such a model does")
        for i, layer in enumerate(self.model.layers):
            meta = inputs.meta if groups is None or metas is None else metas[groups[i]]
            p = self.layer_planes[i]
            h = layer(h, cos, sin, kv_pool[2 * p], kv_pool[2 * p + 1], meta)
        return self.model.norm(h[inputs.meta.sample_indices])

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(h).float()


# Most bytes of attention weights the statistics pass holds at once ([rows, Hkv, max_len] float32 of one
# layer): all layers of a 256-sequence, 8k-context Llama-3-8B step at once would be 2 GB.
STATS_CHUNK_BYTES = 64 << 20


def _layer_weights(model: PagedLlama, kv_pool: torch.Tensor, meta: AttentionMetadata, layer: int,
                   rows: slice) -> torch.Tensor:
    """Layer ``layer``'s decode attention weights of decode rows ``rows`` -> float32 [R, Hkv, max_decode_len]."""
    q, lse = meta.decode_records[layer]
    attn = model.model.layers[layer].self_attn
    kept = None if meta.decode_kept is None else meta.decode_kept[rows]
    return kernels.attention_weights(q[rows], kv_pool[2 * layer], meta.decode_block_tables[rows],
                                     meta.decode_seq_lens[rows], lse[rows], attn.scale, meta.max_decode_len,
                                     kept, backend=attn.backend)


def _check_records(model: PagedLlama, meta: AttentionMetadata) -> None:
    if model.layer_groups is not None:
        raise ValueError("attention statistics read one block table per sequence, not a table per KV cache group")
    if not meta.decode_records:
        raise ValueError("the forward did not record decode lse: set meta.decode_records = [] before it")


def decode_attention_stats(model: PagedLlama, kv_pool: torch.Tensor, meta: AttentionMetadata,
                           rows: slice = slice(None)) -> torch.Tensor:
    """Attention weight of each decode query (rows ``rows`` of the step's decodes) on each cached position,
    per layer and KV group, recomputed from the lse the forward recorded (meta.decode_records) without a
    full attention matrix in the forward.

    -> float32 [L, R, Hkv, max_decode_len]: each entry sums the probabilities of the group's query heads.
    Memory grows with L x R: for many rows use decode_attention_totals.
    """
    _check_records(model, meta)
    return torch.stack([_layer_weights(model, kv_pool, meta, i, rows) for i in range(len(meta.decode_records))])


def decode_attention_totals(model: PagedLlama, kv_pool: torch.Tensor, meta: AttentionMetadata,
                            chunk_bytes: int = STATS_CHUNK_BYTES) -> torch.Tensor:
    """Each decode's attention weight per cached position summed over all query heads and averaged over
    layers (what H2O accumulates) -> float32 [D, max_decode_len].

    Layer by layer over chunks of rows, so at most ``chunk_bytes`` of per-group weights exist at once
    (one row's worth when a single row is larger)."""
    _check_records(model, meta)
    n, width = meta.decode_seq_lens.shape[0], meta.max_decode_len
    hkv = kv_pool.shape[3]
    total = torch.zeros(n, width, dtype=torch.float32, device=kv_pool.device)
    step = max(1, chunk_bytes // max(1, hkv * width * 4))
    for lo in range(0, n, step):
        rows = slice(lo, min(n, lo + step))
        for i in range(len(meta.decode_records)):
            total[rows] += _layer_weights(model, kv_pool, meta, i, rows).sum(1)
    return total / len(meta.decode_records)


# ---------------------------------------------------------------------------------------------
# Weights


# The attention a random initialisation is given (init_random), in logits (q.k / sqrt(d)).
LOCAL_SLOPE = 2.0  # local heads: logit falls by this per e-fold of distance (weight ~ distance^-2)
HEAVY_STD = 2.0  # local heads: std of a token's persistent key bias (its heavy-hitter score)
RETRIEVAL_LOGIT = 16.0  # retrieval heads: logit of a key holding the query's own token
RETRIEVAL_SPAN = 2048  # tokens over which a retrieval match holds (rotation of its dims < 1 rad)
QK_NOISE = 0.05  # plain random part of the query and key projections (std x sqrt(hidden))
RETRIEVAL_MIN_DIMS = 16  # fewer position-free dims than this: no retrieval heads (matches too noisy)
WRITE_FAN_IN, WRITE_DEPTH = 344, 2  # o_proj/down_proj keep std 0.02 up to this fan-in (tiny's MLP) and depth


@torch.no_grad()
def init_random(model: PagedLlama, seed: int) -> None:
    """Random weights from ``seed`` whose attention behaves like a trained model's.

    Matrices N(0, 0.02), biases N(0, 0.02), norm scales 1 + N(0, 0.1) (not 1 and 0, so that a
    misplaced one changes the logits and the selfcheck sees it); then embeddings and the query and
    key projections are set by ``_shape_attention`` so that token eviction has what it meets in real
    models: plain random projections give a narrow model near-uniform attention, and wider random
    ones give spikes on arbitrary tokens that move with every query, so no policy can be judged."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    # The projections that write into the residual stream are scaled down with width and depth so
    # that, as in ``tiny``, what every layer adds stays small next to the embeddings: the structure
    # below is built on the embedding and must reach the last layer of a wide, deep preset too.
    depth = min(1.0, math.sqrt(WRITE_DEPTH / model.spec.num_layers))
    for name, p in sorted(model.named_parameters()):  # shared (tied) weights appear once
        if name.endswith("norm.weight"):
            p.normal_(0.0, 0.1, generator=gen).add_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.normal_(0.0, 0.02 * depth * min(1.0, math.sqrt(WRITE_FAN_IN / p.shape[1])), generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    _shape_attention(model, gen)


def _unit_rows(gen: torch.Generator, n: int, m: int, away: torch.Tensor | None = None) -> torch.Tensor:
    """n random unit vectors of R^m (float32, on gen's device), orthogonal to the unit vector ``away``."""
    w = torch.randn(n, m, generator=gen, device=gen.device)
    if away is not None:
        w -= torch.outer(w @ away, away)
    return w / w.norm(dim=1, keepdim=True)


def _shape_attention(model: PagedLlama, gen: torch.Generator) -> None:
    """Embeddings and q/k projections with the head types trained models show.

    Every embedding is a shared direction u plus an equally long token part orthogonal to it (after
    RMSNorm: u-component sqrt(hidden/2) for every token; token part of unit-vector projections
    ~N(0, 1/2)). The rotary pairs of a head split in two: those that turn less than 1 rad over
    RETRIEVAL_SPAN tokens are position-free, the faster ones carry position. Each KV head (with its
    query heads) is one of two kinds, alternating by head and layer:
    - local: q and k put u on every position pair, so the logit is LOCAL_SLOPE x sum of cos(w_i x
      distance) x ln of the frequency step — about LOCAL_SLOPE x ln(1/distance) plus a constant: a
      recent window with a power-law tail; and one position-free pair pairs u in the query with a
      fixed token direction v in the key: a per-token bias ~N(0, HEAVY_STD) that every query sees,
      the persistent heavy hitters of H2O (and its attention sinks, whichever tokens they fall on);
    - retrieval: q and k both project the token part onto the other position-free pairs by the same
      random matrix, so a key holding the query's own token scores RETRIEVAL_LOGIT and any other
      ~N(0, RETRIEVAL_LOGIT / sqrt(dims)): the head attends to the query itself, and splits with
      an earlier copy of its token when there is one — the re-reading of copy/retrieval heads
      (Olsson et al. 2022; Wu et al. 2024), which is what punishes permanent eviction when an
      answer quotes its context and what InfiniGen's recall recovers.
    Within RETRIEVAL_SPAN the position-free pairs keep most of their match (cos 1 rad = 0.54 at the
    span's end); beyond it, matches fade. With fewer than RETRIEVAL_MIN_DIMS position-free dims
    (a low rope theta or a small head) every head is local. The residual stream stays dominated by
    the embeddings (init_random scales the projections that write into it), so every layer, up to
    the last of a 32-layer preset, sees the same structure."""
    spec = model.spec
    dev = gen.device
    hidden, d, half = spec.hidden_size, spec.head_dim, spec.head_dim // 2
    sd = math.sqrt(d)
    inv = model.inv_freq.float().cpu()
    free = [i for i in range(half) if float(inv[i]) * RETRIEVAL_SPAN < 1.0]
    pos_pairs = [i for i in range(half) if i not in free]
    u = _unit_rows(gen, 1, hidden)[0]
    v = _unit_rows(gen, 1, hidden, u)[0]
    if not free or hidden < 2 * len(free) + 2:  # a low rope theta: every pair turns fast
        free, pos_pairs = [], list(range(half))
    hh, ret = (free[-1], free[:-1]) if free else (None, [])
    r = 2 * len(ret)
    if r < RETRIEVAL_MIN_DIMS:
        log.warning("%s: %d position-free rotary dims, too few for retrieval heads: every head is local",
                    spec.name, r)
        ret, r = [], 0
    # the retrieval subspace: r orthonormal directions orthogonal to u
    basis = torch.linalg.qr(_unit_rows(gen, r, hidden, u).T)[0] if r else None  # [hidden, r]
    share = r / (hidden - 1)  # of a token part's squared length, what lies in the retrieval subspace
    emb = model.model.embed_tokens.weight
    for lo in range(0, emb.shape[0], 8192):  # in chunks: a 128k vocabulary at once is GBs of float32
        z = _unit_rows(gen, min(8192, emb.shape[0] - lo), hidden, u)
        if basis is not None:  # every token gets the same length in the subspace: exact self-matches
            zb = z @ basis  # [n, r]
            rest = z - zb @ basis.T
            z = (rest / rest.norm(dim=1, keepdim=True) * math.sqrt(1 - share)
                 + (zb / zb.norm(dim=1, keepdim=True) * math.sqrt(share)) @ basis.T)
        emb[lo:lo + len(z)] = ((z + u) * math.sqrt(hidden)).to(emb.dtype)
    # after RMSNorm a token is (z + u) sqrt(hidden / 2): u-component x_u, token part of norm x_u
    x_u = math.sqrt(hidden / 2)
    s_tok = math.sqrt(0.5)  # std of the token part along a direction orthogonal to u
    step = math.log(float(inv[0]) / float(inv[1]))
    a = math.sqrt(LOCAL_SLOPE * step * sd) / x_u  # per position pair: a^2 x_u^2 / sqrt(d) = slope x step
    b = HEAVY_STD * sd / (x_u * s_tok)
    g = math.sqrt(RETRIEVAL_LOGIT * sd / share) / x_u if r else 0.0  # g^2 |token part in it|^2 / sqrt(d)
    ret_rows = torch.tensor(ret + [i + half for i in ret], device=dev)
    for li, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        hq, hkv = attn.num_heads, attn.num_kv_heads
        wq = torch.randn(hkv, hq // hkv, d, hidden, generator=gen, device=dev) * (QK_NOISE / math.sqrt(hidden))
        wk = torch.randn(hkv, d, hidden, generator=gen, device=dev) * (QK_NOISE / math.sqrt(hidden))
        for h in range(hkv):
            if not r or (h + li) % 2 == 0:  # local
                wq[h, :, pos_pairs] += a * u
                wk[h, pos_pairs] += a * u
                if hh is not None:
                    wq[h, :, hh] += b * u
            else:  # retrieval
                rot, _ = torch.linalg.qr(torch.randn(r, r, generator=gen, device=dev))
                proj = g * (rot @ basis.T)  # a head of its own, the same matches
                wq[h, :, ret_rows] += proj
                wk[h, ret_rows] += proj
            if hh is not None:
                wk[h, hh] += v
        attn.q_proj.weight.copy_(wq.reshape(hq * d, hidden))
        attn.k_proj.weight.copy_(wk.reshape(hkv * d, hidden))


def rope_from_config(folder: str) -> tuple[float | None, dict | None]:
    """(rope_theta, rope scaling) from a model folder's config.json, in either transformers 4 style
    (``rope_theta`` + ``rope_scaling``) or 5 style (``rope_parameters``)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return (float(theta) if theta is not None else None), scaling


@torch.no_grad()
def load_weights(model: PagedLlama, folder: str) -> None:
    """Copy a Hugging Face folder's *.safetensors tensors into the model (names as in transformers)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise InputError("no *.safetensors weights in the model folder", file=folder)
    params = dict(model.named_parameters())  # tied lm_head is absent here: it is embed_tokens
    seen = set()
    for f in files:
        with safe_open(os.path.join(folder, f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name not in params:
                    if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                        continue
                    if "rotary_emb" in name:
                        continue
                    raise InputError(f"unexpected tensor {name!r} (not a Llama-family checkpoint?)", file=f)
                t = st.get_tensor(name)
                if t.shape != params[name].shape:
                    raise InputError(f"tensor {name!r} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(params[name].shape)}", file=f)
                params[name].copy_(t)
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise InputError(f"weights missing from the folder: {', '.join(missing[:5])}", file=folder)


# Architectures (a config's model_type) whose sliding-window layers this forward computes as transformers
# does: Llama-family layers with a window per layer (Mistral's on every layer; Ministral's and Qwen2's
# per ``layer_types``). Another architecture's windowed layers (Gemma's, gpt-oss's) differ beyond the window.
SLIDING_ARCHITECTURES = ("llama", "mistral", "ministral", "qwen2")


def check_runnable(spec: ModelSpec) -> None:
    """Refuse a shape this forward would silently run as another model: it computes dense Llama-family
    layers of full or sliding-window attention from unquantized weights."""
    why = []
    other = [k for k in dict.fromkeys(spec.kinds) if k not in ("full", "sliding")]
    if other:
        why.append(f"{spec.describe_layers()} attention layers ({' and '.join(other)} attention is not implemented "
                   "in its forward)")
    elif "sliding" in spec.kinds and spec.architecture not in SLIDING_ARCHITECTURES:
        why.append(f"{spec.describe_layers()} attention layers of a {spec.architecture} model (its sliding-window "
                   f"layers are run for {', '.join(SLIDING_ARCHITECTURES)} only)")
    if spec.quant is not None:
        why.append(f"{spec.quant.method} quantized weights")
    if why:
        raise InputError(f"{spec.name} has {' and '.join(why)}; the model executor runs dense, unquantized "
                         "Llama-family models of full and sliding-window attention only: use --executor sim",
                         field="--model")


def build_model(model: str | ModelSpec = "tiny", device: torch.device | str = "cpu", seed: int = 0,
                attention: str = "auto", dtype: torch.dtype | None = None) -> PagedLlama:
    """A preset name, a ModelSpec, or a Hugging Face folder (its safetensors weights are loaded).
    Presets and specs are random-initialised from ``seed``; parameters are allocated once, on ``device``."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    check_runnable(spec)
    folder = model if isinstance(model, str) and os.path.isdir(model) else None
    scaling = None
    if folder:
        theta, scaling = rope_from_config(folder)
        if theta is not None:
            spec = replace(spec, rope_theta=theta)
    with torch.device("meta"):
        net = PagedLlama(spec, attention, scaling)
    net = net.to(dtype).to_empty(device=device)
    if spec.tie_word_embeddings:  # to_empty gives each module its own tensor: tie again
        net.lm_head.weight = net.model.embed_tokens.weight
    # to_empty leaves the float32 rotary buffer uninitialised: recompute it.
    net.inv_freq = rope_inv_freq(spec.head_dim, spec.rope_theta, scaling).to(device)
    if folder and any(f.endswith(".safetensors") for f in os.listdir(folder)):
        load_weights(net, folder)
    else:
        init_random(net, seed)
    return net.eval()
