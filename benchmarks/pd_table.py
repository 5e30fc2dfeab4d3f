#!/usr/bin/env python3
"""Disaggregated prefill/decode against mixed replicas on the same GPUs (README, "Disaggregated prefill
and decode"): the whole Mooncake conversation trace, Llama-3-70B at --tp 4 on H200s, four instances
(16 GPUs) as P:D = 1:3, 2:2, 3:1 at 400 and 100 Gb/s per GPU and as four mixed replicas, each without and
with a KV store all instances share (--store-kv-mem, a DRAM pool at 50 GB/s per instance); the kv-aware
router in front of the prefill instances and the replicas, and Mooncake's conductor router on P:D 3:1.

    python benchmarks/pd_table.py [--trace mooncake.jsonl] [--time-scale 2] [--store 4TiB] [--out runs/pd-table]

Prints a markdown table. The figures are the cost model's (no published P/D measurement is in
benchmarks/published): TTFT and TPOT percentiles, goodput per GPU under --slo, KV bytes a request
moves, the prefill side's prefix hit rate (its share from the store), and the receiving links'
utilisation."""
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
           "--time-scale", str(scale), "--slo", SLO, "--out", out, "--force", "--json", *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="mooncake.jsonl")
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--store", default="4TiB", help="the shared store's size in the rows with one")
    ap.add_argument("--out", default="runs/pd-table")
    args = ap.parse_args()
    kv = ["--router", "kv-aware"]
    rows = []
    for store in ([], ["--store-kv-mem", args.store]):
        tag = ", store" if store else ""
        rows.append((f"4 mixed replicas{tag}", ["--replicas", "4", *kv, *store]))
        for gbps in (400, 100):
            for p, d in ((1, 3), (2, 2), (3, 1)):
                rows.append((f"P:D {p}:{d}, {gbps} Gb/s{tag}", ["--disagg", f"{p}:{d}", "--link", "ib-400",
                                                                "--link-gbps", str(gbps), *kv, *store]))
        rows.append((f"P:D 3:1, 400 Gb/s, conductor{tag}", ["--disagg", "3:1", "--link", "ib-400", "--link-gbps",
                                                             "400", "--router", "conductor", *store]))
    print(f"| 16 GPUs | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | goodput per GPU (req/s, {SLO}) "
          "| KV moved per request p50 / p99 (MB) | prefill-side hit rate (of it, store) | receiving link "
          "utilisation | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, extra in rows:
        slug = name.replace(" ", "").replace(",", "-").replace(":", "")
        s, wall = run(args.trace, os.path.join(args.out, slug), args.time_scale, extra)
        d = s.get("disagg")
        gpus = d["gpus"] if d else 16
        moved = f"{d['bytes_p50'] / 1e6:,.0f} / {d['bytes_p99'] / 1e6:,.0f}" if d else "—"
        util = f"{d['link_util_recv']:.3f}" if d else "—"
        store = f" ({s['hit_rate_store']:.4f})" if s.get("hit_rate_store") is not None else ""
        print(f"| {name} | {s['ttft_ms_p50'] / 1e3:,.2f} / {s['ttft_ms_p99'] / 1e3:,.2f} "
              f"| {s['tpot_ms_p50']:.1f} / {s['tpot_ms_p99']:.1f} | {s['goodput_req_per_s'] / gpus:.4f} "
              f"| {moved} | {s['prefix_hit_rate']:.4f}{store} | {util} | {wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
