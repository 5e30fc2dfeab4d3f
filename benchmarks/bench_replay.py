"""Sim replay of the whole real Mooncake conversation trace (12,031 requests, 145 M prompt tokens,
4.1 M output tokens) at block size 16: wall time, engine steps per second, and the wall time per
scheduled sequence per step (the scheduler + block pool hot path).

    python benchmarks/bench_replay.py [--trace ../shared/traces/real/mooncake_conversation.jsonl]
                                      [--model llama-3-8b --gpu h200 --tp 1] [--limit N] [--profile | --phases]

The trace is converted to kvbench's format first (not timed). One process, one core. --phases times
the loop's parts (each method wrapped in a timer: a few per cent slower) and prints where the replay's
wall time goes: a request's arrival, the scheduler's step (its admission apart), the batch, the
executor, the commit and the update, the accounting.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.trace.importers import convert

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per replica (a model too large for one)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--num-blocks", type=int, default=None, help="pool size [default: the GPU preset's]")
    ap.add_argument("--convert-from", default="mooncake",
                    help="format of --trace to convert first ('' if it is a kvbench trace already)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--phases", action="store_true", help="time the loop's parts")
    a = ap.parse_args()
    phases = timed_phases() if a.phases else None
    with tempfile.TemporaryDirectory() as tmp:
        trace = a.trace
        if a.convert_from:  # a public format: convert it first (not timed)
            trace = os.path.join(tmp, "trace.jsonl")
            convert(a.convert_from, a.trace, trace)
        cfg = ReplayConfig(executor="sim", model=a.model, gpu=a.gpu, tp=a.tp, block_size=a.block_size,
                           limit=a.limit, num_blocks=a.num_blocks)
        t0 = time.perf_counter()
        rp = Replay(trace, cfg, os.path.join(tmp, "run"))
        t_load = time.perf_counter() - t0
        prof = cProfile.Profile() if a.profile else None
        t1, c1 = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        s = rp.run()
        if prof:
            prof.disable()
        t_run, c_run = time.perf_counter() - t1, time.process_time() - c1
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before reading the results back
        seq_steps = int(pq.read_table(os.path.join(tmp, "run", "steps.parquet"), columns=["decode_seqs"])
                        .column("decode_seqs").to_numpy().sum())
    print(f"{'trace':<28} {Path(a.trace).name}")
    print(f"{'model (KV cache groups)':<28} {a.model}: {rp.kv_layout.describe()}")
    print(f"{'requests / completed':<28} {s['requests']:,} / {s['completed']:,}")
    print(f"{'output tokens':<28} {s['output_tokens']:,}")
    print(f"{'engine steps':<28} {s['steps']:,}")
    print(f"{'load + setup (s)':<28} {t_load:.1f}")
    print(f"{'replay wall (s)':<28} {t_run:.1f}")
    print(f"{'replay CPU (s)':<28} {c_run:.1f}")
    print(f"{'total wall (s)':<28} {t_load + t_run:.1f}")
    print(f"{'steps per second':<28} {s['steps'] / t_run:,.0f}")
    print(f"{'us per decode seq-step':<28} {t_run / max(1, seq_steps) * 1e6:.2f}")
    print(f"{'prefix hit / ideal':<28} {s['prefix_hit_rate']:.4f} / {s['ideal_hit_rate']:.4f}")
    print(f"{'engine time (s)':<28} {s['duration_s']:.1f}")
    print(f"{'pool (blocks)':<28} {s['num_blocks']:,}")
    print(f"{'peak RSS (MB)':<28} {rss_mb:,.0f}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    if phases is not None:
        print(f"\n{'phase (wall s; nested in the one above it where indented)':<62} {'s':>7} {'share':>6}")
        for name, label in PHASES:
            print(f"{label:<62} {phases[name]:>7.2f} {phases[name] / t_run:>6.0%}")


# (timer, what it covers), in the loop's order; indented ones run inside the one before
PHASES = (("arrive", "a request arrives (read, keys, ideal, routing, enqueue)"),
          ("schedule", "the scheduler's step (running sequences' blocks, preemption)"),
          ("admit", "  of which admission (prefix lookup, allocation)"),
          ("build_batch", "the step's batch"), ("execute", "the executor (the sim's cost model)"),
          ("update", "commit and update (tokens, ITL, finishes)"), ("commit_all", "  of which the commit"),
          ("step", "accounting: the step's row"), ("request", "accounting: a finished request's row"))


def timed_phases() -> dict[str, float]:
    """Wrap the loop's methods in timers; the wall time each takes, summed, by PHASES name."""
    from kvbench.engine.accounting import Accounts
    from kvbench.executors.sim import SimExecutor
    from kvbench.memory.paged import PagedKV
    from kvbench.scheduler.scheduler import Scheduler

    spent = dict.fromkeys((name for name, _ in PHASES), 0.0)
    for cls, method, name in ((Replay, "_arrive", "arrive"), (Scheduler, "schedule", "schedule"),
                              (Scheduler, "_admit", "admit"), (Scheduler, "build_batch", "build_batch"),
                              (SimExecutor, "execute", "execute"), (Scheduler, "update", "update"),
                              (PagedKV, "commit_all", "commit_all"), (Accounts, "step", "step"),
                              (Accounts, "request", "request")):
        def timer(f=getattr(cls, method), name=name):
            def run(*args, **kw):
                t = time.perf_counter()
                try:
                    return f(*args, **kw)
                finally:
                    spent[name] += time.perf_counter() - t
            return run
        setattr(cls, method, timer())
    return spent


if __name__ == "__main__":
    main()
