"""``random``: requests of random tokens at fixed (or uniformly spread) lengths, as ``vllm bench serve
--dataset-name random`` draws them, so a published benchmark's load can be replayed as it was run.

Each prompt is the shared prefix (``--prefix-len`` tokens, one stream every request starts with), then
``--input-len`` tokens no other request has; with ``--range-ratio r`` the input and output lengths are
drawn uniformly from the integers [floor(L (1 - r)), ceil(L (1 + r))], outputs at least 1
(vLLM's RandomDataset.get_text_sampling_params; it also subtracts the tokenizer's special tokens from
the input length, which a tokenizer-free trace has none of). Arrivals follow vLLM's get_request:
``--rate 0`` (the default) puts every request at t = 0, as ``--request-rate inf`` does; otherwise the
gaps are gamma with shape ``--burstiness`` and mean 1 / rate (1: Poisson; below 1 burstier; their
coefficient of variation is 1 / sqrt(burstiness)), the first request's included, and the times are
rescaled so the last arrives at requests / rate. Replay with ``--max-concurrency C`` for a closed
loop of C users.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvbench.trace.format import Request, Segment
from kvbench.workloads.common import Common, Workload, knob


@dataclass(frozen=True)
class RandomParams:
    input_len: int = knob(1024, "prompt tokens after the prefix (vllm bench serve --random-input-len)", min=1)
    output_len: int = knob(128, "tokens to generate (--random-output-len)", min=1)
    range_ratio: float = knob(0.0, "lengths uniform in [L (1 - r), L (1 + r)], r < 1 (--random-range-ratio)", max=1)
    prefix_len: int = knob(0, "tokens of one random prefix every prompt starts with (--random-prefix-len)")
    rate: float = knob(0.0, "requests per second; 0: all at t = 0 (--request-rate inf)")
    burstiness: float = knob(1.0, "gamma shape of the gaps (--burstiness): 1 Poisson, < 1 burstier, > 1 more "
                                  "regular", min=0, min_open=True)


def lengths(rng: np.random.Generator, n: int, mean: int, ratio: float, lo: int) -> np.ndarray:
    """``n`` lengths uniform on the integers [floor(mean (1 - ratio)), ceil(mean (1 + ratio))], each >= lo."""
    low = max(math.floor(mean * (1 - ratio)), lo)
    high = max(math.ceil(mean * (1 + ratio)), low)
    return rng.integers(low, high + 1, size=n)


def arrival_times_s(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """vLLM's get_request: every request waits a gamma(burstiness, 1 / (rate burstiness)) gap after the
    one before (the first after t = 0), and the times are scaled so the last is n / rate."""
    if rate == 0:
        return np.zeros(n)
    t = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), n))
    return t * (n / rate / t[-1]) if t[-1] > 0 else t


def build(c: Common, p: RandomParams, rng: np.random.Generator) -> list[Request]:
    if not p.range_ratio < 1:
        raise ValueError(f"--range-ratio must be below 1 (lengths down to 0), got {p.range_ratio:g}")
    ins = lengths(rng, c.requests, p.input_len, p.range_ratio, 1)
    outs = lengths(rng, c.requests, p.output_len, p.range_ratio, 1)
    ts = arrival_times_s(rng, c.requests, p.rate, p.burstiness)
    prefix = (Segment("shared", p.prefix_len, name=f"random/prefix-s{c.seed}"),) if p.prefix_len else ()
    meta = {"workload": "random"}
    return [Request(id=f"r{i}", t=round(float(t), 6), prompt=prefix + (Segment("unique", int(n)),),
                    output_len=int(m), meta=meta, prompt_len=p.prefix_len + int(n))
            for i, (n, m, t) in enumerate(zip(ins, outs, ts))]


WORKLOAD = Workload("random", "random tokens at fixed lengths, as vllm bench serve's random dataset",
                    RandomParams, build,
                    "kvbench trace gen random --input-len 1024 --output-len 128 --requests 200 -o random.jsonl",
                    common=("requests", "seed"))
