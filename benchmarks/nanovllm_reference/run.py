#!/usr/bin/env python3
"""Alternate nano-vllm's scheduler (drive.py) and kvbench's sim replay on the whole Mooncake trace,
and print one table (engine, wall, steps, hit rate, preemptions, peak RSS) and the ratios.

    /work/main/.venv/bin/python benchmarks/nanovllm_reference/run.py [--nanovllm /tmp/nano-vllm]
        [--rounds 2] [--limit N] [--skip-256]

Each round runs, one process each, one after another:
  nano16    drive.py, block 16, 48,000 blocks (nano-vllm's Sequence.block_size set to 16)
  bench     benchmarks/bench_replay.py --num-blocks 48000 (kvbench, block 16, the H200 preset clock)
  kvb16     kvbench_side.py, block 16, 48,000 blocks, the linear clock drive.py uses
  nano256   drive.py, block 256 (nano-vllm as shipped), 3,000 blocks (the same 768,000 tokens)
  kvb256    kvbench_side.py, block 256, 3,000 blocks, the linear clock
The nano-vllm checkout is cloned (pinned commit) when --nanovllm does not exist and the network allows.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
MOONCAKE = ROOT.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
NANO_URL = "https://github.com/GeeeekExplorer/nano-vllm"
NANO_COMMIT = "bb823b3e06983d71485a8e1f23715ebd87d98ef8"  # the checkout measured in README.md


def ensure_checkout(path: Path) -> None:
    if (path / "nanovllm" / "engine" / "scheduler.py").exists():
        return
    subprocess.run(["git", "clone", "-q", NANO_URL, str(path)], check=True)
    subprocess.run(["git", "-C", str(path), "checkout", "-q", NANO_COMMIT], check=True)


def run_json(cmd: list[str]) -> dict:
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_bench_replay(limit: int | None) -> dict:
    """benchmarks/bench_replay.py as it is (it converts the trace itself, untimed)."""
    cmd = [PY, str(ROOT / "benchmarks" / "bench_replay.py"), "--trace", str(MOONCAKE), "--num-blocks", "48000"]
    if limit:
        cmd += ["--limit", str(limit)]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"bench_replay.py failed:\n{p.stderr[-4000:]}")
    f = {m.group(1).strip(): m.group(2).strip() for m in re.finditer(r"^(.{28}) (.*)$", p.stdout, re.MULTILINE)}
    hit = f["prefix hit / ideal"].split("/")[0]
    return {"engine": "kvbench", "loop_wall_s": float(f["replay wall (s)"]),
            "steps": int(f["engine steps"].replace(",", "")), "prefix_hit_rate": float(hit),
            "preemptions": None, "peak_rss_mb": int(f["peak RSS (MB)"].replace(",", ""))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanovllm", default="/tmp/nano-vllm", help="nano-vllm checkout (cloned if missing)")
    ap.add_argument("--trace", default="/tmp/mooncake.jsonl", help="converted trace (made if missing)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
    ap.add_argument("--skip-256", action="store_true", help="only the block-16 runs")
    ap.add_argument("--json-out", default=None, help="also write every run's record here")
    a = ap.parse_args()

    nano = Path(a.nanovllm)
    ensure_checkout(nano)
    if not os.path.exists(a.trace):
        subprocess.run([str(Path(PY).parent / "kvbench"), "trace", "convert", "--from", "mooncake",
                        str(MOONCAKE), "-o", a.trace], check=True)
    lim = ["--limit", str(a.limit)] if a.limit else []
    drive = [PY, str(HERE / "drive.py"), a.trace, "--nanovllm", str(nano), "--json", *lim]
    side = [PY, str(HERE / "kvbench_side.py"), a.trace, "--json", *lim]
    def nano(bs, nb):
        return lambda: run_json(drive + ["--block-size", bs, "--num-blocks", nb])

    def kvb(bs, nb):
        return lambda: run_json(side + ["--block-size", bs, "--num-blocks", nb])

    plan = [("nano16", "nano-vllm", "16 / 48000, linear", nano("16", "48000")),
            ("bench", "kvbench bench_replay", "16 / 48000, H200 preset", lambda: run_bench_replay(a.limit)),
            ("kvb16", "kvbench", "16 / 48000, linear", kvb("16", "48000"))]
    if not a.skip_256:
        plan += [("nano256", "nano-vllm", "256 / 3000, linear", nano("256", "3000")),
                 ("kvb256", "kvbench", "256 / 3000, linear", kvb("256", "3000"))]

    rows = []
    for rnd in range(1, a.rounds + 1):
        for key, engine, setting, fn in plan:
            t = time.perf_counter()
            rec = fn()
            rec.update(key=key, round=rnd, label=engine, setting=setting,
                       process_s=round(time.perf_counter() - t, 1), ended=time.strftime("%H:%M:%S"),
                       loadavg=round(os.getloadavg()[0], 2))
            rows.append(rec)
            print(f"# round {rnd} {key}: {rec['loop_wall_s']:.1f} s", file=sys.stderr, flush=True)

    head = f"{'round':>5}  {'engine':<21} {'block / blocks, clock':<24} {'wall (s)':>9} {'+build':>7} " \
           f"{'steps':>9} {'hit rate':>9} {'preempt':>8} {'RSS MB':>7} {'load1':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        build = r.get("prompt_build_s")
        pre = "" if r.get("preemptions") is None else f"{r['preemptions']:,}"
        print(f"{r['round']:>5}  {r['label']:<21} {r['setting']:<24} {r['loop_wall_s']:>9.1f} "
              f"{'' if build is None else format(r['loop_wall_s'] + build, '.1f'):>7} {r['steps']:>9,} "
              f"{r['prefix_hit_rate']:>9.4f} {pre:>8} {r['peak_rss_mb']:>7,} {r['loadavg']:>6}")
    print()
    by = {}
    for r in rows:
        by.setdefault(r["key"], []).append(r)
    for nk, kk in (("nano16", "bench"), ("nano16", "kvb16"), ("nano256", "kvb256")):
        if nk in by and kk in by:
            per = [n["loop_wall_s"] / k["loop_wall_s"] for n, k in zip(by[nk], by[kk])]
            per_b = [(n["loop_wall_s"] + n["prompt_build_s"]) / k["loop_wall_s"] for n, k in zip(by[nk], by[kk])]
            print(f"ratio {nk} / {kk}: loop " + ", ".join(f"{x:.2f}x" for x in per)
                  + "   (nano loop + prompt build: " + ", ".join(f"{x:.2f}x" for x in per_b) + ")")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
