"""``kvbench trace whatif`` on the whole real Mooncake conversation trace (12,031 requests, about
9 M block lookups per point at block size 16): the shared preparation (block keys, dense ids, the
ceiling, belady's next uses) and every (budget, policy) point, then the total.

    python benchmarks/bench_whatif.py [--trace ../shared/traces/real/mooncake_conversation.jsonl]
        [--block-size 16] [--budgets 8GiB,16GiB,32GiB,64GiB,128GiB,1024GiB]
        [--policies lru,fifo,lfu,belady] [-j 2] [--limit N]

The trace is converted to kvbench's format first, in a process of its own (neither timed nor counted in
the peak RSS). Budgets are llama-3.1-8b bf16 bytes. The peak RSS after loading the trace is printed too:
imports (numba, numpy) and the loaded trace are most of the total.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbench.engine.config import parse_size
from kvbench.executors.presets import get_model
from kvbench.trace.format import load_trace
from kvbench.trace.pieces import read_pieces
from kvbench.whatif.blocktrace import prepare
from kvbench.whatif.curve import budgets_from_bytes, run_points
from kvbench.whatif.output import format_bytes

CONVERT = ("import sys; from kvbench.trace.importers import convert; "
           "convert('mooncake', sys.argv[1], sys.argv[2], limit=int(sys.argv[3]) if sys.argv[3] else None)")
DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"


def load_mooncake(trace: str, limit: int | None, read=load_trace) -> tuple[list, float]:
    """The Mooncake trace converted to kvbench's format in a process of its own (neither timed nor
    counted in this process's peak RSS), then read by ``read``: what it returns and when reading
    began (time.perf_counter). bench_whatif_tiers.py loads its trace through this too."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mooncake.jsonl"
        subprocess.run([sys.executable, "-c", CONVERT, trace, str(path), str(limit or "")], check=True)
        t0 = time.perf_counter()
        return read(path), t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", default="8GiB,16GiB,32GiB,64GiB,128GiB,1024GiB")
    ap.add_argument("--policies", default="lru,fifo,lfu,belady")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args()
    policies = a.policies.split(",")
    block_bytes = get_model("llama-3.1-8b").kv_bytes_per_token("bf16") * a.block_size
    budgets = budgets_from_bytes([parse_size(x) for x in a.budgets.split(",")], block_bytes)
    reqs, t0 = load_mooncake(a.trace, a.limit, read_pieces)  # as the CLI reads it: no Request per line
    t1 = time.perf_counter()
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    bt = prepare(reqs, a.block_size, 0.5, future="belady" in policies)
    t2 = time.perf_counter()
    points = run_points(bt, [b.blocks for b in budgets], policies, a.jobs)
    t3 = time.perf_counter()
    lookups = int(bt.lookups.sum())
    print(f"whatif bench: {bt.requests:,} requests, block size {a.block_size}, {lookups:,} block "
          f"lookups per point, {bt.distinct_blocks:,} distinct blocks, -j {a.jobs}")
    print(f"  load trace {t1 - t0:6.2f} s   prepare (keys, ids, ceiling, future) {t2 - t1:6.2f} s")
    print(f"{'budget':>8} {'blocks':>9} " + " ".join(f"{p + ' s':>9} {'hit':>6}" for p in policies))
    for b in budgets:
        cells = [points[(b.blocks, p)] for p in policies]
        print(f"{format_bytes(b.bytes):>8} {b.blocks:>9,} "
              + " ".join(f"{c.wall_s:9.1f} {c.hit_tokens / bt.window_prompt_tokens:6.3f}" for c in cells))
    lru = sum(pt.wall_s for (b, p), pt in points.items() if p == "lru")
    rss = [resource.getrusage(who).ru_maxrss / 1024 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    print(f"  points {t3 - t2:.2f} s wall ({sum(p.wall_s for p in points.values()):.2f} s of work; lru: one "
          f"pass for every budget, {lru:.2f} s); what-if (prepare + points) {t3 - t1:.2f} s; total {t3 - t0:.2f} s")
    print(f"  peak RSS {rss[0]:.0f} MB ({rss_loaded:.0f} MB once imported and loaded; largest worker {rss[1]:.0f} MB)")


if __name__ == "__main__":
    main()
