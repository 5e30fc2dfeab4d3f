"""The sim executor: a per-operation roofline of one engine step, on a GPU preset or a calibration.

A step costs, per GPU, the sum over its operations of max(FLOPs / rate, bytes / bandwidth), plus the
fixed costs real engines pay per step, per scheduled sequence and (without CUDA graphs) per layer.
With tensor parallelism (--tp N) every GPU does 1/N of the work at the same time, so the figures
below are one GPU's. No tokens are produced: the memory behaviour is the engine's, identical to the
model executor's.

Mode. The defaults model vLLM's GPU default: decode under CUDA graphs, no kernel launched one by one;
their fixed costs were fitted to vLLM V1 runs, most of them from before async scheduling (the
scheduler's work for the next step overlapped with this one's forward) became the default, so they
are what those runs left on the critical path. ``--eager`` (vLLM's --enforce-eager) launches every
layer's kernels from the host: each step pays L x layer_overhead_s more.

Symbols (the model's shape; the step's StepBatch):
  L layers, h hidden size, Hq query heads, Hkv KV heads, d head dim, I MLP intermediate size, V vocab;
  MoE: E experts of intermediate size Ie, k of them per token, shared experts of size Is (0: none) in
  each of L_moe layers, the other L - L_moe layers dense (DeepSeek's first layers, Llama 4's interleaving)
  bw, bkv   bytes per weight and per KV element (bf16 2, fp8 1, fp32 4); a quantized checkpoint's
            covered weights (ModelSpec.quant) at their own bytes, scales included
  bc        bytes of the dtype activations are computed in (bf16 under fp8 weights); fp8 checkpoints
            keep the embedding and LM head in it too
  N = --tp; hq = Hq / N; hkv = Hkv / N, or 1 when N > Hkv (every GPU holds a replica, as vLLM does)
  prefill chunk i: n_i new tokens after s_i cached ones (a prefix hit or earlier chunks)
  decode j: c_j keys (its own included)
  T = sum_i n_i + #decodes (tokens computed);  S = #decodes + #chunks that end their prompt (sampled)
  kv = 2 L hkv d bkv (bytes of one token's K and V on one GPU): the sum of ModelSpec.kv_layers(bkv, N);
       an MLA layer keeps one latent of r + p values on every GPU (r kv_lora_rank, p qk_rope_head_dim)
  Layer kinds: each kind g (full, sliding window W, chunked C, mla) over its L_g layers, its kv_g (so
  kv = sum_g kv_g); a query at position q sees keys_g(q): q + 1 (full, mla), min(q + 1, W) (sliding),
  q mod C + 1 (chunked, position // C * C onward). model_config.AttnGroup derives MLA's FLOPs.

Weights per GPU, in elements (the embedding table is not one: a step gathers only its T rows):
  W_attn = h hq d + 2 h hkv d + hq d h                  Q, K, V, O of one layer
  W_mlp(e) = 3 h I / N                                  dense
           = 3 h Ie e / N + (3 h Is + h) / N + h E       MoE with e experts (+ shared expert and Qwen's
                                                         gate, router); MLA's W_attn: ModelSpec.attn_weights
  W_head = h V / N                                      LM head, split over the vocabulary

Operations: FLOPs and bytes per GPU -> time = max(FLOPs / rate, bytes / bandwidth):
  linear     2 T L (W_attn + W_mlp(k))    |  bw L (W_attn + W_mlp(E_T))      matmul_flops | mem_bw
             E_T = E (1 - (1 - k/E)^T): experts T tokens touch under uniform routing (dense: W_mlp);
             summed over MoE and dense layers; quantized weights read at their bytes (matmul_flops: an
             fp8 checkpoint's fp8 rate, MXFP4 and int4 multiplied at bf16's)
  prefill    per chunk: 4 L hq d (n_i s_i + n_i (n_i + 1) / 2)  |  kv (s_i + n_i)   attn_i | kv_bw
             attn_i = attn_flops (1 - exp(-(2 s_i + n_i) / attn_ramp_tokens)): FlashAttention's rate on a
             causal span, rising with it (presets.ATTN_RAMP_TOKENS; a calibration's 0: attn_flops)
             per kind: 4 L_g hq d x sum of keys_g over the chunk's queries | kv_g x keys the chunk
             reads (sliding: min(s_i + n_i, n_i + W - 1); chunked: from s_i // C * C)
  decode     per sequence: 4 L hq d c_j  |  kv c_j                                 attn_flops | kv_bw
             per kind: 4 L_g hq d keys_g(c_j - 1)  |  kv_g keys_g(c_j - 1)
             (every decode has the same FLOPs per byte, so the sum of their maxes is one max of sums)
  lm_head    2 S W_head  |  bc W_head, in steps that sample (S > 0)            matmul_flops | mem_bw
  kv_write   bytes only: kv T (new K/V) + bc T h (embedding rows)
             + 2 kv (block_size x copy-on-write copies + compaction slot moves)       kv_bw
  allreduce  N > 1: two per layer of the step's activations (T h bc bytes), ring:
             2 L (allreduce_latency_s + 2 (N - 1) / N x T h bc / link_bw)
  overhead   step_overhead_s + seq_overhead_s x Q     (Q = #chunks + #decodes: sequences scheduled)
  recurrent  Mamba / Gated DeltaNet layers (L_s of them, ModelSpec.mamba_type): their projections are
             W_attn's share for those layers (ModelSpec.mixer_weights averages the two kinds); each token
             updates the state, 6 x its SSM elements per layer (ModelSpec.state_flops), priced as
             attention; each prefill chunk and each decode reads and writes the sequence's state once:
             2 x state bytes over the L_s layers (ModelSpec.state_bytes)                 kv_bw
  front end  not a step's: each request request_s + request_token_s x its prompt in the API server, one
             at a time, then request_latency_s (holding no other request) before the scheduler sees it
             (engine.issuer.FrontEnd; --no-front-end: none)
  launch     --eager only: L x layer_overhead_s
  per_token  prefill_token_s x sum_i n_i + decode_seq_s x #decodes + context_token_s x sum_j c_j
             + prefill_seq_s x #chunks
             (a linear fit of a live server's steps; 0 on a GPU preset)
  pcie       InfiniGen offload and recall: batch.pcie_bytes / (N pcie_bw), not overlapped
  tiers      prefix-cache tiers (kvbench.memory.tiers), one block of kv x block_size x N bytes per op,
             at the slower end's bandwidth (--cpu-bw, --disk-bw: the replica's links, its GPUs together):
             loads and write-backs before the forward add to the step; write-through stores overlap
             it, so the step takes max(the rest + loads + write-backs, stores)
Units: FLOPs, bytes, seconds; rates in FLOP/s, bandwidths in bytes/s (per GPU, per direction for
links). Biases and norms are left out of the FLOPs (under 0.1% of a layer's).

Memory per GPU (GB = 10^9 bytes, as vendors state it):
  weights     bw (L (W_attn + W_mlp(E) + 2 h) + h) + bc (h V / N (embedding) + W_head (untied))
  activations bc M (2 h + 3 I_tok / N) + 4 min(M, max_num_seqs) V   (M = --max-batched-tokens;
              I_tok = I, or k Ie + Is for MoE, the larger where both kinds of layer are; the fp32
              logits of the sampled rows)
  free        0.9 x memory - weights - activations (vLLM's gpu_memory_utilization)
The default KV pool is N x free bytes, each token taking N x kv of them (a replicated KV head is paid
for on every GPU). Weights and activations that do not fit, or a --kv-mem over N x free, are an
InputError naming the fix (--tp, --kv-mem, a bigger --gpu).

The coefficients (CostModel) come from the --gpu preset (datasheet peaks x the efficiencies and
overheads kvbench.executors.presets fitted to published measurements; fp8 weights at the fp8
tensor-core rate, --dtype fp8), or from a calibration file (version 3) whose "coefficients" replace the
preset's: written by ``kvbench calibrate`` (the rates and one overhead for whole steps), or a linear
fit of a live server (the rates null: no roofline term; step_overhead_s and the per-token terms). A
versioned file (1, 2 and 3 are read) prices whole steps: an overhead or linear term it does not give is
0; rates, link and PCIe terms it does not give are the preset's. A file without a version replaces only
the coefficients it gives.

A calibration file may instead hold a plain linear clock, ``{"kind": "linear",
"prefill_ms_per_token": 0.1, "decode_step_ms": 20, "overhead_ms": 0}``: a step costs the overhead,
plus that much per prefill token, plus the decode cost if it carries any decode. It puts kvbench on
the same clock as another engine's scheduler driven without a model, to compare schedules step by step.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, fields

import numpy as np

from kvbench.errors import InputError
from kvbench.executors.clock import LinearClock
from kvbench.executors.model_config import WEIGHT_KINDS
from kvbench.executors.presets import (
    DTYPE_BYTES,
    GPU_MEMORY_UTILIZATION,
    GPUSpec,
    ModelSpec,
    compute_dtype,
)
from kvbench.memory.specs import LayerKV
from kvbench.memory.tiers import op_seconds
from kvbench.scheduler.batch import StepBatch, StepResult

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 3
OPERATIONS = ("linear", "prefill", "decode", "lm_head", "kv_write", "allreduce", "overhead", "launch", "per_token",
              "pcie")


@dataclass(slots=True)
class CostModel:
    """The coefficients of a step's time on one GPU (the module docstring's table). A rate or bandwidth
    may be infinite: that operation then costs nothing beyond the linear terms (a linear fit)."""

    # Roofline rates: a datasheet peak x the share of it the operation reaches (presets: fitted).
    matmul_flops: float  # FLOP/s of the linear layers and LM head: GEMM tiles, epilogues and waves leave the peak
    attn_flops: float  # FLOP/s of attention (QK^T, PV): softmax and masking between the two GEMMs stall them
    mem_bw: float  # bytes/s reading weights: a small batch's GEMV streams HBM below its pin rate
    kv_bw: float  # bytes/s reading and writing KV: block-table gathers of 16-token blocks
    step_overhead_s: float  # per step: what stays on the critical path (sampling, graph launch, copies)
    link_bw: float  # GPU-to-GPU bytes/s per direction (all-reduce)
    allreduce_latency_s: float  # fixed cost of one all-reduce (launch, handshake)
    pcie_bw: float  # host<->device bytes/s (KV offload)
    layer_overhead_s: float = 0.0  # per layer per step without CUDA graphs (--eager): kernel launches
    seq_overhead_s: float = 0.0  # per scheduled sequence per step: its inputs, sampling and output
    # Linear terms, as a live server's steps are fitted: per prefill token, per decoding sequence and
    # per key a decode reads (0 on a GPU preset: its roofline prices that work).
    prefill_token_s: float = 0.0
    decode_seq_s: float = 0.0
    context_token_s: float = 0.0
    prefill_seq_s: float = 0.0  # per prefill chunk in a step (its own attention call, inputs and metadata)
    # A server's front end (its API process: parsing, hashing, handing the request to the engine), paid
    # by each request before the scheduler sees it, one request at a time (live fits; 0 on a preset).
    request_s: float = 0.0
    request_token_s: float = 0.0
    request_latency_s: float = 0.0  # and then this long to the engine, holding no other request
    # Attention's ramp: a prefill chunk of span S (2 s + n) runs at attn_flops x (1 - exp(-S / this)), the
    # FlashAttention benchmarks' shape (presets.ATTN_RAMP_TOKENS); 0: at attn_flops whatever its length
    # (a calibration's fitted rate).
    attn_ramp_tokens: float = 0.0

    FITTED = ("matmul_flops", "attn_flops", "mem_bw", "kv_bw", "step_overhead_s")  # by kvbench calibrate
    RATES = ("matmul_flops", "attn_flops", "mem_bw", "kv_bw")  # may be infinite (a file's null)
    OVERHEADS = ("step_overhead_s", "layer_overhead_s", "seq_overhead_s")
    LINEAR = ("prefill_token_s", "decode_seq_s", "context_token_s", "prefill_seq_s")
    FRONT_END = ("request_s", "request_token_s", "request_latency_s")
    TIMING = RATES + OVERHEADS + LINEAR  # what times a step (a calibration file's own terms)
    MAY_BE_ZERO = OVERHEADS + LINEAR + FRONT_END + ("allreduce_latency_s", "attn_ramp_tokens")

    @classmethod
    def from_gpu(cls, gpu: GPUSpec, weight_dtype: str = "bf16") -> "CostModel":
        """A preset's coefficients: its datasheet peaks x the fitted efficiencies, its fitted overheads.
        fp8 weights multiply at the fp8 tensor-core rate (bf16 where the GPU has none)."""
        return cls(matmul_flops=gpu.matmul_rate(weight_dtype), attn_flops=gpu.attn_flops, mem_bw=gpu.mem_bw,
                   kv_bw=gpu.kv_bw, step_overhead_s=gpu.step_overhead_s, link_bw=gpu.link_bw,
                   allreduce_latency_s=gpu.allreduce_latency_s, pcie_bw=gpu.pcie_bw,
                   layer_overhead_s=gpu.layer_overhead_s, seq_overhead_s=gpu.seq_overhead_s,
                   request_s=gpu.request_s, request_token_s=gpu.request_token_s,
                   request_latency_s=gpu.request_latency_s,
                   attn_ramp_tokens=gpu.attn_ramp_tokens)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict:
        return {n: getattr(self, n) for n in self.names()}


@dataclass(slots=True)
class Work:
    """One step's FLOPs and bytes per GPU, by operation, and the counts its fixed costs scale with."""

    linear_flops: float = 0.0
    linear_bytes: float = 0.0
    prefill: list[tuple[float, float]] = field(default_factory=list)  # per chunk: (FLOPs, KV bytes)
    prefill_span: list[int] = field(default_factory=list)  # per chunk: 2 s + n (attention's ramp)
    decode_flops: float = 0.0
    decode_bytes: float = 0.0
    lm_head_flops: float = 0.0
    lm_head_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    allreduce_bytes: float = 0.0  # per all-reduce
    allreduces: int = 0
    tp: int = 1
    pcie_bytes: float = 0.0
    launches: int = 0  # layers whose kernels are launched one by one (--eager: every layer; else 0)
    seqs: int = 0  # sequences scheduled: prefill chunks and decodes
    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0  # keys the decodes read, their own included

    def terms(self, c: CostModel) -> tuple[float, ...]:
        """Each operation's time under coefficients ``c``, in OPERATIONS's order."""
        n = self.tp
        ring = 2 * (n - 1) / n * self.allreduce_bytes / c.link_bw if n > 1 else 0.0
        return (
            max(self.linear_flops / c.matmul_flops, self.linear_bytes / c.mem_bw),
            self.prefill_time(c) if self.prefill else 0,
            max(self.decode_flops / c.attn_flops, self.decode_bytes / c.kv_bw),
            max(self.lm_head_flops / c.matmul_flops, self.lm_head_bytes / c.mem_bw),
            self.kv_write_bytes / c.kv_bw,
            self.allreduces * (c.allreduce_latency_s + ring) if self.allreduces else 0.0,
            c.step_overhead_s + self.seqs * c.seq_overhead_s,
            self.launches * c.layer_overhead_s,
            (self.prefill_tokens * c.prefill_token_s + self.decode_seqs * c.decode_seq_s
             + self.context_tokens * c.context_token_s + len(self.prefill) * c.prefill_seq_s),
            self.pcie_bytes / (n * c.pcie_bw) if self.pcie_bytes else 0.0,
        )

    def prefill_time(self, c: CostModel) -> float:
        """The prefill chunks' attention: each at the rate its span reaches (CostModel.attn_ramp_tokens)."""
        r = c.attn_ramp_tokens
        if r <= 0:
            return sum(max(f / c.attn_flops, b / c.kv_bw) for f, b in self.prefill)
        return sum(max(f / (c.attn_flops * -math.expm1(-span / r)), b / c.kv_bw)
                   for (f, b), span in zip(self.prefill, self.prefill_span))

    def seconds(self, c: CostModel) -> dict[str, float]:
        """Each operation's time under coefficients ``c``; the step is their sum."""
        return dict(zip(OPERATIONS, self.terms(c)))

    def time(self, c: CostModel) -> float:
        """The step's time: the terms summed in OPERATIONS's order (as ``seconds``'s values)."""
        return sum(self.terms(c))


_NO_DECODES = np.zeros(0, dtype=np.int64)  # the contexts of a step without windowed layers


class StepCost:
    """A model's shape on N GPUs: the work of a step (``work``) and the memory it needs per GPU."""

    def __init__(self, model: ModelSpec, tp: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                 eager: bool = False):
        m = self.model = model
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InputError(f"must be a whole number >= 1, got {tp!r}", field="--tp")
        if m.num_heads % tp:
            raise InputError(f"{m.name}'s {m.num_heads} query heads do not split over {tp} GPUs "
                             f"(choose a --tp that divides {m.num_heads})", field="--tp")
        self.tp = n = tp
        self.dtypes = (weight_dtype, kv_dtype)
        self.eager = eager
        self.bw, self.bkv = DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype]
        # bytes of the dtype activations are computed in: bf16 under fp8 weights, whose checkpoints
        # (ModelOpt, llm-compressor) also keep the embedding and the LM head in bf16
        self.bc = DTYPE_BYTES[compute_dtype(weight_dtype)]
        # bytes of each kind of weight: a quantized checkpoint's at its bytes, the rest at bw
        q = m.quant
        self.kind_bytes = {k: q.bytes_per_weight if q and k in q.kinds else self.bw for k in WEIGHT_KINDS}
        h = m.hidden_size
        self.hq = m.num_heads // n
        self.hkv = m.kv_heads_per_rank(n)  # vLLM: KV heads divided, or replicated one per GPU
        self.kv_tok = sum(layer.bytes_per_token for layer in m.kv_layers(kv_dtype, n))  # bytes per token per GPU
        self.w_attn = m.mixer_weights(n)  # (attention's, averaged with recurrent layers' where there are some)
        self.w_head = h * m.vocab_size / n
        states = m.num_state_layers  # recurrent layers: a state per sequence read and written each step
        self.state_bytes = states * m.state_bytes(n, compute_dtype(weight_dtype)) if states else 0
        self.state_flops = states * m.state_flops(n) if states else 0.0
        moe = m.moe_layers
        self.layer_classes = [(count, is_moe) for count, is_moe in ((moe, True), (m.num_layers - moe, False))
                              if count]  # (layers, whether their MLP is a MoE)
        self.groups = m.attn_groups(kv_dtype, n)
        self.windowed = any(g.window for g in self.groups)
        active = m.experts_per_token if m.is_moe else 0
        # per class of layer: (layers, weights a token runs through in each)
        self.active_weights = [(count, self.w_attn + self.mlp_weights(active, moe))
                               for count, moe in self.layer_classes]
        self._read_memo: dict[int, float] = {}  # tokens in a step -> bytes of weights it reads

    # -- weights ------------------------------------------------------------------------------
    def mlp_weights(self, experts: float, moe: bool = True) -> float:
        """One layer's MLP weights on one GPU, running ``experts`` experts (dense: the MLP)."""
        return self.model.mlp_weights(experts, self.tp, moe)

    def experts_touched(self, tokens: int) -> float:
        """Experts ``tokens`` tokens touch under uniform routing: E (1 - (1 - k/E)^T)."""
        m = self.model
        if not m.is_moe:
            return 0.0
        return m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens)

    def layer_bytes(self, experts: float) -> float:
        """Bytes of every layer's projections on one GPU, each MoE layer running ``experts`` experts:
        quantized kinds at their bytes, the router at bw."""
        m, b = self.model, self.kind_bytes
        total = 0.0
        for count, moe in self.layer_classes:
            if m.quant is None:  # every weight bw bytes
                total += self.bw * count * (self.w_attn + self.mlp_weights(experts, moe))
                continue
            if moe:
                routed, shared, router = m.mlp_parts(experts, self.tp)
                mlp = b["experts"] * routed + b["shared_experts"] * shared + self.bw * router
            else:
                mlp = b["mlp"] * self.mlp_weights(0, moe=False)
            total += count * (b["attn"] * self.w_attn + mlp)
        return total

    def weight_bytes(self) -> float:
        """Weights held by one GPU: every layer (all experts), embedding, LM head (unless tied), norms."""
        m, h = self.model, self.model.hidden_size
        emb = h * m.vocab_size / self.tp
        norms = self.bw * (m.num_layers * m.norm_weights() + h)
        return self.layer_bytes(m.num_experts) + norms + self.bc * (emb + (0 if m.tie_word_embeddings else self.w_head))

    def activation_bytes(self, max_batched_tokens: int, max_num_seqs: int) -> float:
        """Peak activations of the largest step on one GPU (see the module docstring)."""
        m, h = self.model, self.model.hidden_size
        inter = max(m.experts_per_token * m.moe_intermediate_size + m.shared_expert_intermediate_size
                    if moe else m.intermediate_size for _, moe in self.layer_classes)
        tokens = max_batched_tokens
        return (self.bc * tokens * (2 * h + 3 * inter / self.tp)
                + 4 * min(tokens, max_num_seqs) * m.vocab_size)

    def sequence_kv_bytes(self, tokens: int, max_batched_tokens: int) -> int:
        """KV bytes one GPU holds for one sequence of ``tokens`` at most: a sliding layer keeps its
        window and the step's new tokens, a chunked one its chunk and them (vLLM's
        max_memory_usage_bytes, without the block rounding)."""
        return sum(g.kv * g.tokens_held(tokens, max_batched_tokens) for g in self.groups) + self.state_bytes

    # -- one step -----------------------------------------------------------------------------
    def work(self, batch: StepBatch) -> Work:
        m, kv, groups = self.model, self.kv_tok, self.groups
        w = Work(tp=self.tp, pcie_bytes=float(batch.pcie_bytes), launches=m.num_layers if self.eager else 0)
        n_pre = 0
        for start, n in zip(batch.prefill_starts, batch.prefill_lens):
            n_pre += n
            flops, read = 0.0, 0
            for g in groups:
                f, b = g.prefill(start, n)
                flops += f
                read += b
            if self.state_bytes:
                flops += self.state_flops * n
                read += 2 * self.state_bytes
            w.prefill.append((flops, read))
            w.prefill_span.append(2 * start + n)
        ctx = batch.decode_context_total()
        contexts = np.asarray(batch.decode_slots or batch.decode_positions, dtype=np.int64) + 1 if self.windowed \
            else _NO_DECODES
        flops, read = 0.0, 0
        for g in groups:
            keys = g.decode_keys(contexts, ctx)
            flops += g.decode_pair * keys
            read += g.kv * keys
        if self.state_bytes:
            d = len(batch.decode_positions)
            flops += self.state_flops * d
            read += 2 * self.state_bytes * d
        w.decode_flops, w.decode_bytes = flops, float(read)
        w.prefill_tokens, w.decode_seqs, w.context_tokens = n_pre, len(batch.decode_positions), ctx
        w.seqs = len(batch.prefill_lens) + w.decode_seqs
        t = n_pre + len(batch.decode_positions)
        if t:
            flops = 0.0
            for count, weights in self.active_weights:
                flops += 2.0 * t * count * weights
            w.linear_flops = flops
            weights_read = self._read_memo.get(t)
            if weights_read is None:
                weights_read = self._read_memo[t] = self.layer_bytes(self.experts_touched(t))
            w.linear_bytes = weights_read
        sampled = len(batch.decode_positions) + sum(batch.prefill_last)
        if sampled:
            w.lm_head_flops, w.lm_head_bytes = 2.0 * sampled * self.w_head, self.bc * self.w_head
        moved = len(batch.copies) * batch.block_size
        if batch.slot_moves is not None:  # compaction after token eviction
            moved += len(batch.slot_moves[0])
        w.kv_write_bytes = float(kv * t + self.bc * t * m.hidden_size + 2 * kv * moved)
        if self.tp > 1 and t:
            w.allreduces, w.allreduce_bytes = 2 * m.num_layers, float(t * m.hidden_size * self.bc)
        return w


# -- calibration files ---------------------------------------------------------------------------
# Top-level keys of a calibration file (kvbench calibrate writes them all; only coefficients is needed).
CALIBRATION_KEYS = ("kvbench_calibration", "kvbench_version", "device_name", "dtype", "model", "model_spec",
                    "coefficients", "fit", "points", "grid", "seconds")
SHAPE_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "vocab_size", "num_experts", "experts_per_token", "moe_intermediate_size",
              "shared_expert_intermediate_size")


def read_calibration(path: str) -> dict:
    if not os.path.exists(path):
        raise InputError("no such file", file=path, field="--calibration")
    try:
        with open(path, encoding="utf-8") as fh:
            c = json.load(fh)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read calibration: {e}", file=path, field="--calibration") from None
    if not isinstance(c, dict):
        raise InputError(f"must be a JSON object, not a {type(c).__name__}", file=path, field="--calibration")
    return c


def cost_from_calibration(c: dict, path: str, base: CostModel) -> CostModel:
    """``base`` with the file's coefficients in place of its own. A file with a version was fitted to
    whole steps: an overhead or linear term it does not give is 0 (versions 1 and 2 had only the per-step
    overhead), its rates, links and PCIe default to ``base``'s; in version 3 a rate may be null (infinite:
    no roofline term). A file without a version replaces only the coefficients it gives."""
    unknown = sorted(set(c) - set(CALIBRATION_KEYS))
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r} (a calibration file holds {', '.join(CALIBRATION_KEYS)}, "
                         "or is a linear clock with \"kind\": \"linear\")", file=path, field="--calibration")
    version = c.get("kvbench_calibration")
    if version is not None and version not in range(1, CALIBRATION_VERSION + 1):
        raise InputError(f"unknown version {version!r} (this kvbench reads 1 to {CALIBRATION_VERSION})", file=path,
                         field="kvbench_calibration")
    coef = c.get("coefficients")
    if not isinstance(coef, dict):
        raise InputError("needs an object \"coefficients\" (run kvbench calibrate to write one)", file=path,
                         field="coefficients")
    bad = sorted(set(coef) - set(CostModel.names()))
    if bad:
        raise InputError(f"unknown coefficient {bad[0]!r} (known: {', '.join(CostModel.names())})", file=path,
                         field="coefficients")
    for name in ("model", "device_name", "dtype", "kvbench_version"):
        if name in c and c[name] is not None and not isinstance(c[name], str):
            raise InputError(f"must be a string, got {c[name]!r}", file=path, field=name)
    if c.get("dtype") is not None and c["dtype"] not in DTYPE_BYTES:
        raise InputError(f"unknown dtype {c['dtype']!r} (one of {', '.join(DTYPE_BYTES)})", file=path, field="dtype")
    if "model_spec" in c and not isinstance(c["model_spec"], dict):
        raise InputError("must be an object", file=path, field="model_spec")
    out = CostModel(**base.to_dict())
    if version is not None:
        for name in CostModel.OVERHEADS + CostModel.LINEAR + CostModel.FRONT_END:
            setattr(out, name, 0.0)
    if version == 1:  # one rate and one bandwidth for every operation
        coef = {**coef, "attn_flops": coef.get("matmul_flops", base.attn_flops),
                "kv_bw": coef.get("mem_bw", base.kv_bw)}
    if "attn_flops" in coef:  # a measured attention rate is its own, flat unless the file gives a ramp
        out.attn_ramp_tokens = 0.0
    for name, v in coef.items():
        if v is None and name in CostModel.RATES and version not in (1, 2):
            setattr(out, name, math.inf)
            continue
        zero_ok = name in CostModel.MAY_BE_ZERO
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                or (v == 0 and not zero_ok)):
            want = "a finite number >= 0" if zero_ok else "a finite number > 0"
            if name in CostModel.RATES and version not in (1, 2):
                want += " (or null: no roofline term)"
            raise InputError(f"must be {want}, got {v!r}", file=path, field=name)
        setattr(out, name, float(v))
    return out


def calibration_mismatches(c: dict, model: ModelSpec, gpu: GPUSpec, kv_dtype: str) -> list[str]:
    """What a calibration was measured on that this replay differs from (each a warning)."""
    from kvbench import __version__

    out = []
    spec = c.get("model_spec")
    if isinstance(spec, dict):
        diff = [k for k in SHAPE_KEYS if k in spec and spec[k] != getattr(model, k)]
        if diff:
            out.append(f"measured on model {c.get('model') or '?'} whose {', '.join(diff)} differ from "
                       f"{model.name}'s: its coefficients may not carry over")
    device = c.get("device_name")
    if device and gpu.name.lower() not in str(device).lower():
        out.append(f"measured on {device}, not a {gpu.name}: the file's coefficients time the steps, "
                   f"--gpu {gpu.name} sets only the memory size and link bandwidths")
    if c.get("dtype") and kv_dtype != "auto" and kv_dtype != c["dtype"]:
        out.append(f"measured with {c['dtype']} KV, this replay models {kv_dtype} (--kv-dtype)")
    if c.get("kvbench_version") and c["kvbench_version"] != __version__:
        out.append(f"written by kvbench {c['kvbench_version']}, this is {__version__}: run kvbench calibrate again")
    return out


# GPUs on which vLLM 0.34's Gated DeltaNet prefill is FlashInfer's, which exports the state at the prompt's
# last block boundary itself (vLLM _resolve_gdn_prefill_backend: SM90; Blackwell only with CUDA 13 builds,
# not assumed here): there the prompt's last chunk runs to its end in one step (kvbench.memory.hybrid).
STATE_CHECKPOINT_GPUS = ("h100", "h200", "h20")


# -- the executor --------------------------------------------------------------------------------
class SimExecutor:
    name = "sim"
    needs_tokens = False
    speculate = None  # InfiniGen's look-ahead needs a model: the sim's synthetic attention scores instead

    def __init__(self, model: ModelSpec, cost: CostModel, gpu: GPUSpec, tp: int = 1, kv_dtype: str = "bf16",
                 weight_dtype: str = "bf16", max_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 eager: bool = False):
        self.model, self.cost, self.gpu = model, cost, gpu
        self.clock: LinearClock | None = None  # a linear clock replaces the roofline when given
        self.tier_bw: dict[str, float] = {}  # bytes/s per tier behind the pool (bind_tiers)
        self._recompute_memo: dict[tuple[int, int, int], float] = {}
        self.kv_dtype = kv_dtype
        self.shape = StepCost(model, tp, weight_dtype, kv_dtype, eager)
        self.tp = tp
        self.weights_per_gpu = self.shape.weight_bytes()
        self._act_args = (max_batched_tokens, max_num_seqs)
        self.activations_per_gpu = self.shape.activation_bytes(*self._act_args)
        self.usable_per_gpu = gpu.mem_bytes * GPU_MEMORY_UTILIZATION
        self.free_per_gpu = self.usable_per_gpu - self.weights_per_gpu - self.activations_per_gpu
        self.device_name = f"sim:{gpu.name}" + (f"x{tp}" if tp > 1 else "") + (" (eager)" if eager else "")
        if self.free_per_gpu <= 0:
            raise InputError(self._does_not_fit(), field="--tp")

    @property
    def front_end(self) -> tuple[float, float, float]:
        """Seconds a request spends in the server's front end: per request and per prompt token (one
        request at a time), then the latency to the engine (engine.issuer.FrontEnd)."""
        return self.cost.request_s, self.cost.request_token_s, self.cost.request_latency_s

    def _does_not_fit(self) -> str:
        g, need = self.gpu, self.weights_per_gpu + self.activations_per_gpu
        fix, whole = _smallest_tp(self.model, self.shape.dtypes, g, self.tp, self._act_args)
        where = f"--tp {fix}" if fix else "a bigger GPU (--gpu)"
        if whole:
            where += f" (the smallest with room for a {self.model.max_model_len:,}-token sequence's KV)"
        return (f"{self.model.name} needs {need / 1e9:.1f} GB per GPU for weights "
                f"({self.weights_per_gpu / 1e9:.1f} GB) and activations at --tp {self.tp}, more than the "
                f"{self.usable_per_gpu / 1e9:.1f} GB usable of one {g.name} ({g.mem_bytes / 1e9:g} GB x "
                f"{GPU_MEMORY_UTILIZATION}): use {where}" + (" or a bigger GPU (--gpu)" if fix else ""))

    def kv_bytes_per_token(self) -> int:
        """Pool bytes one token takes: its K and V on every GPU (N x kv, replicas included)."""
        return self.shape.kv_tok * self.tp

    def kv_layers(self) -> list[LayerKV]:
        """Each layer's KV on one GPU, in the dtype cached (ModelSpec.kv_layers at --tp): their bytes
        summed are kv; the pool counts them on each of the N GPUs (kv_bytes_per_token)."""
        return self.model.kv_layers(self.kv_dtype, self.tp, compute_dtype(self.shape.dtypes[0]),
                                    checkpoints=self.gpu.name in STATE_CHECKPOINT_GPUS)

    def default_kv_bytes(self) -> int:
        """The KV pool when none is asked: every GPU's memory left after weights and activations."""
        return int(self.free_per_gpu * self.tp)

    def check_kv_bytes(self, nbytes: int) -> None:
        """Refuse a --kv-mem that the GPUs cannot hold beside the weights and activations."""
        per_gpu = nbytes / self.tp
        if per_gpu > self.free_per_gpu:
            raise InputError(
                f"{nbytes / 1e9:.1f} GB of KV is {per_gpu / 1e9:.1f} GB on each of {self.tp} GPU(s), but one "
                f"{self.gpu.name} has {max(self.free_per_gpu, 0) / 1e9:.1f} GB left after {self.model.name}'s "
                f"weights and activations: lower --kv-mem, raise --tp, or use a bigger GPU (--gpu)",
                field="--kv-mem")

    def bind_pool(self, num_blocks: int, block_size: int, layer_groups: list[int] | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size  # (the step's cost reads no table)

    def work(self, batch: StepBatch) -> Work:
        return self.shape.work(batch)

    def breakdown(self, batch: StepBatch) -> dict[str, float]:
        """Seconds per operation of the roofline (OPERATIONS); the step time is their sum."""
        return self.work(batch).seconds(self.cost)

    def step_time(self, batch: StepBatch) -> float:
        if self.clock is not None:
            return self.clock.seconds(batch)
        return self.work(batch).time(self.cost)

    def pcie_time(self, batch: StepBatch) -> float:
        """Host<->device KV traffic (InfiniGen offload and recall): each GPU moves its share."""
        return batch.pcie_bytes / (self.tp * self.cost.pcie_bw) if batch.pcie_bytes else 0.0

    def bind_tiers(self, bandwidth: dict[str, float], slots: dict[str, int]) -> None:
        """Tiers behind the pool: bandwidth (bytes/s) per tier name (``slots`` only matter to the
        model executor, which holds them)."""
        self.tier_bw = dict(bandwidth)

    def recompute_s(self, start: int, n: int, rest: int = 0) -> float:
        """What prefilling ``n`` tokens after ``start`` cached ones adds to prefilling the ``rest`` of
        the prompt after them, each as a step of its own (``--load-policy auto`` weighs a tier load
        against it): a short prompt's prefill is bound by reading the weights, so recomputing a few
        hundred tokens costs almost nothing, while a long one's is bound by FLOPs."""
        if self.clock is not None:
            return self.clock.prefill_ms_per_token * n / 1e3
        memo = self._recompute_memo  # a waiting request asks again every step until admitted
        got = memo.get((start, n, rest))
        if got is not None:
            return got
        if len(memo) > 1 << 16:
            memo.clear()

        def prefill(s, k):
            if k <= 0:
                return 0.0
            return self.work(StepBatch(block_size=self.block_size, prefill_seq_ids=[0], prefill_starts=[s],
                                       prefill_lens=[k], prefill_last=[True])).time(self.cost)
        got = memo[(start, n, rest)] = prefill(start, n + rest) - prefill(start + n, rest)
        return got

    def execute(self, batch: StepBatch) -> StepResult:
        dur = self.step_time(batch)
        if not (batch.tier_pre or batch.tier_post):
            return StepResult(duration_s=dur, pcie_s=self.pcie_time(batch))
        block = self.kv_bytes_per_token() * batch.block_size
        pre = op_seconds(batch.tier_pre, block, self.tier_bw)
        post = op_seconds(batch.tier_post, block, self.tier_bw)
        return StepResult(duration_s=max(dur + pre, post), pcie_s=self.pcie_time(batch), tier_s=pre,
                          tier_post_s=post)


def _smallest_tp(model: ModelSpec, dtypes: tuple[str, str], gpu: GPUSpec, above: int,
                 act: tuple) -> tuple[int | None, bool]:
    """The smallest --tp above ``above`` (up to 64) whose GPUs hold the weights, the activations and
    the KV of one sequence of the model's whole context (vLLM refuses less: check_enough_kv_cache_memory
    in vllm/v1/core/kv_cache_utils.py); failing that, the smallest that holds the weights and
    activations; None if none does. The second value: it holds that sequence."""
    fits = None
    for n in range(above + 1, 65):
        try:
            s = StepCost(model, n, *dtypes)
        except InputError:
            continue
        free = gpu.mem_bytes * GPU_MEMORY_UTILIZATION - s.weight_bytes() - s.activation_bytes(*act)
        if free >= s.sequence_kv_bytes(model.max_model_len, act[0]):
            return n, True
        if free > 0 and fits is None:
            fits = n
    return fits, False


def make_sim(model: ModelSpec, gpu: GPUSpec, calibration: str | None = None, kv_dtype: str = "auto",
             tp: int = 1, max_batched_tokens: int = 8192, max_num_seqs: int = 256, dtype: str = "auto",
             eager: bool = False, front_end: bool = True) -> SimExecutor:
    """The sim for a model on ``tp`` GPUs of a preset, timed by the preset or a calibration file.
    ``dtype`` (the weights') auto: bf16, or the dtype a calibration was measured in; ``kv_dtype`` auto:
    the dtype activations are computed in (bf16 under fp8 weights, as vLLM's --kv-cache-dtype auto).
    ``eager``: no CUDA graphs (vLLM's --enforce-eager), every layer's kernel launches paid. ``front_end``
    False: requests reach the engine when issued (no API server: vLLM's offline LLM class)."""
    clock, raw = None, None
    if model.quant is not None and dtype not in ("auto", "bf16", "fp16"):
        raise InputError(f"{model.name}'s checkpoint is quantized ({model.quant.method}, its config.json's "
                         "quantization_config): its weights are stored as that; --dtype sets an unquantized "
                         "model's", field="--dtype")
    weight_dtype = "bf16" if dtype == "auto" else dtype
    if calibration:
        raw = read_calibration(calibration)
        if raw.get("kind") == "linear":
            clock = LinearClock.from_dict(raw, calibration)
        else:
            measured = raw.get("dtype")
            if measured and dtype not in ("auto", measured):
                log.warning("kvbench: warning: --calibration %s: measured with %s weights; its coefficients "
                            "time %s, not the --dtype %s asked for", calibration, measured, measured, dtype)
            weight_dtype = measured or weight_dtype
    # what the linear layers multiply in: an fp8 checkpoint's on fp8 tensor cores; MXFP4 and int4 at bf16's
    matmul_dtype = model.quant.matmul_dtype if model.quant is not None else weight_dtype
    if matmul_dtype == "fp8" and gpu.peak_fp8_flops is None:
        log.warning("kvbench: warning: the %s has no fp8 tensor cores: fp8 weights are read as one byte and "
                    "multiplied at the bf16 rate, as vLLM's weight-only FP8 (Marlin) kernels do", gpu.name)
    cost = CostModel.from_gpu(gpu, matmul_dtype)
    if raw is not None and clock is None:
        cost = cost_from_calibration(raw, calibration, cost)
        for msg in calibration_mismatches(raw, model, gpu, kv_dtype):
            log.warning("kvbench: warning: --calibration %s: %s", calibration, msg)
    if not front_end or clock is not None:  # a linear clock is another engine's scheduler alone: no server
        cost.request_s = cost.request_token_s = cost.request_latency_s = 0.0
    kv = compute_dtype(weight_dtype) if kv_dtype == "auto" else kv_dtype
    ex = SimExecutor(model, cost, gpu, tp, kv, weight_dtype, max_batched_tokens, max_num_seqs, eager)
    ex.clock = clock
    return ex
