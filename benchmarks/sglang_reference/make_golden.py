"""Run drive.py's SGLang runs that tests/test_radix.py holds kvbench to, and write them to
tests/data/sglang-0.5.23-radix-mooncake.json.gz: per-request hits on the first Mooncake requests
(prompts only, and with every output decoded) and the whole trace's totals (the issue's figures).

Usage (in the SGLang venv, see README.md): python make_golden.py MOONCAKE.jsonl [--slice 2000]
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from drive import run

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "sglang-0.5.23-radix-mooncake.json.gz"
PAGE = 16
SLICE_RUNS = [(200_000, False), (768_000, False), (4_000_000, False), (200_000, True), (768_000, True)]
WHOLE_RUNS = [(768_000, False), (4_000_000, False), (768_000, True), (4_000_000, True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--slice", type=int, default=2000)
    args = ap.parse_args()
    golden = {"sglang": "0.5.23", "page": PAGE, "protocol": "benchmarks/sglang_reference/drive.py",
              "slice": {"requests": args.slice, "runs": []}, "whole": {"runs": []}}
    for tokens, outputs in SLICE_RUNS:
        r = run(args.trace, tokens, PAGE, limit=args.slice, outputs=outputs)
        print({k: v for k, v in r.items() if k != "hits"}, flush=True)
        golden["slice"]["runs"].append({k: r[k] for k in ("tokens", "outputs", "hit_tokens", "prompt_tokens",
                                                          "evicted_tokens", "hits")})
    for tokens, outputs in WHOLE_RUNS:
        r = run(args.trace, tokens, PAGE, outputs=outputs)
        print({k: v for k, v in r.items() if k != "hits"}, flush=True)
        golden["whole"]["runs"].append({k: r[k] for k in ("tokens", "outputs", "hit_tokens", "prompt_tokens",
                                                          "hit_rate", "evicted_tokens", "requests")})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(OUT, "wt", encoding="utf-8") as fh:
        json.dump(golden, fh, separators=(",", ":"))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
