"""``kvbench calibrate --from-run LIVE_RUN``: a step clock for the sim, fitted to a live server's own
timings. A server tells no step durations, but a client sees them: the gap between two tokens of a
streamed request is the server's step that produced the second. Which work each of those steps did
(prefill tokens, decoding sequences, keys read) is rebuilt by replaying the same requests in the sim,
each issued when the client issued it, under the server's settings; the step time is then fitted as

    step = overhead + prefill_tokens x a + decoding_sequences x b + context_tokens x c

and, before the engine sees a request, the server's front end (its API process) takes
request + prompt_tokens x d, one request at a time (engine.issuer.FrontEnd): a time to first token
is that front end, then the steps until its first token.

Single gaps are noisy (a server's API process can hold a token back and send two at once), so the
fit takes spans: a request's time to first token is the steps from its issue to its first token, and
its decode the steps from its first token to its last, each a sum of the step formula over the steps
the replay put there; non-negative least squares of the relative error over both spans of every
request. The replay is run again on the fitted clock until the steps it rebuilds stop moving. The
requests are split by id into a training share and a held-out share; the error is stated on both.
The file is a calibration of the sim's schema (kvbench.executors.sim: rates null, the linear terms).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvbench import __version__
from kvbench.engine.config import ReplayConfig
from kvbench.engine.issuer import FrontEnd
from kvbench.engine.lengths import engine_rule
from kvbench.engine.server import ServerSettings
from kvbench.errors import InputError
from kvbench.provenance import file_sha256, now_iso
from kvbench.scheduler.batch import StepBatch
from kvbench.trace.format import load_trace

TERMS = ("step_overhead_s", "prefill_token_s", "decode_seq_s", "context_token_s", "request_s", "request_token_s")
HELD_OUT = 1 / 3  # share of requests (by a hash of their id) left out of the fit
ROUNDS = 6  # replays on the fitted clock: the rebuilt steps settle in three or four
DAMPING = 0.5  # of the last clock kept in the next: a fit that moved the replay's queueing too far overshoots
UNQUEUED_STEPS = 3  # a time to first token over at most this many replay steps waited for no queue


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


def issued_trace(rec: LiveRecord, trace_path: str, out_path: str) -> None:
    """The live run's completed requests, each at the time the client issued it."""
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

    work: list[tuple[int, int, int]]  # per step: prefill tokens, decoding sequences, keys the decodes read
    end_s: list[float]
    emitted: dict[tuple[str, int], list[int]]  # (request id, sample) -> the steps that emitted its tokens


def rebuild_steps(trace: str, cfg: ReplayConfig, out_dir: str) -> Steps:
    from kvbench.engine.replay import Replay

    steps = Steps([], [], {})

    def hook(replica: int, start_s: float, end_s: float, batch: StepBatch, emitted) -> None:
        k = len(steps.work)
        steps.work.append((batch.num_prefill_tokens, batch.num_decodes, batch.decode_context_total()))
        steps.end_s.append(end_s)
        for key in emitted:
            steps.emitted.setdefault(key, []).append(k)

    rp = Replay(trace, cfg, out_dir, force=True)
    rp.step_hook = hook
    rp.run()
    return steps


def held_out(request_id: str) -> bool:
    """A stable split by id: the same requests are held out whatever the run's order."""
    h = int(hashlib.sha256(str(request_id).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < HELD_OUT


def span_rows(rec: LiveRecord, steps: Steps, front: tuple[float, float] = (0.0, 0.0)
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X [spans, 6]: the sum over the span's steps of (1, prefill tokens, decoding sequences, keys
    read), then the front end's (1, prompt tokens) for a time to first token; y [spans]: the span as
    the client measured it, seconds, less any wait for the front end (``front``: its current terms);
    held [spans]: from a held-out request; decode [spans]: a decode span, else a time to first
    token). Two spans per request: issue to first token, first token to last."""
    work = np.array(steps.work, dtype=np.float64).reshape(-1, 3)
    cum = np.zeros((len(work) + 1, 4))
    cum[1:, 0] = np.arange(1, len(work) + 1)
    cum[1:, 1:] = np.cumsum(work, axis=0)
    ends = np.array(steps.end_s)
    X, y, held, decode = [], [], [], []
    first = rec.chunks.sort_values("t_s").groupby("id")["t_s"]
    t_first, t_last = first.first(), first.last()
    fe = FrontEnd(*front)
    for row in rec.requests.sort_values("arrival_s", kind="stable").itertuples():
        seen = fe.admit(row.arrival_s, row.prompt_tokens)  # when the replay's engine saw it
        emitted = steps.emitted.get((row.id, 0))
        if not emitted or row.id not in t_first.index:
            continue
        out = held_out(row.id)
        a = int(np.searchsorted(ends, seen, side="right"))  # the first step ending after the engine saw it
        e0, e1 = emitted[0], emitted[-1]
        waited = seen - row.arrival_s - fe.service_s(row.prompt_tokens)  # behind others in the front end
        for lo, hi, span, kind in ((a, e0 + 1, t_first[row.id] - row.arrival_s - waited, False),
                                   (e0 + 1, e1 + 1, t_last[row.id] - t_first[row.id], True)):
            if hi > lo and span > 0:
                X.append(np.concatenate([cum[hi] - cum[lo], [0.0, 0.0] if kind else [1.0, row.prompt_tokens]]))
                y.append(span)
                held.append(out)
                decode.append(kind)
    return (np.array(X, dtype=np.float64).reshape(-1, len(TERMS)), np.array(y), np.array(held, dtype=bool),
            np.array(decode, dtype=bool))


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
    return np.array([float(np.median(gaps)) if len(gaps) else 0.01, 0.0, 0.0, 0.0, 0.0, 0.0])


def fit_from_run(run_dir: str, out_path: str | None = None, rounds: int = ROUNDS) -> dict:
    """Fit the clock to a live run; write it to ``out_path`` (when given); -> the calibration."""
    rec = read_live_run(run_dir)
    trace_path = (rec.config.get("trace") or {}).get("path")
    if not trace_path or not os.path.exists(trace_path):
        raise InputError(f"the run's trace {trace_path!r} is not here: the fit replays it", file=run_dir,
                         field="--from-run")
    if file_sha256(trace_path) != rec.config["trace"].get("sha256"):
        raise InputError(f"the run's trace {trace_path} has changed since the run", file=run_dir, field="--from-run")
    coef, history = initial(rec), []
    with tempfile.TemporaryDirectory(prefix="kvbench-fit-") as tmp:
        trace = os.path.join(tmp, "issued.jsonl")
        issued_trace(rec, trace_path, trace)
        clock = os.path.join(tmp, "clock.json")
        for k in range(rounds):
            clock_file(coef, clock)
            cfg = replay_config(rec, clock)
            X, y, held, decode = span_rows(rec, rebuild_steps(trace, cfg, os.path.join(tmp, f"replay-{k}")),
                                           (float(coef[4]), float(coef[5])))
            # decode spans, and the times to first token that waited for no queue in the replay: a
            # queued one's steps depend on the clock being fitted more than on the request
            use = decode | (X[:, 0] <= UNQUEUED_STEPS)
            train, test = use & ~held, use & held
            if not train.sum():
                raise InputError("no request's tokens could be matched to the replay's steps (none completed, "
                                 "or tokens.parquet is empty)", file=run_dir, field="--from-run")
            w = 1.0 / y  # relative error: a short span weighs as much as a long one
            new = nnls(X[train] * w[train, None], np.ones(int(train.sum())))
            history.append({"round": k, "train": error(X[train], y[train], new), "heldout": error(X[test], y[test], new)})
            coef = new if k == 0 else DAMPING * coef + (1 - DAMPING) * new  # the replay's steps follow the clock
        clock_file(coef, clock)
        check = _replay_check(rec, trace, replay_config(rec, clock), os.path.join(tmp, "check"))
    server = rec.config.get("server") or {}
    doc = {"kvbench_calibration": 3, "kvbench_version": __version__, "device_name": server.get("describe"),
           "model": rec.config["settings"].get("model"),
           "coefficients": {"matmul_flops": None, "attn_flops": None, "mem_bw": None, "kv_bw": None,
                            **{t: float(v) for t, v in zip(TERMS, coef)}},
           "fit": {"kind": "live-run", "run": os.path.abspath(run_dir), "made_at": now_iso(),
                   "model": "step = overhead + prefill tokens x a + decoding sequences x b + keys read x c; "
                            "front end = request + prompt tokens x d, one request at a time",
                   "held_out_share": HELD_OUT, "rounds": history, "train": history[-1]["train"],
                   "heldout": history[-1]["heldout"], "replay_check": check,
                   "server": server, "endpoint": rec.config.get("endpoint"),
                   "trace": rec.config.get("trace")}}
    if out_path is not None:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
    return doc


def _replay_check(rec: LiveRecord, trace: str, cfg: ReplayConfig, out_dir: str) -> dict:
    """The fitted sim against the run, request by request: TTFT and TPOT p50 of both, and each
    request's predicted/measured - 1, over the held-out requests (and all)."""
    from kvbench.engine.replay import replay

    replay(trace, cfg, out_dir, force=True)
    sim = pd.read_parquet(os.path.join(out_dir, "requests.parquet")).set_index("id")
    live = rec.requests.set_index("id")
    both = live.index.intersection(sim.index[sim["rejected"].isna()])
    out = {}
    for part, ids in (("heldout", [i for i in both if held_out(i)]), ("all", list(both))):
        row: dict[str, float | None] = {"requests": len(ids)}
        for name in ("ttft_ms", "tpot_ms"):
            a, b = sim.loc[ids, name].to_numpy(), live.loc[ids, name].to_numpy()
            ok = np.isfinite(a) & np.isfinite(b) & (b > 0)
            row[f"{name}_p50_live"] = float(np.median(b[ok])) if ok.any() else None
            row[f"{name}_p50_sim"] = float(np.median(a[ok])) if ok.any() else None
            row[f"{name}_median_abs_rel_err"] = float(np.median(np.abs(a[ok] / b[ok] - 1))) if ok.any() else None
        out[part] = row
    return out
