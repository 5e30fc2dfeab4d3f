"""The learned cache policy (``--cache-policy learned[:policy.json]``): evict the cached block least
likely to be looked up again within W seconds, as a logistic model predicts it from what is known
online about the block. kvbench.whatif.fit fits the model on the first part of a trace
(``kvbench trace fit-policy``); bare ``learned`` uses DEFAULT_MODEL, fitted on the first half of the
Mooncake conversation trace.

Features, each from calls the policy has seen up to now (nothing from the trace's future):
- depth: tokens before the block along cached blocks at insert (its chain depth), log1p;
- hits: times the block was hit since it entered the cache, log1p;
- prompt: tokens of the chain it was inserted with (the deepest block of its insert call: the request's
  whole blocks in the what-if, a prefill chunk's end in a replay), log1p;
- continuations: blocks inserted as its children since it entered, log1p;
- span: seconds from its insert to its last use, log1p;
- gap: seconds between its last two uses (0 before a hit), log1p;
- age: seconds since its last use, linear (time since insertion is span + age).

Age is the only feature that changes while a block waits to be evicted, and it enters the logit
linearly: coef * (now - last) / scale. That term moves every block's logit by the same amount as time
passes, so the order of evictable blocks never changes and the key is fixed at release: the static
part of the logit minus coef * last / scale. A heap keyed at release (policy_base.ReleaseKeyed) then
pops the lowest predicted reuse in O(log n). The only other change while a block waits is a new
continuation (a child inserted under an evictable parent): the parent is queued again.

Time is the ``now`` the caller passes with each insert and use: the request's arrival in the
what-if; the pool's ``clock`` in a replay (the engine's clock, seconds, set every step). The
model's window and block size are what it was fitted with; the block size of a run may differ (the
features count tokens).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from kvbench.jsonio import dumps
from kvbench.memory.policy_base import ReleaseKeyed

FEATURES = ("depth", "hits", "prompt", "continuations", "span", "gap", "age")
KIND = "kvbench-learned-policy"
# what a model file may hold: |coef|, |intercept| <= MAX_COEF, |mean| and scale <= MAX_FEATURE, scale
# >= MIN_SCALE, so every logit is finite (features are counts and seconds far below MAX_FEATURE)
MAX_COEF = 1e6
MAX_FEATURE = 1e12
MIN_SCALE = 1e-9


@dataclass(slots=True)
class LearnedModel:
    """A logistic model of P(reused within ``window_s``) over FEATURES, standardised by mean/scale."""

    window_s: float
    block_size: int
    mean: list[float]
    scale: list[float]
    coef: list[float]
    intercept: float
    features: list[str] = field(default_factory=lambda: list(FEATURES))
    fit: dict = field(default_factory=dict)  # how it was fitted: trace, requests, samples, scores

    def to_dict(self) -> dict:
        return {"kind": KIND, "version": 1, **asdict(self)}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:  # null, never NaN (an undefined held-out AUC)
            fh.write(dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: dict) -> LearnedModel:
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise ValueError(f"not a kvbench learned policy (kind {KIND!r} expected)")
        if list(d.get("features", ())) != list(FEATURES):
            raise ValueError(f"features {d.get('features')} are not {list(FEATURES)}")
        m = cls(float(d["window_s"]), int(d["block_size"]), [float(x) for x in d["mean"]],
                [float(x) for x in d["scale"]], [float(x) for x in d["coef"]], float(d["intercept"]),
                list(d["features"]), dict(d.get("fit", {})))
        n = len(FEATURES)
        if not (len(m.mean) == len(m.scale) == len(m.coef) == n):
            raise ValueError(f"mean, scale and coef need {n} numbers each")
        if not all(math.isfinite(x) for x in [*m.mean, *m.coef, m.intercept, m.window_s]) \
                or not all(math.isfinite(x) and x > 0 for x in m.scale) or m.block_size < 1:
            raise ValueError("coefficients must be finite, scales and block size positive")
        # bounds under which a logit of any feature row stays a finite number (never inf - inf = NaN)
        if any(abs(x) > MAX_COEF for x in [*m.coef, m.intercept]):
            raise ValueError(f"coef and intercept must lie within ±{MAX_COEF:g}")
        if any(abs(x) > MAX_FEATURE for x in m.mean) or not all(MIN_SCALE <= x <= MAX_FEATURE for x in m.scale):
            raise ValueError(f"means must lie within ±{MAX_FEATURE:g} and scales in [{MIN_SCALE:g}, {MAX_FEATURE:g}]")
        if not 0 < m.window_s <= MAX_FEATURE:
            raise ValueError(f"window_s must be in (0, {MAX_FEATURE:g}] seconds")
        return m

    @classmethod
    def load(cls, path: str) -> LearnedModel:
        try:
            with open(path, encoding="utf-8") as fh:
                d = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read learned policy {path!r}: {e}") from None
        try:
            return cls.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def logit(self, x) -> float:
        """The model's logit for one row of FEATURES (raw values, age included)."""
        return self.intercept + sum(c * (v - m) / s for c, v, m, s in zip(self.coef, x, self.mean, self.scale))


# Fitted on the first half of the Mooncake conversation trace, block 512 (kvbench.whatif.fit):
#   kvbench trace fit-policy mooncake.jsonl --block-size 512 --warmup 0.5 -o policy.json
DEFAULT_MODEL = {
    "kind": KIND, "version": 1, "window_s": 132.0, "block_size": 512, "features": list(FEATURES),
    "mean": [9.216585, 0.199007, 10.122286, 0.669509, 1.128117, 1.040452, 455.358481],
    "scale": [1.235948, 0.417643, 0.942391, 0.138326, 2.196102, 2.023801, 416.933792],
    "coef": [-0.125702, 0.375177, 0.058579, -0.030811, -0.046726, 0.008458, -1.766183],
    "intercept": -3.446688,
    "fit": {"trace": "mooncake_conversation.jsonl", "train_requests": 6015, "of_requests": 12031, "warmup": 0.5,
            "rows": 96240, "positive_share": 0.0721, "seed": 0, "heldout_auc": 0.8874},
}


class LearnedPolicy(ReleaseKeyed):
    """Evict the evictable block with the lowest predicted reuse (see the module docstring)."""

    name = "learned"
    takes_arg = True  # learned:policy.json

    @staticmethod
    def check_arg(path: str) -> None:
        """ValueError in one line unless ``path`` holds a learned policy."""
        LearnedModel.load(path)

    def __init__(self, num_blocks: int, capacity: int | None = None, model=None):
        super().__init__(num_blocks, capacity)
        if model is None:
            model = LearnedModel.from_dict(DEFAULT_MODEL)
        elif isinstance(model, str):
            model = LearnedModel.load(model)
        self.model: LearnedModel = model
        n = num_blocks
        self._depth = [0] * n  # blocks before it along cached blocks, at insert
        self._run = [0] * n  # blocks of the chain it was inserted with (the deepest's depth + 1)
        self._hits = [0] * n
        self._kids = [0] * n
        self._insert_s = [0.0] * n
        self._last_s = [0.0] * n
        self._prev_s = [0.0] * n  # the use before the last
        # the logit without the age, per raw feature, and the age's weight on the last use
        c, s = model.coef, model.scale
        self._w = [ci / si for ci, si in zip(c[:-1], s[:-1])]
        self._w_last = -c[-1] / s[-1]
        self._bs = model.block_size  # a view's block size once bound

    def on_insert_many(self, blocks, now: float, next_uses=None) -> None:
        depth, kids, parent_of, entry = self._depth, self._kids, self.view.parent_of, self._entry
        hits, ins, last, prev = self._hits, self._insert_s, self._last_s, self._prev_s
        deepest = 0
        for b in blocks:  # in chain order: a block's parent is inserted before it
            p = parent_of(b)
            if p >= 0:
                depth[b] = depth[p] + 1
                kids[p] += 1
                if entry[p]:  # an evictable parent gained a continuation: its key changed
                    self._requeue(p)
            else:
                depth[b] = 0
            if depth[b] > deepest:  # noqa: PLR1730  (max() is slower here)
                deepest = depth[b]
            hits[b] = kids[b] = 0
            ins[b] = last[b] = prev[b] = now
        run = self._run
        for b in blocks:
            run[b] = deepest + 1

    def on_use_many(self, blocks, now: float, next_uses=None) -> None:
        hits, last, prev = self._hits, self._last_s, self._prev_s
        for b in blocks:
            hits[b] += 1
            prev[b] = last[b]
            last[b] = now

    def features(self, b: int, now: float) -> list[float]:
        """FEATURES of cached block ``b`` at time ``now`` (raw values, as the model reads them)."""
        bs, log = self._bs, math.log1p
        last = self._last_s[b]
        return [log(self._depth[b] * bs), log(self._hits[b]), log(self._run[b] * bs), log(self._kids[b]),
                log(max(last - self._insert_s[b], 0.0)), log(max(last - self._prev_s[b], 0.0)),
                max(now - last, 0.0)]

    def bind(self, view) -> None:
        super().bind(view)
        self._bs = view.block_size or self.model.block_size

    def _key(self, b: int) -> float:
        """The logit but its age term, less the age's weight x the last use: ``features`` at age 0
        weighted (written out: the hot path of every release)."""
        log, bs, w = math.log1p, self._bs, self._w
        last = self._last_s[b]
        span, gap = last - self._insert_s[b], last - self._prev_s[b]
        return (w[0] * log(self._depth[b] * bs) + w[1] * log(self._hits[b]) + w[2] * log(self._run[b] * bs)
                + w[3] * log(self._kids[b]) + w[4] * log(span if span > 0 else 0.0)
                + w[5] * log(gap if gap > 0 else 0.0) + self._w_last * last)
