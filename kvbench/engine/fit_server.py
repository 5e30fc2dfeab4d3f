"""``kvbench calibrate --from-run LIVE_RUN``: a step clock for the sim, fitted to a live server's own
timings. A server tells no step durations, but a client sees them: the gap between two tokens of a
streamed request is the server's step that produced the second. Which work each of those steps did
(prefill tokens, decoding sequences, keys read, prefill chunks) is rebuilt by replaying the same
requests in the sim, each issued when the client issued it (a profiling run's stages also as closed
loops of their concurrency), under the server's settings; the step time is then fitted as

    step = overhead + prefill_tokens x a + decoding_sequences x b + context_tokens x c
           + prefill_chunks x e

and, before the engine sees a request, the server's front end (its API process) takes
request + prompt_tokens x d, one request at a time (engine.issuer.FrontEnd): a time to first token
is that front end, then the steps until its first token.

Single gaps are noisy (a server's API process can hold a token back and send two at once), so the
fit takes spans: a request's time to first token is the steps from its issue to its first token, and
its decode the steps from its first token to its last, each a sum of the step formula over the steps
the replay put there; non-negative least absolute relative error over both spans of every request.
A profiling load's stages (kvbench.engine.profile) weigh the same in the fit, however many requests
each took: concurrency 64 sends 128 requests and concurrency 1 six, and unweighted the largest
batches would decide a clock meant for every load between them. A profile sent in passes (the same
load twice in a row) is also fitted pass by pass: a coefficient's stated spread is the larger of the
bootstrap's and the passes' (their standard deviation: how far a calibration made at another time
lands), so a server whose speed moved while it was profiled says so in the file.
The replay is run again on the fitted clock, and the clock kept is the one that best fits the steps
of its own replay. The requests are split by id into a training share and a held-out share; the error
is stated on both, per span kind and per term. Each coefficient carries its spread over a bootstrap of
the requests and how much of its term the load measured apart from the others; a fit that is not fit
for use (held-out error over --max-error, a term not told apart) is written only with --force.
The file is a calibration of the sim's schema (kvbench.executors.sim: rates null, the linear terms).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvbench import __version__
from kvbench.engine.config import ReplayConfig
from kvbench.engine.issuer import FrontEnd
from kvbench.engine.lengths import engine_rule
from kvbench.engine.server import ServerSettings
from kvbench.errors import InputError
from kvbench.jsonio import dumps
from kvbench.provenance import file_sha256, now_iso
from kvbench.scheduler.batch import StepBatch
from kvbench.trace.format import load_trace

TERMS = ("step_overhead_s", "prefill_token_s", "decode_seq_s", "context_token_s", "prefill_seq_s", "request_s",
         "request_token_s")
STEP_TERMS = 5  # the first five time a step; the last two the front end
REQUEST, REQUEST_TOKEN = TERMS.index("request_s"), TERMS.index("request_token_s")
HELD_OUT = 1 / 3  # share of requests (by a hash of their id) left out of the fit
ROUNDS = 6  # replays on the fitted clock; the clock kept is the one that best fits its own replay's steps
DAMPING = 0.5  # of the last clock kept in the next: a fit that moved the replay's queueing too far overshoots
UNQUEUED_STEPS = 3  # a time to first token over at most this many replay steps waited for no queue
FRONT_QUEUED = 0.1  # nor did one that waited behind others in the front end for at most this share of it
MIN_CHUNK_SHARE = 0.5  # a decode streamed in fewer arrivals than this share of its tokens was held back
FLUSH_GAP_S = 2e-4  # arrivals closer than this came in one flush (no engine step is this short)
MAX_ERROR = 0.20  # a fit whose held-out median error is above this is written only with --force
IRLS_ROUNDS = 20  # reweightings of the least-absolute fit (its median error settles in about ten)
IRLS_FLOOR = 1e-3  # a residual below this weighs as this
BOOTSTRAP = 200  # resamples of the requests for each coefficient's uncertainty
BLOCK_SHARE = 0.05  # of the run's requests, consecutive in issue order, drawn together by the bootstrap
# a term's column less independent of the others than this (a variance inflation of 10) cannot be told from them
MIN_INDEPENDENT = 0.1
MAX_SPREAD = 0.25  # a term whose bootstrap spread moves a span it weighs in by more than this is too loose
DRIFT = 0.1  # a term whose passes differ by more than this share of it, and
DRIFT_SDS = 3.0  # by more than this many times its bootstrap sd, is said to have moved between the passes
MIN_PASS_SPANS = 3 * 7  # a pass with fewer training spans than this is not fitted alone (7 terms)


@dataclass
class LiveRecord:
    """What a live run directory holds that the fit reads."""

    dir: str
    config: dict
    requests: pd.DataFrame  # the completed requests: id, arrival_s (issue), first_token_s, finish_s
    chunks: pd.DataFrame  # tokens.parquet: id, sample, t_s, tokens


def read_live_run(run_dir: str) -> LiveRecord:
    """A live run (kvbench replay --endpoint) with its per-token times; InputError otherwise."""
    def need(name: str) -> str:
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            raise InputError(f"no {name}: not a live run of this kvbench (replay --endpoint writes it)",
                             file=run_dir, field="--from-run")
        return path
    with open(need("config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    if (config.get("settings") or {}).get("executor") != "live":
        raise InputError("is not a live run (its executor is not 'live')", file=run_dir, field="--from-run")
    reqs = pd.read_parquet(need("requests.parquet"))
    reqs = reqs[reqs["rejected"].isna() & reqs["first_token_s"].notna()]
    return LiveRecord(run_dir, config, reqs, pd.read_parquet(need("tokens.parquet")))


def replay_config(rec: LiveRecord, clock_path: str) -> ReplayConfig:
    """The sim as the server was: its block size, usable blocks, sequence cap, token budget, maximum
    length (with the length rule of the server's engine), prefix caching; the requests come at the times
    the client issued them (no concurrency cap or dependency of its own: the issue times hold both)."""
    s = dict(rec.config["settings"])
    server = server_settings(rec)
    fields = server.replay_fields()
    keep = {k: s[k] for k in ("model", "seed", "prefix_cache", "block_size", "max_num_seqs", "max_batched_tokens",
                               "max_model_len", "num_blocks") if s.get(k) is not None}
    return ReplayConfig(**{**keep, **fields, "executor": "sim", "calibration": clock_path,
                           "overlong": engine_rule(server.kind),
                           "time_scale": 1.0, "max_concurrency": None, "dependent_turns": False,
                           "limit": None}).validate()


def server_settings(rec: LiveRecord) -> ServerSettings:
    """The server's settings as the run recorded them (config.json's "server")."""
    known = {f.name for f in dataclasses.fields(ServerSettings)}
    return ServerSettings(**{k: v for k, v in (rec.config.get("server") or {}).items() if k in known})


def run_stages(rec: LiveRecord) -> list[tuple[int, int]] | None:
    """The run's stages (a profiling load: calibrate --endpoint) when every request of them completed,
    so the sim can send them as the client did; else None."""
    stages = [tuple(s) for s in ((rec.config.get("live") or {}).get("stages") or [])]
    if not stages or sum(n for n, _ in stages) != len(rec.requests):
        return None
    return [(int(n), int(c)) for n, c in stages]


def issued_trace(rec: LiveRecord, trace_path: str, out_path: str) -> None:
    """The live run's completed requests, each at the time the client issued it. A staged run's
    requests also keep their stages (run_stages; the sim's Issuer): a request goes at its issue time
    or, where the sim's closed loop is slower than the server's was, when one of the stage's slots
    frees -- issue times alone would pile a stage the sim runs slower up beyond its concurrency, and a
    closed loop alone would not wait where the client was slow to send."""
    issue = dict(zip(rec.requests["id"], rec.requests["arrival_s"]))
    lines = []
    for r in load_trace(trace_path):
        if r.id in issue:
            lines.append({**r.to_json(), "t": max(0.0, float(issue[r.id]))})
    with open(out_path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(x) + "\n" for x in sorted(lines, key=lambda x: x["t"]))


@dataclass
class Steps:
    """The replay's steps (one engine: a server is one replica): composition and times per step and,
    per (request, sample), the steps that emitted its tokens."""

    work: list[tuple[int, int, int, int]]  # per step: prefill tokens, decoding sequences, keys the decodes
    # read, prefill chunks
    end_s: list[float]
    emitted: dict[tuple[str, int], list[int]]  # (request id, sample) -> the steps that emitted its tokens
    issued: dict[str, float] = field(default_factory=dict)  # request id -> when the sim issued it


def rebuild_steps(trace: str, cfg: ReplayConfig, out_dir: str, stages: list[tuple[int, int]] | None = None) -> Steps:
    from kvbench.engine.replay import Replay

    steps = Steps([], [], {})

    def hook(replica: int, start_s: float, end_s: float, batch: StepBatch, emitted) -> None:
        k = len(steps.work)
        steps.work.append((batch.num_prefill_tokens, batch.num_decodes, batch.decode_context_total(),
                           len(batch.prefill_lens)))
        steps.end_s.append(end_s)
        for key in emitted:
            steps.emitted.setdefault(key, []).append(k)

    rp = Replay(trace, cfg, out_dir, force=True)
    rp.step_hook = hook
    rp.stages = stages
    rp.run()
    reqs = pd.read_parquet(os.path.join(out_dir, "requests.parquet"), columns=["id", "arrival_s"])
    steps.issued = dict(zip(reqs["id"], reqs["arrival_s"]))
    return steps


def held_out(request_id: str) -> bool:
    """A stable split by id: the same requests are held out whatever the run's order."""
    h = int(hashlib.sha256(str(request_id).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < HELD_OUT


@dataclass
class Spans:
    """The fit's rows: per span (two per request: issue to first token, first token to last), ``X``
    [spans, terms]: the sum over the span's steps of (1, prefill tokens, decoding sequences, keys
    read, prefill chunks), then the front end's (1, prompt tokens) for a time to first token;
    ``y``: the span as the client measured it, seconds, less any wait for the front end; ``weight``:
    its weight in the fit (``stage_weights``); ``held``:
    from a held-out request; ``decode``: a decode span, else a time to first token; ``request``: the
    request's id; ``excluded``: left out of the fit and of its judgement -- a time to first token that
    waited (behind others in the front end for over FRONT_QUEUED of it, or over UNQUEUED_STEPS engine
    steps), which depends on the clock being fitted more than on the request, or a decode whose tokens
    the API server held back (they came in fewer than MIN_CHUNK_SHARE as many separate arrivals as
    tokens, arrivals under FLUSH_GAP_S apart counted as one: an API process that falls behind sends
    several at once, and the span then times it, not the steps)."""

    X: np.ndarray
    y: np.ndarray
    weight: np.ndarray
    held: np.ndarray
    decode: np.ndarray
    request: np.ndarray
    excluded: np.ndarray

    def split(self) -> tuple[np.ndarray, np.ndarray]:
        """(train, test) masks over the spans not excluded, split by request id."""
        use = ~self.excluded
        return use & ~self.held, use & self.held


def span_rows(rec: LiveRecord, steps: Steps, front: tuple[float, float] = (0.0, 0.0),
              stage_of: dict[str, str] | None = None) -> Spans:
    """The spans of the run's requests over the replay's ``steps``; ``front``: the front end's current
    terms (request, per prompt token), which say how long a request waited behind others there;
    ``stage_of``: request id -> its stage in a profiling load (``profile_meta``), for the weights."""
    work = np.array(steps.work, dtype=np.float64).reshape(-1, STEP_TERMS - 1)
    cum = np.zeros((len(work) + 1, STEP_TERMS))
    cum[1:, 0] = np.arange(1, len(work) + 1)
    cum[1:, 1:] = np.cumsum(work, axis=0)
    ends = np.array(steps.end_s)
    X, y, held, decode, request, excluded = [], [], [], [], [], []
    first = rec.chunks.sort_values("t_s").groupby("id")["t_s"]
    t_first, t_last = first.first(), first.last()
    own = rec.chunks[rec.chunks["sample"] == 0].sort_values("t_s")
    tokens = own.groupby("id")["tokens"].sum()
    # separate arrivals: chunks less than FLUSH_GAP_S apart came together (a flush, not two steps)
    chunks = own.groupby("id")["t_s"].agg(lambda t: 1 + int((np.diff(t.to_numpy()) > FLUSH_GAP_S).sum()))
    fe = FrontEnd(*front)
    reqs = rec.requests.assign(sim_issue_s=[steps.issued.get(i, a) for i, a in zip(rec.requests["id"],
                                                                                    rec.requests["arrival_s"])])
    for row in reqs.sort_values("sim_issue_s", kind="stable").itertuples():
        # when the replay's engine saw it: after the front end, on the replay's clock (a staged run's
        # requests are issued when the replay's own closed loop frees a slot)
        seen = fe.admit(row.sim_issue_s, row.prompt_tokens)
        emitted = steps.emitted.get((row.id, 0))
        if not emitted or row.id not in t_first.index:
            continue
        out = held_out(row.id)
        a = int(np.searchsorted(ends, seen, side="right"))  # the first step ending after the engine saw it
        e0, e1 = emitted[0], emitted[-1]
        waited = seen - row.sim_issue_s - fe.service_s(row.prompt_tokens)  # behind others in the front end
        ttft = t_first[row.id] - row.arrival_s
        for lo, hi, span, kind in ((a, e0 + 1, ttft - waited, False),
                                   (e0 + 1, e1 + 1, t_last[row.id] - t_first[row.id], True)):
            if hi > lo and span > 0:
                X.append(np.concatenate([cum[hi] - cum[lo], [0.0, 0.0] if kind else [1.0, row.prompt_tokens]]))
                y.append(span)
                held.append(out)
                decode.append(kind)
                request.append(row.id)
                held_back = chunks.get(row.id, 0) < MIN_CHUNK_SHARE * tokens.get(row.id, 0)
                excluded.append(held_back if kind else (waited > FRONT_QUEUED * ttft or hi - lo > UNQUEUED_STEPS))
    decode_ = np.array(decode, dtype=bool)
    request_ = np.array(request, dtype=object)
    excluded_ = np.array(excluded, dtype=bool)
    return Spans(np.array(X, dtype=np.float64).reshape(-1, len(TERMS)), np.array(y),
                 stage_weights(request_, decode_, excluded_ | np.array(held, dtype=bool), stage_of or {}),
                 np.array(held, dtype=bool),
                 decode_, request_, excluded_)


def pass_spread(X: np.ndarray, y: np.ndarray, weight: np.ndarray, passes: np.ndarray) -> dict | None:
    """The fit repeated on each pass of a profile alone (``passes``: each span's pass): per term its
    value in every pass and ``sd``, their standard deviation (how far a calibration made at another
    time lands) -- what the bootstrap within one run cannot see, a server whose speed moved between
    one pass and the next. A pass with fewer than MIN_PASS_SPANS spans is not fitted alone; None when
    fewer than two passes are left."""
    ps = sorted(p for p in {int(p) for p in passes} if (passes == p).sum() >= MIN_PASS_SPANS)
    if len(ps) < 2:
        return None
    coefs = np.array([_fit(X[passes == p], y[passes == p], weight[passes == p]) for p in ps])
    sd = coefs.std(axis=0, ddof=1)
    return {"passes": ps, "coefficients": {t: [float(v) for v in coefs[:, j]] for j, t in enumerate(TERMS)},
            "sd": {t: float(sd[j]) for j, t in enumerate(TERMS)}}


def profile_meta(trace_path: str) -> tuple[dict[str, str], dict[str, int]]:
    """For a profiling load's requests, request id -> its stage and request id -> its pass (their
    ``meta["stage"]`` and ``meta["pass"]``, as kvbench.engine.profile writes them); another trace's
    requests, or a meta of another shape, are in neither."""
    stage_of: dict[str, str] = {}
    pass_of: dict[str, int] = {}
    for r in load_trace(trace_path):
        meta = r.meta if isinstance(r.meta, dict) else {}
        if isinstance(meta.get("stage"), str):
            stage_of[r.id] = meta["stage"]
        if isinstance(meta.get("pass"), int) and not isinstance(meta["pass"], bool):
            pass_of[r.id] = meta["pass"]
    return stage_of, pass_of


def stage_weights(request: np.ndarray, decode: np.ndarray, excluded: np.ndarray,
                  stage_of: dict[str, str]) -> np.ndarray:
    """Each span's weight in the fit: the spans the fit uses from one stage of a profiling load and of
    one kind (times to first token, decodes) share one weight, the same for every such group, and
    together weigh as many as they are; a span of a request outside any stage weighs 1. A profile
    visits regimes -- one sequence at a time, batches of 64, short and long contexts -- with as many
    requests as each needs to be seen (two per concurrency slot), so unweighted the largest batches
    would decide the clock, and where the server's cost is not linear (a CPU server's cost per key read
    grows with the batch's keys) a linear clock fitted that way misses what lies between. Only the
    spans the fit uses count (``excluded``: the ones it leaves out, the held-out ones among them)."""
    groups = [(stage_of.get(str(r)), bool(d)) for r, d in zip(request, decode)]
    counts: dict[tuple[str | None, bool], int] = {}
    for g, x in zip(groups, excluded):
        if g[0] is not None and not x:
            counts[g] = counts.get(g, 0) + 1
    share = sum(counts.values()) / len(counts) if counts else 0.0
    return np.array([share / counts[g] if g in counts else 1.0 for g in groups], dtype=np.float64)


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a term a step cannot make shorter): the negative
    ones dropped one at a time and the rest refitted."""
    free = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        if free:
            coef[free] = np.linalg.lstsq(X[:, free], y, rcond=None)[0]
        neg = [i for i in free if coef[i] < 0]
        if not neg:
            return coef
        free.remove(min(neg, key=lambda i: coef[i]))


def error(X: np.ndarray, y: np.ndarray, coef: np.ndarray) -> dict:
    """How far the fitted spans are from the measured: the mean and median |predicted / measured - 1|."""
    if not len(y):
        return {"spans": 0, "mean_abs_rel_err": None, "median_abs_rel_err": None}
    rel = np.abs(X @ coef / y - 1)
    return {"spans": int(len(y)), "mean_abs_rel_err": float(rel.mean()), "median_abs_rel_err": float(np.median(rel))}


def clock_file(coef: np.ndarray, path: str) -> None:
    """A calibration of the sim's schema: no roofline (rates null), the fitted linear terms."""
    doc = {"kvbench_calibration": 3, "coefficients": {"matmul_flops": None, "attn_flops": None, "mem_bw": None,
                                                      "kv_bw": None, **dict(zip(TERMS, map(float, coef)))}}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)


def initial(rec: LiveRecord) -> np.ndarray:
    """A first clock: every step the median gap the client saw."""
    gaps = np.concatenate([np.diff(g["t_s"].to_numpy()) for _, g in rec.chunks.sort_values("t_s").groupby(
        ["id", "sample"])] or [np.array([0.01])])
    gaps = gaps[gaps > 0]
    return np.array([float(np.median(gaps)) if len(gaps) else 0.01] + [0.0] * (len(TERMS) - 1))


def fit_from_run(run_dir: str, out_path: str | None = None, rounds: int = ROUNDS, *,
                 max_error: float = MAX_ERROR, force: bool = False, seed: int = 0) -> dict:
    """Fit the clock to a live run; -> the calibration, with its assessment (``fit``: the held-out
    error per span kind and per term, each coefficient's bootstrap uncertainty and identifiability,
    ``usable`` and the ``problems`` that make it not). Written to ``out_path`` when given, if the fit
    is usable (held-out median at most ``max_error``, every term identifiable) or ``force``."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    rec = read_live_run(run_dir)
    trace_path = (rec.config.get("trace") or {}).get("path")
    if not trace_path or not os.path.exists(trace_path):
        raise InputError(f"the run's trace {trace_path!r} is not here: the fit replays it", file=run_dir,
                         field="--from-run")
    if file_sha256(trace_path) != rec.config["trace"].get("sha256"):
        raise InputError(f"the run's trace {trace_path} has changed since the run", file=run_dir, field="--from-run")
    coef, history = initial(rec), []
    stages = run_stages(rec)
    best: tuple[float, int, np.ndarray, Spans] | None = None  # (its own training error, round, clock, spans)
    with tempfile.TemporaryDirectory(prefix="kvbench-fit-") as tmp:
        trace = os.path.join(tmp, "issued.jsonl")
        issued_trace(rec, trace_path, trace)
        clock = os.path.join(tmp, "clock.json")

        stage_of, pass_of = profile_meta(trace_path)

        def replay_on(c: np.ndarray, out: str) -> Spans:
            clock_file(c, clock)
            return span_rows(rec, rebuild_steps(trace, replay_config(rec, clock), out, stages),
                             (float(c[REQUEST]), float(c[REQUEST_TOKEN])), stage_of)

        for k in range(rounds + 1):
            spans = replay_on(coef, os.path.join(tmp, f"replay-{k}"))
            train, test = spans.split()
            if not train.sum():
                raise InputError("no request's tokens could be matched to the replay's steps (none completed, "
                                 "or tokens.parquet is empty)", file=run_dir, field="--from-run")
            X, y = spans.X, spans.y
            # the clock judged on the steps its own replay made (a fixed point: a clock that fits the
            # steps of another clock's replay may not fit its own)
            own = error(X[train], y[train], coef)
            if k and (best is None or own["median_abs_rel_err"] < best[0]):
                best = (own["median_abs_rel_err"], k, coef.copy(), spans)
            if k == rounds:
                break
            new = _fit(X[train], y[train], spans.weight[train])
            history.append({"round": k, "clock_on_its_replay": own, "train": error(X[train], y[train], new),
                            "heldout": error(X[test], y[test], new)})
            coef = new if k == 0 else DAMPING * coef + (1 - DAMPING) * new  # the replay's steps follow the clock
        assert best is not None
        _, chosen, coef, spans = best
        # the chosen clock's own replay (that round's): its steps gave the spans the fit is judged on,
        # its requests the sim's TTFT and TPOT beside the server's
        check = _replay_check(rec, os.path.join(tmp, f"replay-{chosen}"), stage_of)
    X, y, decode, request = spans.X, spans.y, spans.decode, spans.request
    train, test = spans.split()
    order = {rid: k for k, rid in enumerate(rec.requests.sort_values("arrival_s", kind="stable")["id"])}
    boot = bootstrap(X[train], y[train], request[train], seed=seed, order=order, weight=spans.weight[train])
    passes = pass_spread(X[train], y[train], spans.weight[train],
                         np.array([pass_of.get(str(r), 1) for r in request[train]], dtype=int))
    terms = identifiability(X[train], y[train], coef, boot)  # on the bootstrap's sd: drift is said apart
    for t, row in boot["summary"].items():  # the stated sd: the larger of the bootstrap's and the passes'
        row["sd_bootstrap"] = row["sd"]
        if passes is not None:
            row["sd_passes"] = passes["sd"][t]
            row["passes"] = passes["coefficients"][t]
            row["sd"] = max(row["sd"], passes["sd"][t])
        terms[t]["sd"] = row["sd"]
    fit: dict[str, Any] = {"kind": "live-run", "run": os.path.abspath(run_dir), "made_at": now_iso(),
           "model": "step = overhead + prefill tokens x a + decoding sequences x b + keys read x c + prefill "
                    "chunks x e; front end = request + prompt tokens x d, one request at a time",
           "held_out_share": HELD_OUT,
           "weighting": ("each stage of the profiling load and span kind weighs the same"
                         if any(str(r) in stage_of for r in request[train]) else "every span the same"),
           "rounds": history, "chosen_round": chosen,
           "train": error(X[train], y[train], coef),
           "heldout": error(X[test], y[test], coef),
           "heldout_by_span": {"ttft": error(X[test & ~decode], y[test & ~decode], coef),
                               "decode": error(X[test & decode], y[test & decode], coef)},
           "heldout_by_term": by_dominant_term(X[test], y[test], coef),
           "uncertainty": {"method": f"moving-block bootstrap over the training requests, {BOOTSTRAP} resamples "
                                     f"of blocks of {BLOCK_SHARE:.0%} of them in issue order, the spans of a "
                                     "request drawn together" + (
                                         f"; sd the larger of the bootstrap's and the {len(passes['passes'])} "
                                         "passes' (their standard deviation)" if passes else ""),
                           **boot["summary"]},
           "terms": terms, "load": load_coverage(rec), "max_error": max_error,
           "replay_check": check, "server": rec.config.get("server") or {}, "endpoint": rec.config.get("endpoint"),
           "trace": rec.config.get("trace")}
    fit["problems"], fit["warnings"], fit["advice"] = verdict(fit)
    fit["usable"] = not fit["problems"]
    fit["forced"] = bool(force and fit["problems"])
    doc = {"kvbench_calibration": 3, "kvbench_version": __version__, "device_name": server_settings(rec).describe(),
           "model": rec.config["settings"].get("model"),
           "coefficients": {"matmul_flops": None, "attn_flops": None, "mem_bw": None, "kv_bw": None,
                            **{t: float(v) for t, v in zip(TERMS, coef)}},
           "fit": fit}
    if out_path is not None and (fit["usable"] or force):
        with open(out_path, "w", encoding="utf-8") as fh:
            fh.write(dumps(doc, indent=1))  # a NaN or infinity written as null, never as bare NaN
    return doc


def _fit(X: np.ndarray, y: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """Non-negative least absolute relative error: the median-unbiased fit of what the fit is judged
    on (the median |predicted / measured - 1|), so a stretch of spans the linear clock cannot follow
    (a machine that slowed, a batch whose keys left the CPU's caches) pulls it less than least
    squares would. Iteratively reweighted NNLS, rows weighted 1 / sqrt(|residual|), times the square
    root of each span's ``weight`` (stage_weights; None: all 1) -- its weight in the absolute error."""
    A = X / y[:, None]  # relative error: a short span weighs as much as a long one
    root = np.ones(len(y)) if weight is None else np.sqrt(weight)
    coef = nnls(A * root[:, None], root)
    for _ in range(IRLS_ROUNDS):
        w = root / np.sqrt(np.maximum(np.abs(A @ coef - 1), IRLS_FLOOR))
        coef = nnls(A * w[:, None], w)
    return coef


def bootstrap(X: np.ndarray, y: np.ndarray, request: np.ndarray, seed: int = 0, n: int | None = None,
              order: dict | None = None, weight: np.ndarray | None = None) -> dict:
    """The fit repeated on resamples of the requests: each coefficient's spread. A request's spans are
    drawn together (its steps are shared by both), and requests in blocks of BLOCK_SHARE of the run in
    issue order (``order``: request id -> rank; a moving-block bootstrap), so a drift of the machine's
    speed over a stretch of the run is in the spread, not only the scatter of single requests.
    -> {"samples": [n, terms], "summary": {term: {"sd", "p05", "p95"}}}."""
    n = BOOTSTRAP if n is None else n
    ids, inverse = np.unique(request.astype(str), return_inverse=True)
    if order is not None:  # the requests in issue order
        rank = np.argsort(np.argsort([order.get(i, 0) for i in ids]))
    else:
        rank = np.arange(len(ids))
    rows_of_rank = [np.flatnonzero(inverse == k) for k in np.argsort(rank)]
    m = len(ids)
    block = max(1, int(round(BLOCK_SHARE * m)))
    starts = max(1, m - block + 1)
    rng = np.random.default_rng(seed)
    samples = np.empty((n, X.shape[1]))
    for b in range(n):
        picked: list[np.ndarray] = []
        while sum(len(p) for p in picked) < len(y):
            s0 = int(rng.integers(0, starts))
            picked.extend(rows_of_rank[s0:s0 + block])
        pick = np.concatenate(picked)
        samples[b] = _fit(X[pick], y[pick], None if weight is None else weight[pick])
    summary = {t: {"sd": float(samples[:, j].std(ddof=1)) if n > 1 else 0.0,
                   "p05": float(np.percentile(samples[:, j], 5)), "p95": float(np.percentile(samples[:, j], 95))}
               for j, t in enumerate(TERMS)}
    return {"samples": samples, "summary": summary}


def identifiability(X: np.ndarray, y: np.ndarray, coef: np.ndarray, boot: dict) -> dict:
    """Per term: whether the load measured it apart from the others.

    - ``independent``: the share of the term's column (relative to each span) that the other terms'
      columns do not explain (1 - R^2 of it regressed on them): below MIN_INDEPENDENT the load cannot
      tell this term from those (``confused_with``, the ones that explain it) -- a decode batch of one
      sequence throughout makes the decode term the step overhead;
    - ``spread``: the bootstrap's standard deviation of the coefficient times the term's 95th-percentile
      share of a span (at this spread a span where the term is large moves by so much): above
      MAX_SPREAD the term is measured too loosely to use;
    - ``share``: the term's median share of the fitted time of the spans it is in.
    A term whose column is zero was not measured (``measured`` false)."""
    W = X / y[:, None]
    out = {}
    for j, t in enumerate(TERMS):
        col = W[:, j]
        row: dict = {"coefficient": float(coef[j]), "sd": boot["summary"][t]["sd"],
                     "measured": bool(np.any(col > 0))}
        others = [k for k in range(len(TERMS)) if k != j and np.any(W[:, k] > 0)]
        if not row["measured"]:
            row.update(independent=0.0, confused_with=[], spread=None, share=0.0, identifiable=False)
            out[t] = row
            continue
        if others:
            beta = np.linalg.lstsq(W[:, others], col, rcond=None)[0]
            resid = col - W[:, others] @ beta
            independent = float(resid @ resid / (col @ col))
            weight = np.abs(beta) * np.linalg.norm(W[:, others], axis=0)
            confused = [TERMS[others[i]] for i in np.argsort(-weight) if weight[i] > 0.1 * np.linalg.norm(col)]
        else:
            independent, confused = 1.0, []
        pred = X @ coef
        share = np.divide(X[:, j] * coef[j], pred, out=np.zeros(len(y)), where=pred > 0)[X[:, j] > 0]
        spread = float(row["sd"] * np.percentile(col, 95))
        row.update(independent=independent, confused_with=confused[:2] if independent < MIN_INDEPENDENT else [],
                   spread=spread, share=float(np.median(share)),
                   identifiable=independent >= MIN_INDEPENDENT and spread <= MAX_SPREAD)
        out[t] = row
    return out


def by_dominant_term(X: np.ndarray, y: np.ndarray, coef: np.ndarray) -> dict:
    """The held-out error over the spans each term dominates (the largest part of the fitted span)."""
    parts = X * coef
    top = np.argmax(parts, axis=1) if len(y) else np.array([], dtype=int)
    return {t: error(X[top == j], y[top == j], coef) for j, t in enumerate(TERMS) if np.any(top == j)}


def load_coverage(rec: LiveRecord) -> dict:
    """What the load spanned: prompt lengths, their cached share, and the concurrency of the run
    (requests in flight at each issue, counted from the client's times)."""
    reqs = rec.requests
    prompt = reqs["prompt_tokens"].to_numpy(dtype=float)
    cached = reqs["cached_tokens"].fillna(0).to_numpy(dtype=float)
    start, end = reqs["arrival_s"].to_numpy(), reqs["finish_s"].to_numpy()
    in_flight = [int(((start <= s) & (end > s)).sum()) for s in start]
    server = rec.config.get("server") or {}
    return {"requests": int(len(reqs)), "prompt_tokens": [int(prompt.min()), int(prompt.max())] if len(prompt) else None,
            "cached_share": [float((cached / prompt).min()), float((cached / prompt).max())] if len(prompt) else None,
            "in_flight": [min(in_flight), max(in_flight)] if in_flight else None,
            "server_max_num_seqs": server.get("max_num_seqs")}


ADVICE = {  # the load that would measure a term
    "step_overhead_s": "requests one at a time (concurrency 1) beside batches of many",
    "decode_seq_s": "decode batches of every size up to the server's cap: closed-loop stages at concurrency "
                    "1, 2, 4, ... (kvbench calibrate --endpoint sends them)",
    "context_token_s": "decodes over short and long contexts (prompt lengths spread over the server's range)",
    "prefill_seq_s": "prompts arriving while others decode (a closed loop above concurrency 1), so steps "
                     "with a prefill chunk differ from steps without one beyond the chunk's tokens",
    "prefill_token_s": "prompt lengths spread from tens to thousands of tokens",
    "request_s": "requests sent one at a time with idle gaps, so a time to first token is the front end and "
                 "one step",
    "request_token_s": "prompts whose cached share varies (shared prefixes of several lengths), so the API "
                       "server's per-token cost differs from prefill's",
}


def verdict(fit: dict) -> tuple[list[str], list[str], list[str]]:
    """(problems, warnings, advice): why the fit is not fit for use (a held-out error above the
    threshold; a term not measured, or not told apart from the others: the load cannot say what it
    costs, so any other load's prediction is a guess), what to read with care (a term measured
    loosely: its bootstrap spread moves the spans it weighs in by over MAX_SPREAD), and the load that
    would fix either."""
    problems, warnings, advice = [], [], []
    med = fit["heldout"]["median_abs_rel_err"]
    if med is None:
        problems.append("no held-out span to judge it on")
        advice.append("more requests (a third of them are held out)")
    elif med > fit["max_error"]:
        problems.append(f"held-out median error {med:.0%} > {fit['max_error']:.0%}")
        advice.append("a load spanning what the server does (kvbench calibrate --endpoint), on a machine "
                      "nothing else runs on")
    for t, u in (fit.get("uncertainty") or {}).items():
        if not isinstance(u, dict) or "passes" not in u:
            continue
        vals = u["passes"]
        mid = float(np.mean(vals))
        moved = (max(vals) - min(vals)) / mid if mid > 0 else 0.0
        if moved > DRIFT and u["sd_passes"] > DRIFT_SDS * u["sd_bootstrap"]:
            warnings.append(f"the {TERM_NAMES[t]} term moved {moved:.0%} between the profile's passes, "
                            f"{u['sd_passes'] / max(u['sd_bootstrap'], 1e-30):.1f}x its bootstrap sd (the "
                            "server's speed changed while it was profiled; its sd says so)")
    for t, row in fit["terms"].items():
        if row["identifiable"]:
            continue
        name = TERM_NAMES[t]
        if not row["measured"]:
            problems.append(f"the {name} term was not measured")
        elif row["independent"] < MIN_INDEPENDENT:
            problems.append(f"the {name} term cannot be told from the "
                            + " and ".join(TERM_NAMES[o] for o in row["confused_with"] or ["others"])
                            + f" ({row['independent']:.1%} of it independent)")
        else:
            warnings.append(f"the {name} term is loose (its bootstrap spread moves a span by {row['spread']:.0%})")
        advice.append(f"{name}: {ADVICE[t]}")
    return problems, warnings, advice


TERM_NAMES = {"step_overhead_s": "step overhead", "prefill_token_s": "prefill token",
              "decode_seq_s": "decoding sequence", "context_token_s": "key read",
              "prefill_seq_s": "prefill chunk", "request_s": "front-end request",
              "request_token_s": "front-end prompt token"}


def calibration_caveat(path: str) -> str | None:
    """For a replay's first line: how a calibration fitted to a live run was judged (None: the file is
    not such a fit, or cannot be read -- the sim says why when it reads it)."""
    try:
        with open(path, encoding="utf-8") as fh:
            fit = json.load(fh).get("fit") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(fit, dict) or fit.get("kind") != "live-run":
        return None
    med = (fit.get("heldout") or {}).get("median_abs_rel_err")
    said = f"held-out median {med:.0%}" if isinstance(med, (int, float)) else "no held-out error"
    if fit.get("usable", True):
        loose = "; ".join(fit.get("warnings") or [])
        return f"fitted to a live run, {said}" + (f" ({loose})" if loose else "")
    return "ITS FIT IS POOR (" + "; ".join(fit.get("problems") or []) + "), written with --force"


def _replay_check(rec: LiveRecord, out_dir: str, stage_of: dict[str, str] | None = None) -> dict:
    """The fitted sim against the run, request by request: TTFT and TPOT p50 of both, and each
    request's predicted/measured - 1, over the held-out requests (and all); for a profiling load also
    per stage over its held-out requests (``by_stage``: where a linear clock misses the server). ``out_dir``:
    the sim's replay of the run's requests on the fitted clock."""
    sim = pd.read_parquet(os.path.join(out_dir, "requests.parquet")).set_index("id")
    live = rec.requests.set_index("id")
    both = live.index.intersection(sim.index[sim["rejected"].isna()])
    out: dict[str, dict] = {}
    held = [i for i in both if held_out(i)]
    for part, ids in (("heldout", held), ("all", list(both))):
        row: dict[str, float | None] = {"requests": len(ids)}
        for name in ("ttft_ms", "tpot_ms"):
            a, b = sim.loc[ids, name].to_numpy(), live.loc[ids, name].to_numpy()
            ok = np.isfinite(a) & np.isfinite(b) & (b > 0)
            row[f"{name}_p50_live"] = float(np.median(b[ok])) if ok.any() else None
            row[f"{name}_p50_sim"] = float(np.median(a[ok])) if ok.any() else None
            row[f"{name}_median_abs_rel_err"] = float(np.median(np.abs(a[ok] / b[ok] - 1))) if ok.any() else None
        out[part] = row
    in_stage: dict[str, list] = {}  # stage -> its held-out requests, stages in the order the load sent them
    held_ids = set(held)
    for i in rec.requests.sort_values("arrival_s", kind="stable")["id"]:
        if stage_of and i in stage_of:
            ids = in_stage.setdefault(stage_of[i], [])
            if i in held_ids:
                ids.append(i)
    by_stage: dict[str, dict] = {}
    for st, ids in in_stage.items():
        a, b = sim.loc[ids, "tpot_ms"].to_numpy(), live.loc[ids, "tpot_ms"].to_numpy()
        ok = np.isfinite(a) & np.isfinite(b) & (b > 0)
        if ok.any():
            by_stage[st] = {"requests": int(ok.sum()), "tpot_ms_p50_live": float(np.median(b[ok])),
                            "tpot_ms_p50_sim": float(np.median(a[ok])),
                            "tpot_p50_rel_err": float(np.median(a[ok]) / np.median(b[ok]) - 1)}
    out["by_stage"] = by_stage
    return out
