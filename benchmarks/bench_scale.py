"""Replay at production scale: a real trace repeated to N requests (make_big_trace.py: copies share
nothing, --gap-s apart), each size replayed in a fresh process; wall, CPU, peak RSS and per-request
cost, to show time linear and memory bounded by what is live, not by the trace.

    python benchmarks/bench_scale.py --sizes 100000,300000,1000000 [--trace mooncake.jsonl] [--keep DIR]

The gap: the whole Mooncake trace arrives over 59 min and takes the H200 model about 2.6 h of engine
time (it is overloaded), so copies 2 h apart (the default) each drain before the next; an hour apart
the backlog, and with it the requests in flight and the memory, grows from copy to copy, as a real
server's queue would.

--trace is a kvbench trace (default: the real Mooncake conversation trace, converted first). The sim
on the H200 preset, block 16, the preset's pool (as bench_replay.py). Each size's trace is written to
a temporary folder (or --keep DIR) and removed after its run unless kept.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE.parents[1] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"

DRIVER = r"""
import json, resource, sys, time
from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
trace, out = sys.argv[1], sys.argv[2]
t0, c0 = time.perf_counter(), time.process_time()
rp = Replay(trace, ReplayConfig(executor="sim", model="llama-3-8b", gpu="h200", block_size=16), out)
setup = time.perf_counter() - t0
s = rp.run()
print(json.dumps({"setup_s": setup, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "requests": s["requests"], "completed": s["completed"], "steps": s["steps"],
                  "hit": s["prefix_hit_rate"], "ideal": s["ideal_hit_rate"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--convert-from", default="mooncake", help="format of --trace to convert first ('' if kvbench's)")
    ap.add_argument("--sizes", default="100000,300000,1000000")
    ap.add_argument("--keep", default=None, help="keep the traces in this folder")
    ap.add_argument("--gap-s", type=float, default=7200.0, help="seconds between a copy's last arrival and the next's first")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from make_big_trace import copies

    work = a.keep or tempfile.mkdtemp(prefix="kvbench-scale-")
    os.makedirs(work, exist_ok=True)
    base = a.trace
    if a.convert_from:
        from kvbench.trace.importers import convert
        base = os.path.join(work, "base.jsonl")
        convert(a.convert_from, a.trace, base)
    with open(base, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    print(f"{'requests':>10} {'steps':>11} {'setup s':>8} {'wall s':>8} {'CPU s':>8} {'CPU us/req':>10} "
          f"{'peak RSS MB':>11} {'hit / ideal':>15}", flush=True)
    for n in (int(x) for x in a.sizes.split(",")):
        path = os.path.join(work, f"trace-{n}.jsonl")
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as out:
                for r in copies(rows, n, a.gap_s):
                    out.write(json.dumps(r, separators=(",", ":")) + "\n")
        with tempfile.TemporaryDirectory() as run:
            res = subprocess.run([sys.executable, "-c", DRIVER, path, os.path.join(run, "run")], check=True,
                                 capture_output=True, text=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{r['requests']:>10,} {r['steps']:>11,} {r['setup_s']:>8.1f} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} "
              f"{r['cpu_s'] / r['requests'] * 1e6:>10.0f} {r['peak_rss_mb']:>11,.0f} "
              f"{r['hit']:.4f} / {r['ideal']:.4f}", flush=True)
        if not a.keep:
            os.remove(path)


if __name__ == "__main__":
    main()
