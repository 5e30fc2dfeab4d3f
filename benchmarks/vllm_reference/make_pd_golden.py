#!/usr/bin/env python3
"""Reduce a pd.py run (vLLM 0.34's own prefill and decode Schedulers with a KV connector) to the golden
tests/test_vllm_pd_golden.py holds kvbench's disaggregated replay to:

    python make_pd_golden.py NAME OUT.steps.jsonl TRACE_SPEC_JSON [DEST]

OUT.steps.jsonl is pd.py's --out (its prefill steps, requests and summary beside it); TRACE_SPEC_JSON the
trace as tests/test_vllm_golden.py's golden_trace makes it (e.g. '{"mooncake": "conversation", "start": 0,
"count": 300}'). Writes tests/data/vllm-pd-0.34-NAME.json.gz: the digests of every step that computed
something on each side (pd.py's empty steps -- an engine polling while only loads are in flight -- are
kvbench's waits, not steps), the preemptions, and per request its load's start and end, its blocks and
bytes, the decode side's local hit, the prefill side's hit, its first token and its finish.

A hybrid run (pd.py --layers) adds, beside those (whose format does not change): "hybrid" (vLLM's KV cache
groups -- kind, window, layers, block size, page bytes of one block of the group, manager, admission cap --
the coordinator, and the NIXL clipping in force), and per request, per KV cache group (in vLLM's group order),
"load_blocks_per_group" (the block ids the decode side's connector was handed: the blocks the load moves;
bytes = sum over groups of count x config["bytes_per_block_per_group"][g]), "d_held_blocks_per_group" (the
blocks the request holds on the decode side while its load is in flight), "p_held_blocks_per_group" (the blocks
the prefill side holds, delay-freed, until the decode side has read them) and "p_remote_blocks_per_group" (the
block ids the prefill side offered in remote_block_ids, null ids included). DEST: another path than
tests/data/vllm-pd-0.34-NAME.json.gz.
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from test_vllm_golden import step_digest  # noqa: E402  (one digest for every golden)


def steps(path: str) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if not r["empty"]]


PER_GROUP = ("load_blocks_per_group", "d_held_blocks_per_group", "p_held_blocks_per_group",
             "p_remote_blocks_per_group")


def main(name: str, out: str, spec: str, dest: str | None = None) -> None:
    stem = out[:-len(".steps.jsonl")]
    summary = json.load(open(stem + ".steps.summary.json"))
    cfg = summary["config"]
    assert cfg["load_start"] == "end", "kvbench starts a load when its step ends (vLLM's post_forward)"
    dec, pre = steps(out), steps(stem + ".steps.prefill.jsonl")
    reqs = [json.loads(line) for line in open(stem + ".steps.requests.jsonl")]
    golden = {
        "name": name, "vllm_version": summary["vllm_version"],
        "source": "vLLM 0.34.0 Scheduler x 2 with a KV connector (NIXL pull rules), benchmarks/vllm_reference/pd.py",
        "trace_spec": json.loads(spec), "config": cfg,
        "kvbench_num_blocks": {"prefill": cfg["p_num_blocks"] - 1, "decode": cfg["d_num_blocks"] - 1},
        "decode_step_digests": [step_digest(s["sched"], s["preempted"]) for s in dec],
        "prefill_step_digests": [step_digest(s["sched"], s["preempted"]) for s in pre],
        "decode_preemptions": [[i, s["preempted"]] for i, s in enumerate(dec) if s["preempted"]],
        # id -> [load start s, load end s, blocks, bytes, decode local hit, prefill hit, first token s, finish s]
        "requests": {r["id"]: [r["load_start"], r["load_end"], r["load_blocks"], r["load_bytes"], r["d_local_hit"],
                               r["p_cached"], r["first_token"], r["finish"]] for r in reqs},
    }
    if summary.get("hybrid"):
        h = summary["hybrid"]
        golden["hybrid"] = {k: h[k] for k in (
            "layers", "model", "num_layers", "coordinator", "disable_hybrid_kv_cache_manager",
            "prefix_cache_retention_interval", "scheduler_block_size", "hash_block_size", "transfer_group_ids",
            "p_max_admission_blocks_per_request", "nixl")}
        golden["hybrid"]["kv_cache_groups"] = [{k: g[k] for k in (
            "group", "kind", "window", "chunk", "spec", "manager", "num_layers", "layers", "block_size",
            "page_size_bytes", "group_page_bytes", "max_admission_blocks_per_request")} for g in h["kv_cache_groups"]]
        for key in PER_GROUP:
            golden[key] = {r["id"]: r[key] for r in reqs}
        for r in reqs:
            per, cfg_bytes = r["load_blocks_per_group"], cfg["bytes_per_block_per_group"]
            assert sum(per) == r["load_blocks"], r["id"]
            assert sum(n * cfg_bytes[g] for n, g in zip(per, h["transfer_group_ids"])) == r["load_bytes"], r["id"]
    dest = Path(dest) if dest else ROOT / "tests" / "data" / f"vllm-pd-0.34-{name}.json.gz"
    with gzip.open(dest, "wt", encoding="utf-8") as fh:
        json.dump(golden, fh, separators=(",", ":"))
    print(f"{dest}: {len(dec)} decode and {len(pre)} prefill steps, {len(reqs)} requests")


if __name__ == "__main__":
    main(*sys.argv[1:5])
