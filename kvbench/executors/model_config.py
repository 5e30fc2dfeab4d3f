"""A model's shape (ModelSpec): what decides its KV memory and its step cost, read from a Hugging Face
``config.json`` as transformers builds the model and vLLM serves it.

A ModelSpec holds, beyond the Llama-family block: each layer's attention kind (``layer_kinds``, the
kinds of kvbench.memory.specs: full, sliding, chunked, mla) with one sliding window and one chunk size,
multi-head latent attention (MLA), a mixture of experts with dense layers and shared experts, and the
checkpoint's weight quantization (WeightQuant). ``kv_layers`` turns it into one LayerKV per layer on one
tensor-parallel rank; every KV figure (``kv_bytes_per_token``, the sim's bytes) is a sum over them,
and ``attn_groups`` the layers of each kind together with what attention costs them (AttnGroup).

Reading never guesses: a field kvbench cannot represent (a Mamba or linear-attention layer, an unknown
layer type or quantization method, a window that is not a positive length within the model's) is an
InputError naming the file and the field. A field a published config leaves out is what transformers'
config class fills in (``_DEFAULTS``: Gemma 3's vocabulary and window pattern, Llama 4's NoPE interval).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvbench.errors import InputError
from kvbench.memory.specs import LayerKV

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
MAMBA_TYPES = ("gdn", "mamba2", "mamba1")


def _split(n: int, tp: int, what: str) -> int:
    """``n`` split over ``tp`` ranks (vLLM's divide: it must divide)."""
    if n % tp:
        raise InputError(f"a recurrent layer's {what} ({n}) does not split over {tp} GPUs (choose a --tp that "
                         f"divides it)", field="--tp")
    return n // tp

# Linear weights a quantization may cover; the router, norms, embedding and LM head always stay in the
# checkpoint's unquantized dtype (vLLM builds them without a quant method).
WEIGHT_KINDS = ("attn", "mlp", "experts", "shared_experts")


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """A checkpoint's quantized weights (its ``quantization_config``). A quantized weight takes
    ``bits / 8`` bytes, and each group of ``group_size`` of them one scale (and zero point) of
    ``scale_bytes``: block fp8 a float32 per 128 x 128 block, MXFP4 an E8M0 byte per 32 (4.25 bits a
    weight), int4 AWQ/GPTQ an fp16 scale and a 4-bit zero per group. group_size 0: one scale per tensor or
    channel, left out (under 0.1%)."""

    method: str  # fp8 (per tensor), fp8-block, mxfp4, awq, gptq
    bits: int
    group_size: int
    scale_bytes: float
    kinds: tuple[str, ...]  # the WEIGHT_KINDS it covers (modules_to_not_convert taken out)

    @property
    def bytes_per_weight(self) -> float:
        return self.bits / 8 + (self.scale_bytes / self.group_size if self.group_size else 0.0)

    @property
    def matmul_dtype(self) -> str:
        """What the linear layers multiply in: fp8 weights on fp8 tensor cores; MXFP4 and int4 weights
        are read at their bytes and multiplied at the bf16 rate (no native fp4 rate is modelled)."""
        return "fp8" if self.method.startswith("fp8") else "bf16"


@dataclass(frozen=True, slots=True)
class AttnGroup:
    """The layers of one attention kind on one GPU, together: what a (query, key) pair costs them, what a
    token's KV takes in them, and which keys a query sees (all, the window's, the chunk's).

    MLA (a latent of r = kv_lora_rank values and a rotary key of p = qk_rope_head_dim per token):
      decode, absorbed (vLLM's MLA decode, FlashMLA): W_UK is folded into the query (q_nope W_UK^T: a
        query of r per head) and W_UV applied after attention, so each (query, key) pair of each head
        scores over the latent and the rotary key, 2 (r + p) FLOPs, and adds up the latent weighted by
        its probability, 2 r FLOPs: 2 hq (2 r + p) per layer. The absorption itself, per token
        2 hq nope r + 2 hq r v, is kv_b's 2 r hq (nope + v): counted among the linear layers.
      prefill, decompressed (vLLM's MLA prefill): kv_b turns the latent into per-head keys of
        nope + p and values of v, so a pair costs 2 hq (nope + p) + 2 hq v per layer, and the cached
        context is decompressed first: 2 r hq (nope + v) FLOPs per cached token per layer
        (``context_flops``; the chunk's own tokens pass kv_b among the linear layers)."""

    kind: str
    window: int  # sliding: tokens a query sees; chunked: the chunk; else 0
    kv: int  # bytes one token's KV takes over the group's layers on one GPU
    decode_pair: float  # FLOPs of one (query, key) pair over the group's layers, decoding
    prefill_pair: float  # the same, prefilling
    context_flops: float = 0.0  # MLA prefill: FLOPs per cached token decompressed

    def prefill(self, start: int, n: int) -> tuple[float, int]:
        """(FLOPs, KV bytes read) of a chunk of n queries at positions start..start+n-1, query i
        seeing its own key and those before it that its layer keeps."""
        if self.kind == "sliding":  # query at p sees min(p + 1, W) keys; the chunk reads keys from start - W + 1
            w = self.window
            m = min(max(w - start, 0), n)  # queries still seeing every key before them
            seen = m * start + m * (m + 1) / 2 + (n - m) * w
            return self.prefill_pair * seen, self.kv * min(start + n, n + w - 1)
        if self.kind == "chunked":  # query at p sees p - p // C * C + 1 keys, from its chunk's first
            c = self.window
            seen = _chunk_keys(start + n, c) - _chunk_keys(start, c)
            return self.prefill_pair * seen, self.kv * (start + n - start // c * c)
        # causal: query i of the chunk sees start + i + 1 keys
        return (self.prefill_pair * n * (start + (n + 1) / 2) + self.context_flops * start,
                self.kv * (start + n))

    def tokens_held(self, tokens: int, max_batched_tokens: int) -> int:
        """Tokens of one sequence of ``tokens`` whose KV the group holds at most: the window (less one)
        or the chunk, and a step's new tokens (vLLM's max_memory_usage_bytes, without block rounding)."""
        if self.kind == "sliding":
            return min(tokens, self.window - 1 + max_batched_tokens)
        if self.kind == "chunked":
            return min(tokens, self.window + max_batched_tokens)
        return tokens

    def decode_keys(self, contexts: np.ndarray, total: int) -> int:
        """Keys the decodes' queries see in this group: ``contexts`` are their keys, their own included
        (int64 [D]; ``total`` their sum)."""
        if self.kind == "sliding":
            return int(np.minimum(contexts, self.window).sum())
        if self.kind == "chunked":
            return int(((contexts - 1) % self.window + 1).sum())
        return total


def _chunk_keys(p: int, c: int) -> float:
    """Keys seen by queries at positions 0..p-1 of chunked-local attention with chunks of c tokens."""
    r = p % c
    return p // c * (c * (c + 1) / 2) + r * (r + 1) / 2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # MLA: 1, the latent (vLLM's MLAAttentionSpec)
    head_dim: int  # MLA: kv_lora_rank + qk_rope_head_dim, the latent's values
    intermediate_size: int  # a dense MLP's (a MoE model's dense layers)
    vocab_size: int
    max_model_len: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    tie_word_embeddings: bool = False
    architecture: str = "llama"  # the config's model_type
    # Mixture of experts (0 = dense): a MoE layer's MLP is num_experts experts of moe_intermediate_size,
    # experts_per_token of them run per token, plus always-on shared experts of
    # shared_expert_intermediate_size in all (Qwen2-MoE's behind a sigmoid gate of h weights:
    # shared_expert_gate), and a router of h x num_experts. The layers in dense_layers have a dense MLP
    # of intermediate_size instead (DeepSeek's first_k_dense_replace, Llama 4's interleaving).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True
    dense_layers: tuple[int, ...] = ()
    # Attention per layer, kvbench.memory.specs kinds; empty: every layer full attention. A sliding
    # layer's query sees the last sliding_window tokens (itself included); a chunked layer's the tokens
    # of its own attention_chunk_size-token chunk (position // chunk * chunk onward).
    layer_kinds: tuple[str, ...] = ()
    sliding_window: int = 0
    attention_chunk_size: int = 0
    # Multi-head latent attention (DeepSeek V2/V3, Kimi K2; every layer "mla" when kv_lora_rank > 0):
    # a token caches a latent of kv_lora_rank plus a shared rotary key of qk_rope_head_dim; a query head
    # has qk_nope_head_dim + qk_rope_head_dim dims, a value head v_head_dim; q_lora_rank 0: queries are
    # projected from the hidden state directly.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    quant: WeightQuant | None = None  # None: every weight in the dtype asked for (--dtype)
    # Recurrent layers (layer kind "mamba"): Gated DeltaNet ("gdn": Qwen3-Next, Qwen3.5), Mamba-2
    # ("mamba2": Granite 4.0-H, Nemotron-H, Falcon-H1) or Mamba-1 ("mamba1": Jamba). A sequence's state in
    # such a layer is a conv state of (conv_kernel - 1) x conv_dim and an SSM state of heads x head_dim x
    # state_size, conv_dim = inner + 2 x groups x state_size (vLLM MambaStateShapeCalculator; GDN: heads and
    # head_dim are the value heads', groups and state_size the key heads', inner = heads x head_dim;
    # Mamba-1: conv_dim = inner, an SSM state of inner x state_size). ssm_dtype: the SSM state's dtype
    # when not the model's (Nemotron-H keeps it in fp32).
    mamba_type: str = ""
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_groups: int = 0
    mamba_inner: int = 0
    mamba_conv_kernel: int = 0
    mamba_ssm_dtype: str = ""
    attn_output_gate: bool = False  # Qwen3-Next: the query projection also makes a sigmoid gate on the output

    def __post_init__(self) -> None:
        if self.layer_kinds and len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{self.name}: {len(self.layer_kinds)} layer kinds for {self.num_layers} layers")
        kinds = set(self.kinds)
        if ("mla" in kinds) != (self.kv_lora_rank > 0) or ("mla" in kinds and len(kinds) > 1):
            raise ValueError(f"{self.name}: MLA (kv_lora_rank > 0) is every layer's kind or none's")
        for kind, window in (("sliding", self.sliding_window), ("chunked", self.attention_chunk_size)):
            if kind in kinds and window < 1:
                raise ValueError(f"{self.name}: a {kind} layer needs a window >= 1")
        if ("mamba" in kinds) != (self.mamba_type in MAMBA_TYPES):
            raise ValueError(f"{self.name}: recurrent layers need a mamba_type ({', '.join(MAMBA_TYPES)}) and it them")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind (kvbench.memory.specs.KINDS)."""
        return self.layer_kinds or ("full",) * self.num_layers

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    def window(self, kind: str) -> int:
        """Tokens a query of a ``kind`` layer may see: its window or chunk; 0 for full and MLA layers."""
        return self.sliding_window if kind == "sliding" else self.attention_chunk_size if kind == "chunked" else 0

    # -- KV cache ---------------------------------------------------------------------------------
    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one of ``tp`` ranks holds: split when tp divides them, else one replicated head
        each when tp is a multiple of them (vLLM); MLA's latent is held whole on every rank."""
        if self.kv_lora_rank:
            return 1
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise InputError(f"{self.name}'s {self.num_kv_heads} KV heads neither split over nor replicate evenly "
                             f"on {tp} GPUs (choose a --tp that divides or is a multiple of {self.num_kv_heads})",
                             field="--tp")
        return self.num_kv_heads // tp if self.num_kv_heads >= tp else 1

    def kv_layers(self, kv_dtype: str, tp: int = 1, state_dtype: str = "bf16",
                  checkpoints: bool = False) -> list[LayerKV]:
        """One LayerKV per layer, in layer order: the KV one of ``tp`` ranks keeps for it, in
        ``kv_dtype`` (a DTYPE_BYTES key). MLA: one latent head of kv_lora_rank + qk_rope_head_dim values
        on every rank, so its bytes per GPU do not fall with tp. A recurrent layer: its state on a rank
        in ``state_dtype`` (the model's: vLLM's --mamba-cache-dtype auto), ``checkpoints`` whether its
        prefill exports states itself (a GDN layer on Hopper)."""
        dtype_bytes, heads = DTYPE_BYTES[kv_dtype], self.kv_heads_per_rank(tp)
        spec = {kind: LayerKV(kind, heads, self.head_dim, dtype_bytes, self.window(kind)) for kind in set(self.kinds)
                if kind != "mamba"}
        if "mamba" in self.kinds:
            spec["mamba"] = LayerKV("mamba", 1, 1, 1, state_bytes=self.state_bytes(tp, state_dtype),
                                    checkpoints=checkpoints and self.mamba_type == "gdn")
        return [spec[kind] for kind in self.kinds]

    def state_shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A recurrent layer's (conv state, SSM state) shapes on one of ``tp`` ranks (vLLM
        MambaStateShapeCalculator: mamba1_state_shape, mamba2_state_shape, gated_delta_net_state_shape;
        a Mamba-2 model's groups are replicated up to tp when tp does not divide them)."""
        k, inner, n = self.mamba_conv_kernel, self.mamba_inner, self.mamba_state_size
        if self.mamba_type == "mamba1":
            return (k - 1, _split(inner, tp, "mamba_inner")), (_split(inner, tp, "mamba_inner"), n)
        groups = self.mamba_groups
        if self.mamba_type == "mamba2" and groups % tp:
            groups = tp
        conv_dim = inner + 2 * groups * n
        return ((k - 1, _split(conv_dim, tp, "conv_dim")),
                (_split(self.mamba_heads, tp, "mamba_heads"), self.mamba_head_dim, n))

    def state_bytes(self, tp: int = 1, dtype: str = "bf16") -> int:
        """One sequence's state in one recurrent layer on one of ``tp`` ranks (vLLM
        MambaSpec.page_size_bytes, unpadded): the conv state in ``dtype``, the SSM state in
        ``mamba_ssm_dtype`` when the model names one."""
        conv, ssm = self.state_shapes(tp)
        return (math.prod(conv) * DTYPE_BYTES[dtype]
                + math.prod(ssm) * DTYPE_BYTES[self.mamba_ssm_dtype or dtype])

    def mamba_weights(self, tp: int = 1) -> float:
        """One recurrent layer's projections on one GPU. GDN (vLLM's Qwen3-Next): in_proj_qkvz and in_proj_ba
        (h x (2 Hk Dk + 2 Hv Dv + 2 Hv)), the depthwise conv (conv_dim x K), out_proj (Hv Dv x h). Mamba-2:
        in_proj (h x (2 I + 2 G N + H)), the conv, out_proj (I x h). Mamba-1: in_proj (h x 2 I), x_proj
        (I x (R + 2 N), R = ceil(h / 16)), dt_proj (R x I), out_proj (I x h)."""
        h, inner, n, g, k = self.hidden_size, self.mamba_inner, self.mamba_state_size, self.mamba_groups, self.mamba_conv_kernel
        if self.mamba_type == "mamba1":
            r = -(-h // 16)
            return (2 * h * inner + inner * (r + 2 * n) + r * inner + inner * h + inner * k) / tp
        conv_dim = inner + 2 * g * n
        extra = 2 * self.mamba_heads if self.mamba_type == "gdn" else self.mamba_heads
        return (h * (conv_dim + inner + extra) + conv_dim * k + inner * h) / tp

    def state_flops(self, tp: int = 1) -> float:
        """FLOPs of one token's state update and read-out in one recurrent layer on one GPU: the SSM
        state's elements, each touched about six times (decay, the rank-one update, the output)."""
        _, ssm = self.state_shapes(tp)
        return 6.0 * math.prod(ssm)

    @property
    def num_state_layers(self) -> int:
        return self.kinds.count("mamba")

    def mixer_weights(self, tp: int = 1) -> float:
        """The token mixer's projections on one GPU averaged over the layers: attention's, and a
        recurrent layer's (mamba_weights) where the model has them."""
        states = self.num_state_layers
        if not states:
            return self.attn_weights(tp)
        return ((self.num_layers - states) * self.attn_weights(tp) + states * self.mamba_weights(tp)) / self.num_layers

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """KV of one token over every layer, on one GPU holding the whole model (sum of kv_layers)."""
        return sum(layer.bytes_per_token for layer in self.kv_layers(dtype))

    def attn_groups(self, kv_dtype: str, tp: int = 1) -> list[AttnGroup]:
        """The layers of each attention kind on one of tp GPUs, in order of first appearance."""
        hq, layers, kinds = self.num_heads // tp, self.kv_layers(kv_dtype, tp), self.kinds
        out = []
        for kind in dict.fromkeys(kinds):
            if kind == "mamba":  # (no attention: StepCost prices its state)
                continue
            count, kv = kinds.count(kind), kinds.count(kind) * layers[kinds.index(kind)].bytes_per_token
            if kind != "mla":  # QK^T and PV: 2 d FLOPs each per head per pair
                pair = 4.0 * count * hq * self.head_dim
                out.append(AttnGroup(kind, self.window(kind), kv, pair, pair))
                continue
            r, p, nope, v = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
            out.append(AttnGroup(kind, 0, kv, decode_pair=2.0 * count * hq * (2 * r + p),
                                 prefill_pair=2.0 * count * hq * (nope + p + v),
                                 context_flops=2.0 * count * r * hq * (nope + v)))
        return out

    # -- weights (elements on one of tp GPUs; vLLM's column / row parallel splits) -----------------
    def attn_weights(self, tp: int = 1) -> float:
        """One layer's attention projections on one GPU. GQA: Q, K, V, O with KV heads split or
        replicated. MLA: q_a (h x q_lora) and kv_a (h x (kv_lora + rope)) replicated on every GPU,
        q_b (q_lora x H (nope + rope)), kv_b (kv_lora x H (nope + v)) and o (H v x h) split by heads."""
        h, hq = self.hidden_size, self.num_heads // tp
        if not self.kv_lora_rank:
            d, hkv = self.head_dim, self.kv_heads_per_rank(tp)
            gate = h * hq * d if self.attn_output_gate else 0
            return h * hq * d + gate + 2 * h * hkv * d + hq * d * h
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * hq * qk if self.q_lora_rank else h * hq * qk
        return (q + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank * hq * (self.qk_nope_head_dim + self.v_head_dim) + hq * self.v_head_dim * h)

    def mlp_parts(self, experts: float, tp: int = 1) -> tuple[float, float, float]:
        """One MoE layer's MLP on one GPU, running ``experts`` routed experts: (routed experts, shared
        experts and their gate, router). Experts are split over tp (no expert parallelism); the router
        is replicated."""
        h = self.hidden_size
        shared = 0.0
        if self.shared_expert_intermediate_size:
            shared = (3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gate else 0)) / tp
        return 3 * h * self.moe_intermediate_size * experts / tp, shared, h * self.num_experts

    def mlp_weights(self, experts: float, tp: int = 1, moe: bool = True) -> float:
        """One layer's MLP on one GPU: a MoE layer running ``experts`` experts, or (moe False, or a
        dense model) the dense gate/up/down of 3 x h x intermediate_size."""
        if not (moe and self.is_moe):
            return 3 * self.hidden_size * self.intermediate_size / tp
        routed, shared, router = self.mlp_parts(experts, tp)
        return routed + shared + router

    def norm_weights(self) -> int:
        """One layer's norms: before attention and MLP (MLA: and its q and kv latents)."""
        return 2 * self.hidden_size + (self.q_lora_rank + self.kv_lora_rank if self.kv_lora_rank else 0)

    def mlp_params(self, active: bool = False) -> int:
        """One MoE layer's MLP weights (every expert; ``active``: the experts_per_token a token runs);
        a dense model's MLP."""
        return int(self.mlp_weights(self.experts_per_token if active else self.num_experts))

    def param_counts(self) -> dict[str, int]:
        """Every weight of the checkpoint by kind (WEIGHT_KINDS, router, norms, embedding, lm_head);
        the LM head is 0 when tied to the embedding."""
        moe, dense, h = self.moe_layers, self.num_layers - self.moe_layers, self.hidden_size
        routed, shared, router = self.mlp_parts(self.num_experts) if self.is_moe else (0.0, 0.0, 0)
        emb = self.vocab_size * h
        counts = {"attn": self.num_layers * self.mixer_weights(), "mlp": dense * self.mlp_weights(0, moe=False),
                  "experts": moe * routed, "shared_experts": moe * shared, "router": moe * router,
                  "norms": self.num_layers * self.norm_weights() + h, "embedding": emb,
                  "lm_head": 0 if self.tie_word_embeddings else emb}
        return {k: int(v) for k, v in counts.items()}

    @property
    def num_params(self) -> int:
        """Every weight (all experts of a MoE), embedding and LM head included."""
        return sum(self.param_counts().values())

    def weight_bytes(self, dtype: str = "bf16") -> int:
        """The checkpoint's bytes: quantized weights at their bytes (scales included), the rest in ``dtype``."""
        if self.quant is None:
            return self.num_params * DTYPE_BYTES[dtype]
        q = self.quant
        return round(sum(n * (q.bytes_per_weight if kind in q.kinds else DTYPE_BYTES[dtype])
                         for kind, n in self.param_counts().items()))

    def describe_layers(self) -> str:
        """The layers by kind, e.g. "18 sliding 128 + 18 full"."""
        counts: dict[str, int] = {}
        for kind in self.kinds:
            counts[kind] = counts.get(kind, 0) + 1
        return " + ".join(f"{n} {kind}" + (f" {self.window(kind)}" if self.window(kind) else "")
                          for kind, n in counts.items())

    def to_dict(self) -> dict:
        return asdict(self)


# -- reading a config.json ------------------------------------------------------------------------
# Fields of transformers' config classes that published configs leave to the class's default.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True},
    "gemma2": {"vocab_size": 256000, "max_position_embeddings": 8192, "sliding_window": 4096,
               "sliding_window_pattern": 2, "tie_word_embeddings": True},
    "llama4_text": {"no_rope_layer_interval": 4, "interleave_moe_layer_step": 1},
}
# Llama 4's MoE layers carry one always-on shared expert of intermediate_size (no config field says so).
_SHARED_EXPERT_BY_ARCHITECTURE = {"llama4_text": 1}
# Fields only a recurrent layer (Mamba, linear attention, RG-LRU) has: Jamba, Zamba, Bamba, Falcon-H1,
# Nemotron-H, Qwen3-Next, MiniMax-01, Kimi Linear, RecurrentGemma.
_RECURRENT_FIELDS = ("mamba_d_state", "ssm_state_size", "layers_block_type", "hybrid_override_pattern",
                     "attn_layer_period", "attn_layer_indices", "linear_num_value_heads", "attn_type_list",
                     "linear_attn_config", "block_types")
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
               "attention": "full", "linear_attention": "mamba", "mamba": "mamba"}
_RECURRENT_TYPES = ("mamba2", "conv", "recurrent", "lightning_attention")
QUANT_METHODS = ("fp8", "mxfp4", "awq", "gptq")
_POSITIVE_INT_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                        "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
                        "experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size",
                        "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
                        "interleave_moe_layer_step", "intermediate_size_mlp", "kv_lora_rank", "qk_rope_head_dim",
                        "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "sliding_window", "sliding_window_pattern",
                        "max_window_layers", "attention_chunk_size", "no_rope_layer_interval", "full_attention_interval",
                        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_n_heads", "mamba_d_head",
                        "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_expand", "shared_intermediate_size",
                        "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                        "attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset")
_MAY_BE_ZERO = ("attn_layer_offset", "expert_layer_offset", "shared_intermediate_size", "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
                "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace", "max_window_layers")
# Module names a modules_to_not_convert pattern is matched against, per kind of weight.
_MODULE_NAMES = {
    "attn": ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"),
    "mlp": ("model.layers.0.mlp.down_proj", "model.layers.0.feed_forward.down_proj"),
    "experts": ("model.layers.0.mlp.experts.0.down_proj", "model.layers.0.feed_forward.experts.down_proj"),
    "shared_experts": ("model.layers.0.mlp.shared_experts.down_proj", "model.layers.0.mlp.shared_expert.down_proj",
                       "model.layers.0.feed_forward.shared_expert.down_proj"),
}


class _Fields:
    """The language model's fields: a multimodal config's ``text_config`` (Gemma 3, Llama 4), with the
    outer config's quantization_config and tie_word_embeddings where it has none; nulls read as absent."""

    def __init__(self, raw: dict, path: str):
        self.path = path
        inner = raw.get("text_config")
        if inner is not None and not isinstance(inner, dict):
            raise InputError("must be a JSON object", file=path, field="text_config")
        self.prefix = "text_config." if inner is not None else ""
        own = inner if inner is not None else raw
        arch = own.get("model_type") or raw.get("model_type") or "llama"
        self.architecture = str(arch).lower()
        fields = {**_DEFAULTS.get(self.architecture, {}), **own}  # a default fills an absent key, not a null
        self.outer: set[str] = set()
        if inner is not None:
            for key in ("quantization_config", "tie_word_embeddings"):
                if fields.get(key) is None and raw.get(key) is not None:
                    fields[key] = raw[key]
                    self.outer.add(key)
        self.c = {k: v for k, v in fields.items() if v is not None}

    def name(self, key: str) -> str:
        return key if key in self.outer else self.prefix + key

    def error(self, key: str, message: str, sub: str = "") -> InputError:
        return InputError(message, file=self.path, field=self.name(key) + (f".{sub}" if sub else ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.c.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.c:
            raise self.error(key, "required field missing")
        return self.c[key]


def _positive_float(f: _Fields, key: str, default: float) -> float:
    v = f.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise f.error(key, f"must be a positive number, got {v!r}")
    return float(v)


def _int_list(f: _Fields, key: str, length: int) -> list[int]:
    v = f.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise f.error(key, f"must be a list of integers, got {v!r}")
    if length and len(v) != length:
        raise f.error(key, f"has {len(v)} entries for {length} layers")
    return v


def _layer_kinds(f: _Fields, layers: int, max_len: int, mla: bool) -> tuple[tuple[str, ...], int, int]:
    """Each layer's attention kind, the sliding window and the chunk, as transformers builds them."""
    types = f.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise f.error("layer_types", f"must be a list of {layers} layer types, one per layer")
        kinds = []
        for i, t in enumerate(types):
            if t in _RECURRENT_TYPES:
                raise f.error("layer_types", f"layer {i} is a {t} layer: kvbench reads Gated DeltaNet "
                                             "(linear_attention) and Mamba-2 (mamba) layers, not this recurrent state")
            if t not in LAYER_TYPES:
                raise f.error("layer_types", f"unknown layer type {t!r} at layer {i} "
                                             f"(kvbench reads {', '.join(LAYER_TYPES)})")
            kinds.append(LAYER_TYPES[t])
    elif f.get("attn_layer_period") is not None:  # Jamba: attention where i % period == offset, Mamba-1 between
        period, offset = f.get("attn_layer_period"), f.get("attn_layer_offset", 0)
        kinds = ["full" if i % period == offset else "mamba" for i in range(layers)]
        if "full" not in kinds:
            raise f.error("attn_layer_period", f"no attention layer in {layers} layers (period {period}, offset "
                                               f"{offset}): a model of recurrent layers only is not modelled")
    elif f.get("full_attention_interval") is not None:  # Qwen3-Next: every interval-th layer full, GDN between
        every = f.get("full_attention_interval")
        kinds = ["full" if (i + 1) % every == 0 else "mamba" for i in range(layers)]
    elif f.get("attention_chunk_size") is not None:
        # Llama 4: a NoPE layer (no_rope_layers[i] == 0) attends globally, the others chunked-local
        # (vLLM's llama4.py); an empty list means every no_rope_layer_interval-th layer is NoPE.
        rope = f.get("no_rope_layers") and _int_list(f, "no_rope_layers", layers)
        if not rope:
            every = f.get("no_rope_layer_interval", 4)
            rope = [int((i + 1) % every != 0) for i in range(layers)]
        kinds = ["chunked" if r else "full" for r in rope]
    elif f.get("sliding_window") is not None and f.get("use_sliding_window", True):
        pattern, first = f.get("sliding_window_pattern"), f.get("max_window_layers")
        if pattern:  # Gemma 2/3, Cohere 2: every pattern-th layer full
            kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
        elif f.get("use_sliding_window") and first is not None:  # Qwen2: sliding from max_window_layers on
            kinds = ["sliding" if i >= first else "full" for i in range(layers)]
        else:  # Mistral v0.1, Phi-3, Starcoder2: every layer
            kinds = ["sliding"] * layers
    else:
        kinds = ["full"] * layers
    window = chunk = 0
    for kind, key in (("sliding", "sliding_window"), ("chunked", "attention_chunk_size")):
        if kind not in kinds:
            continue
        if mla:
            raise f.error(key, f"a {kind} MLA layer: kvbench models MLA over the whole context only")
        w = f.get(key)
        if w is None:
            raise f.error(key, f"required field missing (the config has {kind} layers)")
        if w > max_len:
            raise f.error(key, f"{w:,} tokens is longer than the model's max_position_embeddings ({max_len:,})")
        if kind == "sliding":
            window = w
        else:
            chunk = w
    if mla:
        kinds = ["mla"] * layers
    return tuple(kinds), window, chunk


# The recurrent layers kvbench reads, by the field that names them: Gated DeltaNet (Qwen3-Next, Qwen3.5) and
# Granite 4.0-H's Mamba-2. Others are refused naming the field (_RECURRENT_FIELDS).
_GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")
_MAMBA2_FIELDS = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv")
_NEMOTRON_FIELDS = ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel")
_JAMBA_FIELDS = ("mamba_d_state", "mamba_d_conv")
_READ_RECURRENT = (*_GDN_FIELDS, *_MAMBA2_FIELDS, *_NEMOTRON_FIELDS, *_JAMBA_FIELDS, "hybrid_override_pattern",
                   "attn_layer_period")
_REFUSED_RECURRENT = {"layers_block_type": "this model's recurrent layers are not read"}


def _nemotron_pattern(f: _Fields, layers: int, inter: int) -> tuple[int, int, tuple[str, ...]]:
    """Nemotron-H's ``hybrid_override_pattern``: one block per character, a Mamba-2 mixer (M), attention
    (*) or an MLP alone (-), each with its own norm and residual (vLLM's NemotronHForCausalLM). kvbench's
    layer is a mixer and an MLP, so the model reads as its M and * blocks, each carrying an equal share of
    the MLP blocks' weights (a gated MLP of the same weights, FLOPs and bytes; a non-gated relu^2 MLP of
    I has 2 h I): -> (layers, intermediate size of that MLP, kinds)."""
    pattern = f.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or len(pattern) != layers or set(pattern) - set("M*-E"):
        raise f.error("hybrid_override_pattern", f"must be {layers} characters of M (Mamba), * (attention) and - "
                                                 f"(MLP), got {pattern!r}")
    if "E" in pattern:
        raise f.error("hybrid_override_pattern", "Nemotron-H's MoE blocks (E) are not modelled")
    mixers = [c for c in pattern if c in "M*"]
    if "*" not in mixers:
        raise f.error("hybrid_override_pattern", "no attention block (*): a model of recurrent layers only is not "
                                                 "modelled")
    share = pattern.count("-") * 2 * inter / (3 * len(mixers))
    return len(mixers), round(share), tuple("mamba" if c == "M" else "full" for c in mixers)


def _recurrent(f: _Fields, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The recurrent layers' shape (ModelSpec's mamba_* fields) of a config whose layers include them: Gated
    DeltaNet from its linear_* fields (Qwen3NextForCausalLM.get_mamba_state_shape_from_config), Mamba-2
    from Granite 4.0-H's mamba_* fields (GraniteMoeHybridForCausalLM's)."""
    if "mamba" not in kinds:
        for key in (*_RECURRENT_FIELDS, *_GDN_FIELDS, *_MAMBA2_FIELDS):
            if key in f.c:
                raise f.error(key, "a recurrent (Mamba or linear-attention) layer's state, but no layer_types (or "
                                   "full_attention_interval) says which layers are recurrent")
        return {}
    gdn = f.architecture.startswith(("qwen3_next", "qwen3_5"))
    if gdn or f.get("linear_num_value_heads") is not None or f.get("linear_num_key_heads") is not None:
        hk, hv, dk, dv, k = (f.need(key) for key in _GDN_FIELDS)
        ssm = f.get("mamba_ssm_dtype")  # Qwen3.5: the recurrent state in this dtype (vLLM's config hook)
        if ssm is not None and ssm not in _STATE_DTYPES:
            raise f.error("mamba_ssm_dtype", f"must be one of {', '.join(_STATE_DTYPES)}, got {ssm!r}")
        return {"mamba_type": "gdn", "mamba_heads": hv, "mamba_head_dim": dv, "mamba_state_size": dk,
                "mamba_groups": hk, "mamba_inner": hv * dv, "mamba_conv_kernel": k,
                "mamba_ssm_dtype": _STATE_DTYPES.get(ssm, "") if ssm else "",
                "attn_output_gate": bool(f.get("attn_output_gate", True))}
    if f.get("hybrid_override_pattern") is not None:  # Nemotron-H (NemotronHForCausalLM's state shapes)
        h, d, n, g, k = (f.need(key) for key in _NEMOTRON_FIELDS)
        ssm = f.get("mamba_ssm_cache_dtype", "float32")  # vLLM's NemotronHForCausalLMConfig: fp32 unless named
        if ssm not in _STATE_DTYPES:
            raise f.error("mamba_ssm_cache_dtype", f"must be one of {', '.join(_STATE_DTYPES)}, got {ssm!r}")
        return {"mamba_type": "mamba2", "mamba_heads": h, "mamba_head_dim": d, "mamba_state_size": n,
                "mamba_groups": g, "mamba_inner": h * d, "mamba_conv_kernel": k, "mamba_ssm_dtype": _STATE_DTYPES[ssm]}
    if f.get("attn_layer_period") is not None:  # Jamba: Mamba-1 (JambaForCausalLM's state shapes)
        n, k = (f.need(key) for key in _JAMBA_FIELDS)
        return {"mamba_type": "mamba1", "mamba_heads": 0, "mamba_head_dim": 0, "mamba_state_size": n,
                "mamba_groups": 0, "mamba_inner": f.get("mamba_expand", 2) * f.need("hidden_size"),
                "mamba_conv_kernel": k}
    if f.architecture.startswith("granitemoehybrid") or f.get("mamba_n_heads") is not None:
        h, d, n, g, k = (f.need(key) for key in _MAMBA2_FIELDS)
        inner = f.get("mamba_expand", 2) * f.need("hidden_size")
        if h * d != inner:
            raise f.error("mamba_n_heads", f"{h} heads x {d} != the {inner} inner dimensions (mamba_expand x hidden_size)")
        return {"mamba_type": "mamba2", "mamba_heads": h, "mamba_head_dim": d, "mamba_state_size": n,
                "mamba_groups": g, "mamba_inner": inner, "mamba_conv_kernel": k}
    raise f.error("layer_types", "recurrent layers without the fields of their state (linear_num_key_heads ... for "
                                 "Gated DeltaNet, mamba_n_heads ... for Granite's Mamba-2)")


_STATE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _dense_layers(f: _Fields, layers: int) -> tuple[int, ...]:
    """A MoE model's layers with a dense MLP, by the rule of its architecture."""
    if f.get("first_k_dense_replace") is not None or f.get("moe_layer_freq") is not None:  # DeepSeek
        first, freq = f.get("first_k_dense_replace", 0), f.get("moe_layer_freq", 1)
        return tuple(i for i in range(layers) if not (i >= first and i % freq == 0))
    if f.get("expert_layer_period") is not None:  # Jamba: a MoE where i % period == offset
        period, offset = f.get("expert_layer_period"), f.get("expert_layer_offset", 0)
        return tuple(i for i in range(layers) if i % period != offset)
    if f.get("moe_layers") is not None:  # Llama 4, written out
        moe = set(_int_list(f, "moe_layers", 0))
        return tuple(i for i in range(layers) if i not in moe)
    if f.get("interleave_moe_layer_step") is not None:  # Llama 4: every step-th layer
        step = f.get("interleave_moe_layer_step")
        return tuple(i for i in range(layers) if (i + 1) % step)
    step, only = f.get("decoder_sparse_step", 1), f.get("mlp_only_layers") or []  # Qwen MoE
    if only:
        only = _int_list(f, "mlp_only_layers", 0)
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def _quantization(f: _Fields) -> WeightQuant | None:
    q = f.get("quantization_config")
    if q is None:
        return None
    key = "quantization_config"
    if not isinstance(q, dict):
        raise f.error(key, "must be a JSON object")
    method = q.get("quant_method")
    if not isinstance(method, str) or method.lower() not in QUANT_METHODS:
        raise f.error(key, f"{method!r} is not a quantization kvbench models ({', '.join(QUANT_METHODS)})",
                      "quant_method")
    method = method.lower()
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise f.error(key, f"must be a list of module names, got {skip!r}", "modules_to_not_convert")
    patterns = [re.compile(r"(?:^|\.)" + re.escape(s).replace(r"\*", r"[^.]+") + r"(?:\.|$)") for s in skip]
    covered = tuple(kind for kind in (("experts",) if method == "mxfp4" else WEIGHT_KINDS)
                    if not any(p.search(name) for p in patterns for name in _MODULE_NAMES[kind]))
    if method == "mxfp4":  # gpt-oss: the MoE experts only (vLLM's Mxfp4Config leaves linear layers bf16)
        return WeightQuant("mxfp4", 4, 32, 1.0, covered)
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            return WeightQuant("fp8", 8, 0, 0.0, covered)
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise f.error(key, f"must be two positive integers, got {block!r}", "weight_block_size")
        return WeightQuant("fp8-block", 8, block[0] * block[1], 4.0, covered)
    bits: Any = q.get("bits", q.get("w_bit", 4))
    group: Any = q.get("group_size", q.get("q_group_size", 128))
    if bits not in ((4,) if method == "awq" else (4, 8)) or isinstance(bits, bool):
        raise f.error(key, f"{method} with {bits!r} bits is not modelled (4{'' if method == 'awq' else ' or 8'})",
                      "bits")
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group > 0):
        raise f.error(key, f"must be a positive integer or -1, got {group!r}", "group_size")
    zero = bits / 8 if q.get("zero_point", True) else 0.0  # AutoAWQ's zero_point false: scales only
    return WeightQuant(method, bits, max(group, 0), 2 + zero, covered)


def read_hf_config(path: str, name: str | None = None) -> ModelSpec:
    """The shape in a Hugging Face config.json (a file or a model folder)."""
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 text
        raise InputError(f"cannot read model config: {e}", file=cfg_path) from None
    if not isinstance(raw, dict):
        raise InputError("must be a JSON object", file=cfg_path)
    f = _Fields(raw, cfg_path)
    for key, why in _REFUSED_RECURRENT.items():
        if key in f.c:
            raise f.error(key, f"a recurrent (Mamba or linear-attention) layer's state: {why} (kvbench reads Gated "
                               "DeltaNet, Granite 4.0-H's and Nemotron-H's Mamba-2 and Jamba's Mamba-1)")
    for key in _RECURRENT_FIELDS:
        if key in f.c and key not in _READ_RECURRENT:
            raise f.error(key, "a recurrent (Mamba or linear-attention) layer's state kvbench does not read (it reads "
                               "Gated DeltaNet, Granite 4.0-H's and Nemotron-H's Mamba-2 and Jamba's Mamba-1)")
    for key in _POSITIVE_INT_FIELDS:
        v = f.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if key in _MAY_BE_ZERO else 1)):
            raise f.error(key, f"must be a positive integer, got {v!r}")
    heads, hidden, layers = f.need("num_attention_heads"), f.need("hidden_size"), f.need("num_hidden_layers")
    inter, vocab = f.need("intermediate_size"), f.need("vocab_size")
    max_len = f.get("max_position_embeddings", 4096)
    mla = f.get("kv_lora_rank") is not None
    if f.get("hybrid_override_pattern") is not None:  # Nemotron-H: its mixer blocks, the MLP blocks shared out
        layers, inter, kinds = _nemotron_pattern(f, layers, inter)
        window = chunk = 0
    else:
        kinds, window, chunk = _layer_kinds(f, layers, max_len, mla)
    recurrent = _recurrent(f, kinds)
    if mla:
        rope, nope, v_dim = f.need("qk_rope_head_dim"), f.need("qk_nope_head_dim"), f.need("v_head_dim")
        kv_heads, head_dim = 1, f.get("kv_lora_rank") + rope
    else:
        rope = nope = v_dim = 0
        kv_heads = f.get("num_key_value_heads") or heads  # absent or null: one per query head
        head_dim = f.get("head_dim") or hidden // heads
        if head_dim < 1:
            raise f.error("hidden_size", f"hidden_size {hidden} over {heads} heads leaves no head dimension: "
                                         "give head_dim")
    # Experts under their several names: DeepSeek n_routed_experts, Mixtral / gpt-oss / Llama 4
    # num_local_experts (each of intermediate_size), Qwen MoE num_experts (each of moe_intermediate_size).
    experts = f.get("n_routed_experts") or f.get("num_local_experts") or f.get("num_experts") or 0
    per_token = (f.get("num_experts_per_tok") or f.get("experts_per_token") or 0) if experts else 0
    if experts and not 1 <= per_token <= experts:
        raise f.error("num_experts_per_tok", f"must be in [1, {experts}] for a model of {experts} experts, "
                                             f"got {per_token!r}")
    expert_size = (f.get("moe_intermediate_size") or inter) if experts else 0
    shared, gate = 0, False
    if experts:
        if f.get("n_shared_experts"):  # DeepSeek: n experts of moe_intermediate_size, no gate
            shared = f.get("n_shared_experts") * expert_size
        elif f.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one, behind a sigmoid gate
            shared, gate = f.get("shared_expert_intermediate_size"), True
        elif f.get("shared_intermediate_size"):  # Granite 4.0-H: one, ungated
            shared = f.get("shared_intermediate_size")
        elif f.architecture in _SHARED_EXPERT_BY_ARCHITECTURE:
            shared = _SHARED_EXPERT_BY_ARCHITECTURE[f.architecture] * expert_size
    rope_params = f.get("rope_parameters") if isinstance(f.get("rope_parameters"), dict) else {}
    return ModelSpec(
        name=name or os.path.basename(os.path.normpath(path)),
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=f.get("intermediate_size_mlp") or inter, vocab_size=vocab, max_model_len=max_len,
        # transformers 5 writes rope_parameters: {rope_theta: ...}; older configs a top-level key
        rope_theta=_positive_float(f, "rope_theta", rope_params.get("rope_theta") or 10000.0),
        rms_norm_eps=_positive_float(f, "rms_norm_eps", 1e-6),
        qkv_bias=bool(f.get("attention_bias", f.architecture == "qwen2")),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        architecture=f.architecture,
        num_experts=experts, experts_per_token=per_token, moe_intermediate_size=expert_size,
        shared_expert_intermediate_size=shared, shared_expert_gate=gate,
        dense_layers=_dense_layers(f, layers) if experts else (),
        layer_kinds=() if set(kinds) == {"full"} else kinds, sliding_window=window, attention_chunk_size=chunk,
        kv_lora_rank=f.get("kv_lora_rank", 0), qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v_dim,
        q_lora_rank=f.get("q_lora_rank", 0) if mla else 0,
        quant=_quantization(f),
        **recurrent,
    )


__all__ = ["DTYPE_BYTES", "LAYER_TYPES", "QUANT_METHODS", "WEIGHT_KINDS", "AttnGroup", "ModelSpec", "WeightQuant",
           "read_hf_config"]
