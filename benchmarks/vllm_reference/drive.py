#!/usr/bin/env python3
"""Drive vLLM's own v1 Scheduler + KVCacheManager (0.34; 0.33 works too) without a model, on a kvbench trace.

Reference for kvbench: the same trace, the same linear clock, vLLM's real scheduling code.

    VLLM_VENV/bin/python drive.py TRACE --limit N --num-blocks B --block-size S --out steps.jsonl

It prints a JSON summary (also written to OUT with .summary.json) that names the vLLM version it ran
and the scheduler settings that matter (block size, full-prompt admission, async scheduling off,
cache-aware admission window off, ...).

What is real vLLM: Scheduler.schedule(), Scheduler.update_from_output(), KVCacheManager, BlockPool,
Request, the prefix-cache block hasher (sha256 by default, as vLLM's CacheConfig default).
What is faked: the model. Every scheduled request whose computed tokens reach its known tokens gets
one sampled token, chosen by kvbench's rule (TokenStreams.output_tokens(req, 1, k, 0)).
No vLLM source is modified; no vLLM function is monkeypatched. The only non-default plumbing:
  * ModelConfig is built from a local, weight-less tiny Llama config.json (skip_tokenizer_init=True),
  * DeviceConfig(device="cpu") is passed explicitly (the platform is vLLM's UnspecifiedPlatform,
    whose empty device_type otherwise makes DeviceConfig raise),
  * cache_config.num_gpu_blocks and the KVCacheConfig are set by hand (EngineCore would derive them
    from memory profiling), exactly as EngineCore._initialize_kv_caches does afterwards,
  * the block size is always passed (0.34's CacheConfig.DEFAULT_BLOCK_SIZE is 64, 0.33's was 16),
    async scheduling is off (SchedulerConfig.async_scheduling=False, and the synchronous Scheduler is
    built directly: a step-for-step driver needs schedule() and update_from_output() to alternate),
    and 0.34's cache_aware_admission_window stays at its default 0 (strict arrival-order admission)
    unless --cache-aware-admission-window asks otherwise,
  * on a CPU build of vLLM (its platform is CpuPlatform) 0.34 refuses an x86 CPU without Triton in
    CpuPlatform.check_and_update_config; there the driver sets vllm.triton_utils.HAS_TRITON = True
    before building the config, since no kernel ever runs. With the CUDA wheel on a machine without
    a GPU the platform is UnspecifiedPlatform and nothing is set.
Hybrid models: `--layers MODEL` (a preset of hybrid.py or a JSON layer list) replaces the one
full-attention group by vLLM's own grouping of per-layer specs (sliding window, chunked local, MLA,
full), built and checked by hybrid.py with the hybrid KV cache manager on; the summary's "hybrid"
record has the groups, the coordinator and each manager's admission cap. With Mamba / linear-attention
layers (hybrid.py's "mamba" type) the run is vLLM's align mode: prefix caching and chunked prefill on,
cache_config.mamba_cache_mode = "align" and mamba_block_size = --block-size set by hand (the tiny
model is a Llama, so vLLM's MambaModelConfig hook and platform alignment do not run), and
--block-size must be what vLLM's _align_hybrid_block_size makes of a user --block-size 16
(hybrid.aligned_block_size: 544 for Qwen3-Next, 576 with its GDN prefill checkpoints, 400 for
Granite 4.0-H Tiny); the driver asserts the scheduler runs the Mamba block-aligned split
(Scheduler.need_mamba_block_aligned_split) and the Mamba groups' managers are MambaManager in align
mode, and the "hybrid" record's "mamba" part says so. With --no-prefix-caching a Mamba layer list runs
vLLM's "none" mode instead (what MambaModelConfig.verify_and_update_config makes of prefix caching
off): mamba_cache_mode "none", the Mamba specs' block size = max_model_len (one block per Mamba group
per request), the page still padded to the attention page at the aligned --block-size (the same
alignment, without the GDN checkpoint lcm); asserted: KVCacheCoordinatorNoPrefixCache, MambaManager
in "none" mode, no block-aligned split, scheduler = hash block size = lcm(group block sizes), and no
request block hasher (as EngineCore without prefix caching); "prefix_caching": false in the record.
Install kvbench into vLLM's venv with `pip install --no-deps -e .` (not PYTHONPATH=<repo>: the repo's
kernels/ folder would shadow the `kernels` package that transformers probes for, in this process and
in the subprocess where vLLM inspects the model class).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL = os.path.join(__import__("tempfile").gettempdir(), "kvbench-vllm-tiny-model")


def ensure_tiny_model(max_model_len: int) -> str:
    """A weight-less Llama config.json vLLM's ModelConfig can read offline."""
    cfg_path = os.path.join(TINY_MODEL, "config.json")
    if not os.path.exists(cfg_path):
        os.makedirs(TINY_MODEL, exist_ok=True)
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
            "vocab_size": 32000, "max_position_embeddings": max_model_len,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "torch_dtype": "float32",
        }
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)
    return TINY_MODEL


def vllm_version() -> str:
    import vllm
    return getattr(vllm, "__version__", "unknown")


def build_scheduler(args):
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.platforms import current_platform
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    if current_platform.is_cpu():
        import vllm.triton_utils
        if not vllm.triton_utils.HAS_TRITON:
            vllm.triton_utils.HAS_TRITON = True  # see the module docstring: no kernel runs here

    layers = None
    args.mamba = None
    if args.layers:
        import hybrid
        args.layers_name, layers, args.layers_expect = hybrid.load_layers(args.layers)
        if hybrid.has_mamba(layers):
            # vLLM's align mode needs the block size its platform aligns for the model
            # (Platform._align_hybrid_block_size); --block-size is that aligned size, for a user
            # --block-size 16 (FlashAttention, TP 1). With --no-prefix-caching: vLLM's "none" mode
            # (MambaModelConfig.verify_and_update_config), where the attention block size is raised
            # the same way (pages must match) but without the GDN checkpoint alignment.
            mode = "none" if args.no_prefix_caching else "align"
            al = hybrid.aligned_block_size(layers, 16, mamba_cache_mode=mode)
            if args.block_size != al["block_size"]:
                sys.exit(f"{args.layers_name}: vLLM aligns --block-size 16 to {al['block_size']} "
                         f"(Mamba state {al['mamba_state_bytes']:,} B, attention {al['attn_page_bytes_per_token']:,} "
                         f"B/token, prefill checkpoints {al['prefill_checkpoints']}); pass --block-size "
                         f"{al['block_size']}, not {args.block_size}")
            args.mamba = {"user_block_size": 16, "alignment": al}
            if args.no_prefix_caching:
                args.mamba["prefix_caching"] = False
    model_config = ModelConfig(model=ensure_tiny_model(args.max_model_len), skip_tokenizer_init=True,
                               max_model_len=args.max_model_len, dtype="float32")
    cache_config = CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                               prefix_caching_hash_algo=args.hash)
    extra = {}
    if args.cache_aware_admission_window:
        if "cache_aware_admission_window" not in SchedulerConfig.__dataclass_fields__:
            sys.exit(f"vLLM {vllm_version()} has no cache_aware_admission_window (0.34 and later)")
        extra["cache_aware_admission_window"] = args.cache_aware_admission_window
        extra["cache_aware_admission_threshold"] = args.cache_aware_admission_threshold
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=True, max_model_len=args.max_model_len, is_encoder_decoder=False,
        async_scheduling=False, scheduler_reserve_full_isl=not args.no_reserve_full_isl,
        watermark=args.watermark, **extra)
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                             scheduler_config=scheduler_config,
                             device_config=DeviceConfig(device="cpu"))
    vllm_config.cache_config.num_gpu_blocks = args.num_blocks
    spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=1, head_size=64,
                             dtype=torch.float16)
    kv_cache_config = KVCacheConfig(
        num_blocks=args.num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"],
                                          kv_cache_spec=spec)],
        hash_block_size=args.block_size, cache_hit_alignment_tokens=args.block_size)
    sched_block_size = hash_block_size = args.block_size
    args.kv_cache_groups = None
    if args.layers:
        # Hybrid mode (hybrid.py): vLLM's own grouping of the per-layer specs, checked, and the
        # scheduler's KVCacheConfig built the way EngineCore._initialize_kv_caches builds it.
        import hybrid
        name, expect = args.layers_name, args.layers_expect
        mamba_mode, mamba_block_size = "align", None
        if args.mamba and args.no_prefix_caching:
            # "None" mode as vLLM's MambaModelConfig hook sets it with prefix caching off (the tiny
            # model is a Llama, so the hook does not run): mamba_cache_mode "none", mamba_block_size
            # = max_model_len; each Mamba layer's MambaSpec (MambaBase.get_kv_cache_spec) takes that
            # block size and the page padded to the attention page at the aligned block size.
            hybrid.set_mamba_none(vllm_config)
            mamba_mode, mamba_block_size = "none", vllm_config.cache_config.mamba_block_size
            assert mamba_block_size == args.max_model_len, mamba_block_size
        elif args.mamba:
            # Align mode as vLLM's MambaModelConfig hook and _align_hybrid_block_size set it (the
            # tiny model is a Llama, so neither runs): prefix caching + chunked prefill on,
            # mamba_cache_mode "align", mamba_block_size = the aligned block size;
            # prefix_cache_retention_interval stays at its default.
            hybrid.set_mamba_align(vllm_config, args.block_size)
        hybrid.prepare_config(vllm_config)
        specs = hybrid.layer_specs(layers, args.block_size, args.kv_cache_dtype,
                                   **({"mamba_cache_mode": mamba_mode, "mamba_block_size": mamba_block_size}
                                      if mamba_mode == "none" else {}))
        groups = hybrid.group_layers(vllm_config, specs)
        args.kv_cache_groups = hybrid.check_groups(groups, layers, expect)
        args.layers_name, args.num_layers = name, len(layers)
        kv_cache_config, sched_block_size, hash_block_size = hybrid.scheduler_kv_cache_config(
            vllm_config, groups, args.num_blocks)
        assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                      structured_output_manager=StructuredOutputManager(vllm_config),
                      block_size=sched_block_size, hash_block_size=hash_block_size,
                      include_finished_set=False, log_stats=True)
    if args.layers:
        coord = sched.kv_cache_manager.coordinator
        got = [type(m).__name__ for m in coord.single_type_managers]
        assert len(got) == len(args.kv_cache_groups), got
        if len(got) > 1 and not args.no_prefix_caching:
            assert type(coord).__name__ == "HybridKVCacheCoordinator", type(coord).__name__
        for d, m in zip(args.kv_cache_groups, coord.single_type_managers):
            d["manager"] = type(m).__name__
            d["max_admission_blocks_per_request"] = m.max_admission_blocks_per_request
        args.coordinator = type(coord).__name__
        args.prefix_cache_retention_interval = coord.retention_interval
        if args.mamba and args.no_prefix_caching:
            from vllm.v1.core.single_type_kv_cache_manager import MambaManager
            cc = vllm_config.cache_config
            assert cc.mamba_cache_mode == "none" and cc.mamba_block_size == args.max_model_len, cc
            assert not cc.enable_prefix_caching and not sched.kv_cache_manager.enable_caching
            assert sched.has_mamba_layers and not sched.need_mamba_block_aligned_split, \
                "vLLM's scheduler runs the Mamba block-aligned split without prefix caching"
            assert type(coord).__name__ == "KVCacheCoordinatorNoPrefixCache", type(coord).__name__
            pages = set()
            for d, m in zip(args.kv_cache_groups, coord.single_type_managers):
                pages.add(d["page_size_bytes"])
                if d["kind"] == "mamba":
                    assert isinstance(m, MambaManager) and m.mamba_cache_mode == "none", (d, m)
                    assert d["block_size"] == args.max_model_len and m.block_size == args.max_model_len, d
                    assert d["mamba"]["page_size_padded"] == args.mamba["alignment"]["mamba_page_size_padded"], d
                else:
                    assert d["block_size"] == args.block_size, d
            assert pages == {args.mamba["alignment"]["attn_page_bytes"]}, pages
            # resolve_kv_cache_block_sizes: prefix caching (and connectors) off -> both the lcm of
            # the group block sizes; nothing is hashed (EngineCore makes no block hasher).
            from math import lcm
            assert sched_block_size == hash_block_size == lcm(args.block_size, args.max_model_len), \
                (sched_block_size, hash_block_size)
            args.mamba.update({
                "aligned_block_size": args.block_size, "mamba_cache_mode": cc.mamba_cache_mode,
                "mamba_block_size": cc.mamba_block_size,
                "need_mamba_block_aligned_split": sched.need_mamba_block_aligned_split,
                "managers": sorted({d["manager"] for d in args.kv_cache_groups}),
                "coordinator": args.coordinator})
            # vLLM's own hook and platform alignment on the real model config (hybrid.py), where
            # the extra packages are there (README.md); recorded apart from the golden's record.
            try:
                args.vllm_alignment = hybrid.vllm_aligned_block_size(
                    args.layers_name, 16, args.max_model_len, enable_prefix_caching=False)
            except Exception as e:  # noqa: BLE001
                args.vllm_alignment = {"error": f"{type(e).__name__}: {e}"}
            else:
                got_al = {k: args.vllm_alignment[k] for k in (
                    "mamba_cache_mode", "block_size", "mamba_block_size", "mamba_page_size_padded")}
                want = {"mamba_cache_mode": "none", "block_size": args.block_size,
                        "mamba_block_size": min(args.max_model_len, hybrid.MAX_MODEL_LEN[args.layers_name]),
                        "mamba_page_size_padded": args.mamba["alignment"]["mamba_page_size_padded"]}
                assert got_al == want, (got_al, want)
        elif args.mamba:
            from vllm.v1.core.single_type_kv_cache_manager import MambaManager
            cc = vllm_config.cache_config
            assert cc.mamba_cache_mode == "align" and cc.mamba_block_size == args.block_size, cc
            assert cc.enable_prefix_caching and vllm_config.scheduler_config.enable_chunked_prefill
            assert sched.has_mamba_layers and sched.need_mamba_block_aligned_split, \
                "vLLM's scheduler does not run the Mamba block-aligned split"
            assert type(coord).__name__ == "HybridKVCacheCoordinator", type(coord).__name__
            mamba_groups = [d for d in args.kv_cache_groups if d["kind"] == "mamba"]
            assert mamba_groups
            for d, m in zip(args.kv_cache_groups, coord.single_type_managers):
                if d["kind"] == "mamba":
                    assert isinstance(m, MambaManager) and m.mamba_cache_mode == "align", (d, m)
                    d["mamba"]["has_prefill_checkpoint_blocks"] = bool(m.has_prefill_checkpoint_blocks)
            ckpt = args.mamba["alignment"]["prefill_checkpoints"]
            assert sched.mamba_has_prefill_checkpoint_blocks == ckpt, (sched.mamba_has_prefill_checkpoint_blocks, ckpt)
            args.mamba.update({
                "aligned_block_size": args.block_size, "mamba_cache_mode": cc.mamba_cache_mode,
                "mamba_block_size": cc.mamba_block_size,
                "need_mamba_block_aligned_split": sched.need_mamba_block_aligned_split,
                "mamba_has_prefill_checkpoint_blocks": sched.mamba_has_prefill_checkpoint_blocks,
                "mamba_prefill_checkpoint_alignment": sched.mamba_prefill_checkpoint_alignment,
                "mamba_partial_cache_hit": sched.mamba_partial_cache_hit,
                "cache_hit_alignment_tokens": kv_cache_config.cache_hit_alignment_tokens,
                "managers": sorted({d["manager"] for d in args.kv_cache_groups}),
                "coordinator": args.coordinator,
                "prefix_cache_retention_interval": cc.prefix_cache_retention_interval})
    sc = vllm_config.scheduler_config
    assert type(sched) is Scheduler and sc.async_scheduling is False, "async scheduling must be off"
    assert vllm_config.cache_config.block_size == args.block_size
    hash_fn = get_hash_fn_by_name(args.hash)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens)
    if args.mamba and args.no_prefix_caching:
        hasher = None  # EngineCore makes no request block hasher without prefix caching or a connector
    return sched, hasher, vllm_config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the file")
    ap.add_argument("--num-blocks", type=int, default=48000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--watermark", type=float, default=0.0)
    ap.add_argument("--no-reserve-full-isl", action="store_true",
                    help="scheduler_reserve_full_isl=False (default True, as vLLM)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="prefix caching off; with Mamba layers: vLLM's Mamba \"none\" mode")
    ap.add_argument("--cache-aware-admission-window", type=int, default=0,
                    help="vLLM 0.34's SchedulerConfig.cache_aware_admission_window (default 0: off, "
                         "strict arrival order, as vLLM's default)")
    ap.add_argument("--cache-aware-admission-threshold", type=float, default=0.5,
                    help="vLLM 0.34's SchedulerConfig.cache_aware_admission_threshold")
    ap.add_argument("--layers", default=None,
                    help="hybrid mode: per-layer KV specs, a preset of hybrid.py (gpt-oss-120b, gemma-3-27b, "
                         "llama-4-scout, deepseek-v3; Mamba hybrids: qwen3-next-80b-a3b[-h100], "
                         "granite-4.0-h-tiny, nemotron-h-8b) or a JSON layer list; vLLM groups them itself. "
                         "With Mamba layers: vLLM's align mode, and --block-size must be the size vLLM "
                         "aligns a user --block-size 16 to (hybrid.py align)")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["fp8"],
                    help="hybrid mode: every layer's KV in fp8 (default: the layer list's dtype)")
    ap.add_argument("--hash", default="sha256", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    ap.add_argument("--decode-step-ms", type=float, default=20.0)
    ap.add_argument("--out", default="steps.jsonl", help="per-step JSON lines")
    ap.add_argument("--req-out", default=None, help="per-request JSON lines (default: OUT with .requests.jsonl)")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--float-clock", action="store_true",
                    help="accumulate the clock as float seconds (default: exact integer nanoseconds)")
    args = ap.parse_args(argv)

    from vllm.platforms import current_platform
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VReq

    from kvbench.trace.format import load_trace
    from kvbench.trace.tokens import TokenStreams

    trace = load_trace(args.trace, limit=args.limit)
    for r in trace:
        if r.n != 1:
            sys.exit(f"request {r.id}: n={r.n}; this driver only supports n=1")
    order = sorted(range(len(trace)), key=lambda i: trace[i].t)  # stable
    reqs = [trace[i] for i in order]
    ids = [r.id for r in reqs]
    if len(set(ids)) != len(ids):
        sys.exit("duplicate request ids in trace")
    by_id = {r.id: r for r in reqs}

    streams = TokenStreams()
    sched, hasher, vcfg = build_scheduler(args)
    # The clock is kept in integer nanoseconds (exact sums; arrivals compared exactly), unless
    # --float-clock asks for a float seconds accumulator.
    if args.float_clock:
        unit = 1.0
        prefill_s = args.prefill_ms_per_token / 1000.0
        decode_s = args.decode_step_ms / 1000.0
        arrive = [r.t for r in reqs]
    else:
        unit = 1e9
        prefill_s = round(args.prefill_ms_per_token * 1e6)
        decode_s = round(args.decode_step_ms * 1e6)
        arrive = [round(r.t * 1e9) for r in reqs]

    def sec(c):
        return c / unit if unit != 1.0 else c

    per_req: dict[str, dict] = {}
    clock = 0.0 if args.float_clock else 0
    nxt = 0
    step = 0
    total_preempt = 0
    peak_running = 0
    pc_queries = pc_hits = pc_pre_queries = pc_pre_hits = 0
    t0 = time.time()
    req_out = args.req_out or (os.path.splitext(args.out)[0] + ".requests.jsonl")
    fout = open(args.out, "w")
    stalled = None
    empty_schedules = 0

    def admit_until(c):
        nonlocal nxt
        while nxt < len(reqs) and arrive[nxt] <= c:
            r = reqs[nxt]
            nxt += 1
            prompt = [int(x) for x in streams.expand(r)]
            vr = VReq(request_id=r.id, prompt_token_ids=prompt,
                      sampling_params=SamplingParams(max_tokens=r.output_len, ignore_eos=True, n=1),
                      pooling_params=None, arrival_time=r.t, block_hasher=hasher)
            sched.add_request(vr)
            per_req[r.id] = {"id": r.id, "t": r.t, "enter": sec(c), "prompt": len(prompt),
                             "output_len": r.output_len, "cached": None, "admit_step": None,
                             "admit_clock": None, "first_token": None, "finish": None,
                             "preemptions": 0, "readmits": []}

    while True:
        admit_until(clock)
        if not sched.running and not sched.waiting and not sched.kv_holding_waiting:
            if nxt >= len(reqs):
                break
            clock = max(clock, arrive[nxt])
            continue
        if args.max_steps is not None and step >= args.max_steps:
            break
        running_before = [r.request_id for r in sched.running]
        pos_before = {rid: i for i, rid in enumerate(running_before)}
        out = sched.schedule()
        nst = out.num_scheduled_tokens
        if out.total_num_scheduled_tokens == 0:
            empty_schedules += 1
            # Nothing fits (e.g. a prompt larger than the whole cache); wait for arrivals, else stop.
            if nxt < len(reqs):
                clock = max(clock, arrive[nxt])
                continue
            stalled = {"step": step, "waiting": len(sched.waiting), "running": len(sched.running)}
            break
        preempted = sorted(out.preempted_req_ids, key=lambda rid: -pos_before.get(rid, -1))
        for rid in preempted:
            per_req[rid]["preemptions"] += 1
        total_preempt += len(preempted)

        entries = []
        starts = []  # each scheduled request's computed tokens before this step
        prefill_tokens = 0
        n_decode = 0
        sampled = []
        for rid, n in nst.items():
            vr = sched.requests[rid]
            computed_before = vr.num_computed_tokens - n
            # a decode: one token after the last, once the request has sampled (a prompt's last token
            # scheduled alone, as Mamba's block-aligned split can leave it, is a prefill)
            is_decode = n == 1 and computed_before == vr.num_tokens - 1 and vr.num_output_tokens > 0
            if is_decode:
                n_decode += 1
            else:
                prefill_tokens += n
            entries.append([rid, n])
            starts.append(computed_before)
            pr = per_req[rid]
            if pr["admit_step"] is None:
                # First admission: tokens already computed before this step = local prefix hit.
                pr["admit_step"], pr["admit_clock"], pr["cached"] = step, sec(clock), computed_before
            elif rid not in pos_before:
                # Re-admission of a preempted request: its prefix hit on the re-prefill.
                pr["readmits"].append([step, computed_before])
            # vLLM's model runner samples only when the request reached the end of its known tokens.
            if vr.num_computed_tokens >= vr.num_tokens:
                k = len(vr.output_token_ids)
                sampled.append([int(streams.output_tokens(by_id[rid], 1, k, 0)[0])])
            else:
                sampled.append([])
        dur = prefill_tokens * prefill_s + (decode_s if n_decode else 0)
        rec = {"step": step, "clock": round(sec(clock), 9), "dur": round(sec(dur), 9), "sched": entries,
               "start": starts,
               "prefill_tokens": prefill_tokens, "decodes": n_decode, "preempted": preempted,
               "running": len(sched.running), "waiting": len(sched.waiting) + len(sched.kv_holding_waiting),
               "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks()}
        peak_running = max(peak_running, len(sched.running))
        fout.write(json.dumps(rec, separators=(",", ":")) + "\n")
        clock += dur
        mro_kw = {}
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # vLLM <= 0.33
            mro_kw["req_id_to_index"] = {rid: i for i, rid in enumerate(nst.keys())}
        mro = ModelRunnerOutput(req_ids=list(nst.keys()), sampled_token_ids=sampled, **mro_kw)
        eco = sched.update_from_output(out, mro)
        for outs in eco.values():
            st = outs.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                p = st.prefix_cache_stats
                pc_queries += p.queries
                pc_hits += p.hits
                pc_pre_queries += p.preempted_queries
                pc_pre_hits += p.preempted_hits
            for o in outs.outputs:
                pr = per_req[o.request_id]
                if o.new_token_ids and pr["first_token"] is None:
                    pr["first_token"] = sec(clock)
                if o.finish_reason is not None:
                    pr["finish"] = sec(clock)
        step += 1
    fout.close()

    with open(req_out, "w") as f:
        for r in reqs:
            if r.id in per_req:
                f.write(json.dumps(per_req[r.id], separators=(",", ":")) + "\n")

    admitted = [p for p in per_req.values() if p["cached"] is not None]
    prompt_tok = sum(p["prompt"] for p in admitted)
    hit_tok = sum(p["cached"] for p in admitted)
    unfinished = sum(1 for p in per_req.values() if p["finish"] is None)
    sc, cc = vcfg.scheduler_config, vcfg.cache_config
    summary = {
        "vllm_version": vllm_version(),
        "requests": len(reqs), "steps": step, "preemptions": total_preempt,
        "preempted_requests": sum(1 for p in per_req.values() if p["preemptions"]),
        "peak_running": peak_running,
        "prefix_hit_rate": hit_tok / prompt_tok if prompt_tok else 0.0,
        "hit_tokens": hit_tok, "prompt_tokens": prompt_tok,
        "vllm_prefix_cache_stats": {"queries": pc_queries, "hits": pc_hits,
                                    "preempted_queries": pc_pre_queries, "preempted_hits": pc_pre_hits},
        "engine_duration_s": round(sec(clock), 6), "empty_schedules": empty_schedules, "unfinished": unfinished, "stalled": stalled,
        "config": {"num_blocks": args.num_blocks, "block_size": args.block_size,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_model_len": args.max_model_len, "watermark": args.watermark,
                   "scheduler_reserve_full_isl": not args.no_reserve_full_isl, "hash": args.hash,
                   "long_prefill_token_threshold": sc.long_prefill_token_threshold,
                   "enable_chunked_prefill": sc.enable_chunked_prefill, "policy": str(sc.policy),
                   "async_scheduling": sc.async_scheduling,
                   "cache_aware_admission_window": getattr(sc, "cache_aware_admission_window", None),
                   "cache_aware_admission_threshold": getattr(sc, "cache_aware_admission_threshold", None),
                   "enable_prefix_caching": cc.enable_prefix_caching,
                   "vllm_default_block_size": getattr(type(cc), "DEFAULT_BLOCK_SIZE", None),
                   "platform": type(current_platform).__name__,
                   "prefill_ms_per_token": args.prefill_ms_per_token, "decode_step_ms": args.decode_step_ms},
        "hybrid": None if not args.layers else {
            "layers": args.layers, "model": args.layers_name, "num_layers": args.num_layers,
            "kv_cache_dtype": args.kv_cache_dtype, "coordinator": args.coordinator,
            "disable_hybrid_kv_cache_manager": sc.disable_hybrid_kv_cache_manager,
            "kv_cache_layout": cc.kv_cache_layout,
            "prefix_cache_retention_interval": args.prefix_cache_retention_interval,
            "scheduler_block_size": sched.block_size, "hash_block_size": sched.hash_block_size,
            "kv_cache_groups": args.kv_cache_groups, "mamba": args.mamba,
            **({"prefix_caching": False, "vllm_update_block_size_for_backend": args.vllm_alignment}
               if args.mamba and args.no_prefix_caching else {})},
        "steps_file": os.path.abspath(args.out), "requests_file": os.path.abspath(req_out),
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(summary, indent=1))
    with open(os.path.splitext(args.out)[0] + ".summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if not stalled else 2


if __name__ == "__main__":
    sys.exit(main())
