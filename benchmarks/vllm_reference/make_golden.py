"""Make the goldens tests/test_vllm_golden.py holds kvbench to: for each configuration, the trace
(made by the test's own golden_trace), drive.py run on it with vLLM's venv, and drive.py's steps file
reduced to per step a short digest of (scheduled (request, tokens) in order, preempted in order), the
preemption events in full, and per request the prefix-hit tokens at first admission.

Run it with kvbench's Python (it imports kvbench and the test module); drive.py runs under
``--vllm-python`` (a venv with vLLM 0.34 and kvbench, see README.md):

    .venv/bin/python benchmarks/vllm_reference/make_golden.py --vllm-python /work/vllm034/venv/bin/python
    .venv/bin/python benchmarks/vllm_reference/make_golden.py --vllm-python ... dupkey mooncake2000
    # hybrid models (drive.py --layers, hybrid.py): one, or all of them (~5-9 min each on 2 cores)
    .venv/bin/python benchmarks/vllm_reference/make_golden.py --vllm-python ... hybrid-gemma-3-27b-chat50x
    .venv/bin/python benchmarks/vllm_reference/make_golden.py --vllm-python ... hybrid

    # only reduce a steps file drive.py already wrote (with its .requests.jsonl and .summary.json):
    .venv/bin/python benchmarks/vllm_reference/make_golden.py --reduce STEPS.jsonl NAME
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data")
DRIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drive.py")

sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_vllm_golden import MOONCAKE, golden_trace, step_digest  # shared with the test

VERSION = "0.34"
CLOCK = {"kind": "linear", "prefill_ms_per_token": 0.1, "decode_step_ms": 20, "overhead_ms": 0}
DEFAULTS = {"block_size": 16, "vllm_num_gpu_blocks": 48000, "max_num_seqs": 256, "max_batched_tokens": 8192,
            "admission_window": 0, "admission_threshold": 0.5}


def mooncake(start: int, count: int) -> dict:
    return {"mooncake": "mooncake_conversation.jsonl", "start": start, "count": count}


CONFIGS: dict[str, dict] = {
    "mooncake2000": {
        "trace": "mooncake_conversation.jsonl converted by kvbench, first 2000 requests",
        "trace_spec": mooncake(0, 2000)},
    "mooncake6000-7999": {
        "trace": "mooncake_conversation.jsonl converted by kvbench, requests 6000..7999 (held out), "
                 "t rebased to start at 0",
        "trace_spec": mooncake(6000, 2000)},
    "mooncake2000-8kblocks": {
        "trace": "mooncake_conversation.jsonl converted by kvbench, first 2000 requests; a small pool",
        "trace_spec": mooncake(0, 2000), "vllm_num_gpu_blocks": 8000},
    "mooncake2000-block64": {
        "trace": "mooncake_conversation.jsonl converted by kvbench, first 2000 requests; 64-token blocks",
        "trace_spec": mooncake(0, 2000), "block_size": 64, "vllm_num_gpu_blocks": 12000},
    "mooncake1000-seqs32": {
        "trace": "mooncake_conversation.jsonl converted by kvbench, first 1000 requests; 32 sequences, "
                 "2048 batched tokens",
        "trace_spec": mooncake(0, 1000), "max_num_seqs": 32, "max_batched_tokens": 2048},
    "rag-2kblocks-cacheaware": {
        "trace": "traces/rag.jsonl at 20x its rate (t x 0.05); 2,000 blocks; cache-aware admission "
                 "(a window of 16 waiting requests, from half the pool held)",
        "trace_spec": {"shipped": "rag.jsonl", "time_scale": 0.05}, "vllm_num_gpu_blocks": 2000,
        "admission_window": 16},
    "dupkey": {
        "trace": "vllm-0.34-dupkey-trace.jsonl: vLLM's duplicate-key rule in five requests",
        "trace_spec": {"file": "vllm-0.34-dupkey-trace.jsonl"}, "vllm_num_gpu_blocks": 64},
}

# Hybrid models (hybrid.py's presets): vLLM's hybrid KV cache manager, its groups built by vLLM from
# per-layer specs. Pools chosen so that each run preempts and its windowed groups free blocks; the
# shipped trace is chat at 50x its rate (a queue forms: preemptions even where sliding-window groups
# give decodes their blocks back).
CHAT_50X = {"shipped": "chat.jsonl", "time_scale": 0.02}
HYBRID_POOLS = {  # model -> {trace name: vLLM num_gpu_blocks}
    "gpt-oss-120b": {"mooncake2000": 30000, "chat50x": 2000},
    "gemma-3-27b": {"mooncake2000": 56000, "chat50x": 5000},
    "llama-4-scout": {"mooncake2000": 72000, "chat50x": 6000},
    "deepseek-v3": {"mooncake2000": 40000, "chat50x": 1500},
}
for _model, _pools in HYBRID_POOLS.items():
    CONFIGS[f"hybrid-{_model}-mooncake2000"] = {
        "trace": "mooncake_conversation.jsonl converted by kvbench, first 2000 requests",
        "trace_spec": mooncake(0, 2000), "layers": _model, "vllm_num_gpu_blocks": _pools["mooncake2000"]}
    CONFIGS[f"hybrid-{_model}-chat50x"] = {
        "trace": "traces/chat.jsonl at 50x its rate (t x 0.02)",
        "trace_spec": CHAT_50X, "layers": _model, "vllm_num_gpu_blocks": _pools["chat50x"]}
# Mamba / linear-attention hybrids (hybrid.py's "mamba" layers), vLLM's align mode (prefix caching
# on): the block size is the one vLLM's platform aligns a user --block-size 16 to
# (hybrid.aligned_block_size; drive.py refuses another): a block holds one Mamba state per layer of a
# Mamba group, or block_size tokens of a full-attention layer.
MAMBA_BLOCK_SIZES = {"qwen3-next-80b-a3b": 544, "qwen3-next-80b-a3b-h100": 576, "granite-4.0-h-tiny": 400}
MAMBA_POOLS = {  # name suffix -> (model, trace name, vLLM num_gpu_blocks)
    "qwen3-next-80b-a3b-chat50x": ("qwen3-next-80b-a3b", "chat50x", 600),
    "qwen3-next-80b-a3b-mooncake2000": ("qwen3-next-80b-a3b", "mooncake2000", 4000),
    "granite-4.0-h-tiny-chat50x": ("granite-4.0-h-tiny", "chat50x", 2500),
    "qwen3-next-80b-a3b-h100-chat50x": ("qwen3-next-80b-a3b-h100", "chat50x", 600),
}
for _suffix, (_model, _trace, _blocks) in MAMBA_POOLS.items():
    CONFIGS[f"hybrid-{_suffix}"] = {
        **({"trace": "mooncake_conversation.jsonl converted by kvbench, first 2000 requests",
            "trace_spec": mooncake(0, 2000)} if _trace == "mooncake2000" else
           {"trace": "traces/chat.jsonl at 50x its rate (t x 0.02)", "trace_spec": CHAT_50X}),
        "layers": _model, "block_size": MAMBA_BLOCK_SIZES[_model], "vllm_num_gpu_blocks": _blocks}
# vLLM's Mamba "none" mode: prefix caching off (MambaModelConfig.verify_and_update_config sets
# mamba_cache_mode "none" and mamba_block_size = max_model_len: one block per Mamba group for a
# request's whole life); the attention block size is still the aligned one, the coordinator
# KVCacheCoordinatorNoPrefixCache, no block-aligned split (drive.py --no-prefix-caching).
NOCACHE_POOLS = {  # name suffix -> (model, trace name, vLLM num_gpu_blocks)
    "granite-4.0-h-tiny-chat50x-nocache": ("granite-4.0-h-tiny", "chat50x", 400),
}
for _suffix, (_model, _trace, _blocks) in NOCACHE_POOLS.items():
    CONFIGS[f"hybrid-{_suffix}"] = {
        "trace": "traces/chat.jsonl at 50x its rate (t x 0.02); prefix caching off (Mamba \"none\" mode)",
        "trace_spec": CHAT_50X, "layers": _model, "block_size": MAMBA_BLOCK_SIZES[_model],
        "vllm_num_gpu_blocks": _blocks, "prefix_caching": False}
HYBRID_INDEX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybrid_goldens.json")

DUPKEY_TRACE = os.path.join(DATA, "vllm-0.34-dupkey-trace.jsonl")


def write_dupkey_trace(path: str = DUPKEY_TRACE) -> None:
    """Five requests, one second apart (each finishes long before the next arrives), literal tokens:
    E (32 tokens), A (32 others), B (= A: it hits A's first block and re-computes the second, whose key
    is then cached twice), C (942 others: its prompt takes 59 of the 63 blocks, evicting most of the
    cache), F (E's 32 tokens + 16 more)."""
    e = list(range(1000, 1032))
    a = list(range(2000, 2032))
    c = list(range(3000, 3942))
    f = e + list(range(5000, 5016))
    rows = [("E", 0, e), ("A", 1, a), ("B", 2, a), ("C", 3, c), ("F", 4, f)]
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"id": rid, "t": t, "output_len": 2, "prompt": [{"tokens": toks}]},
                                 separators=(",", ":")) + "\n" for rid, t, toks in rows)


def reduce(steps_path: str, name: str) -> dict:
    """The golden record of one configuration from drive.py's steps, requests and summary files."""
    cfg = {**DEFAULTS, **CONFIGS[name]}
    base = os.path.splitext(steps_path)[0]
    def lines(path: str) -> list:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]

    steps, reqs = lines(steps_path), lines(base + ".requests.jsonl")
    by_req = {r["id"]: r for r in reqs}
    with open(base + ".summary.json", encoding="utf-8") as fh:
        summ = json.load(fh)
    sc = summ["config"]
    assert summ["unfinished"] == 0 and summ["stalled"] is None, summ
    assert (sc["num_blocks"], sc["block_size"], sc["max_num_seqs"], sc["max_num_batched_tokens"]) == (
        cfg["vllm_num_gpu_blocks"], cfg["block_size"], cfg["max_num_seqs"], cfg["max_batched_tokens"]), sc
    assert (sc["prefill_ms_per_token"], sc["decode_step_ms"]) == (CLOCK["prefill_ms_per_token"], CLOCK["decode_step_ms"])
    assert not sc["async_scheduling"]
    assert sc["enable_prefix_caching"] == cfg.get("prefix_caching", True), sc
    assert (sc.get("cache_aware_admission_window") or 0) == cfg["admission_window"], sc
    if cfg["admission_window"]:
        assert sc["cache_aware_admission_threshold"] == cfg["admission_threshold"], sc
    hybrid = summ.get("hybrid")
    assert (hybrid or {}).get("model") == cfg.get("layers"), (hybrid, cfg.get("layers"))
    extra = {}
    if hybrid:
        assert hybrid["disable_hybrid_kv_cache_manager"] is False, hybrid
        extra["hybrid"] = {k: hybrid[k] for k in (
            "model", "num_layers", "kv_cache_dtype", "coordinator", "kv_cache_layout",
            "prefix_cache_retention_interval", "scheduler_block_size", "hash_block_size")}
        if cfg.get("prefix_caching") is False:
            assert hybrid["prefix_caching"] is False, hybrid
            extra["hybrid"]["prefix_caching"] = False
        extra["hybrid"]["kv_cache_groups"] = [{k: g[k] for k in (
            "group", "kind", "window", "chunk", "spec", "manager", "num_layers", "layers", "block_size",
            "page_size_bytes", "max_admission_blocks_per_request") + (("mamba",) if "mamba" in g else ())}
            for g in hybrid["kv_cache_groups"]]
        if hybrid.get("mamba"):
            # vLLM's align mode: the aligned block size and what the scheduler/managers run with, and
            # per request every prefill chunk ([step, computed tokens before, tokens]) and the prefix
            # hit of each re-admission after a preemption ([step, hit tokens]): the Mamba rules
            # (block-aligned chunk ends, hits only at cached states) show there first.
            extra["hybrid"]["mamba"] = hybrid["mamba"]
            chunks: dict = {}
            for st in steps:
                for (rid, n), start in zip(st["sched"], st["start"]):
                    if n > 1 or start < by_req[rid]["prompt"]:  # not a decode
                        chunks.setdefault(rid, []).append([st["step"], start, n])
            extra["prefill_chunks"] = chunks
            extra["readmit_cached"] = {r["id"]: r["readmits"] for r in reqs if r["readmits"]}
    return {
        "name": name,
        **({"prefix_caching": False} if cfg.get("prefix_caching") is False else {}),
        **extra,
        "source": f"vLLM {summ['vllm_version']} Scheduler + KVCacheManager, benchmarks/vllm_reference/drive.py",
        "vllm_version": summ["vllm_version"],
        "trace": cfg["trace"], "trace_spec": cfg["trace_spec"],
        "vllm_num_gpu_blocks": cfg["vllm_num_gpu_blocks"], "kvbench_num_blocks": cfg["vllm_num_gpu_blocks"] - 1,
        "block_size": cfg["block_size"], "max_num_seqs": cfg["max_num_seqs"],
        "max_batched_tokens": cfg["max_batched_tokens"],
        "admission_window": cfg["admission_window"], "admission_threshold": cfg["admission_threshold"],
        "vllm_scheduler": {k: sc.get(k) for k in (
            "max_model_len", "enable_chunked_prefill", "scheduler_reserve_full_isl", "watermark", "policy",
            "long_prefill_token_threshold", "async_scheduling", "cache_aware_admission_window",
            "cache_aware_admission_threshold",
            "enable_prefix_caching", "hash", "vllm_default_block_size", "platform")},
        "clock": CLOCK,
        "steps": len(steps),
        "step_digests": [step_digest(s["sched"], s["preempted"]) for s in steps],
        "preemptions": [[s["step"], s["preempted"]] for s in steps if s["preempted"]],
        "peak_running": max(s["running"] for s in steps),
        "duration_s": steps[-1]["clock"] + steps[-1]["dur"],
        "cached_tokens": {r["id"]: r["cached"] for r in reqs},
        "summary": {k: summ[k] for k in ("requests", "preemptions", "preempted_requests", "hit_tokens",
                                         "prompt_tokens", "prefix_hit_rate", "vllm_prefix_cache_stats")},
    }


def write_golden(golden: dict) -> str:
    out = os.path.join(DATA, f"vllm-{VERSION}-{golden['name']}.json.gz")
    with gzip.GzipFile(out, "wb", mtime=0) as gz:  # mtime 0: the same run gives the same bytes
        gz.write(json.dumps(golden, separators=(",", ":")).encode("utf-8"))
    print(f"wrote {out}: {golden['steps']} steps, {sum(len(p) for _, p in golden['preemptions'])} "
          f"preemptions, {os.path.getsize(out):,} bytes", flush=True)
    return out


def make(name: str, vllm_python: str, work: str, mooncake_path: str) -> str:
    cfg = {**DEFAULTS, **CONFIGS[name]}
    if cfg["trace_spec"].get("file") == os.path.basename(DUPKEY_TRACE):
        write_dupkey_trace()
    trace = golden_trace(cfg["trace_spec"], os.path.join(work, f"{name}.trace.jsonl"), mooncake_path)
    steps = os.path.join(work, f"{name}.steps.jsonl")
    cmd = [vllm_python, DRIVE, str(trace), "--num-blocks", str(cfg["vllm_num_gpu_blocks"]),
           "--block-size", str(cfg["block_size"]), "--max-num-seqs", str(cfg["max_num_seqs"]),
           "--max-num-batched-tokens", str(cfg["max_batched_tokens"]),
           "--prefill-ms-per-token", str(CLOCK["prefill_ms_per_token"]),
           "--decode-step-ms", str(CLOCK["decode_step_ms"]), "--out", steps,
           "--cache-aware-admission-window", str(cfg["admission_window"]),
           "--cache-aware-admission-threshold", str(cfg["admission_threshold"])]
    if cfg.get("layers"):
        cmd += ["--layers", cfg["layers"]]
    if cfg.get("prefix_caching") is False:
        cmd += ["--no-prefix-caching"]
    t0 = time.time()
    # cwd outside the checkout: the repository's kernels/ would shadow the `kernels` package
    # transformers probes for (see README.md).
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=work)
    print(f"{name}: drive.py took {time.time() - t0:.0f} s", flush=True)
    golden = reduce(steps, name)
    out = write_golden(golden)
    if "hybrid" in golden:
        index_hybrid(golden, out)
    return out


def index_hybrid(golden: dict, path: str) -> None:
    """Record a hybrid golden's parameters in hybrid_goldens.json (one entry per name)."""
    index = {}
    if os.path.exists(HYBRID_INDEX):
        with open(HYBRID_INDEX, encoding="utf-8") as fh:
            index = json.load(fh)
    h, summ = golden["hybrid"], golden["summary"]
    index.setdefault("goldens", {})[golden["name"]] = {
        "file": os.path.relpath(path, ROOT), "model": h["model"], "trace": golden["trace"],
        "trace_spec": golden["trace_spec"], "vllm_num_gpu_blocks": golden["vllm_num_gpu_blocks"],
        "kvbench_num_blocks": golden["kvbench_num_blocks"], "block_size": golden["block_size"],
        "max_num_seqs": golden["max_num_seqs"], "max_batched_tokens": golden["max_batched_tokens"],
        "steps": golden["steps"], "preemptions": summ["preemptions"],
        "preempted_requests": summ["preempted_requests"], "prefix_hit_rate": round(summ["prefix_hit_rate"], 4),
        "hit_tokens": summ["hit_tokens"], "prompt_tokens": summ["prompt_tokens"],
        "coordinator": h["coordinator"],
        **({"prefix_caching": False} if golden.get("prefix_caching") is False else {}),
        "groups": [[g["kind"], g["window"] or g["chunk"], g["num_layers"]] for g in h["kv_cache_groups"]],
        "bytes": os.path.getsize(path)}
    index["vllm_version"] = golden["vllm_version"]
    index["command"] = ("python benchmarks/vllm_reference/make_golden.py --vllm-python "
                        "/work/vllm034/venv/bin/python NAME")
    index["goldens"] = dict(sorted(index["goldens"].items()))
    with open(HYBRID_INDEX, "w", encoding="utf-8") as fh:
        json.dump(index, fh, indent=1)
        fh.write("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"configurations (default: all but the hybrid ones; 'hybrid': "
                                             f"all hybrid ones): {', '.join(CONFIGS)}")
    ap.add_argument("--vllm-python", help="the Python of a venv with vLLM 0.34 and kvbench")
    ap.add_argument("--mooncake", default=str(MOONCAKE), help="the real Mooncake conversation trace")
    ap.add_argument("--work", default=None, help="keep traces and steps files here (default: a temp dir)")
    ap.add_argument("--reduce", nargs=2, metavar=("STEPS", "NAME"), help="only reduce a steps file")
    args = ap.parse_args(argv)
    if args.reduce:
        golden = reduce(args.reduce[0], args.reduce[1])
        out = write_golden(golden)
        if "hybrid" in golden:
            index_hybrid(golden, out)
        return 0
    if not args.vllm_python:
        ap.error("--vllm-python is required")
    hybrid = [n for n in CONFIGS if n.startswith("hybrid-")]
    names = [m for n in args.names for m in (hybrid if n == "hybrid" else [n])] if args.names else \
        [n for n in CONFIGS if n not in hybrid]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="kvbench-vllm-golden-"))
    os.makedirs(work, exist_ok=True)
    for name in names:
        make(name, args.vllm_python, work, args.mooncake)
    return 0


if __name__ == "__main__":
    sys.exit(main())
