#!/usr/bin/env python3
"""kvbench's sim replay of a kvbench trace, timed as benchmarks/bench_replay.py times it (Replay.run()
alone; loading and setup apart), with the clock nano-vllm's driver uses: the linear clock
(0.1 ms per prefill token + 20 ms if a step decodes) unless --preset-clock keeps the GPU preset's.

    python kvbench_side.py TRACE [--block-size 16] [--num-blocks 48000] [--limit N] [--json]

Prints the same fields as drive.py (engine, loop_wall_s, steps, prefix_hit_rate, preemptions, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a kvbench trace (JSONL)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=48000)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    ap.add_argument("--decode-step-ms", type=float, default=20.0)
    ap.add_argument("--preset-clock", action="store_true", help="the GPU preset's cost model (bench_replay's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import Replay

    with tempfile.TemporaryDirectory() as tmp:
        calibration = None
        if not a.preset_clock:
            calibration = os.path.join(tmp, "linear.json")
            with open(calibration, "w") as f:
                json.dump({"kind": "linear", "prefill_ms_per_token": a.prefill_ms_per_token,
                           "decode_step_ms": a.decode_step_ms, "overhead_ms": 0}, f)
        cfg = ReplayConfig(executor="sim", model=a.model, gpu=a.gpu, block_size=a.block_size,
                           limit=a.limit, num_blocks=a.num_blocks, calibration=calibration)
        t0 = time.perf_counter()
        rp = Replay(a.trace, cfg, os.path.join(tmp, "run"))
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        s = rp.run()
        run_s = time.perf_counter() - t1
    out = {"engine": "kvbench", "trace": os.path.basename(a.trace), "requests": s["requests"],
           "finished": s["completed"], "rejected": s.get("rejected"), "steps": s["steps"],
           "preemptions": s["preemptions"], "peak_running": s.get("peak_running"),
           "prefix_hit_rate": s["prefix_hit_rate"], "ideal_hit_rate": s.get("ideal_hit_rate"),
           "engine_duration_s": s["duration_s"], "loop_wall_s": round(run_s, 3), "load_s": round(load_s, 3),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "config": {"num_blocks": s.get("num_blocks"), "block_size": a.block_size,
                      "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_batched_tokens,
                      "admission": cfg.admission,
                      "clock": "preset" if a.preset_clock else
                      {"prefill_ms_per_token": a.prefill_ms_per_token, "decode_step_ms": a.decode_step_ms}}}
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
