"""A linear clock for the sim (``--calibration`` a file of ``{"kind": "linear", ...}``): a step's time from
its prefill tokens and whether it decodes, with no roofline: what the vLLM reference goldens run on, so
that kvbench and vLLM's scheduler see the same step times."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.errors import InputError
from kvbench.scheduler.batch import StepBatch


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


__all__ = ["LinearClock"]
