"""The profiling load ``kvbench calibrate --endpoint`` sends a server: requests chosen so that every
term of the step clock (kvbench.engine.fit_server) can be told from the others.

Each term needs its own variation in the load:

- the front end against the steps: first, requests sent one at a time with idle gaps, so a time to
  first token is the API server, the wait for the step in progress (none) and the prefill; each
  prompt twice in a row, the second time all but its last block a prefix-cache hit, so the API
  server's per-token cost (it reads every token) is measured apart from prefill's;
- the step overhead against the per-decoding-sequence cost: decode batches of every size from 1 to the
  server's cap. The load is closed-loop stages at concurrency 1, 2, 4, ... up to the cap (what a
  ``vllm bench serve --max-concurrency`` sweep runs), each stage starting when the one before it has
  finished; within a stage the outputs' lengths differ, so its batch also drains step by step;
- the per-prefill-token cost: prompt lengths spread log-uniformly from a few tokens to the server's
  maximum length less the longest output (chunked prefill included);
- the front end's per-prompt-token cost against prefill's: the cached share of a prompt varied, by
  shared prefixes of three lengths (none, an eighth, a half of the longest prompt) that the server's
  prefix cache holds once one request has sent them, so equal prompt lengths cost the engine differently
  while the API server reads them all;
- the per-key cost of decode against the per-sequence cost: at each concurrency a stage of short
  prompts, then one of long prompts, so the keys a decoding sequence reads differ from batch to batch
  (with one prompt spread throughout, keys read are decoding sequences times one mean context, and
  the two terms cannot be told apart).

With ``passes`` above 1 the whole load is sent that many times in a row (each pass its own requests;
the idle stage's requests shared out between them), so the fit can say how far the server's speed
moved from one pass to the next: a bootstrap over one run's requests sees their scatter, not a machine
whose speed drifts by more than that between one calibration and the run it predicts. It doubles the
profile's time, so one pass is the default. A later pass's idle requests go one at a time but back to
back (their trace time is past when the pass starts): each still finds the server otherwise idle.

Its tokens are new to the server: request ids (which seed a unique segment's tokens) and prefix names
carry a nonce drawn per profile, so a second calibration against the same server finds nothing the
first left in its prefix cache (the sim, replaying the run, starts from an empty one).

The pool bounds the load: a stage runs at most as many sequences at once as half the server's KV
pool holds at the load's mean sequence length, so it measures steps, not preemptions.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from kvbench.engine.server import ServerSettings
from kvbench.trace.format import Request, Segment

MIN_PROMPT = 16
MIN_OUTPUT = 8
MAX_OUTPUT = 192
IDLE_REQUESTS = 32  # the first stage: requests that each find the server idle (16 prompts, each twice)
IDLE_GAP_S = 0.5  # between their issues (each is done well within it: outputs up to IDLE_OUTPUT)
IDLE_OUTPUT = 16
MAX_CONCURRENCY = 64  # the highest stage unless the server's cap is lower (a larger batch adds minutes, not terms)
QUICK_MAX_CONCURRENCY = 16
PASSES = 1  # the load sent this many times in a row (kvbench calibrate --passes N; 2 to see the drift)


@dataclass(frozen=True)
class Stage:
    """``requests`` sent as a closed loop of ``concurrency`` users; ``long``: long prompts behind
    shared prefixes, else short prompts of their own; ``idle``: one at a time IDLE_GAP_S apart, short
    outputs, so each finds the server idle (prompts short and long); ``pass_``: which pass of the load
    (1, 2, ...; a stage of a later pass is named after it: ``p2-c4-long``)."""

    concurrency: int
    requests: int
    long: bool
    idle: bool = False
    pass_: int = 1

    @property
    def name(self) -> str:
        kind = "idle" if self.idle else f"c{self.concurrency}-{'long' if self.long else 'short'}"
        return kind if self.pass_ == 1 else f"p{self.pass_}-{kind}"


@dataclass(frozen=True)
class Profile:
    stages: list[Stage]
    requests: list[Request]
    short_prompt: int
    longest_prompt: int

    @property
    def passes(self) -> int:
        return max(s.pass_ for s in self.stages)

    def describe(self) -> str:
        levels = ", ".join(sorted({str(s.concurrency) for s in self.stages if not s.idle}, key=int))
        times = f"; the whole sent {self.passes} times in a row" if self.passes > 1 else ""
        return (f"{len(self.requests)} requests: {self.stages[0].requests} one at a time {IDLE_GAP_S} s apart, then "
                f"closed-loop stages at concurrency {levels}, each a stage "
                f"of short prompts ({MIN_PROMPT}-{self.short_prompt}) then one of long ones (up to "
                f"{self.longest_prompt:,} tokens, two in three behind a shared prefix of one of two lengths); "
                f"outputs {MIN_OUTPUT}-{MAX_OUTPUT}{times}")


def _log_uniform_mean(lo: int, hi: int) -> float:
    """The mean of _log_uniform's draws on [lo, hi] (continuous)."""
    return float(lo) if hi <= lo else (hi - lo) / math.log(hi / lo)


def _log_uniform(rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
    hi = max(hi, lo)
    return np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n))).astype(int).clip(lo, hi)


def _idle_prompt(rng: np.random.Generator, nonce: str, k: int, longest: int, short: int,
                 max_len: int) -> tuple[tuple[Segment, ...], int]:
    """The k-th prompt of the idle stage (sent twice; short and long ones alternate) and its output."""
    n = int(_log_uniform(rng, max(MIN_PROMPT, longest // 8), longest, 1)[0]) if k % 2 else int(
        _log_uniform(rng, MIN_PROMPT, short, 1)[0])
    out = int(min(_log_uniform(rng, MIN_OUTPUT, IDLE_OUTPUT, 1)[0], max(1, max_len - n - 1)))
    return (Segment("shared", n, name=f"profile/{nonce}/idle-{k}"),), out


def profile(server: ServerSettings, seed: int = 0, quick: bool = False, nonce: str | None = None,
            passes: int = PASSES) -> Profile:
    """The load for a server with these settings (its sequence cap, maximum length and pool; a
    setting it did not report is taken as vLLM's default). ``nonce``: what makes its tokens new
    [drawn at random]; ``passes``: how many times the load is sent in a row."""
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    if nonce is None:
        nonce = os.urandom(4).hex()
    max_len = server.max_model_len or 8192
    longest = max(4 * MIN_PROMPT, max_len - MAX_OUTPUT - 1)  # decodes up to the longest context the server takes
    pool = (server.usable_blocks * server.block_size) if server.usable_blocks and server.block_size else None
    if pool is not None:
        longest = max(4 * MIN_PROMPT, min(longest, pool // 8))
    cap = min(server.max_num_seqs or 256, QUICK_MAX_CONCURRENCY if quick else MAX_CONCURRENCY)
    if pool is not None:
        # half the pool held at once by the long stages (the larger): each sequence its own prompt tokens
        # and output, the shared prefixes once
        prefixes = [0, longest // 8, longest // 2]
        lo = max(MIN_PROMPT, longest // 8)
        own = sum(_log_uniform_mean(lo, max(lo, longest - p)) for p in prefixes) / len(prefixes)
        per_seq = own + _log_uniform_mean(MIN_OUTPUT, MAX_OUTPUT)
        cap = max(1, min(cap, int((pool / 2 - sum(prefixes)) / per_seq)))
    levels = [1]
    while levels[-1] * 2 <= cap:
        levels.append(levels[-1] * 2)
    if levels[-1] != cap:
        levels.append(cap)
    idle = max(2, 2 * (IDLE_REQUESTS // (2 * passes)))  # pairs, shared out between the passes
    stages = []
    for p in range(1, passes + 1):
        stages.append(Stage(1, idle, False, idle=True, pass_=p))
        stages += [Stage(c, max(6, 2 * c), long, pass_=p) for c in levels for long in (False, True)]
    # trace times: the first idle stage's requests IDLE_GAP_S apart, every later request after them (a
    # stage starts when the one before it has finished; a later pass's idle requests go one at a time)
    last_idle_t = (stages[0].requests - 1) * IDLE_GAP_S
    short = max(2 * MIN_PROMPT, longest // 16)
    prefixes = [0, longest // 8, longest // 2]
    rng = np.random.default_rng(seed)
    reqs = []
    for si, st in enumerate(stages):
        for j in range(st.requests):
            if st.idle:  # pairs: a prompt, then the same prompt again (all but its last block cached)
                if j % 2 == 0:
                    prompt, out = _idle_prompt(rng, nonce, j // 2 + (st.pass_ - 1) * st.requests, longest, short,
                                               max_len)
            else:
                kind = int(rng.integers(0, len(prefixes))) if st.long else 0
                pre = prefixes[kind]
                lo = max(MIN_PROMPT, longest // 8) if st.long else MIN_PROMPT
                own = int(_log_uniform(rng, lo, max(lo, (longest if st.long else short) - pre), 1)[0])
                out = int(min(_log_uniform(rng, MIN_OUTPUT, MAX_OUTPUT, 1)[0], max(1, max_len - pre - own - 1)))
                prompt = ((Segment("shared", pre, name=f"profile/{nonce}/prefix-{kind}"),) if pre else ()) + (
                    Segment("unique", own),)
            reqs.append(Request(id=f"{nonce}-{st.name}-{j}",
                                t=j * IDLE_GAP_S if st.idle and st.pass_ == 1 else last_idle_t,
                                prompt=prompt, output_len=out, meta={"workload": "calibration-profile",
                                                                     "stage": st.name, "pass": st.pass_},
                                prompt_len=sum(seg.length for seg in prompt)))
    return Profile(stages, reqs, short, longest)


__all__ = ["Profile", "Stage", "profile"]
