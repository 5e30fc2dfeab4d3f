#!/usr/bin/env python3
"""Disaggregated prefill/decode against mixed replicas on the same GPUs (README, "Disaggregated prefill
and decode"): the whole Mooncake conversation trace, Llama-3-70B at --tp 4 on H200s, four instances
(16 GPUs) as P:D = 1:3, 2:2, 3:1 at 400 and 100 Gb/s per GPU, and as four mixed replicas; the same
router (kv-aware) in front of the prefill instances and the replicas.

    python benchmarks/pd_table.py [--trace mooncake.jsonl] [--time-scale 2] [--out runs/pd-table]

Prints a markdown table. The figures are the cost model's (no published P/D measurement is in
benchmarks/published): TTFT and TPOT percentiles, goodput per GPU under --slo, KV bytes a request
moves, the prefill side's prefix hit rate, and the receiving links' utilisation."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SLO = "ttft=2000,tpot=50"


def run(trace: str, out: str, scale: float, extra: list[str]) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "kvbench", "replay", trace, "--model", "llama-3-70b", "--tp", "4", "--gpu", "h200",
           "--router", "kv-aware", "--time-scale", str(scale), "--slo", SLO, "--out", out, "--force", "--json", *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="mooncake.jsonl")
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--out", default="runs/pd-table")
    args = ap.parse_args()
    rows = [("mixed x 4", ["--replicas", "4"])]
    for gbps in (400, 100):
        for p, d in ((1, 3), (2, 2), (3, 1)):
            rows.append((f"P:D {p}:{d}, {gbps} Gb/s", ["--disagg", f"{p}:{d}",
                                                        "--link", "ib-400", "--link-gbps", str(gbps)]))
    print(f"| layout (16 GPUs) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | goodput / GPU (req/s, {SLO}) "
          "| KV moved p50 / p99 (MB) | prefill hit rate | link util | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, extra in rows:
        s, wall = run(args.trace, os.path.join(args.out, name.replace(" ", "").replace(",", "-").replace(":", "")),
                      args.time_scale, extra)
        d = s.get("disagg")
        gpus = d["gpus"] if d else 16
        moved = f"{d['bytes_p50'] / 1e6:,.0f} / {d['bytes_p99'] / 1e6:,.0f}" if d else "-"
        util = f"{d['link_util_recv']:.3f}" if d else "-"
        print(f"| {name} | {s['ttft_ms_p50'] / 1e3:,.2f} / {s['ttft_ms_p99'] / 1e3:,.2f} "
              f"| {s['tpot_ms_p50']:.1f} / {s['tpot_ms_p99']:.1f} | {s['goodput_req_per_s'] / gpus:.4f} "
              f"| {moved} | {s['prefix_hit_rate']:.4f} | {util} | {wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
