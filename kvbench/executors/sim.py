"""The sim executor: a roofline cost model of one engine step on a GPU preset (or calibration).

step time = overhead + max(compute, memory), where
  compute = FLOPs / matmul rate:  2 x non-embedding params x tokens computed
                                  + 2 x hidden x vocab x tokens sampled (LM head)
                                  + 4 x layers x heads x head_dim x attended (query, key) pairs
  memory  = bytes / bandwidth:    weights once per step + KV read by every query + KV written
                                  + slots moved by token eviction's compaction (read + write)
plus, for InfiniGen-style offload, the batch's host<->device bytes / pcie_bw (not overlapped).
A decode step of a big batch is memory bound (the KV read grows with context), a long prefill chunk
compute bound. The coefficients (matmul_flops, mem_bw, step_overhead_s) come from the GPU preset,
or from a calibration file written by ``kvbench calibrate`` on real hardware, which may also carry
per-term scale factors fitted to measured steps. No tokens are produced: the memory behaviour is the
engine's, identical to the model executor's.

A calibration file may instead hold a plain linear clock, ``{"kind": "linear",
"prefill_ms_per_token": 0.1, "decode_step_ms": 20, "overhead_ms": 0}``: a step costs the overhead,
plus that much per prefill token, plus the decode cost if it carries any decode. It puts kvbench on
the same clock as another engine's scheduler driven without a model, to compare schedules step by step.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from kvbench.errors import InputError
from kvbench.scheduler.batch import StepBatch, StepResult
from kvbench.executors.presets import GPUSpec, ModelSpec


@dataclass(slots=True)
class CostModel:
    matmul_flops: float
    mem_bw: float
    step_overhead_s: float
    pcie_bw: float

    def time(self, flops: float, mem_bytes: float) -> float:
        """The roofline: a fixed overhead plus the slower of compute and memory traffic."""
        return self.step_overhead_s + max(flops / self.matmul_flops, mem_bytes / self.mem_bw)

    @classmethod
    def from_gpu(cls, gpu: GPUSpec) -> "CostModel":
        return cls(gpu.matmul_flops, gpu.mem_bw, gpu.step_overhead_s, gpu.pcie_bw)

    @classmethod
    def from_file(cls, path: str, fallback: GPUSpec) -> "CostModel":
        return cls.from_dict(_read_calibration(path), path, fallback)

    @classmethod
    def from_dict(cls, c: dict, path: str, fallback: GPUSpec) -> "CostModel":
        base = cls.from_gpu(fallback)
        coef = c.get("coefficients", c)
        for name in ("matmul_flops", "mem_bw", "step_overhead_s", "pcie_bw"):
            if name in coef:
                v = coef[name]
                if not isinstance(v, (int, float)) or v < 0 or (name != "step_overhead_s" and v == 0):
                    raise InputError(f"must be a positive number, got {v!r}", file=path, field=name)
                setattr(base, name, float(v))
        return base


@dataclass(frozen=True, slots=True)
class LinearClock:
    """A step = overhead + prefill tokens x per-token cost + (a decode cost if any sequence decodes)."""

    prefill_ms_per_token: float
    decode_step_ms: float
    overhead_ms: float = 0.0

    KEYS = ("prefill_ms_per_token", "decode_step_ms", "overhead_ms")

    @classmethod
    def from_dict(cls, d: dict, path: str) -> "LinearClock":
        unknown = set(d) - {"kind", *cls.KEYS}
        if unknown:
            raise InputError(f"unknown key {sorted(unknown)[0]!r} in a linear clock (keys: {', '.join(cls.KEYS)})",
                             file=path, field="--calibration")
        vals = {}
        for name in cls.KEYS:
            v = d.get(name, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InputError(f"must be a finite number >= 0, got {v!r}", file=path, field=name)
            vals[name] = float(v)
        if vals["prefill_ms_per_token"] == 0 and vals["decode_step_ms"] == 0 and vals["overhead_ms"] == 0:
            raise InputError("a clock whose every step takes no time never advances", file=path,
                             field="--calibration")
        return cls(**vals)

    def seconds(self, batch: StepBatch) -> float:
        ms = self.overhead_ms + self.prefill_ms_per_token * batch.num_prefill_tokens
        if batch.decode_seq_ids:
            ms += self.decode_step_ms
        return ms / 1e3


def _read_calibration(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            c = json.load(fh)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read calibration: {e}", file=path, field="--calibration") from None
    if not isinstance(c, dict):
        raise InputError("must be a JSON object", file=path, field="--calibration")
    return c


class SimExecutor:
    name = "sim"
    needs_tokens = False

    def __init__(self, model: ModelSpec, cost: CostModel, gpu_mem_bytes: int, kv_dtype: str = "bf16",
                 weight_dtype: str = "bf16"):
        self.model = model
        self.gpu_mem_bytes = gpu_mem_bytes
        self.cost = cost
        self.clock: LinearClock | None = None  # a linear clock replaces the roofline when given
        self.kv_dtype = kv_dtype
        m = model
        self._kv_tok = m.kv_bytes_per_token(kv_dtype)
        self._weights = m.weight_bytes(weight_dtype)
        emb = m.vocab_size * m.hidden_size
        self._flops_tok = 2.0 * (m.num_params - emb * (1 if m.tie_word_embeddings else 2))
        self._flops_head = 2.0 * emb
        self._flops_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim

    def kv_bytes_per_token(self) -> int:
        return self._kv_tok

    def default_kv_bytes(self) -> int:
        """KV pool bytes when none is asked: 90% of the GPU's memory, less the weights."""
        return int(self.gpu_mem_bytes * 0.9) - self._weights

    def bind_pool(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def step_work(self, batch: StepBatch) -> tuple[float, float]:
        """(FLOPs, HBM bytes) of a step under the model above."""
        n_pre = 0
        pairs = 0.0
        kv_read = 0
        for start, n in zip(batch.prefill_starts, batch.prefill_lens):
            n_pre += n
            pairs += n * (start + (n + 1) / 2)  # causal: query i sees start + i + 1 keys
            kv_read += start + n
        ctx = sum(batch.decode_context_lens())
        pairs += ctx
        kv_read += ctx
        n_tok = n_pre + len(batch.decode_positions)
        n_sampled = len(batch.decode_positions) + sum(batch.prefill_last)
        flops = self._flops_tok * n_tok + self._flops_head * n_sampled + self._flops_pair * pairs
        mem = self._weights + self._kv_tok * (kv_read + n_tok)
        mem += len(batch.copies) * batch.block_size * self._kv_tok * 2  # copy-on-write: read + write
        if batch.slot_moves is not None:  # compaction after token eviction: read + write
            mem += len(batch.slot_moves[0]) * self._kv_tok * 2
        return flops, mem

    def step_time(self, batch: StepBatch) -> float:
        if self.clock is not None:
            return self.clock.seconds(batch)
        flops, mem = self.step_work(batch)
        return self.cost.time(flops, mem) + self.pcie_time(batch)

    def pcie_time(self, batch: StepBatch) -> float:
        """Host<->device KV traffic (InfiniGen offload and recall), not overlapped with compute."""
        return batch.pcie_bytes / self.cost.pcie_bw if batch.pcie_bytes else 0.0

    def execute(self, batch: StepBatch) -> StepResult:
        return StepResult(duration_s=self.step_time(batch), pcie_s=self.pcie_time(batch))


def make_sim(model: ModelSpec, gpu: GPUSpec, calibration: str | None = None,
             kv_dtype: str = "auto") -> SimExecutor:
    """The sim for a model on a GPU preset (or a calibration file); ``kv_dtype`` auto: bf16, the
    weights' dtype."""
    if calibration and not os.path.exists(calibration):
        raise InputError("no such file", file=calibration, field="--calibration")
    clock = None
    if calibration:
        raw = _read_calibration(calibration)
        if raw.get("kind") == "linear":
            clock, cost = LinearClock.from_dict(raw, calibration), CostModel.from_gpu(gpu)
        else:
            cost = CostModel.from_dict(raw, calibration, gpu)
    else:
        cost = CostModel.from_gpu(gpu)
    ex = SimExecutor(model, cost, gpu.mem_bytes, "bf16" if kv_dtype == "auto" else kv_dtype)
    ex.clock = clock
    ex.device_name = f"sim:{gpu.name}"
    return ex
