"""Fit the learned cache policy (``kvbench trace fit-policy``): a logistic model of "this cached block
is looked up again within W seconds" over kvbench.memory.learned.FEATURES, from the first part of a
trace.

The training part (the requests before the warm-up fraction's end: what a what-if with the same
``--warmup`` only warms the cache with) goes through the what-if's own loop (curve.simulate) with a
cache that holds every block, so nothing is evicted and every block's features are what the policy
computes online. After each request, a few cached blocks are drawn at random; each gives one row:
its features at that request's arrival (age included), and a label from the trace's future, which
only the label reads: the next request that looks the block up arrives within W seconds. Drawing
from every cached block, not only the recently used ones, shows the model the ages it must rank.

The model: standardised features, L2-regularised logistic regression fitted by Newton's method
(IRLS), numpy only. The last fifth of the training requests is held out for the reported AUC and
log-loss, then the model is refitted on all rows. W defaults to the median time from a block's use
to its next lookup in the training part.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvbench.memory.learned import FEATURES, LearnedModel, LearnedPolicy
from kvbench.memory.policy_base import NEVER
from kvbench.trace.format import Request
from kvbench.trace.tokens import TokenStreams
from kvbench.whatif.blocktrace import prepare, window_start
from kvbench.whatif.curve import simulate

L2 = 1e-3


def training_rows(requests: Sequence[Request], block_size: int, *, samples_per_request: int = 16,
                  seed: int = 0, streams: TokenStreams | None = None):
    """(X [rows, len(FEATURES)], reuse gap [rows] in seconds (inf: never looked up again), request
    index [rows]) for the blocks drawn after each request of ``requests``."""
    bt = prepare(requests, block_size, 0.0, future=True, streams=streams)
    arrival = bt.arrival_s
    nxt = np.full(max(bt.distinct_blocks, 1), NEVER, dtype=np.int64)  # next lookup, as of now
    pol = LearnedPolicy(max(bt.distinct_blocks, 1), None, _flat_model(block_size))
    rng = np.random.default_rng(seed)
    rows, gaps, at = [], [], []
    seen = 0  # dense ids are in order of first appearance: ids < seen are cached (nothing is evicted)

    def sample(i: int, hits: int) -> None:
        nonlocal seen
        s, e = int(bt.starts[i]), int(bt.starts[i + 1])
        if e > s:
            nxt[bt.ids[s:e]] = bt.next_use[s:e]
            seen = max(seen, int(bt.ids[s:e].max()) + 1)
        if not seen:
            return
        now = float(arrival[i])
        for b in rng.integers(0, seen, samples_per_request).tolist():
            rows.append(pol.features(b, now))
            j = int(nxt[b])
            gaps.append(math.inf if j == NEVER else float(arrival[j]) - now)
            at.append(i)

    simulate(bt, max(bt.distinct_blocks, 1), pol, on_request=sample)
    width = len(FEATURES)
    return (np.asarray(rows, dtype=np.float64).reshape(-1, width), np.asarray(gaps, dtype=np.float64),
            np.asarray(at, dtype=np.int64))


def _flat_model(block_size: int) -> LearnedModel:
    n = len(FEATURES)
    return LearnedModel(1.0, block_size, [0.0] * n, [1.0] * n, [0.0] * n, 0.0)


def logistic(X: np.ndarray, y: np.ndarray, l2: float = L2, iters: int = 50):
    """(coef, intercept) of an L2-regularised logistic regression on standardised ``X``, by IRLS."""
    n, d = X.shape
    A = np.hstack([X, np.ones((n, 1))])
    w = np.zeros(d + 1)
    reg = np.full(d + 1, l2 * n)
    reg[-1] = 0.0  # the intercept is not shrunk
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(A @ w, -30, 30)))
        grad = A.T @ (p - y) + reg * w
        H = (A * (p * (1 - p))[:, None]).T @ A + np.diag(reg) + 1e-9 * np.eye(d + 1)
        step = np.linalg.solve(H, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w[:-1], float(w[-1])


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (ties count half), by ranks."""
    pos, neg = int(y.sum()), int(len(y) - y.sum())
    if not pos or not neg:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def standardise(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each feature's (mean, scale). A feature (nearly) constant in the rows carries nothing, and a scale
    of rounding noise would blow its standardised values up: its scale is 1 (the test is relative to
    the feature's size, so no scale is below 1e-9)."""
    mean, scale = X.mean(axis=0), X.std(axis=0)
    scale[scale <= 1e-9 * np.maximum(1.0, np.abs(mean))] = 1.0
    return mean, scale


def fit(requests: Sequence[Request], block_size: int, *, warmup: float = 0.5, window_s: float | None = None,
        samples_per_request: int = 16, seed: int = 0, trace: str = "",
        streams: TokenStreams | None = None) -> LearnedModel:
    """The learned policy fitted on ``requests[:window_start(len, warmup)]`` (all of them with
    ``warmup`` 0 or 1: a trace that is all training)."""
    end = window_start(len(requests), warmup) if 0 < warmup < 1 else len(requests)
    train = list(requests[:end])
    if len(train) < 2:
        raise ValueError(f"fit-policy needs at least 2 training requests, the first part has {len(train)}")
    X, gap, at = training_rows(train, block_size, samples_per_request=samples_per_request, seed=seed,
                               streams=streams)
    if window_s is None:
        finite = gap[np.isfinite(gap)]
        window_s = float(np.median(finite)) if len(finite) else 60.0
        window_s = max(window_s, 1e-3)
    y = (gap <= window_s).astype(np.float64)
    if y.min() == y.max():
        raise ValueError(f"every training row is {'a reuse' if y[0] else 'no reuse'} within {window_s:g} s: "
                         "nothing to learn (try another --window-s)")
    mean, scale = standardise(X)
    Z = (X - mean) / scale
    held = at >= int(len(train) * 0.8)
    scores = {}
    if held.any() and (~held).any() and 0 < y[~held].mean() < 1:
        c, b = logistic(Z[~held], y[~held])
        z = Z[held] @ c + b
        p = np.clip(1 / (1 + np.exp(-z)), 1e-12, 1 - 1e-12)
        scores = {"heldout_auc": round(auc(z, y[held]), 4),
                  "heldout_logloss": round(float(-np.mean(y[held] * np.log(p) + (1 - y[held]) * np.log(1 - p))), 4),
                  "heldout_rows": int(held.sum())}
    coef, intercept = logistic(Z, y)
    info = {"trace": trace, "train_requests": len(train), "of_requests": len(requests), "warmup": warmup,
            "rows": len(y), "positive_share": round(float(y.mean()), 4), "seed": seed, **scores}
    return LearnedModel(float(window_s), block_size, [float(v) for v in mean], [float(v) for v in scale],
                        [float(v) for v in coef], intercept, list(FEATURES), info)
