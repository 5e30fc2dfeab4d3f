"""``kvbench calibrate``: fit the sim executor's per-operation roofline to steps measured on this device.

The model executor runs a grid of steps on real KV tensors, three kinds of them:
  prefill  one chunk of n tokens after a cached prefix of s tokens
  decode   a batch of B sequences, each over c keys
  mixed    a chunk after a cached prefix plus a batch of decodes, as chunked prefill schedules them
Each step's FLOPs and bytes per operation come from the sim's own model (StepCost.work), and the
fitted coefficients are the sim's: matmul_flops, attn_flops, mem_bw, kv_bw and step_overhead_s
(kvbench.executors.sim.CostModel.FITTED; the file gives its other timing terms as 0, and link and PCIe
bandwidths keep the --gpu preset's). The fit
minimises the squared relative error, each step kind weighing the same, over the four rates (a
coordinate search over log grids, and a least-squares step with every operation's bound held) with
the overhead solved exactly for each trial. A third of the points of each kind is held out (see
grid); the file reports the mean |predicted / measured - 1| per kind on the points fitted and on
those held out, and records the device, dtype, model shape and kvbench version it was measured with
(a replay warns when they differ from its own). It also reports the timing spread, how much the
repeats of a step scattered: on a shared CPU the machine's speed moves by tens of percent, and errors
of that size are its noise, not the cost model's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from kvbench.executors.presets import GPUS, ModelSpec
from kvbench.executors.sim import CALIBRATION_VERSION, CostModel, StepCost, Work
from kvbench.jsonio import dumps
from kvbench.scheduler.batch import StepBatch

STEP_KINDS = ("prefill", "decode", "mixed")


@dataclass(slots=True)
class Point:
    kind: str  # prefill | decode | mixed
    prefix: int  # tokens cached before the chunk (0 without one)
    chunk: int  # prefill tokens computed (0 without a chunk)
    batch: int  # decoding sequences
    context: int  # keys each decode attends to
    work: Work
    measured_s: float
    heldout: bool = False
    samples: bool = True  # the chunk ends its prompt (decode-only steps: True)
    spread: float = 0.0  # (p75 - p25) / median of the repeats: how much the machine's speed moved


@dataclass(frozen=True, slots=True)
class Shape:
    """One grid point: (prefix, chunk) of a prefill chunk, (batch, context) of the decodes. ``samples``:
    the chunk ends its prompt (samples a token; a middle chunk of chunked prefill does not).
    ``heldout``: left out of the fit to measure how well it predicts steps it has not seen."""

    kind: str
    prefix: int = 0
    chunk: int = 0
    batch: int = 0
    context: int = 0
    samples: bool = True
    heldout: bool = False


def grid(quick: bool) -> list[Shape]:
    """The steps measured. Prefill and decode are grids of two sizes; a diagonal of each
    ((row + column) % 3 == 2) is held out, so every size is both fitted and held out somewhere (one
    batch size: every third context, inside the fitted range); every third mixed step is held out.
    Half the prefill chunks end their prompt and half do not, so the LM head's cost is told apart
    from the overhead.

    The full grid is for a GPU: decode batches of 1 to 64 at 256 to 4k context, chunks of 64 to 2k
    after prefixes up to 4k. ``quick`` is for a CPU (seconds), in the regime a CPU replay runs: one
    sequence decoding at a time (traces/chat_cpu.jsonl averages 1.07), at 128 to 4k context, and
    chunks of 16 to 256 tokens. It keeps every step at one sampled row, because on a CPU's BLAS the
    LM head switches kernel (matrix-vector to matrix-matrix) at two rows, a jump no roofline draws:
    fitting both sides would misprice the single-row steps that make up such a replay. Its mixed
    steps pair a middle chunk (not sampling) with one decode."""
    if quick:
        prefixes, chunks = (0, 256, 1024), (16, 64, 256)
        batches, contexts = (1,), (128, 256, 512, 1024, 2048, 4096)
        mix = [(256, 64, 1, 512), (1024, 16, 1, 1024), (0, 256, 1, 256), (512, 128, 1, 128),
               (256, 32, 1, 2048), (1024, 64, 1, 1024)]
        mixed_samples = False
    else:
        prefixes, chunks = (0, 1024, 4096), (64, 256, 1024, 2048)
        batches, contexts = (1, 8, 32, 64), (256, 1024, 4096)  # 64 x 4k: 34 GB of Llama-3-8B KV
        mix = [(s, n, b, c) for s, n in ((0, 512), (2048, 256), (1024, 2048)) for b, c in ((8, 1024), (32, 4096))]
        mixed_samples = True
    out = [Shape("prefill", s, n, samples=(i + j) % 2 == 0, heldout=(i + j) % 3 == 2)
           for i, s in enumerate(prefixes) for j, n in enumerate(chunks)]
    line = len(batches) == 1  # a line of contexts: hold out inner ones (the ends are fitted)
    out += [Shape("decode", batch=b, context=c, heldout=(i + j) % 3 == (1 if line else 2))
            for i, b in enumerate(batches) for j, c in enumerate(contexts)]
    out += [Shape("mixed", s, n, b, c, samples=mixed_samples, heldout=i % 3 == 2)
            for i, (s, n, b, c) in enumerate(mix)]
    return out


def make_batch(shape: Shape, block_size: int, vocab: int, rng: np.random.Generator) -> tuple[StepBatch, int]:
    """The step of one grid point over block tables laid out from block 0; returns it and blocks used."""
    b = StepBatch(block_size=block_size)
    nxt = 0

    def table(tokens: int) -> list[int]:
        nonlocal nxt
        n = -(-tokens // block_size)
        nxt += n
        return list(range(nxt - n, nxt))

    sid = 0
    if shape.chunk:
        b.prefill_seq_ids.append(sid)
        b.prefill_starts.append(shape.prefix)
        b.prefill_lens.append(shape.chunk)
        b.prefill_last.append(shape.samples)
        b.prefill_tokens.append(rng.integers(16, vocab, size=shape.chunk, dtype=np.int32))
        b.block_tables[sid] = table(shape.prefix + shape.chunk)
        sid += 1
    for _ in range(shape.batch):
        b.decode_seq_ids.append(sid)
        b.decode_positions.append(shape.context - 1)
        b.decode_tokens.append(int(rng.integers(16, vocab)))
        b.block_tables[sid] = table(shape.context)
        sid += 1
    return b, nxt


def dtype_name(executor) -> str:
    return {"torch.float32": "fp32", "torch.float16": "fp16"}.get(str(getattr(executor, "dtype", "")), "bf16")


def measure(executor, spec: ModelSpec, quick: bool = False, repeats: int = 5, block_size: int = 16,
            seed: int = 0, shapes: list[Shape] | None = None) -> list[Point]:
    """Run the grid on ``executor`` (a ModelExecutor): one warm-up round, then ``repeats`` rounds over
    every step, each timing the second of two runs, keeping each step's median. Rounds, not
    back-to-back repeats: a burst of other load (or a clock change) then touches one sample of many
    steps, not every sample of one. The second run: in a replay, a step follows steps much like it,
    whose weights and buffers it finds in cache. The median, not the best: a replay times each step
    once."""
    dtype = dtype_name(executor)
    cost = StepCost(spec, 1, dtype, dtype)
    rng = np.random.default_rng(seed)
    shapes = shapes or grid(quick)
    batches = [make_batch(s, block_size, spec.vocab_size, rng)[0] for s in shapes]
    executor.bind_pool(max(max(max(t) for t in b.block_tables.values()) for b in batches) + 2, block_size)
    for batch in batches:
        executor.execute(batch)  # warm-up (kernel compilation, allocator)

    def warm(batch) -> float:  # the second of two runs: a replay's steps find the weights in cache
        executor.execute(batch)
        return executor.execute(batch).duration_s
    times = np.array([[warm(batch) for batch in batches] for _ in range(repeats)])  # [repeats, steps]
    med = np.median(times, axis=0)
    spread = (np.percentile(times, 75, axis=0) - np.percentile(times, 25, axis=0)) / med
    return [Point(s.kind, s.prefix, s.chunk, s.batch, s.context, cost.work(b), float(t), s.heldout, s.samples,
                  float(sp)) for s, b, t, sp in zip(shapes, batches, med, spread)]


# -- the fit --------------------------------------------------------------------------------------
RATES = ("matmul_flops", "attn_flops", "mem_bw", "kv_bw")


def _with(base: CostModel, rates: np.ndarray, overhead: float) -> CostModel:
    """``base``'s links with these rates and one per-step overhead: the grid's steps are timed whole
    (the model executor runs eagerly, one step after another), so the other fixed and linear terms are 0."""
    c = CostModel(**base.to_dict())
    for name in CostModel.OVERHEADS + CostModel.LINEAR:
        setattr(c, name, 0.0)
    for name, v in zip(RATES, rates):
        setattr(c, name, float(v))
    c.step_overhead_s = overhead
    return c


def _weights(points: list[Point]) -> np.ndarray:
    """Each step kind weighs the same, however many points it has."""
    n = {k: sum(p.kind == k for p in points) for k in STEP_KINDS}
    return np.array([1.0 / n[p.kind] for p in points])


def _objective(points, base, rates, w, m) -> tuple[float, float]:
    """(weighted mean squared relative error, the best overhead >= 0) for these rates."""
    c = _with(base, rates, 0.0)
    body = np.array([p.work.time(c) for p in points])
    # d/dt0 of sum w ((t0 + body) / m - 1)^2 = 0
    over = max(0.0, float(np.sum(w * (1 - body / m) / m) / np.sum(w / m ** 2)))
    err = float(np.sum(w * ((over + body) / m - 1.0) ** 2) / np.sum(w))
    return err, over


def fit(points: list[Point], base: CostModel | None = None) -> CostModel:
    """The coefficients that best predict ``points`` (link and PCIe terms: ``base``'s)."""
    base = replace(base or CostModel.from_gpu(GPUS["h200"]), attn_ramp_tokens=0.0)  # one attention rate
    w, m = _weights(points), np.array([p.measured_s for p in points])
    # Start from rates at which each operation alone would take its whole step (lower bounds).
    def lower(get):
        vals = [get(p.work) / p.measured_s for p in points if get(p.work) > 0]
        return max(vals) if vals else 1e12
    rates = np.array([lower(lambda x: x.linear_flops + x.lm_head_flops),
                      lower(lambda x: sum(f for f, _ in x.prefill) + x.decode_flops),
                      lower(lambda x: x.linear_bytes + x.lm_head_bytes),
                      lower(lambda x: sum(b for _, b in x.prefill) + x.decode_bytes + x.kv_write_bytes)])
    best, over = _objective(points, base, rates, w, m)
    # Coordinate search: each rate in turn over a log grid around its value (the whole grid, not a
    # step downhill: the error is piecewise in each rate, with a kink where an operation changes
    # bound), the grid narrowing as the fit settles. Between rounds, a least-squares step that moves
    # every rate at once: with each operation's bound held, a step's time is linear in 1 / rate.
    for span in (1e4, 1e4, 1e2, 1e2, 10.0, 10.0, 3.0, 3.0, 1.5, 1.5, 1.1, 1.1, 1.02, 1.02):
        for i in range(len(rates)):
            for f in np.logspace(-math.log10(span), math.log10(span), 41):
                trial = rates.copy()
                trial[i] = min(max(trial[i] * f, 1e3), 1e18)
                err, o = _objective(points, base, trial, w, m)
                if err < best:
                    best, over, rates = err, o, trial
        for _ in range(5):
            trial = _bounds_held(points, base, rates, w, m)
            err, o = _objective(points, base, trial, w, m)
            if not err < best:
                break
            best, over, rates = err, o, trial
    return _with(base, rates, over)


def _bounds_held(points, base, rates, w, m) -> np.ndarray:
    """The rates minimising the error with every operation kept on the side of its roofline (compute
    or memory) it is on at ``rates``: weighted least squares in (overhead, 1 / rate), non-negative."""
    c = _with(base, rates, 0.0)
    rows, rhs = [], []
    for p, wt, meas in zip(points, w, m):
        x = p.work
        a = np.zeros(5)  # overhead, 1/matmul_flops, 1/attn_flops, 1/mem_bw, 1/kv_bw

        def bound(flops, nbytes, rate_col, bw_col, rate, bw):
            if flops / rate >= nbytes / bw:
                a[rate_col] += flops
            else:
                a[bw_col] += nbytes
        bound(x.linear_flops, x.linear_bytes, 1, 3, c.matmul_flops, c.mem_bw)
        bound(x.lm_head_flops, x.lm_head_bytes, 1, 3, c.matmul_flops, c.mem_bw)
        for f, b in x.prefill:
            bound(f, b, 2, 4, c.attn_flops, c.kv_bw)
        bound(x.decode_flops, x.decode_bytes, 2, 4, c.attn_flops, c.kv_bw)
        a[4] += x.kv_write_bytes
        a[0] = 1.0
        fixed = sum(v for k, v in x.seconds(c).items() if k in ("allreduce", "pcie"))
        rows.append(a * math.sqrt(wt) / meas)
        rhs.append(math.sqrt(wt) * (1.0 - fixed / meas))
    A, y = np.array(rows), np.array(rhs)
    free = [j for j in range(5) if A[:, j].any()]
    while True:  # drop what comes out negative and solve again (a small non-negative least squares)
        sol = np.linalg.lstsq(A[:, free], y, rcond=None)[0]
        if (sol >= 0).all() or not free:
            break
        free = [j for j, v in zip(free, sol) if v >= 0]
    inv = np.zeros(5)
    inv[free] = sol
    out = rates.copy()
    for j in range(1, 5):
        if A[:, j].any():
            out[j - 1] = 1e18 if inv[j] <= 0 else min(max(1.0 / inv[j], 1e3), 1e18)
    return out


def errors(cost: CostModel, points: list[Point]) -> dict:
    """Mean |predicted / measured - 1| per step kind, on the fitted and on the held-out points."""
    out = {}
    for kind in (*STEP_KINDS, "all"):
        row = {}
        for split, held in (("train", False), ("heldout", True)):
            sel = [p for p in points if (kind == "all" or p.kind == kind) and p.heldout == held]
            row[split] = (float(np.mean([abs(p.work.time(cost) / p.measured_s - 1.0) for p in sel]))
                          if sel else None)
            row[f"points_{split}"] = len(sel)
        out[kind] = row
    return out


def calibrate(executor, spec: ModelSpec, quick: bool = False, seed: int = 0, repeats: int = 5) -> dict:
    """Measure the grid, fit on the points not held out, report the error per kind: the calibration
    file's contents."""
    from kvbench import __version__

    t0 = time.perf_counter()
    points = measure(executor, spec, quick=quick, seed=seed, repeats=repeats)
    model = fit([p for p in points if not p.heldout])
    per_kind = errors(model, points)
    return {
        "kvbench_calibration": CALIBRATION_VERSION,
        "kvbench_version": __version__,
        "device_name": getattr(executor, "device_name", None),
        "dtype": dtype_name(executor),
        "model": spec.name,
        "model_spec": spec.to_dict(),
        "grid": "quick" if quick else "full",
        # every term that times a step: the fitted ones, and 0 for those the fit leaves out (the
        # preset's would otherwise be added to steps the fit already priced whole)
        "coefficients": {name: getattr(model, name) for name in CostModel.TIMING},
        "fit": {"per_kind": per_kind,
                # the whole grid at once, as earlier files reported it
                "mape_train": per_kind["all"]["train"], "mape_heldout": per_kind["all"]["heldout"],
                "points_train": per_kind["all"]["points_train"],
                "points_heldout": per_kind["all"]["points_heldout"],
                # the median step's (p75 - p25) / median over the repeats: errors of this size are the
                # machine's noise (other load, clock changes), not the cost model's
                "timing_spread": float(np.median([p.spread for p in points]))},
        "seconds": time.perf_counter() - t0,
        "points": [{"kind": p.kind, "prefix": p.prefix, "chunk": p.chunk, "batch": p.batch,
                    "context": p.context, "samples": p.samples, "measured_s": p.measured_s,
                    "predicted_s": p.work.time(model), "heldout": p.heldout, "spread": p.spread}
                   for p in points],
    }


def write(result: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:  # null, never NaN, as every JSON kvbench writes
        fh.write(dumps(result, indent=2) + "\n")
