"""``kvbench trace whatif --tiers`` on the whole real Mooncake conversation trace (12,031 requests):
the shared preparation, the GPU pool's run (once per GPU size and policy), then each lower-tier
combination behind it, timed apart.

    python benchmarks/bench_whatif_tiers.py [--trace ../shared/traces/real/mooncake_conversation.jsonl]
        [--block-size 512] [--gpu 16GiB] [--cpu 0,128GiB,512GiB,2TiB] [--disk 0] [--policy lru]
        [--tier-policy lru] [--offload write-through] [--limit N]

The trace is converted to kvbench's format first, in a process of its own (bench_whatif.load_mooncake:
neither timed nor counted in the peak RSS), then read as the CLI reads it (read_pieces). Sizes are llama-3.1-8b bf16 bytes.
"""
from __future__ import annotations

import argparse
import itertools
import resource
import time

from bench_whatif import DEFAULT, load_mooncake  # beside this script (sys.path[0])

from kvbench.executors.presets import get_model
from kvbench.trace.pieces import read_pieces
from kvbench.whatif.blocktrace import prepare
from kvbench.whatif.tiers import gpu_stream, parse_tiers, simulate_tiers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT))
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--gpu", default="16GiB")
    ap.add_argument("--cpu", default="0,128GiB,512GiB,2TiB")
    ap.add_argument("--disk", default="0")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--tier-policy", default="lru")
    ap.add_argument("--offload", default="write-through")
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args()
    tiers = parse_tiers(f"gpu={a.gpu},cpu={a.cpu},disk={a.disk}")
    block_bytes = get_model("llama-3.1-8b").kv_bytes_per_token("bf16") * a.block_size
    reqs, t0 = load_mooncake(a.trace, a.limit, read_pieces)  # as the CLI reads it
    t1 = time.perf_counter()
    bt = prepare(reqs, a.block_size, 0.5, future="belady" in (a.policy, a.tier_policy))
    t2 = time.perf_counter()
    print(f"whatif tiers bench: {bt.requests:,} requests, block size {a.block_size}, {len(bt.ids):,} blocks, "
          f"{bt.distinct_blocks:,} distinct; gpu {a.policy}, lower tiers {a.tier_policy}, {a.offload}")
    print(f"  load trace {t1 - t0:6.1f} s   prepare {t2 - t1:6.1f} s")
    print(f"{'gpu':>8} {'cpu':>8} {'disk':>8} {'gpu s':>7} {'tiers s':>8} {'gpu':>7} {'cpu':>7} {'disk':>7} {'total':>7}")
    prompt = bt.window_prompt_tokens
    for (gb, gl) in tiers["gpu"]:
        t = time.perf_counter()
        gpu_blocks = gb // block_bytes
        stream = gpu_stream(bt, gpu_blocks, a.policy, victims=a.offload == "write-back")
        gpu_s = time.perf_counter() - t
        for (cb, cl), (db, dl) in itertools.product(tiers["cpu"], tiers["disk"]):
            pt = simulate_tiers(bt, [gpu_blocks, cb // block_bytes, db // block_bytes], a.policy,
                                a.tier_policy, a.offload, stream)
            rates = [h / prompt if prompt else 0.0 for h in pt.hit_tokens]
            print(f"{gl:>8} {cl:>8} {dl:>8} {gpu_s:7.2f} {pt.wall_s:8.2f} "
                  + " ".join(f"{r:7.4f}" for r in rates) + f" {sum(rates):7.4f}")
    print(f"  total {time.perf_counter() - t0:.1f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
