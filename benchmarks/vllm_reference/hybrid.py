#!/usr/bin/env python3
"""Per-layer KV specs for drive.py's hybrid mode, vLLM 0.34's own grouping and planning of them.

A layer list says, per attention layer of a model, what KV it keeps:

    {"type": "full" | "sliding" | "chunked" | "mla", "window": W (sliding), "chunk": C (chunked),
     "num_kv_heads": H, "head_dim": D, "dtype": "bfloat16" | "float16" | "fp8"}

(an MLA layer keeps one latent "head" of head_dim = kv_lora_rank + qk_rope_head_dim, e.g. 512 + 64),
or, for a Mamba / linear-attention layer (one recurrent state per request, vLLM's ``MambaSpec``):

    {"type": "mamba", "mamba_type": "gdn" | "mamba2" | "mamba1", "shapes": [[3, 8192], [32, 128, 128]],
     "dtypes": ["bfloat16", "bfloat16"], "prefill_checkpoints": false}

(``prefill_checkpoints``: the layer exports a prefill checkpoint, as Qwen's Gated DeltaNet does on
Hopper with the FlashInfer GDN prefill: ``num_prefill_checkpoint_blocks=1``). A Mamba layer's block
size is the attention block size aligned by vLLM's ``Platform._align_hybrid_block_size``
(``aligned_block_size``; drive.py's ``--block-size`` is that aligned size) and its page is padded to
the attention page, as ``update_block_size_for_backend`` makes ``mamba_page_size_padded``; the
layers run in vLLM's align mode (``mamba_cache_mode="align"``, prefix caching on).
``--layers`` takes a preset name (PRESETS below, written from the models' published config.json) or
a JSON file holding such a list, or an object {"name": ..., "layers": [...], "expect": [...]}.

With vLLM imported (its venv), this module builds vLLM's per-layer ``KVCacheSpec`` objects
(``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``, ``MLAAttentionSpec``,
as the layers' own ``get_kv_cache_spec`` do), groups them with vLLM's engine-core path
(``get_global_kv_cache_groups``: ``get_kv_cache_groups`` behind the default config builder), and
builds the scheduler's ``KVCacheConfig`` with ``get_kv_cache_config_from_groups`` (through the
default builder, as ``get_kv_cache_configs`` does) and ``generate_scheduler_kv_cache_config``.

Two settings are made before grouping, both what a CUDA engine core would have:
  * ``cache_config.kv_cache_layout = "LBNHC"``: the layout ``resolve_kv_cache_layout`` picks when the
    backends declare nothing (FlashAttention), the default preference's first;
  * ``scheduler_config.disable_hybrid_kv_cache_manager = False``, set after the VllmConfig is built.
    Without a GPU vLLM's platform (``UnspecifiedPlatform``) answers ``support_hybrid_kv_cache() ->
    False``, so ``VllmConfig.__post_init__`` turns the hybrid manager off and ``get_kv_cache_groups``
    would silently promote every sliding/chunked layer to full attention
    (``unify_hybrid_kv_cache_specs``). The groups are then checked against the layer list
    (``check_groups``): a run whose groups are not the hybrid ones fails loudly.

Planning (``plan``; ``python hybrid.py plan``): for each preset, the groups and vLLM's num_blocks for
a few KV memory sizes, from ``get_kv_cache_config_from_groups`` (available // bytes per block), with
whether ``get_kv_cache_configs`` accepts that memory at max_model_len (its
``_check_enough_kv_cache_memory``) and, if not, the max_model_len vLLM estimates would fit.

    /work/vllm034/venv/bin/python benchmarks/vllm_reference/hybrid.py plan \\
        --out benchmarks/vllm_reference/hybrid_groups.json

Mamba presets (qwen3-next-80b-a3b[-h100], granite-4.0-h-tiny, nemotron-h-8b) are planned at each user
block size (16, none) after vLLM's block-size alignment; ``python hybrid.py align`` prints it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

LAYER_NAME = "model.layers.{}.self_attn.attn"
KINDS = ("full", "sliding", "chunked", "mla", "mamba")
MAMBA_TYPES = {"gdn": "GDN_ATTN", "mamba2": "MAMBA2", "mamba1": "MAMBA1"}  # -> MambaAttentionBackendEnum
ATTN_MIN_KERNEL_BLOCK = 16  # FlashAttention: MultipleOf(16)
GDN_FLASHINFER_CHECKPOINT_ALIGNMENT = 64  # vllm/v1/attention/backends/gdn_attn.py


def _layers(pattern: list[dict], repeat: int) -> list[dict]:
    return [dict(layer) for _ in range(repeat) for layer in pattern]


def _gpt_oss_120b() -> list[dict]:
    # openai/gpt-oss-120b config.json: 36 layers, layer_types alternating sliding_attention /
    # full_attention (vLLM's gpt_oss.py: sliding when layer_idx % 2 == 0), sliding_window 128,
    # 8 KV heads x head_dim 64, bf16.
    kv = {"num_kv_heads": 8, "head_dim": 64, "dtype": "bfloat16"}
    return _layers([{"type": "sliding", "window": 128, **kv}, {"type": "full", **kv}], 18)


def _gemma3_27b() -> list[dict]:
    # google/gemma-3-27b-it text_config: 62 layers, sliding_window 1024, sliding_window_pattern 6
    # (layer i is global when (i + 1) % 6 == 0: 5, 11, ..., 59 -> 10 global, 52 local),
    # 16 KV heads x head_dim 128, bf16.
    kv = {"num_kv_heads": 16, "head_dim": 128, "dtype": "bfloat16"}
    return [{"type": "full", **kv} if (i + 1) % 6 == 0 else {"type": "sliding", "window": 1024, **kv}
            for i in range(62)]


def _llama4_scout() -> list[dict]:
    # meta-llama/Llama-4-Scout-17B-16E text_config: 48 layers, attention_chunk_size 8192,
    # no_rope_layers [1, 1, 1, 0] * 12 (vLLM's llama4.py: a NoPE layer, no_rope_layers[i] == 0, is
    # global attention; the others are ChunkedLocalAttention), 8 KV heads x head_dim 128, bf16.
    kv = {"num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
    return _layers([{"type": "chunked", "chunk": 8192, **kv}] * 3 + [{"type": "full", **kv}], 12)


def _deepseek_v3() -> list[dict]:
    # deepseek-ai/DeepSeek-V3 config.json: 61 layers, MLA with kv_lora_rank 512 + qk_rope_head_dim 64:
    # one latent "head" of 576 per token (vLLM's MLAAttention.get_kv_cache_spec: num_kv_heads=1,
    # head_size = kv_lora_rank + qk_rope_head_dim, no separate V), bf16.
    return _layers([{"type": "mla", "num_kv_heads": 1, "head_dim": 576, "dtype": "bfloat16"}], 61)


def _qwen3_next_80b_a3b(prefill_checkpoints: bool = False) -> list[dict]:
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: num_hidden_layers 48, full_attention_interval 4
    # (vLLM's qwen3_next.py: layer i is full attention when (i + 1) % 4 == 0: 3, 7, ..., 47 -> 12;
    # the other 36 are Gated DeltaNet), num_key_value_heads 2 x head_dim 256, bf16;
    # GDN: linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
    # linear_value_head_dim 128, linear_conv_kernel_dim 4 -> vLLM's gated_delta_net_state_shape:
    # conv (4 - 1, 128*16*2 + 128*32) = (3, 8192), recurrent (32, 128, 128), both the model dtype
    # (bf16). prefill_checkpoints: the FlashInfer GDN prefill (CUDA SM90, e.g. H100) exports a
    # checkpoint (one more block, 64-token alignment); elsewhere the Triton path does not.
    attn = {"type": "full", "num_kv_heads": 2, "head_dim": 256, "dtype": "bfloat16"}
    gdn = {"type": "mamba", "mamba_type": "gdn", "shapes": [[3, 8192], [32, 128, 128]],
           "dtypes": ["bfloat16", "bfloat16"], "prefill_checkpoints": prefill_checkpoints}
    return [dict(attn) if (i + 1) % 4 == 0 else dict(gdn) for i in range(48)]


def _granite_4_0_h_tiny() -> list[dict]:
    # ibm-granite/granite-4.0-h-tiny config.json: num_hidden_layers 40, layer_types "attention" at
    # 5, 15, 25, 35, "mamba" elsewhere (36); num_key_value_heads 4, hidden_size 1536 /
    # num_attention_heads 12 = head_dim 128, bf16; Mamba-2: mamba_n_heads 48, mamba_d_head 64,
    # mamba_d_state 128, mamba_n_groups 1, mamba_d_conv 4, mamba_expand 2 -> vLLM's
    # mamba2_state_shape: conv (3, 2*1536 + 2*1*128) = (3, 3328), ssm (48, 64, 128), both bf16.
    attn = {"type": "full", "num_kv_heads": 4, "head_dim": 128, "dtype": "bfloat16"}
    m2 = {"type": "mamba", "mamba_type": "mamba2", "shapes": [[3, 3328], [48, 64, 128]],
          "dtypes": ["bfloat16", "bfloat16"], "prefill_checkpoints": False}
    return [dict(attn) if i in (5, 15, 25, 35) else dict(m2) for i in range(40)]


NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _nemotron_h_8b() -> list[dict]:
    # nvidia/Nemotron-H-8B-Base-8K config.json: num_hidden_layers 52, hybrid_override_pattern above
    # (M: Mamba-2 mixer, *: attention, -: MLP, which keeps no cache and is left out here; "layer" is
    # the model's layer index), num_key_value_heads 8 x head_dim 128, bf16; Mamba-2: mamba_num_heads
    # 128, mamba_head_dim 64, n_groups 8, ssm_state_size 128, conv_kernel 4 -> conv
    # (3, 128*64 + 2*8*128) = (3, 10240) bf16, ssm (128, 64, 128) in float32 (vLLM's
    # NemotronHForCausalLMConfig: mamba_ssm_cache_dtype "auto" -> float32).
    out = []
    for i, c in enumerate(NEMOTRON_H_8B_PATTERN):
        if c == "*":
            out.append({"type": "full", "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "layer": i})
        elif c == "M":
            out.append({"type": "mamba", "mamba_type": "mamba2", "shapes": [[3, 10240], [128, 64, 128]],
                        "dtypes": ["bfloat16", "float32"], "prefill_checkpoints": False, "layer": i})
    return out


# The models' config.json fields vLLM reads for the Mamba presets (planning cross-check only:
# ``vllm_aligned_block_size`` builds a real ModelConfig from them, so vLLM's own state-shape
# calculators and its block-size alignment run on the model's own architecture).
HF_CONFIGS: dict[str, dict] = {
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06, "vocab_size": 151936, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "torch_dtype": "bfloat16", "rope_theta": 10000000,
        "partial_rotary_factor": 0.25, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645},
    "granite-4.0-h-tiny": {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "hidden_size": 1536, "num_hidden_layers": 40, "num_attention_heads": 12, "num_key_value_heads": 4,
        "intermediate_size": 512, "shared_intermediate_size": 1024, "num_local_experts": 64,
        "num_experts_per_tok": 6, "vocab_size": 100352, "tie_word_embeddings": True, "mamba_d_state": 128,
        "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_expand": 2, "mamba_d_conv": 4,
        "mamba_chunk_size": 256, "max_position_embeddings": 131072,
        "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        "torch_dtype": "bfloat16", "position_embedding_type": "nope", "rms_norm_eps": 1e-05,
        "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256},
    "nemotron-h-8b": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
        "intermediate_size": 21504, "num_hidden_layers": 52, "hybrid_override_pattern": NEMOTRON_H_8B_PATTERN,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2,
        "chunk_size": 128, "max_position_embeddings": 8192, "vocab_size": 131072, "layer_norm_epsilon": 1e-05,
        "torch_dtype": "bfloat16", "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "use_bias": False, "use_conv_bias": True,
        "residual_in_fp32": False, "rescale_prenorm_residual": True, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
}
HF_CONFIGS["qwen3-next-80b-a3b-h100"] = HF_CONFIGS["qwen3-next-80b-a3b"]
# max_model_len for planning: the model's max_position_embeddings (Nemotron-H-8B: 8K).
MAX_MODEL_LEN = {name: cfg["max_position_embeddings"] for name, cfg in HF_CONFIGS.items()}


# name -> (layer list, the grouping vLLM 0.34 must produce: (kind, window or chunk, layers) per group
# in vLLM's group order; check_groups asserts it).
PRESETS: dict[str, tuple] = {
    "gpt-oss-120b": (_gpt_oss_120b, [("sliding", 128, 18), ("full", None, 18)]),
    "gemma-3-27b": (_gemma3_27b, [("sliding", 1024, 9)] * 4 + [("sliding", 1024, 8)] * 2
                    + [("full", None, 10)]),
    "llama-4-scout": (_llama4_scout, [("chunked", 8192, 12)] * 3 + [("full", None, 12)]),
    "deepseek-v3": (_deepseek_v3, [("mla", None, 61)]),
    # Mamba / linear-attention hybrids (align mode): vLLM puts the Mamba groups first (layer 0 is
    # Mamba), group size = the attention layer count.
    "qwen3-next-80b-a3b": (_qwen3_next_80b_a3b, [("mamba", None, 12)] * 3 + [("full", None, 12)]),
    "qwen3-next-80b-a3b-h100": (lambda: _qwen3_next_80b_a3b(prefill_checkpoints=True),
                                [("mamba", None, 12)] * 3 + [("full", None, 12)]),
    "granite-4.0-h-tiny": (_granite_4_0_h_tiny, [("mamba", None, 4)] * 9 + [("full", None, 4)]),
    "nemotron-h-8b": (_nemotron_h_8b, [("mamba", None, 4)] * 6 + [("full", None, 4)]),
}
MAMBA_PRESETS = ("qwen3-next-80b-a3b", "qwen3-next-80b-a3b-h100", "granite-4.0-h-tiny", "nemotron-h-8b")


def load_layers(spec: str) -> tuple[str, list[dict], list | None]:
    """(name, layers, expected grouping or None) of a preset name or a JSON file."""
    if spec in PRESETS:
        make, expect = PRESETS[spec]
        return spec, make(), [list(e) for e in expect]
    with open(spec, encoding="utf-8") as fh:
        obj = json.load(fh)
    if isinstance(obj, list):
        obj = {"layers": obj}
    name = obj.get("name") or os.path.splitext(os.path.basename(spec))[0]
    layers = obj["layers"]
    for i, layer in enumerate(layers):
        if layer.get("type") not in KINDS:
            raise ValueError(f"layer {i}: type must be one of {KINDS}, got {layer.get('type')!r}")
        if layer["type"] == "sliding" and not layer.get("window"):
            raise ValueError(f"layer {i}: a sliding layer needs 'window'")
        if layer["type"] == "chunked" and not layer.get("chunk"):
            raise ValueError(f"layer {i}: a chunked layer needs 'chunk'")
        if layer["type"] == "mamba":
            if layer.get("mamba_type") not in MAMBA_TYPES:
                raise ValueError(f"layer {i}: mamba_type must be one of {sorted(MAMBA_TYPES)}")
            if not layer.get("shapes") or len(layer["shapes"]) != len(layer.get("dtypes") or []):
                raise ValueError(f"layer {i}: a mamba layer needs 'shapes' and as many 'dtypes'")
    expect = obj.get("expect")
    return name, layers, [list(e) for e in expect] if expect else None


def layer_key(layer: dict) -> tuple:
    """(kind, window or chunk) of one layer."""
    kind = layer["type"]
    return kind, layer.get("window") if kind == "sliding" else layer.get("chunk") if kind == "chunked" else None


# ---- vLLM side (needs vLLM importable) ----------------------------------------------------------------

def _dtype(name: str):
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode
    table = {"bfloat16": (torch.bfloat16, KVQuantMode.NONE, "auto"),
             "float16": (torch.float16, KVQuantMode.NONE, "auto"),
             "fp8": (torch.uint8, KVQuantMode.FP8_PER_TENSOR, "fp8")}
    if name not in table:
        raise ValueError(f"dtype {name!r}: one of {sorted(table)}")
    return table[name]


def has_mamba(layers: list[dict]) -> bool:
    return any(layer["type"] == "mamba" for layer in layers)


def mamba_prefill_checkpoints(layers: list[dict]) -> bool:
    """Whether the model's Mamba layers export prefill checkpoints: vLLM takes them only when every
    Mamba layer can (``get_mamba_prefill_checkpoint_alignment`` is None otherwise)."""
    flags = {bool(layer.get("prefill_checkpoints")) for layer in layers if layer["type"] == "mamba"}
    return flags == {True}


def _torch_dtype(name: str):
    import torch
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def mamba_spec(layer: dict, block_size: int, page_size_padded: int | None, mamba_cache_mode: str = "align"):
    """vLLM's MambaSpec of one Mamba layer, as ``MambaBase.get_kv_cache_spec`` builds it (state
    alignment 1, no speculative blocks), plus what Qwen's GDN layer adds when it exports prefill
    checkpoints (``num_prefill_checkpoint_blocks=1``, alignment ``get_mamba_prefill_checkpoint_grid``
    = the Mamba block size with no --prefix-match-unit)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec
    kw = {}
    if layer.get("prefill_checkpoints") and mamba_cache_mode == "align":
        kw = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": block_size}
    return MambaSpec(block_size=block_size, shapes=tuple(tuple(int(x) for x in s) for s in layer["shapes"]),
                     dtypes=tuple(_torch_dtype(d) for d in layer["dtypes"]), state_alignment=1,
                     page_size_padded=page_size_padded,
                     mamba_type=getattr(MambaAttentionBackendEnum, MAMBA_TYPES[layer["mamba_type"]]),
                     mamba_cache_mode=mamba_cache_mode, **kw)


def mamba_state_bytes(layers: list[dict]) -> int:
    """The largest Mamba layer's own state bytes (one page before padding)."""
    return max(mamba_spec(layer, -1, None, "none").page_size_bytes for layer in layers if layer["type"] == "mamba")


def attn_page_bytes_per_token(layers: list[dict], kv_cache_dtype: str | None = None) -> int:
    """One token's page bytes of the attention layers (FullAttentionSpec at block 1, what
    ``_align_hybrid_block_size`` computes; FlashAttention's ``customize_spec`` leaves it as is)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    pages = set()
    for layer in layers:
        if layer["type"] == "mamba":
            continue
        if layer["type"] == "mla":
            raise NotImplementedError("Mamba + MLA hybrids are not modelled here")
        dtype, quant, _ = _dtype(kv_cache_dtype or layer.get("dtype", "bfloat16"))
        pages.add(FullAttentionSpec(block_size=1, num_kv_heads=int(layer["num_kv_heads"]),
                                    head_size=int(layer["head_dim"]), dtype=dtype, kv_quant_mode=quant).page_size_bytes)
    if len(pages) != 1:
        raise ValueError(f"a Mamba hybrid needs one attention page size, got {sorted(pages)}")
    return pages.pop()


def aligned_block_size(layers: list[dict], user_block_size: int | None, prefill_checkpoints: bool | None = None,
                       kv_cache_dtype: str | None = None, mamba_cache_mode: str = "align") -> dict:
    """vLLM 0.34's block size for a Mamba hybrid with the FlashAttention backend, TP 1: what
    ``Platform.update_block_size_for_backend`` makes of ``cache_config.block_size`` (platforms/interface.py),
    transcribed:
      phase 1: no --block-size -> the backend's preferred size for CacheConfig.DEFAULT_BLOCK_SIZE (64;
        FlashAttention takes MultipleOf(16), so 64);
      phase 2 (``_align_hybrid_block_size``): kernel_align = max(min kernel block 16, block_size),
        in align mode lcm(kernel_align, the Mamba layers' prefill checkpoint alignment or 1) (64 for
        Qwen's GDN with the FlashInfer prefill); attn_block = kernel_align * cdiv(mamba_page,
        kernel_align * attn_page_1_token), rounded up to a multiple of 16; block_size raised to it if
        smaller; align mode: mamba_block_size = block_size; mamba_page_size_padded = the attention page.
    Returns {"block_size", "mamba_block_size", "attn_page_bytes", "mamba_state_bytes",
    "mamba_page_size_padded", "padding_pct", ...}. ``vllm_aligned_block_size`` runs vLLM's own function
    on the model's config.json and the plan checks the two agree."""
    from math import lcm
    if prefill_checkpoints is None:
        prefill_checkpoints = mamba_prefill_checkpoints(layers)
    default = 64  # CacheConfig.DEFAULT_BLOCK_SIZE in 0.34, accepted by FlashAttention as is
    block_size = user_block_size or default
    attn_1 = attn_page_bytes_per_token(layers, kv_cache_dtype)
    mamba_page = mamba_state_bytes(layers)
    kernel_align = max(ATTN_MIN_KERNEL_BLOCK, block_size)
    if mamba_cache_mode == "align":
        kernel_align = lcm(kernel_align, GDN_FLASHINFER_CHECKPOINT_ALIGNMENT if prefill_checkpoints else 1)
    attn_block = kernel_align * -(-mamba_page // (kernel_align * attn_1))
    attn_block = ATTN_MIN_KERNEL_BLOCK * -(-attn_block // ATTN_MIN_KERNEL_BLOCK)
    if block_size < attn_block:
        block_size = attn_block
    attn_page = block_size * attn_1
    assert attn_page >= mamba_page
    return {"user_block_size": user_block_size, "prefill_checkpoints": bool(prefill_checkpoints),
            "mamba_cache_mode": mamba_cache_mode, "block_size": block_size,
            "mamba_block_size": block_size if mamba_cache_mode == "align" else None,
            "attn_page_bytes_per_token": attn_1, "attn_page_bytes": attn_page, "mamba_state_bytes": mamba_page,
            "mamba_page_size_padded": attn_page if attn_page != mamba_page else None,
            "padding_pct": round(100 * (attn_page - mamba_page) / mamba_page, 2)}


def layer_specs(layers: list[dict], block_size: int, kv_cache_dtype: str | None = None,
                mamba_cache_mode: str = "align", mamba_block_size: int | None = None) -> dict:
    """vLLM's per-layer KVCacheSpec for each layer, as the layers' get_kv_cache_spec build them
    (Attention, ChunkedLocalAttention, MLAAttention, MambaBase / Qwen's GDN layer), keyed by layer name
    in layer order. ``kv_cache_dtype`` ("fp8") overrides every attention layer's dtype, as
    ``--kv-cache-dtype`` does (a Mamba state keeps its own dtypes: --mamba-cache-dtype is apart).
    A Mamba layer's block size is ``block_size`` (the aligned size: align mode sets
    ``mamba_block_size = block_size``) and its page is padded to the attention page at that block size
    (``mamba_page_size_padded``), which must hold the state: every page ends equal. In "none" mode
    (prefix caching off) the Mamba block size is ``mamba_block_size`` (vLLM's MambaModelConfig hook
    sets ``cache_config.mamba_block_size = max_model_len``; ``MambaBase.get_kv_cache_spec`` takes it),
    the page still padded to the attention page at ``block_size``."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    padded = None
    if has_mamba(layers):
        padded = block_size * attn_page_bytes_per_token(layers, kv_cache_dtype)
        state = mamba_state_bytes(layers)
        if padded < state:
            raise ValueError(f"block size {block_size}: the attention page ({padded:,} B) is smaller than a "
                             f"Mamba state ({state:,} B); vLLM aligns the block size first (aligned_block_size)")
        if padded == state:
            padded = None  # _align_hybrid_block_size leaves mamba_page_size_padded unset then
    specs = {}
    for i, layer in enumerate(layers):
        kind = layer["type"]
        if kind == "mamba":
            specs[LAYER_NAME.format(i)] = mamba_spec(layer, mamba_block_size or block_size, padded, mamba_cache_mode)
            continue
        dtype, quant, cache_dtype_str = _dtype(kv_cache_dtype or layer.get("dtype", "bfloat16"))
        kw = dict(block_size=block_size, num_kv_heads=int(layer["num_kv_heads"]),
                  head_size=int(layer["head_dim"]), dtype=dtype, kv_quant_mode=quant)
        if kind == "full":
            spec = FullAttentionSpec(**kw)
        elif kind == "sliding":
            spec = SlidingWindowSpec(**kw, sliding_window=int(layer["window"]))
        elif kind == "chunked":
            spec = ChunkedLocalAttentionSpec(**kw, attention_chunk_size=int(layer["chunk"]))
        elif kind == "mla":
            spec = MLAAttentionSpec(**kw, max_tp_shards=1, cache_dtype_str=cache_dtype_str)
        else:
            raise ValueError(f"layer {i}: unknown type {kind!r}")
        specs[LAYER_NAME.format(i)] = spec
    if padded is not None or has_mamba(layers):
        pages = {s.page_size_bytes for s in specs.values()}
        assert len(pages) == 1, f"pages not equal: {sorted(pages)}"
    return specs


def spec_kind(spec) -> tuple:
    """(kind, window or chunk) of a vLLM group spec (per-layer spec or UniformTypeKVCacheSpecs)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {spec_kind(s) for s in spec.kv_cache_specs.values()}
        assert len(kinds) == 1, kinds
        return kinds.pop()
    if isinstance(spec, MambaSpec):
        return "mamba", None
    if isinstance(spec, MLAAttentionSpec):
        return "mla", None
    if isinstance(spec, FullAttentionSpec):
        return "full", None
    if isinstance(spec, SlidingWindowSpec):
        return "sliding", spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked", spec.attention_chunk_size
    return type(spec).__name__, None


def describe_groups(groups, layers: list[dict]) -> list[dict]:
    """One record per vLLM KV cache group: kind, window/chunk, layers, block size, page bytes."""
    from vllm.v1.kv_cache_interface import iter_layer_specs
    index = {LAYER_NAME.format(i): i for i in range(len(layers))}
    out = []
    for gid, g in enumerate(groups):
        kind, size = spec_kind(g.kv_cache_spec)
        per_layer = list(iter_layer_specs(g.kv_cache_spec))
        page = {s.page_size_bytes for s in per_layer}
        out.append({
            "group": gid, "kind": kind, "window": size if kind == "sliding" else None,
            "chunk": size if kind == "chunked" else None, "spec": type(per_layer[0]).__name__,
            "num_layers": len(g.layer_names), "layers": [index[n] for n in g.layer_names],
            "block_size": g.kv_cache_spec.block_size,
            "page_size_bytes": page.pop() if len(page) == 1 else sorted(page),
            "group_page_bytes": sum(s.page_size_bytes for s in
                                    (per_layer if len(per_layer) > 1 else per_layer * len(g.layer_names))),
        })
        if kind == "mamba":
            s0 = per_layer[0]
            out[-1]["mamba"] = {
                "mamba_type": s0.mamba_type.name, "mamba_cache_mode": s0.mamba_cache_mode,
                "shapes": [list(x) for x in s0.shapes], "dtypes": [str(d).replace("torch.", "") for d in s0.dtypes],
                "state_bytes": s0.state_content_size_bytes, "page_size_padded": s0.page_size_padded,
                "num_prefill_checkpoint_blocks": s0.num_prefill_checkpoint_blocks,
                "prefill_checkpoint_alignment": s0.prefill_checkpoint_alignment,
                "num_speculative_blocks": s0.num_speculative_blocks}
    return out


def check_groups(groups, layers: list[dict], expect: list | None) -> list[dict]:
    """Fail loudly unless vLLM's groups are the hybrid ones for this layer list: every layer in exactly
    one group, every group of one (kind, window/chunk) that is its layers' own, every kind of the
    layer list present, and (for presets) exactly the expected (kind, window, layers) per group."""
    desc = describe_groups(groups, layers)
    seen = [0] * len(layers)
    for d in desc:
        for i in d["layers"]:
            seen[i] += 1
            if layer_key(layers[i]) != (d["kind"], d["window"] if d["kind"] == "sliding" else d["chunk"]):
                raise AssertionError(
                    f"vLLM put layer {i} ({layer_key(layers[i])}) into a {d['kind']} group "
                    f"(window {d['window']}, chunk {d['chunk']}): the hybrid KV cache manager is off "
                    f"or the specs were promoted; groups: {desc}")
    if any(n != 1 for n in seen):
        raise AssertionError(f"layers not in exactly one group: {[i for i, n in enumerate(seen) if n != 1]}")
    kinds = {layer_key(layer) for layer in layers}
    got = {(d["kind"], d["window"] if d["kind"] == "sliding" else d["chunk"]) for d in desc}
    if kinds != got:
        raise AssertionError(f"layer kinds {sorted(map(str, kinds))} but vLLM's groups {sorted(map(str, got))}")
    if expect is not None:
        have = [[d["kind"], d["window"] if d["kind"] == "sliding" else d["chunk"], d["num_layers"]] for d in desc]
        if have != [list(e) for e in expect]:
            raise AssertionError(f"vLLM's groups {have} are not the expected {expect}")
    return desc


def prepare_config(vllm_config) -> None:
    """The two engine-core settings made before grouping (see the module docstring)."""
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    register_all_kvcache_specs(vllm_config)


def group_layers(vllm_config, specs: dict):
    """vLLM's global KV cache groups for these per-layer specs (EngineCore._initialize_kv_caches)."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    return get_global_kv_cache_groups(vllm_config, [dict(specs)])


def scheduler_kv_cache_config(vllm_config, groups, num_blocks: int):
    """(scheduler KVCacheConfig, scheduler_block_size, hash_block_size) for ``num_blocks`` blocks, the way
    EngineCore._initialize_kv_caches resolves them after get_kv_cache_configs."""
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    builder = get_kv_cache_config_builder(vllm_config)
    worker = builder.get_kv_cache_config_from_groups(vllm_config, groups, num_blocks)
    assert worker.num_blocks == num_blocks, (worker.num_blocks, num_blocks)
    worker.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    cfg = generate_scheduler_kv_cache_config([worker])
    cache_config = vllm_config.cache_config
    cache_config.num_gpu_blocks = cfg.num_blocks
    cache_config.block_size = min(g.kv_cache_spec.block_size for g in cfg.kv_cache_groups
                                  if g.kv_cache_spec.prefix_cacheable)
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(cfg, vllm_config)
    cfg.hash_block_size = hash_bs
    cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(cfg, vllm_config, sched_bs, hash_bs)
    return cfg, sched_bs, hash_bs


def _vllm_config(block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_dtype: str | None, mamba: bool = False):
    """A bare VllmConfig on the tiny weight-less model of drive.py (planning only); ``mamba``: align
    mode as vLLM's MambaModelConfig hook sets it for a hybrid with prefix caching on."""
    from drive import ensure_tiny_model  # noqa: PLC0415  (same folder)
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    model_config = ModelConfig(model=ensure_tiny_model(max_model_len), skip_tokenizer_init=True,
                               max_model_len=max_model_len, dtype="float32")
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True,
                               **({"cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}))
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       enable_chunked_prefill=True, max_model_len=max_model_len,
                                       is_encoder_decoder=False, async_scheduling=False)
    cfg = VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
                     device_config=DeviceConfig(device="cpu"))
    if mamba:
        set_mamba_align(cfg, block_size)
    prepare_config(cfg)
    return cfg


def set_mamba_align(vllm_config, block_size: int) -> None:
    """vLLM's align mode, by hand (the MambaModelConfig hook only runs for hybrid architectures and the
    tiny model is a Llama): prefix caching and chunked prefill on (asserted, as the hook does),
    ``mamba_cache_mode = "align"``, ``mamba_block_size`` = the aligned block size (what
    ``_align_hybrid_block_size`` sets in align mode)."""
    cc = vllm_config.cache_config
    assert cc.enable_prefix_caching, "align mode is Mamba prefix caching"
    assert vllm_config.scheduler_config.enable_chunked_prefill, "Chunked prefill is required for Mamba prefix caching"
    cc.mamba_cache_mode = "align"
    cc.mamba_block_size = block_size


def set_mamba_none(vllm_config) -> None:
    """vLLM's "none" mode, by hand (as ``MambaModelConfig.verify_and_update_config`` sets it with
    prefix caching off): ``mamba_cache_mode = "none"``, ``mamba_block_size = max_model_len`` (each
    request holds one block per Mamba group for its whole life); ``_align_hybrid_block_size`` still
    raises the attention block size and pads the Mamba page, but leaves ``mamba_block_size`` alone."""
    cc = vllm_config.cache_config
    assert not cc.enable_prefix_caching, "none mode is Mamba without prefix caching"
    cc.mamba_cache_mode = "none"
    if cc.mamba_block_size is None:
        cc.mamba_block_size = vllm_config.model_config.max_model_len


EXTRA_SITE = os.environ.get("KVBENCH_VLLM_EXTRA", "/work/vllm034/extra")


def vllm_aligned_block_size(name: str, user_block_size: int | None, max_model_len: int | None = None,
                            enable_prefix_caching: bool = True) -> dict:
    """vLLM's own ``Platform.update_block_size_for_backend`` (phases 1-3, ``_align_hybrid_block_size``)
    on a real ``VllmConfig`` of the preset's model (HF_CONFIGS written as a weight-less config.json),
    so the Mamba page comes from the model class's ``get_mamba_state_shape_from_config`` /
    ``get_mamba_state_dtype_from_config`` and the config hooks (``MambaModelConfig``: align mode from
    prefix caching; Nemotron-H: fp32 ssm state) run. What a model load would add is put in
    ``compilation_config.static_forward_context`` as stand-in layers: one FlashAttention layer per
    attention layer (``_find_non_ssm_backends``) and one ``MambaBase`` per Mamba layer, whose
    ``get_prefill_checkpoint_alignment`` is what Qwen's GDN layer answers (64 with the FlashInfer
    prefill, else None; ``get_mamba_prefill_checkpoint_alignment``). No vLLM function is replaced.
    Building the config needs ``compressed_tensors`` and ``loguru`` (imported by vLLM's model
    registry, in this process and in the model-inspection subprocess), not in the driver's venv:
    they are looked for in ``KVBENCH_VLLM_EXTRA`` (default /work/vllm034/extra, ``pip install
    --target``). Returns the same keys as ``aligned_block_size`` plus the model class's shapes.
    ``enable_prefix_caching=False``: the hook's "none" mode (``mamba_block_size = max_model_len``)."""
    import tempfile

    if os.path.isdir(EXTRA_SITE):
        if EXTRA_SITE not in sys.path:
            sys.path.insert(0, EXTRA_SITE)
        pp = os.environ.get("PYTHONPATH", "")
        if EXTRA_SITE not in pp.split(os.pathsep):
            os.environ["PYTHONPATH"] = EXTRA_SITE + (os.pathsep + pp if pp else "")
    import torch  # noqa: F401
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    _, layers, _ = load_layers(name)
    hf = HF_CONFIGS[name]
    ckpt = mamba_prefill_checkpoints(layers)
    max_model_len = min(max_model_len or MAX_MODEL_LEN[name], MAX_MODEL_LEN[name])
    model_dir = os.path.join(tempfile.gettempdir(), f"kvbench-vllm-{hf['model_type']}")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf, fh, indent=1)

    class AttnLayer(AttentionLayerBase):
        def get_attn_backend(self):
            return FlashAttentionBackend

        def get_kv_cache_spec(self, vllm_config):
            return None

    class MambaLayer(MambaBase):
        def __init__(self, layer: dict):
            self.layer = layer

        def get_state_shape(self):
            return tuple(tuple(x) for x in self.layer["shapes"])

        def get_state_dtype(self):
            return tuple(_torch_dtype(d) for d in self.layer["dtypes"])

        @property
        def mamba_type(self):
            return getattr(MambaAttentionBackendEnum, MAMBA_TYPES[self.layer["mamba_type"]])

        def get_prefill_checkpoint_alignment(self):
            return GDN_FLASHINFER_CHECKPOINT_ALIGNMENT if self.layer.get("prefill_checkpoints") else None

    vcfg = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len,
                                 dtype="bfloat16"),
        cache_config=CacheConfig(block_size=user_block_size, enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, enable_chunked_prefill=True,
                                         max_model_len=max_model_len, is_encoder_decoder=False,
                                         async_scheduling=False),
        device_config=DeviceConfig(device="cpu"))
    ctx = vcfg.compilation_config.static_forward_context
    for i, layer in enumerate(layers):
        ctx[LAYER_NAME.format(i)] = MambaLayer(layer) if layer["type"] == "mamba" else AttnLayer()
    cc = vcfg.cache_config
    assert vcfg.model_config.is_hybrid, "vLLM does not see a hybrid model"
    mode = cc.mamba_cache_mode
    Platform.update_block_size_for_backend(vcfg)
    model_cls, _ = ModelRegistry.resolve_model_cls(vcfg.model_config.architecture, model_config=vcfg.model_config)
    shapes = [list(x) for x in model_cls.get_mamba_state_shape_from_config(vcfg)]
    dtypes = [str(d).replace("torch.", "") for d in model_cls.get_mamba_state_dtype_from_config(vcfg)]
    return {"user_block_size": user_block_size, "prefill_checkpoints": ckpt, "mamba_cache_mode": mode,
            "block_size": cc.block_size, "mamba_block_size": cc.mamba_block_size,
            "mamba_page_size_padded": cc.mamba_page_size_padded, "model_class": model_cls.__name__,
            "model_state_shapes": shapes, "model_state_dtypes": dtypes, "max_model_len": max_model_len}


def plan_mamba(name: str, user_block_size: int | None, mem_gib: list[float], max_model_len: int,
               max_num_seqs: int, max_num_batched_tokens: int, check_vllm: bool = True) -> dict:
    """The plan of a Mamba preset at one user block size (None: no --block-size): the aligned block size
    (``aligned_block_size``, checked against vLLM's own ``update_block_size_for_backend`` on the model's
    config when ``check_vllm``), then groups and num_blocks as ``plan_one``."""
    _, layers, _ = load_layers(name)
    al = aligned_block_size(layers, user_block_size)
    vllm_al = None
    if check_vllm:
        try:
            vllm_al = vllm_aligned_block_size(name, user_block_size, max_model_len)
        except Exception as e:  # noqa: BLE001  (the formula stands; the record says why vLLM could not run)
            vllm_al = {"error": f"{type(e).__name__}: {e}"}
        else:
            for k in ("block_size", "mamba_block_size", "mamba_page_size_padded"):
                if vllm_al[k] != al[k]:
                    raise AssertionError(f"{name} bs {user_block_size}: aligned_block_size {k}={al[k]} but "
                                         f"vLLM's update_block_size_for_backend {vllm_al[k]}")
            assert vllm_al["mamba_cache_mode"] == "align", vllm_al
            mamba = [layer for layer in layers if layer["type"] == "mamba"]
            if [list(map(int, s)) for s in mamba[0]["shapes"]] != vllm_al["model_state_shapes"] or \
                    list(mamba[0]["dtypes"]) != vllm_al["model_state_dtypes"]:
                raise AssertionError(f"{name}: preset state {mamba[0]['shapes']} {mamba[0]['dtypes']} but vLLM's "
                                     f"{vllm_al['model_class']} says {vllm_al['model_state_shapes']} "
                                     f"{vllm_al['model_state_dtypes']}")
    mml = min(max_model_len, MAX_MODEL_LEN.get(name, max_model_len))
    out = plan_one(name, al["block_size"], mem_gib, mml, max_num_seqs, max_num_batched_tokens)
    out = {"model": name, "user_block_size": user_block_size, "alignment": al,
           "vllm_update_block_size_for_backend": vllm_al, **{k: v for k, v in out.items() if k != "model"}}
    return out


def plan_one(name: str, block_size: int, mem_gib: list[float], max_model_len: int, max_num_seqs: int,
             max_num_batched_tokens: int, kv_cache_dtype: str | None = None, disable_hybrid: bool = False) -> dict:
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import (
        _estimate_max_model_len_from_groups,
        _max_memory_usage_bytes_from_groups,
        _pool_bytes_per_block,
        get_kv_cache_configs,
    )
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    _, layers, expect = load_layers(name)
    vcfg = _vllm_config(block_size, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_dtype,
                        mamba=has_mamba(layers))
    if disable_hybrid:
        vcfg.scheduler_config.disable_hybrid_kv_cache_manager = True
    specs = layer_specs(layers, block_size, kv_cache_dtype)
    groups = group_layers(vcfg, specs)
    desc = describe_groups(groups, layers) if disable_hybrid else check_groups(groups, layers, expect)
    builder = get_kv_cache_config_builder(vcfg)
    bytes_per_block = _pool_bytes_per_block(vcfg, groups)
    rows = []
    for gib in mem_gib:
        avail = int(gib * (1 << 30))
        cfg = builder.get_kv_cache_config_from_groups(vcfg, groups, avail // bytes_per_block)
        row = {"kv_memory_gib": gib, "available_bytes": avail, "num_blocks": cfg.num_blocks,
               "usable_blocks": cfg.num_blocks - 1}
        try:
            checked = get_kv_cache_configs(vcfg, [dict(specs)], [avail], groups)
            row["get_kv_cache_configs_num_blocks"] = checked[0].num_blocks
            row["fits_max_model_len"] = True
            row["max_concurrency"] = round(get_max_concurrency_for_kv_cache_config(vcfg, checked[0]), 4)
        except ValueError:
            row["fits_max_model_len"] = False
            row["estimated_max_model_len"] = _estimate_max_model_len_from_groups(
                builder, vcfg, groups, avail - bytes_per_block)
        rows.append(row)
    return {
        "model": name, "block_size": block_size, "kv_cache_dtype": kv_cache_dtype or "auto (bf16)",
        "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens,
        "max_in_flight_tokens": vcfg.max_in_flight_tokens,
        "disable_hybrid_kv_cache_manager": vcfg.scheduler_config.disable_hybrid_kv_cache_manager,
        "kv_cache_layout": vcfg.cache_config.kv_cache_layout,
        "num_layers": len(layers), "groups": desc, "bytes_per_block": bytes_per_block,
        "max_memory_usage_bytes_per_request": _max_memory_usage_bytes_from_groups(builder, vcfg, groups),
        "planning": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="groups and planned num_blocks of each preset")
    p.add_argument("--models", nargs="*", default=[m for m in PRESETS if m not in MAMBA_PRESETS])
    p.add_argument("--mamba-models", nargs="*", default=list(MAMBA_PRESETS),
                   help="Mamba presets, planned at each --mamba-block-size after vLLM's block-size alignment")
    p.add_argument("--mamba-block-size", nargs="*", default=["16", "none"],
                   help="user block sizes for the Mamba presets ('none': no --block-size, vLLM starts from 64)")
    p.add_argument("--no-vllm-check", action="store_true",
                   help="Mamba presets: skip running vLLM's update_block_size_for_backend on the model's config")
    p.add_argument("--block-size", type=int, nargs="*", default=[16])
    p.add_argument("--mem-gib", type=float, nargs="*", default=[1, 4, 16])
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--fp8", action="store_true", help="also plan with --kv-cache-dtype fp8")
    p.add_argument("--disabled", action="store_true",
                   help="also plan with disable_hybrid_kv_cache_manager=True (every layer full attention)")
    p.add_argument("--out", default=None)
    a = sub.add_parser("align", help="vLLM's aligned block size of the Mamba presets (formula and vLLM's own)")
    a.add_argument("--mamba-models", nargs="*", default=list(MAMBA_PRESETS))
    a.add_argument("--mamba-block-size", nargs="*", default=["16", "none"])
    args = ap.parse_args(argv)
    if args.cmd == "align":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        for name in args.mamba_models:
            _, layers, _ = load_layers(name)
            for ubs in args.mamba_block_size:
                bs = None if ubs == "none" else int(ubs)
                print(json.dumps({"model": name, "formula": aligned_block_size(layers, bs),
                                  "vllm": vllm_aligned_block_size(name, bs)}))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm
    plans = []
    for name in args.models:
        for bs in args.block_size:
            variants = [(None, False)] + ([("fp8", False)] if args.fp8 else []) + \
                       ([(None, True)] if args.disabled else [])
            for dtype, disabled in variants:
                plans.append(plan_one(name, bs, args.mem_gib, args.max_model_len, args.max_num_seqs,
                                      args.max_num_batched_tokens, dtype, disabled))
    for name in args.mamba_models:
        for ubs in args.mamba_block_size:
            plans.append(plan_mamba(name, None if ubs == "none" else int(ubs), args.mem_gib, args.max_model_len,
                                    args.max_num_seqs, args.max_num_batched_tokens,
                                    check_vllm=not args.no_vllm_check))
    out = {"vllm_version": vllm.__version__, "source": "benchmarks/vllm_reference/hybrid.py plan: vLLM's "
           "get_global_kv_cache_groups and get_kv_cache_config_from_groups / get_kv_cache_configs; Mamba "
           "presets at vLLM's aligned block size (aligned_block_size, checked against vLLM's "
           "Platform.update_block_size_for_backend on the model's config)",
           "plans": plans}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
