"""Reading a Hugging Face ``config.json`` into a ModelSpec (kvbench.executors.model_config), as
transformers builds the model and vLLM serves it: layer kinds and windows (``layer_types``, Gemma's
pattern, Qwen2's max_window_layers, Llama 4's chunks), recurrent layers (Gated DeltaNet's linear_*
fields and full_attention_interval, Granite 4.0-H's and Nemotron-H's Mamba-2, Jamba's Mamba-1), MLA,
MoE under its several names with shared experts and dense layers, a nested ``text_config``, and the
checkpoint's ``quantization_config``.

Reading never guesses: a field kvbench cannot represent (another recurrent layer, an unknown layer
type or quantization method, a window that is not a positive length within the model's) is an
InputError naming the file and the field. A field a published config leaves out is what transformers'
config class fills in (``_DEFAULTS``).
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from kvbench.errors import InputError
from kvbench.executors.model_config import WEIGHT_KINDS, ModelSpec, WeightQuant

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
_MAY_BE_ZERO = ("attn_layer_offset", "expert_layer_offset", "shared_intermediate_size", "num_local_experts",
                "num_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
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
    if f.architecture.startswith("falcon_h1"):
        raise f.error("model_type", "Falcon-H1 runs a Mamba-2 mixer beside attention in every layer (one state group "
                                    "of every layer and one attention group): not modelled")
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


__all__ = ["LAYER_TYPES", "QUANT_METHODS", "read_hf_config"]
