"""Registers, spills, shared memory, warps and stages of every kernel, compiled ahead of time for sm_80,
sm_90 and sm_100 on this machine (no GPU needed: kernels/aot.py compiles each launch as Triton's JIT
would on a real one).

    python benchmarks/kernel_resources.py [--full] [--out FILE.md] [--json FILE.json]

Default: each launcher at the production shape (bf16, head dim 128, Llama-3-8B's GQA 4, block 16), plus
the GQA-8 / block-128 decode and the head-dim-64 prefill. --full: the whole grid of kernels/aot.py
(every dtype, head dim, GQA group, block size 1-128, kept mask) for sm_80 and sm_90, summarised per
kernel and target (the worst case over its distinct compiles); minutes on 2 cores, cached by Triton.
The README quotes the default table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvbench.kernels import aot
from kvbench.kernels.aot import Spec

TABLE_SPECS = [Spec("decode"), Spec("decode1"), Spec("decode", group=8, block_size=128), Spec("prefill"),
               Spec("prefill", head_dim=64), Spec("weights", kept=True), Spec("write_kv"), Spec("copy_blocks")]
COLUMNS = ["kernel", "launch", "target", "regs", "spill B", "smem KiB", "warps", "stages", "16-B loads"]


def _row(spec: Spec, c) -> list:
    wide = sum(n for (_, nbytes), n in c.load_counts.items() if nbytes == 16)
    return [c.kernel.strip("_"), spec.label(), f"sm_{c.arch}", c.regs, c.spill_bytes,
            round(c.smem_bytes / 1024, 1), c.num_warps, c.num_stages, wide]


def default_table() -> list[list]:
    return [_row(spec, c) for spec in TABLE_SPECS for arch in aot.TARGETS for c in aot.compile_spec(spec, arch)]


def full_table(archs=(80, 90)) -> list[list]:
    """Per (kernel, target): specialisations compiled (distinct compiles: launches that share Triton's
    cache key are one), worst registers, spills and shared memory."""
    grid = aot.compile_grid(aot.full_grid(), archs)
    distinct: dict[tuple, dict] = {}  # (kernel, arch) -> {id: Compiled}: each distinct compile once
    for compiled in grid.points.values():
        for c in compiled:
            if isinstance(c, aot.CompileFailure):
                raise SystemExit(f"{c.kernel} sm_{c.arch} failed to compile: {c.error}")
            distinct.setdefault((c.kernel.strip("_"), c.arch), {})[id(c)] = c
    print(f"{grid.launches} launches, {grid.compiles} distinct compiles", file=sys.stderr)
    return [[k, f"sm_{a}", len(cs), max(c.regs for c in cs.values()), max(c.spill_bytes for c in cs.values()),
             round(max(c.smem_bytes for c in cs.values()) / 1024, 1), round(aot.smem_limit(a) / 1024, 1)]
            for (k, a), cs in sorted(distinct.items())]


def markdown(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the whole specialisation grid, worst case per kernel")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    t0 = time.time()
    if args.full:
        columns = ["kernel", "target", "distinct compiles", "max regs", "max spill B", "max smem KiB", "smem limit KiB"]
        rows = full_table()
    else:
        columns, rows = COLUMNS, default_table()
    text = markdown(columns, rows)
    print(text)
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s", file=sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([dict(zip(columns, r)) for r in rows], fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
