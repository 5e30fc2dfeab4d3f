"""Block-pool throughput at pool sizes from 10k to 1M blocks: the per-operation cost must not grow
with the pool (O(1) free-list pop/append, O(1) cached-block reuse, dict-indexed prefix lookup).

    python benchmarks/bench_block_pool.py [--sizes 10000,100000,1000000] [--policy lru] [--pool both]

``--pool``: ``compiled`` (ArrayBlockPool, what PagedKV runs under lru), ``python`` (BlockPool, the
reference and every other policy's pool), or ``both`` (default), a row each (one row for a policy
other than lru: BlockPool's).

Prints one table: for each pool size, blocks (or tokens) per second for
  alloc   : taking blocks for prefills of 64 blocks (free blocks first, then evicting cached ones)
  append  : decode steps of every sequence, one token each (allocate per sequence, one commit_all a
            step, as the scheduler does), a new block every block_size
  free    : releasing whole sequences (blocks become cached, registered under prefix keys)
  lookup  : prefix matches of 64-block prompts whose blocks are cached (hash + token confirmation)
"""
from __future__ import annotations

import argparse
import time

from kvbench.memory import PagedKV, SeqKV
from kvbench.trace.tokens import TokenStreams

BS = 16
PROMPT_BLOCKS = 64


def bench(num_blocks: int, policy: str, compiled: bool, rounds: int = 3) -> dict:
    streams = TokenStreams()
    n_seqs = max(4, num_blocks // (PROMPT_BLOCKS * 2))  # prompts fill half the pool
    prompts = [streams.stream(f"bench/{i}", PROMPT_BLOCKS * BS) for i in range(n_seqs)]
    best = {"alloc": 0.0, "append": 0.0, "free": 0.0, "lookup": 0.0}
    for r in range(rounds):
        kv = PagedKV(num_blocks, BS, cache_policy=policy, compiled=compiled)
        best["pool"] = type(kv.pool).__name__
        seqs = [SeqKV(tokens=p) for p in prompts]
        t = time.perf_counter()
        for s in seqs:
            kv.allocate(s, PROMPT_BLOCKS * BS)
        dt = time.perf_counter() - t
        best["alloc"] = max(best["alloc"], n_seqs * PROMPT_BLOCKS / dt)
        for s in seqs:
            kv.commit(s, PROMPT_BLOCKS * BS)  # registers every block in the prefix index
        # decode: 4 blocks' worth of tokens per sequence
        steps = 4 * BS
        t = time.perf_counter()
        ones = [1] * len(seqs)
        for _ in range(steps):
            for s in seqs:
                kv.allocate(s, 1)
            kv.commit_all(seqs, ones)
        dt = time.perf_counter() - t
        best["append"] = max(best["append"], steps * n_seqs / dt)
        held = sum(len(s.table) for s in seqs)
        t = time.perf_counter()
        for s in seqs:
            kv.free(s)
        dt = time.perf_counter() - t
        best["free"] = max(best["free"], held / dt)
        probes = [SeqKV(tokens=p) for p in prompts]
        t = time.perf_counter()
        matched = 0
        for s in probes:
            matched += len(kv.lookup(s, PROMPT_BLOCKS * BS))
        dt = time.perf_counter() - t
        assert matched == n_seqs * (PROMPT_BLOCKS - 1), matched  # all cached: a full hit each
        best["lookup"] = max(best["lookup"], matched / dt)
        # second allocation round evicts cached blocks: the eviction path
        fresh = [SeqKV(tokens=streams.stream(f"bench2/{i}", PROMPT_BLOCKS * BS)) for i in range(n_seqs)]
        t = time.perf_counter()
        for s in fresh:
            kv.allocate(s, PROMPT_BLOCKS * BS)
        dt = time.perf_counter() - t
        best["alloc_evict"] = max(best.get("alloc_evict", 0.0), n_seqs * PROMPT_BLOCKS / dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--pool", choices=("both", "compiled", "python"), default="both")
    a = ap.parse_args()
    pools = {"both": (True, False), "compiled": (True,), "python": (False,)}[a.pool] if a.policy == "lru" else (False,)
    print(f"block pool, block_size={BS}, policy={a.policy} (best of 3 rounds; millions per second)")
    print(f"{'pool':>14} {'pool blocks':>12} {'alloc blk/s':>12} {'alloc+evict':>12} {'append tok/s':>13} "
          f"{'free blk/s':>11} {'lookup blk/s':>13}")
    for n in (int(x) for x in a.sizes.split(",")):
        for compiled in pools:
            b = bench(n, a.policy, compiled)
            print(f"{b['pool']:>14} {n:>12,} {b['alloc'] / 1e6:>12.2f} {b['alloc_evict'] / 1e6:>12.2f} "
                  f"{b['append'] / 1e6:>13.2f} {b['free'] / 1e6:>11.2f} {b['lookup'] / 1e6:>13.2f}")


if __name__ == "__main__":
    main()
