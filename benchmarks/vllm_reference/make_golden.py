"""Reduce drive.py's steps file to the golden record tests/test_vllm_golden.py checks kvbench against:
per step a short digest of (scheduled (request, tokens) in order, preempted in order), the
preemption events in full, and per request the prefix-hit tokens at first admission."""
from __future__ import annotations

import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_vllm_golden import step_digest  # noqa: E402  (one digest, shared with the test)


def main(steps_path: str, out: str = os.path.join(ROOT, "tests", "data", "vllm-0.33-mooncake2000.json.gz")) -> None:
    steps = [json.loads(line) for line in open(steps_path, encoding="utf-8")]
    reqs = [json.loads(line) for line in open(steps_path.replace(".jsonl", ".requests.jsonl"), encoding="utf-8")]
    golden = {
        "source": "vLLM 0.33.0 Scheduler + KVCacheManager, benchmarks/vllm_reference/drive.py",
        "trace": "mooncake_conversation.jsonl converted by kvbench, first 2000 requests",
        "vllm_num_gpu_blocks": 48000, "kvbench_num_blocks": 47999, "block_size": 16,
        "max_num_seqs": 256, "max_batched_tokens": 8192,
        "clock": {"kind": "linear", "prefill_ms_per_token": 0.1, "decode_step_ms": 20, "overhead_ms": 0},
        "steps": len(steps),
        "step_digests": [step_digest(s["sched"], s["preempted"]) for s in steps],
        "preemptions": [[s["step"], s["preempted"]] for s in steps if s["preempted"]],
        "peak_running": max(s["running"] for s in steps),
        "duration_s": steps[-1]["clock"] + steps[-1]["dur"],
        "cached_tokens": {r["id"]: r["cached"] for r in reqs},
    }
    with gzip.open(out, "wt", encoding="utf-8") as fh:
        json.dump(golden, fh, separators=(",", ":"))
    print(f"wrote {out}: {golden['steps']} steps, {sum(len(p) for _, p in golden['preemptions'])} preemptions")


if __name__ == "__main__":
    main(*sys.argv[1:])
