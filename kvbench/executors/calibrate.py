"""``kvbench calibrate``: fit the sim executor's roofline to steps measured on this device.

A short grid of prefill batches (one sequence, growing chunks over a cached prefix) and decode
batches (many sequences, growing contexts) runs through the model executor on real KV tensors. Each
step's FLOPs and HBM bytes come from the sim's own model (SimExecutor.step_work), so the fit finds the
three coefficients the sim uses — matmul rate, memory bandwidth, per-step overhead — for
``time = overhead + max(FLOPs / rate, bytes / bandwidth)``. Two points in three fit, the third are held
out, and the file records how well the fitted model predicts them (mean absolute percentage error).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from kvbench.scheduler.batch import StepBatch
from kvbench.executors.sim import CostModel, SimExecutor
from kvbench.executors.presets import GPUS, ModelSpec


@dataclass(slots=True)
class Point:
    kind: str  # prefill | decode
    batch: int
    tokens: int  # prefill: chunk length; decode: context length
    flops: float
    mem_bytes: float
    measured_s: float


def _grid(quick: bool) -> list[tuple[str, int, int]]:
    if quick:
        pre = [("prefill", 1, n) for n in (32, 64, 128, 256)]
        dec = [("decode", b, c) for b in (1, 4, 16) for c in (64, 256)]
    else:
        pre = [("prefill", 1, n) for n in (64, 128, 256, 512, 1024, 2048)]
        dec = [("decode", b, c) for b in (1, 8, 32, 64) for c in (256, 1024, 4096)]
    return pre + dec


def _batch(kind: str, batch: int, tokens: int, block_size: int, vocab: int,
           rng: np.random.Generator) -> tuple[StepBatch, int]:
    """A step over block tables laid out consecutively from block 0; returns it and blocks used."""
    b = StepBatch(block_size=block_size)
    nxt = 0
    for sid in range(batch):
        ctx = tokens
        nblk = -(-ctx // block_size)
        table = list(range(nxt, nxt + nblk))
        nxt += nblk
        if kind == "prefill":
            b.prefill_seq_ids.append(sid)
            b.prefill_starts.append(0)
            b.prefill_lens.append(ctx)
            b.prefill_last.append(True)
            b.prefill_tokens.append(rng.integers(16, vocab, size=ctx, dtype=np.int32))
        else:
            b.decode_seq_ids.append(sid)
            b.decode_positions.append(ctx - 1)
            b.decode_tokens.append(int(rng.integers(16, vocab)))
        b.block_tables[sid] = table
    return b, nxt


def measure(executor, spec: ModelSpec, quick: bool = False, repeats: int = 3,
            block_size: int = 16, seed: int = 0) -> list[Point]:
    """Run the grid on ``executor`` (a ModelExecutor); the best of ``repeats`` per point."""
    dtype = "fp32" if str(executor.dtype) == "torch.float32" else "bf16"
    sim = SimExecutor(spec, CostModel.from_gpu(GPUS["h200"]), 0, kv_dtype=dtype, weight_dtype=dtype)
    rng = np.random.default_rng(seed)
    grid = _grid(quick)
    batches = [_batch(k, b, n, block_size, spec.vocab_size, rng) for k, b, n in grid]
    executor.bind_pool(max(nb for _, nb in batches) + 1, block_size)
    out = []
    for (kind, bsz, n), (batch, _) in zip(grid, batches):
        executor.execute(batch)  # warm-up (kernel compilation, allocator)
        best = min(executor.execute(batch).duration_s for _ in range(repeats))
        flops, mem = sim.step_work(batch)
        out.append(Point(kind, bsz, n, flops, mem, best))
    return out


def fit(points: list[Point]) -> CostModel:
    """Least relative squared error over a log grid of rates; the overhead by least squares."""
    f = np.array([p.flops for p in points])
    m = np.array([p.mem_bytes for p in points])
    t = np.array([p.measured_s for p in points])
    best = None
    for rate in np.logspace(9, 16, 141):
        for bw in np.logspace(9, 14, 101):
            body = np.maximum(f / rate, m / bw)
            over = max(0.0, float(np.median(t - body)))
            err = float(np.mean(((over + body) / t - 1.0) ** 2))
            if best is None or err < best[0]:
                best = (err, rate, bw, over)
    _, rate, bw, over = best
    return CostModel(matmul_flops=float(rate), mem_bw=float(bw), step_overhead_s=over, pcie_bw=0.0)


def mape(model: CostModel, points: list[Point]) -> float:
    if not points:
        return float("nan")
    errs = [abs(model.time(p.flops, p.mem_bytes) / p.measured_s - 1.0) for p in points]
    return float(np.mean(errs))


def calibrate(executor, spec: ModelSpec, quick: bool = False, seed: int = 0) -> dict:
    """Measure, fit on 2/3 of the points, report the error on the held-out third."""
    t0 = time.perf_counter()
    points = measure(executor, spec, quick=quick, seed=seed)
    held = [p for i, p in enumerate(points) if i % 3 == 2]
    train = [p for i, p in enumerate(points) if i % 3 != 2]
    model = fit(train)
    model.pcie_bw = GPUS["h200"].pcie_bw  # not measured here; the preset's value
    return {
        "kvbench_calibration": 1,
        "device_name": getattr(executor, "device_name", None),
        "model": spec.name,
        "coefficients": {"matmul_flops": model.matmul_flops, "mem_bw": model.mem_bw,
                         "step_overhead_s": model.step_overhead_s, "pcie_bw": model.pcie_bw},
        "fit": {"mape_train": mape(model, train), "mape_heldout": mape(model, held),
                "points_train": len(train), "points_heldout": len(held),
                "seconds": time.perf_counter() - t0},
        "points": [{"kind": p.kind, "batch": p.batch, "tokens": p.tokens, "flops": p.flops,
                    "mem_bytes": p.mem_bytes, "measured_s": p.measured_s,
                    "predicted_s": model.time(p.flops, p.mem_bytes),
                    "heldout": i % 3 == 2} for i, p in enumerate(points)],
    }


def write(result: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
