"""A model's shape (ModelSpec): what decides its KV memory and its step cost, as transformers builds
the model and vLLM serves it (read from a Hugging Face ``config.json`` by kvbench.executors.hf_config).

A ModelSpec holds, beyond the Llama-family block: each layer's kind (``layer_kinds``, the kinds of
kvbench.memory.specs: full, sliding, chunked, mla attention, or a recurrent mamba layer) with one
sliding window and one chunk size, multi-head latent attention (MLA), a recurrent layer's state shape
(Gated DeltaNet, Mamba-2, Mamba-1), a mixture of experts with dense layers and shared experts, and the
checkpoint's weight quantization (WeightQuant). ``kv_layers`` turns it into one LayerKV per layer on one
tensor-parallel rank; every KV figure (``kv_bytes_per_token``, the sim's bytes) is a sum over them,
and ``attn_groups`` the attention layers of each kind together with what attention costs them (AttnGroup).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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


__all__ = ["DTYPE_BYTES", "MAMBA_TYPES", "WEIGHT_KINDS", "AttnGroup", "ModelSpec", "WeightQuant"]
