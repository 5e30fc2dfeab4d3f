"""Radix mode against SGLang 0.5.23 without SGLang: the whole Mooncake conversation trace, one request
at a time (benchmarks/sglang_reference/drive.py's protocol), page/block 16, at the cache budgets whose
SGLang figures tests/data/sglang-0.5.23-radix-mooncake.json.gz holds. One table: hit rate, evicted
tokens and wall time of each kvbench model beside SGLang's.

    python benchmarks/bench_radix.py [--limit N] [--tokens 768000,4000000] [--decode] [--skip-engine]

Rows: the what-if's radix mode (whole blocks, node eviction); PagedKV's radix mode with node eviction,
whole blocks (SGLang at page size 16) and with partial-block hits (the engine's default radix mode);
radix with block eviction; hash mode (vLLM's block LRU). ``--decode`` adds PagedKV radix/node/whole
decoding every output token, against SGLang's run that inserts the outputs too.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvbench.memory import PagedKV, SeqKV
from kvbench.trace.format import load_trace
from kvbench.trace.importers import convert
from kvbench.trace.keys import sequence_tokens
from kvbench.trace.tokens import TokenStreams
from kvbench.whatif.blocktrace import prepare
from kvbench.whatif.curve import simulate

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
GOLDEN = ROOT / "tests" / "data" / "sglang-0.5.23-radix-mooncake.json.gz"
BS = 16


def sequential(reqs, num_blocks: int, mode: str, eviction: str, partial: bool, decode: bool) -> tuple[int, int]:
    """(hit tokens, evicted tokens): lookup, allocate + commit the prompt (and each output token), free."""
    streams = TokenStreams()
    kv = PagedKV(num_blocks, BS, prefix_mode=mode, radix_eviction=eviction, radix_partial=partial)
    hit = 0
    for r in reqs:
        prompt = streams.expand(r)
        s = SeqKV(tokens=sequence_tokens(r, prompt, streams) if decode else prompt)
        found = kv.lookup(s, r.prompt_len)
        cached = kv.num_cached_tokens(s, found)
        if not kv.allocate(s, r.prompt_len - cached, found):
            raise SystemExit(f"request {r.id} does not fit in {num_blocks} blocks")
        kv.take_copies()
        kv.commit(s, r.prompt_len - cached)
        for _ in range(r.output_len - 1 if decode else 0):
            kv.allocate(s, 1)
            kv.commit(s, 1)
        hit += cached
        kv.free(s)
    return hit, kv.pool.evictions * BS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, help="only the first N requests (SGLang's figures: whole trace)")
    ap.add_argument("--tokens", default="768000,4000000", help="cache budgets in tokens")
    ap.add_argument("--decode", action="store_true", help="also decode every output token")
    ap.add_argument("--skip-engine", action="store_true", help="the what-if only (about a minute)")
    args = ap.parse_args()
    if not REAL.exists():
        sys.exit(f"real trace not found at {REAL}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mooncake.jsonl"
        convert("mooncake", REAL, path, limit=args.limit)
        reqs = load_trace(path)
    prompt_tokens = sum(r.prompt_len for r in reqs)
    golden = {"whole": {"runs": []}}
    if GOLDEN.exists():
        with gzip.open(GOLDEN, "rt", encoding="utf-8") as fh:
            golden = json.load(fh)
    sglang = {(r["tokens"], r["outputs"]): r for r in golden["whole"]["runs"]} if args.limit is None else {}
    t0 = time.perf_counter()
    bt = prepare(reqs, BS, future=False)
    print(f"{len(reqs):,} requests, {prompt_tokens:,} prompt tokens; what-if preparation "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    table = Table(title=f"Mooncake conversation, one request at a time, block/page {BS}")
    for col in ("cache tokens", "model", "hit rate", "evicted tokens", "wall s"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for tokens in (int(x) for x in args.tokens.split(",")):
        rows = []
        if (tokens, False) in sglang:
            g = sglang[(tokens, False)]
            rows.append(("SGLang 0.5.23 RadixCache (golden)", g["hit_tokens"], g["evicted_tokens"], None))
        t = time.perf_counter()
        pt = simulate(bt, tokens // BS, "lru", prefix_mode="radix")
        rows.append(("what-if radix (node, whole blocks)", pt.hit_tokens, pt.evicted_blocks * BS,
                     time.perf_counter() - t))
        if not args.skip_engine:
            for label, mode, ev, partial in (("PagedKV radix, node, whole blocks", "radix", "node", False),
                                             ("PagedKV radix, node, partial blocks (default)", "radix", "node", True),
                                             ("PagedKV radix, block eviction (lru), partial", "radix", "block", True),
                                             ("PagedKV hash (vLLM block lru)", "hash", "node", True)):
                t = time.perf_counter()
                hit, ev_tokens = sequential(reqs, tokens // BS, mode, ev, partial, False)
                rows.append((label, hit, ev_tokens, time.perf_counter() - t))
        if args.decode:
            if (tokens, True) in sglang:
                g = sglang[(tokens, True)]
                rows.append(("SGLang + outputs inserted (golden)", g["hit_tokens"], g["evicted_tokens"], None))
            t = time.perf_counter()
            hit, ev_tokens = sequential(reqs, tokens // BS, "radix", "node", False, True)
            rows.append(("PagedKV radix, node, whole, decoding", hit, ev_tokens, time.perf_counter() - t))
        for label, hit, ev_tokens, wall in rows:
            table.add_row(f"{tokens:,}", label, f"{hit / prompt_tokens:.6f}", f"{ev_tokens:,}",
                          "" if wall is None else f"{wall:.1f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
