"""A production-scale trace from a real one: a kvbench trace repeated until it holds N requests, each
copy its own traffic (every id, session, shared stream and answer name prefixed with the copy's
number, so copies share nothing) shifted in time to follow the one before (its span plus --gap-s).
Written as a stream: memory stays that of one copy's lines.

    python benchmarks/make_big_trace.py TRACE -n 1000000 -o /tmp/mooncake-1m.jsonl [--gap-s 3600]

TRACE is a kvbench trace (convert a public one first: kvbench trace convert --from mooncake ...).
"""
from __future__ import annotations

import argparse
import json
import sys


def _rename(seg: dict, tag: str) -> dict:
    return {**seg, "shared": tag + seg["shared"]} if "shared" in seg else seg


def copies(lines: list[dict], n: int, gap_s: float):
    """The first ``n`` requests of the copies, in order (copy k: times + k x (span + gap))."""
    t0 = min(r["t"] for r in lines)
    span = max(r["t"] for r in lines) - t0 + gap_s
    k = written = 0
    while written < n:
        tag, shift = f"c{k}/", k * span
        for r in lines:
            if written == n:
                return
            out = {**r, "id": tag + str(r["id"]), "t": round(r["t"] + shift, 6),
                   "prompt": [_rename(seg, tag) for seg in r["prompt"]]}
            if r.get("session") is not None:
                out["session"] = tag + str(r["session"])
            if r.get("output") is not None:
                out["output"] = tag + r["output"]
            yield out
            written += 1
        k += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("-n", type=int, required=True, help="requests to write")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--gap-s", type=float, default=3600.0, help="seconds between one copy's last arrival and the next's first")
    a = ap.parse_args(argv)
    with open(a.trace, encoding="utf-8") as fh:
        lines = [json.loads(line) for line in fh if line.strip()]
    with open(a.out, "w", encoding="utf-8") as out:
        for r in copies(lines, a.n, a.gap_s):
            out.write(json.dumps(r, separators=(",", ":")) + "\n")
    print(f"wrote {a.n:,} requests ({-(-a.n // len(lines))} copies of {len(lines):,}) to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
