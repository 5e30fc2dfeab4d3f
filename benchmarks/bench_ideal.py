"""Memory of the ideal hit rate's infinite cache on a long trace of mostly unique prompts: keys kept and
peak RSS with the keys that can never hit dropped (today) and with every key kept (before).

    python benchmarks/bench_ideal.py [--requests 20000] [--shared 512] [--unique 2048] [--block-size 16]

Every request is a shared system prompt then a prompt of its own; the figures are equal either way.
Each mode runs in a fresh process so the peak RSS is its own.

    python benchmarks/bench_ideal.py --trace PATH [--block-size 16]

times a replay's ideal pass over a kvbench trace instead (Replay._ideal_in_trace_order: block_expiry
then IdealCounter.add, request by request in trace order, with expiry), the block keys computed
beforehand so that only those two are timed.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def run(mode: str, a) -> dict:
    from kvbench.trace.format import Request, Segment
    from kvbench.trace.ideal import IdealCounter
    from kvbench.trace.keys import PrefixKeys

    keys_of, counter = PrefixKeys(a.block_size), IdealCounter(a.block_size)
    t0 = time.perf_counter()
    for i in range(a.requests):
        r = Request(id=f"r{i}", t=float(i), output_len=2,
                    prompt=[Segment("shared", name="system", length=a.shared), Segment("unique", length=a.unique)])
        keys, plen = keys_of(r)
        counter.add(keys, plen, keys_of.shareable_blocks(r) if mode == "drop" else None)
    res = counter.result()
    return {"mode": mode, "keys_kept": len(counter.seen), "hit_rate": res.hit_rate,
            "seconds": time.perf_counter() - t0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def replay_ideal(a) -> None:
    from kvbench.trace.format import load_trace
    from kvbench.trace.ideal import IdealCounter, block_expiry
    from kvbench.trace.keys import PrefixKeys
    from kvbench.trace.stream import SharedNames

    bs, reqs = a.block_size, load_trace(a.trace)
    names, keys_of = SharedNames.of(reqs), PrefixKeys(a.block_size)
    keys_of.once = names.once
    inputs = list(map(keys_of.with_pieces, reqs))
    keys, plen, pieces, shareable = inputs[0]  # compiled code loaded (or compiled) before the clock
    IdealCounter(bs).add(keys, plen, shareable, block_expiry(pieces, len(keys), bs, names), at=0)
    counter, peak, expiry_s, add_s = IdealCounter(bs), 0, 0.0, 0.0
    clock = time.perf_counter
    for rank, (keys, plen, pieces, shareable) in enumerate(inputs):
        t0 = clock()
        expires = block_expiry(pieces, len(keys), bs, names)
        t1 = clock()
        counter.add(keys, plen, shareable, expires, at=rank)
        add_s += clock() - t1
        expiry_s += t1 - t0
        peak = max(peak, len(counter.seen))
    res = counter.result()
    print(f"{len(reqs):,} requests, {sum(len(k) for k, *_ in inputs):,} block keys, block {bs}: "
          f"block_expiry {expiry_s:.3f} s, IdealCounter.add {add_s:.3f} s; hit rate {res.hit_rate:.4f}, "
          f"{res.distinct_blocks:,} distinct blocks, peak {peak:,} keys kept")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--shared", type=int, default=512)
    ap.add_argument("--unique", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--trace", help="time a replay's ideal pass over this kvbench trace instead")
    ap.add_argument("--mode", choices=["drop", "keep"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trace:
        replay_ideal(a)
        return
    if a.mode:
        print(json.dumps(run(a.mode, a)))
        return
    print(f"{a.requests:,} requests of {a.shared} shared + {a.unique} unique tokens, block {a.block_size}")
    print("| keys that cannot hit | keys kept | hit rate | seconds | peak RSS (MB) |")
    print("|---|---|---|---|---|")
    for mode, label in (("keep", "kept (before)"), ("drop", "dropped")):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--requests", str(a.requests),
                              "--shared", str(a.shared), "--unique", str(a.unique),
                              "--block-size", str(a.block_size)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        print(f"| {label} | {r['keys_kept']:,} | {r['hit_rate']:.4f} | {r['seconds']:.1f} | {r['peak_rss_mb']:,.0f} |")


if __name__ == "__main__":
    main()
