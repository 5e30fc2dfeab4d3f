#!/usr/bin/env python3
"""Per-layer KV specs for drive.py's hybrid mode, vLLM 0.34's own grouping and planning of them.

A layer list says, per attention layer of a model, what KV it keeps:

    {"type": "full" | "sliding" | "chunked" | "mla", "window": W (sliding), "chunk": C (chunked),
     "num_kv_heads": H, "head_dim": D, "dtype": "bfloat16" | "float16" | "fp8"}

(an MLA layer keeps one latent "head" of head_dim = kv_lora_rank + qk_rope_head_dim, e.g. 512 + 64).
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
"""
from __future__ import annotations

import argparse
import json
import os
import sys

LAYER_NAME = "model.layers.{}.self_attn.attn"
KINDS = ("full", "sliding", "chunked", "mla")


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


# name -> (layer list, the grouping vLLM 0.34 must produce: (kind, window or chunk, layers) per group
# in vLLM's group order; check_groups asserts it).
PRESETS: dict[str, tuple] = {
    "gpt-oss-120b": (_gpt_oss_120b, [("sliding", 128, 18), ("full", None, 18)]),
    "gemma-3-27b": (_gemma3_27b, [("sliding", 1024, 9)] * 4 + [("sliding", 1024, 8)] * 2
                    + [("full", None, 10)]),
    "llama-4-scout": (_llama4_scout, [("chunked", 8192, 12)] * 3 + [("full", None, 12)]),
    "deepseek-v3": (_deepseek_v3, [("mla", None, 61)]),
}


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


def layer_specs(layers: list[dict], block_size: int, kv_cache_dtype: str | None = None) -> dict:
    """vLLM's per-layer KVCacheSpec for each layer, as the layers' get_kv_cache_spec build them
    (Attention, ChunkedLocalAttention, MLAAttention), keyed by layer name in layer order.
    ``kv_cache_dtype`` ("fp8") overrides every layer's dtype, as ``--kv-cache-dtype`` does."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    specs = {}
    for i, layer in enumerate(layers):
        dtype, quant, cache_dtype_str = _dtype(kv_cache_dtype or layer.get("dtype", "bfloat16"))
        kw = dict(block_size=block_size, num_kv_heads=int(layer["num_kv_heads"]),
                  head_size=int(layer["head_dim"]), dtype=dtype, kv_quant_mode=quant)
        kind = layer["type"]
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
    return specs


def spec_kind(spec) -> tuple:
    """(kind, window or chunk) of a vLLM group spec (per-layer spec or UniformTypeKVCacheSpecs)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {spec_kind(s) for s in spec.kv_cache_specs.values()}
        assert len(kinds) == 1, kinds
        return kinds.pop()
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
                 kv_cache_dtype: str | None):
    """A bare VllmConfig on the tiny weight-less model of drive.py (planning only)."""
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
    prepare_config(cfg)
    return cfg


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
    vcfg = _vllm_config(block_size, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_dtype)
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
    p.add_argument("--models", nargs="*", default=list(PRESETS))
    p.add_argument("--block-size", type=int, nargs="*", default=[16])
    p.add_argument("--mem-gib", type=float, nargs="*", default=[1, 4, 16])
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--fp8", action="store_true", help="also plan with --kv-cache-dtype fp8")
    p.add_argument("--disabled", action="store_true",
                   help="also plan with disable_hybrid_kv_cache_manager=True (every layer full attention)")
    p.add_argument("--out", default=None)
    args = ap.parse_args(argv)
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
    out = {"vllm_version": vllm.__version__, "source": "benchmarks/vllm_reference/hybrid.py plan: vLLM's "
           "get_global_kv_cache_groups and get_kv_cache_config_from_groups / get_kv_cache_configs",
           "plans": plans}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
