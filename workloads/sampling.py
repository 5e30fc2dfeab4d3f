"""Random draws every generator shares: token lengths and arrival times.

All draws come from a numpy Generator the caller seeds, so a trace is fully determined by --seed.
Lengths are lognormal (right-skewed like real prompt and answer lengths) and parameterised by their
mean, so a flag such as ``--output-len 300`` means what it says. Arrivals are a Poisson process, or a
gamma renewal process whose coefficient of variation (``burstiness``) is above 1 for bursty traffic.
"""
from __future__ import annotations

import math

import numpy as np

ARRIVALS = ("poisson", "gamma")


def lognormal_len(rng: np.random.Generator, mean: float, sigma: float, size=None,
                  lo: int = 1, hi: int | None = None):
    """Token lengths with the given mean (before clipping) and log-space spread ``sigma``.

    sigma = 0 gives the mean every time. Results are ints clipped to [lo, hi].
    """
    mu = math.log(max(mean, 1e-9)) - sigma * sigma / 2  # E[exp(N(mu, s))] = exp(mu + s^2/2)
    x = np.rint(rng.lognormal(mu, sigma, size)) if sigma > 0 else np.full(size or (), round(mean))
    x = np.clip(x, lo, hi if hi is not None else np.inf).astype(np.int64)
    return int(x) if size is None else x


def interarrival_s(rng: np.random.Generator, n: int, rate_per_s: float, arrival: str = "poisson",
                   burstiness: float = 1.0) -> np.ndarray:
    """``n`` gaps between arrivals with mean 1/rate. Gamma with CV c has shape 1/c^2."""
    if arrival == "poisson":
        return rng.exponential(1.0 / rate_per_s, n)
    if arrival == "gamma":
        shape = 1.0 / (burstiness * burstiness)
        return rng.gamma(shape, 1.0 / (rate_per_s * shape), n)
    raise ValueError(f"unknown arrival process {arrival!r} (choose from {', '.join(ARRIVALS)})")


def arrival_times_s(rng: np.random.Generator, n: int, rate_per_s: float, arrival: str = "poisson",
                    burstiness: float = 1.0) -> np.ndarray:
    """Arrival times of ``n`` events; the first arrives at t = 0."""
    gaps = interarrival_s(rng, n, rate_per_s, arrival, burstiness)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def session_times_s(rng: np.random.Generator, turns: list[int], rate_per_s: float,
                    think_mean_s: float, arrival: str = "poisson",
                    burstiness: float = 1.0) -> list[np.ndarray]:
    """Arrival times of every turn of every session.

    ``rate_per_s`` is the mean *request* rate: sessions start at rate / (mean turns per session), so
    the trace carries about ``rate`` requests per second however long its sessions are. Turn k+1
    arrives an exponential think time (mean ``think_mean_s``) after turn k arrives; the engine does
    not wait for turn k's answer, so keep think times above typical generation times.
    """
    mean_turns = sum(turns) / max(len(turns), 1)
    starts = arrival_times_s(rng, len(turns), rate_per_s / mean_turns, arrival, burstiness)
    out = []
    for start, k in zip(starts, turns):
        think = rng.exponential(think_mean_s, k)
        think[0] = 0.0
        out.append(start + np.cumsum(think))
    return out
