"""A disaggregated replay against a mixed one with the same number of instances: the whole real Mooncake
conversation trace (12,031 requests), Llama-3-8B on H200s at its recorded rate, as N mixed
replicas (least-loaded) and as N/2 prefill + N/2 decode instances (least-loaded prefill routing),
alternated round by round, in one process on one core.

    python benchmarks/bench_disagg.py [--trace ../shared/traces/real/mooncake_conversation.jsonl]
                                      [--instances 4] [--rounds 3]

Prints a table: wall seconds per round, engine steps, steps per wall second, and the ratio of the
disaggregated replay's wall time to the mixed one's (the issue's bound: within 2x).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kvbench.engine.config import ReplayConfig
from kvbench.engine.runs import replay
from kvbench.trace.importers import convert

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    n = args.instances
    base = dict(executor="sim", model="llama-3-8b", gpu="h200", time_scale=1.0, router="least-loaded")
    kinds = {"mixed": ReplayConfig(**base, replicas=n),
             "disaggregated": ReplayConfig(**base, disagg=f"{n // 2}:{n - n // 2}")}
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "mooncake.jsonl")
        convert("mooncake", args.trace, trace)
        walls: dict[str, list[float]] = {k: [] for k in kinds}
        steps: dict[str, int] = {}
        for r in range(args.rounds):
            for name, cfg in kinds.items():
                t0 = time.perf_counter()
                s = replay(trace, cfg, os.path.join(tmp, f"{name}-{r}"))
                walls[name].append(time.perf_counter() - t0)
                steps[name] = s["steps"]
    print(f"| replay ({n} instances) | wall s per round | mean | engine steps | steps / wall s |")
    print("|---|---|---|---|---|")
    for name in kinds:
        w = walls[name]
        mean = sum(w) / len(w)
        print(f"| {name} | {' / '.join(f'{x:.1f}' for x in w)} | {mean:.1f} | {steps[name]:,} | {steps[name] / mean:,.0f} |")
    ratio = (sum(walls["disaggregated"]) / len(walls["disaggregated"])) / (sum(walls["mixed"]) / len(walls["mixed"]))
    print(f"\ndisaggregated / mixed wall time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
