"""Routing across replicas on the whole real Mooncake conversation trace (sim, Llama-3-8B, H200 preset):
one run per router at ``--replicas``, a table of hit rate, TTFT, output tok/s and balance, and the
wall time of each run against one replica replaying the same trace (the cost of N engines on one clock).

    python benchmarks/bench_routing.py [--replicas 4] [--time-scale 1.0] [--limit N]
                                       [--routers round-robin,least-loaded,session,prefix,kv-aware]

The trace is converted to kvbench's format first (not timed). One process, one core.
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.engine.routing import ROUTERS
from kvbench.trace.importers import convert

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--convert-from", default="mooncake", help="'' if --trace is a kvbench trace already")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--routers", default=",".join(ROUTERS) + ",prefix:64",
                    help="routers to run; prefix:K hashes the first K blocks, kv-aware:W weighs the blocks "
                         "to prefill W times the active blocks")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = a.trace
        if a.convert_from:
            trace = os.path.join(tmp, "trace.jsonl")
            convert(a.convert_from, a.trace, trace)
        # one replica at the trace's rate, one at 1/N of it (the load each of N replicas sees: the
        # same work per engine step, the reference for the cost of N engines on one clock), then N
        runs = [(1, "round-robin", 1.0), (1, "round-robin", float(a.replicas))] + \
            [(a.replicas, r, 1.0) for r in a.routers.split(",")]
        print(f"trace {Path(a.trace).name}, {a.model} on {a.gpu}, time scale {a.time_scale}")
        print("| replicas | router | hit rate | TTFT p50 (s) | TTFT p99 (s) | output tok/s | requests max/mean "
              "| busy max/mean | Jain (busy) | engine steps | wall (s) | µs per step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n, spec, slower in runs:
            router, _, k = spec.partition(":")
            arg = {"router_prefix_blocks": int(k)} if router == "prefix" and k else \
                {"router_cache_weight": float(k)} if router == "kv-aware" and k else {}
            cfg = ReplayConfig(executor="sim", model=a.model, gpu=a.gpu, replicas=n, router=router,
                               time_scale=a.time_scale * slower, limit=a.limit, **arg)
            rp = Replay(trace, cfg, os.path.join(tmp, f"{n}-{spec.replace(':', '-')}-{slower:g}"))
            t0 = time.perf_counter()
            s = rp.run()
            wall = time.perf_counter() - t0

            def g(key, fmt):
                v = s.get(key)
                return "-" if v is None else fmt.format(v)
            label = spec if n > 1 else ("-" if slower == 1 else f"- (arrivals 1/{slower:g})")
            print(f"| {n} | {label} | {s['prefix_hit_rate']:.4f} | {s['ttft_ms_p50'] / 1e3:.2f} "
                  f"| {s['ttft_ms_p99'] / 1e3:.2f} | {s['output_tok_per_s']:,.0f} "
                  f"| {g('balance_requests_max_over_mean', '{:.2f}')} | {g('balance_busy_max_over_mean', '{:.2f}')} "
                  f"| {g('jain_busy', '{:.3f}')} | {s['steps']:,} | {wall:.1f} | {wall / s['steps'] * 1e6:.0f} |", flush=True)
        print(f"ideal hit rate (one infinite cache): {s['ideal_hit_rate']:.4f}; "
              f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MB")


if __name__ == "__main__":
    main()
