"""The sim executor's synthetic attention: per decode step, a weight on each cached position of a
sequence, fully determined by the seed, so H2O scores and InfiniGen recalls are reproducible
without a model.

Unnormalised weight of position i when the query sits at position t (every term vectorised):
- sinks: the first SINKS positions get SINK_W each (attention sinks exist whatever a policy keeps);
- recency: RECENT_W * exp(-(t - i) / RECENT_TAU): the local window every layer attends to;
- heavy hitters: a position is a heavy hitter with chance HEAVY_P, drawn once per sequence; its
  weight is HEAVY_W / rank^1.1 with rank uniform in 1..HEAVY_RANKS (a Zipf tail);
- re-reads: the decode steps come in epochs of EPOCH steps; an epoch re-reads old history with a
  per-workload chance (``REREAD_P[meta.workload]``, higher for agents, which act on what they read
  long before) and then puts REREAD_W on each of REREAD_SPAN positions chosen uniformly among those
  older than RECENT_CUT;
- a floor of BASE_W everywhere (attention is never exactly zero).
Weights are normalised by their sum over the positions asked for (the tokens on the GPU), as the
model executor's weights are normalised over the kept tokens; offloaded tokens are scored relative
to the same sum, which is what an InfiniGen recall threshold compares against.

Randomness is a counter-based hash (splitmix64) of (seed, request index, position or epoch): no
per-sequence RNG state, the same weights whatever the batch composition or preemptions.

The weights are the same bits on every CPU: numpy's ``exp`` and ``power`` take other code paths where
the CPU has AVX-512 (a last-bit difference, which decides near-ties between kept and recalled tokens:
the agent trace's InfiniGen run recalled 23,656 tokens on one machine and 23,645 on another), so the
recency decay is a table of products of one constant and the Zipf weights a table built once.
"""
from __future__ import annotations

import numpy as np

SINKS = 4
SINK_W = 20.0
RECENT_W = 8.0
RECENT_TAU = 32.0
HEAVY_P = 0.05
HEAVY_W = 30.0
HEAVY_RANKS = 50
EPOCH = 16
REREAD_SPAN = 64
REREAD_W = 40.0
RECENT_CUT = 256
BASE_W = 0.5
# chance that an epoch of EPOCH decode steps re-reads old history, by the request's meta.workload
REREAD_P = {"agent": 0.5, "rag": 0.15, "chat": 0.02, "best-of-n": 0.02}
REREAD_P_DEFAULT = 0.1

_M64 = (1 << 64) - 1
_DECAY = float.fromhex("0x1.f03f56a88b5d8p-1")  # exp(-1 / RECENT_TAU), rounded to the nearest double
assert RECENT_TAU == 32.0  # (the constant above is its decay)
_RANK_W = HEAVY_W * np.array([0.0] + [float(r) ** -1.1 for r in range(1, HEAVY_RANKS + 1)])
_recent = np.array([RECENT_W])  # RECENT_W * _DECAY ** age, by age (grown by recent_weights)


def recent_weights(max_age: int) -> np.ndarray:
    """RECENT_W * exp(-age / RECENT_TAU) for ages 0..max_age (at least), the same bits on every CPU:
    successive products (IEEE multiplication is exact to the rounding rule everywhere)."""
    global _recent
    if len(_recent) <= max_age:
        n = max(max_age + 1, 2 * len(_recent))
        steps = np.full(n, _DECAY)
        steps[0] = RECENT_W
        _recent = np.multiply.accumulate(steps)
    return _recent


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: uint64 [n] -> uint64 [n], a bijection that scrambles every bit
    (uint64 array arithmetic wraps silently, which is the point)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """_mix for one Python int (no array round trip on the per-step path)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _uniform(key: int, salt: int, idx: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) floats for integer indices under (key, salt). idx: int [n] -> float64 [n]."""
    h = _mix(idx.astype(np.uint64) ^ np.uint64(_mix_int((key * 1_000_003 + salt) & _M64)))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _uniform1(key: int, salt: int, i: int) -> float:
    return (_mix_int(i ^ _mix_int((key * 1_000_003 + salt) & _M64)) >> 11) * (1.0 / (1 << 53))


def sequence_key(seed: int, request_index: int) -> int:
    return _mix_int((seed * 7_919 + request_index) & _M64) >> 2


def reread_chance(workload: str | None) -> float:
    return REREAD_P.get(workload or "", REREAD_P_DEFAULT)


def raw_weights(key: int, pos: np.ndarray, t: int, reread_p: float) -> np.ndarray:
    """Unnormalised weights of positions ``pos`` (int64 [n]) for the query at position t -> float64 [n]."""
    age = t - pos
    w = BASE_W + recent_weights(int(age.max()) if len(age) else 0)[age]
    w[pos < SINKS] += SINK_W
    heavy = _uniform(key, 1, pos) < HEAVY_P
    if heavy.any():
        rank = 1 + (_uniform(key, 2, pos[heavy]) * HEAVY_RANKS).astype(np.int64)
        w[heavy] += _RANK_W[rank]
    old_end = t - RECENT_CUT
    if old_end > REREAD_SPAN:
        epoch = t // EPOCH
        if _uniform1(key, 3, epoch) < reread_p:
            lo = int(_uniform1(key, 4, epoch) * (old_end - REREAD_SPAN))
            w[(pos >= lo) & (pos < lo + REREAD_SPAN)] += REREAD_W
    return w
