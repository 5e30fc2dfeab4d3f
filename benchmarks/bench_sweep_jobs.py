"""How `kvbench sweep -j N` scales: the same grid swept with 1 worker and with N, each into a fresh
folder, in a fresh process; wall time, the speed-up over the same round's -j 1, its share of the ideal N x, and the
largest process's peak RSS (one worker's, or the parent's).

    python benchmarks/bench_sweep_jobs.py [--jobs 1,2] [--trace mooncake.jsonl] [--limit 4000]
        [--grid "--block-size 16,32 --cache-policy lru,fifo"] [--ray [--ray-path DIR]]

--ray adds a third mode each round: `--backend ray` on a local Ray started by the sweep with every CPU
(one task per configuration, one CPU each; Ray's start-up inside the wall time), its speed-up against
the round's -j 1 and its share of the ideal min(CPUs, configurations) x. Ray is not a kvbench
requirement: --ray-path names a folder holding it (pip install --target DIR ray), put on PYTHONPATH.

--trace is the real Mooncake conversation trace by default (converted first); the sim on the H200
preset (the sweep's defaults). A grid of C configurations on N workers can be at best
min(N, C) x faster; each worker is one process with its own engine, so memory is per worker.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE.parents[1] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"


# runs the sweep as its child, polls /proc for every process under it, and prints the largest peak RSS
# (VmHWM) any one of them reached, in MB: the parent's or one worker's
WRAP = r"""
import os, subprocess, sys, time
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
peak = 0
def tree(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    kids.setdefault(int(fh.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except OSError:
                pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out
while p.poll() is None:
    for pid in tree(p.pid):
        try:
            with open(f"/proc/{pid}/status") as fh:
                peak = max([peak] + [int(line.split()[1]) for line in fh if line.startswith("VmHWM:")])
        except OSError:
            pass
    time.sleep(0.2)
if p.returncode:
    sys.exit(p.returncode)
print(peak / 1024)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--convert-from", default="mooncake", help="format of --trace to convert first ('' if kvbench's)")
    ap.add_argument("--jobs", default=f"1,{os.cpu_count() or 1}")
    ap.add_argument("--limit", type=int, default=None, help="the first N requests only")
    ap.add_argument("--grid", default="--block-size 16,32 --cache-policy lru,fifo")
    ap.add_argument("--repeats", type=int, default=1, help="alternate the job counts this many times")
    ap.add_argument("--ray", action="store_true", help="also sweep with --backend ray on a local Ray")
    ap.add_argument("--ray-path", default=None, help="a folder holding ray, put on PYTHONPATH")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvbench-sweepj-")
    trace = a.trace
    if a.convert_from:
        from kvbench.trace.importers import convert

        trace = os.path.join(work, "trace.jsonl")
        convert(a.convert_from, a.trace, trace)
    extra = shlex.split(a.grid) + (["--limit", str(a.limit)] if a.limit else [])
    cpus = os.cpu_count() or 1
    modes: list[tuple[str, list[str], int]] = [(f"-j {j}", ["-j", j], int(j)) for j in a.jobs.split(",")]
    env = dict(os.environ)
    if a.ray:
        configs = 1
        for values in re.findall(r"--\S+ (\S+)", a.grid):
            configs *= len(values.split(","))
        modes.append((f"ray {cpus} CPUs", ["--backend", "ray", "--cpus-per-task", "1"], min(cpus, configs)))
        if a.ray_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (a.ray_path, env.get("PYTHONPATH")) if p)
    print(f"grid: {a.grid}{'  --limit ' + str(a.limit) if a.limit else ''}; {cpus} CPUs", flush=True)
    print(f"{'mode':>12} {'wall s':>8} {'speed-up':>9} {'of ideal':>9} {'peak RSS MB':>12}", flush=True)
    for rep in range(a.repeats):
        base: float | None = None  # this round's -j 1 (the rounds alternate, so each has its own)
        for name, args, ideal in modes:
            out = os.path.join(work, f"sweep-{name.replace(' ', '')}-{rep}")
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-c", WRAP, sys.executable, "-m", "kvbench", "sweep", trace,
                                  "--out", out, *args, "--json", *extra],
                                 check=True, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t0
            rss = float(res.stdout.strip().splitlines()[-1])
            if args == ["-j", "1"]:
                base = wall
            speed = base / wall if base else float("nan")
            print(f"{name:>12} {wall:>8.1f} {speed:>8.2f}x {speed / ideal:>8.0%} {rss:>12,.0f}", flush=True)
    shutil.rmtree(work)  # the converted trace and every sweep's runs


if __name__ == "__main__":
    main()
