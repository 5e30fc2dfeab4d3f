"""What every workload generator shares: the common knobs, the generator record the CLI reads, and
the assembly of multi-turn sessions into one time-ordered trace."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvbench.trace.format import Request
from kvbench.workloads.sampling import arrival_times_s, session_times_s


def knob(default, help: str, min: float = 0, min_open: bool = False, max: float | None = None):
    """A generator parameter: its default, its --help text and its smallest (and largest) valid value."""
    return field(default=default, metadata={"help": help, "min": min, "min_open": min_open, "max": max})


@dataclass(frozen=True)
class Common:
    """Knobs every generator takes. ``rate`` is the mean request rate, for every workload."""

    requests: int = knob(200, "requests to generate", min=1)
    rate: float = knob(1.0, "mean arrival rate, requests per second", min=0, min_open=True)
    seed: int = knob(0, "seed: the same seed gives the same trace, byte for byte")
    arrival: str = "poisson"
    burstiness: float = knob(1.0, "coefficient of variation of gamma inter-arrival gaps "
                                  "(>1: bursty; gamma only)", min=0, min_open=True)
    len_sigma: float = knob(0.5, "log-space spread of every lognormal length (0: fixed lengths)")


@dataclass(frozen=True)
class Workload:
    """A generator as the CLI sees it: ``build(common, params, rng)`` returns the requests."""

    name: str
    summary: str
    params: type
    build: Callable[[Common, object, np.random.Generator], list[Request]]
    example: str
    # the Common knobs the command takes (the others keep their defaults); a generator whose params
    # declare arrivals of their own (random: vLLM's rate and burstiness) takes fewer
    common: tuple[str, ...] = ("requests", "rate", "seed", "arrival", "burstiness", "len_sigma")


def generate(workload: Workload, common: Common, params=None) -> list[Request]:
    """Requests of a workload in arrival order, determined by ``common.seed`` alone."""
    rng = np.random.default_rng(common.seed)
    reqs = workload.build(common, params if params is not None else workload.params(), rng)
    # Trace order = arrival order, so the ideal hit rate (trace order) matches what a replay sees.
    reqs.sort(key=lambda r: r.t)
    return reqs


def stamp_independent(reqs: list[Request], common: Common, rng: np.random.Generator) -> list[Request]:
    """Arrival times for requests that belong to no session."""
    ts = arrival_times_s(rng, len(reqs), common.rate, common.arrival, common.burstiness)
    for r, t in zip(reqs, ts):
        r.t = round(float(t), 6)
    return reqs


def stamp_sessions(sessions: list[list[Request]], common: Common, think_mean_s: float,
                   rng: np.random.Generator) -> list[Request]:
    """Cut the sessions to ``common.requests`` requests in all and give every turn its arrival."""
    out: list[list[Request]] = []
    left = common.requests
    for turns in sessions:
        if left <= 0:
            break
        out.append(turns[:left])
        left -= len(out[-1])
    times = session_times_s(rng, [len(t) for t in out], common.rate, think_mean_s, common.arrival,
                            common.burstiness)
    flat = []
    for turns, ts in zip(out, times):
        for r, t in zip(turns, ts):
            r.t = round(float(t), 6)
            flat.append(r)
    return flat
