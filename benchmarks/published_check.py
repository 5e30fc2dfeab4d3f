"""The sim against every published GPU measurement (benchmarks/published/points.csv): each point's load
replayed as it was measured, predicted against published in that source's own metric, the error.

    python benchmarks/published_check.py                   # the table, on the sim's defaults
    python benchmarks/published_check.py --fit -o benchmarks/published/fitted.json
                                                           # fit the defaults, leave-one-source-out errors
    python benchmarks/published_check.py --points rocm --max-requests 200      # a subset, smaller loads

A point becomes a trace and a replay (``kvbench trace gen random ...`` then ``kvbench replay
--max-concurrency C --model M --gpu G --tp N --dtype D``): fixed lengths (``--range-ratio`` where the
source varies them), all requests at t = 0 under a closed loop of C (vllm bench serve
--max-concurrency), a batch at t = 0 (benchmark_latency; its latency is the whole batch's, the
replay's duration), an offline burst (throughput), or Poisson arrivals at the source's rate; vLLM's
own defaults for the token budget and sequence cap (16384 tokens and 1024 sequences for the LLM class,
8192 and 1024 for the server, on GPUs of 70 GiB or more; 8192/2048 and 256 on an A100).

Each point has a role. ``fit``: vLLM V1 with a load the sim can run; the defaults are fitted on these
(``--fit``) and judged leave-one-source-out: each source predicted by the parameters fitted on the
others. ``other engine``: SGLang, TensorRT-LLM, NIM, predicted with the same defaults (out of sample,
never fitted). ``flagged``: a point the sim cannot match, with the reason (ERAS: a pre-V1 engine,
multi-step scheduling, weights it cannot express, piecewise CUDA graphs, a box far below its GPU's
peak); predicted, never fitted. A point measured through a server pays the front end; an offline or
batch one (vLLM's LLM class) does not.

The fit is of eight numbers shared by every GPU: the share of the dense tensor-core peak the linear
layers reach, the share of the HBM bandwidth weights and KV are streamed at, three overheads (per step,
per scheduled sequence, per all-reduce) and the API server's front end (per request and per prompt
token, one request at a time, then a latency that holds no other request). Attention is not fitted: its
rate is FlashAttention's published curve (presets.ATTN_EFFICIENCY, ATTN_RAMP_TOKENS). The points excluded
before the fit are ERAS, each with its reason. It minimises the mean squared log error, each source
weighing the same, with weak priors on the streaming share (MEM_PRIOR: the corpus cannot tell it from the
per-step overhead) and on the GEMM share (COMPUTE_PRIOR: only the long prompts pin it). It re-times
recorded steps (a replay's schedule, its steps' FLOPs and bytes) rather than replaying for every trial,
then replays again with the result (the schedule of a closed loop or a batch does not depend on step
times; a Poisson load's does, a little; a burst through the server's, on the front end's pace, so
``--rounds`` re-records it). A closed loop or Poisson load is recorded without the front end and re-timed
with it added to each request; a burst is recorded with it (Retimer.front_end). --eager's per-layer
launch cost is estimated beside it, not fitted (eager_layer_s).

A script rather than a kvbench command: it judges the defaults kvbench ships against a corpus kept in
this repository, and its result is written into kvbench/executors/presets.py by hand, not into a
user's calibration file.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kvbench.engine.config import ReplayConfig
from kvbench.engine.records import weighted_percentile
from kvbench.engine.replay import Replay
from kvbench.executors import presets
from kvbench.executors.presets import get_gpu, get_model
from kvbench.executors.sim import CALIBRATION_VERSION
from kvbench.trace.format import write_trace
from kvbench.workloads import WORKLOADS, Common, generate

HERE = os.path.dirname(os.path.abspath(__file__))
POINTS_CSV = os.path.join(HERE, "published", "points.csv")

# Hugging Face model id -> kvbench preset of the same shape (3.1, 3.3: the 3 architecture; the coder
# fine-tune: Qwen3-30B-A3B's); the weights' dtype comes from the row's weight_dtype.
MODEL_PRESETS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "llama-3.1-8b", "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b", "amd/Llama-3.1-70B-Instruct-FP8-KV": "llama-3.1-70b",
    "meta-llama/Llama-3.3-70B-Instruct": "llama-3.1-70b", "nvidia/Llama-3.3-70B-Instruct-FP8": "llama-3.1-70b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b", "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8": "qwen3-30b-a3b",
    "nvidia/Qwen3-30B-A3B-FP4": "qwen3-30b-a3b",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b", "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3-14B": "qwen3-14b",
}

# published column -> (summary key, what it is); "batch_ms" is the replay's duration (one batch's latency)
METRICS = {
    "ttft_ms_mean": ("ttft_ms_mean", "TTFT"), "ttft_ms_median": ("ttft_ms_p50", "TTFT"),
    "tpot_ms_mean": ("tpot_ms_mean", "TPOT"), "tpot_ms_median": ("tpot_ms_p50", "TPOT"),
    "itl_ms_mean": ("itl_ms_mean", "ITL"), "itl_ms_median": ("itl_ms_p50", "ITL"),
    "e2e_ms_mean": ("e2e_ms_mean", "E2E"), "e2e_ms_median": ("e2e_ms_p50", "E2E"),
    "output_tok_per_s": ("output_tok_per_s", "throughput"), "total_tok_per_s": ("total_tok_per_s", "throughput"),
    "req_per_s": ("req_per_s", "throughput"),
}
KIND_OF = {key: kind for key, kind in METRICS.values()} | {"batch_ms": "latency"}
GOALS = {"TPOT": 0.20, "ITL": 0.20, "throughput": 0.20, "latency": 0.20, "TTFT": 0.30, "E2E": 0.30}
V1_SOURCES = ("vllm_blog_fp8_kvcache_2026", "rocm_vllm_devdocker_20250715", "vllm_pr_23151", "vllm_pr_20759",
              "gpustack_perflab_qwen3_8b_h100", "gpustack_perflab_qwen3_14b_h100", "kvcached_h100_layout_results")


@dataclass
class Load:
    """The published load as a random trace and the replay's closed loop (``concurrency``)."""

    requests: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0
    rate: float = 0.0  # requests per second (Poisson); 0: all at t = 0
    concurrency: int | None = None

    def describe(self) -> str:
        r = f"±{self.range_ratio:.0%} " if self.range_ratio else ""
        p = f"{self.prefix_len}+" if self.prefix_len else ""
        how = (f"C={self.concurrency}" if self.concurrency else f"{self.rate:g}/s" if self.rate
               else "all at t=0")
        return f"{self.requests}x {p}{self.input_len}/{self.output_len} {r}{how}"


@dataclass
class Point:
    id: str
    source: str
    engine: str
    gpu: str
    tp: int
    model: str
    dtype: str
    kv_dtype: str
    load: Load
    published: dict[str, float]  # summary key (or batch_ms) -> value
    role: str  # fit | other engine | flagged
    flag: str | None = None
    max_num_seqs: int = 1024
    max_batched_tokens: int = 8192
    prefix_cache: bool = True
    note: str = ""  # how the load was approximated
    unfitted: tuple[str, ...] = ()  # published metrics left out of the fit (the note says why); still judged
    front_end: bool = True  # through the API server (vllm bench serve); False: the offline LLM class

    @property
    def burst(self) -> bool:
        return _burst(self.load, self.front_end)

    def config(self, **kw) -> ReplayConfig:
        kw.setdefault("front_end", self.front_end)
        return ReplayConfig(executor="sim", model=self.model, gpu=self.gpu, tp=self.tp, dtype=self.dtype,
                            kv_dtype=self.kv_dtype, max_num_seqs=self.max_num_seqs,
                            max_batched_tokens=self.max_batched_tokens, prefix_cache=self.prefix_cache,
                            max_concurrency=self.load.concurrency, **kw)


def _burst(load: Load, front_end: bool) -> bool:
    """Every request sent through the server at t = 0, none held back (request rate inf, no
    --max-concurrency): its figures are the whole load's, and its schedule the front end's pace."""
    return front_end and load.concurrency is None and not load.rate


def _num(v: str) -> float | None:
    return float(v) if v not in ("", None) else None


# The points the sim is not meant to match, fixed before any fit: each is replayed and judged, never
# fitted. (why, rule): the first rule a row meets names its flag.
ERAS: tuple[tuple[str, Callable[[dict], bool]], ...] = (
    ("NVFP4 weights (the sim has bf16 and fp8)", lambda row: row["weight_dtype"] == "nvfp4"),
    ("pre-V1 vLLM with multi-step scheduling (its ITL is a chunk of tokens)",
     lambda row: "multi-step" in row["flags"].lower() or "num_scheduler_steps" in row["flags"].lower()),
    ("pre-V1 vLLM engine", lambda row: row["engine"] == "vllm" and row["v1_engine"] == "false"),
    ("2024 CI build of unknown version (the V0 engine, likely)", lambda row: row["source_id"] == "vllm_buildkite_perf_ci"),
    ("piecewise CUDA graphs (attention launched eagerly): neither the default nor --eager",
     lambda row: "cudagraph_mode piecewise" in row["flags"].lower()),
    ("block-quantized FP8 MoE (128x128 scales, Triton fused_moe): the sim's fp8 is per-tensor weights at the "
     "dense GEMM's efficiency", lambda row: row["model"] == "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8"),
    ("long-prompt bursts on a box whose H100 prefilled at about a quarter of its peak for every engine (SGLang "
     "0.5.5 on the same page and loads: 0.3 of peak); no other source's GPU runs so slow",
     lambda row: row["source_id"] == "gpustack_perflab_qwen3_14b_h100" and int(row["input_len"]) >= 1000),
)


def _flag(row: dict) -> str | None:
    """Why the sim cannot match a point (None: it can)."""
    return next((why for why, rule in ERAS if rule(row)), None)


def _engine_limits(row: dict, llm_class: bool) -> tuple[int, int]:
    """vLLM's default (max_num_seqs, max_batched_tokens) for the GPU and the entry point."""
    if row["gpu"].startswith("a100"):
        return 256, 8192 if llm_class else 2048
    return 1024, 16384 if llm_class else 8192


def point_of(row: dict, max_requests: int | None = None) -> Point:
    """A row of points.csv as a load the sim replays (see the module docstring)."""
    src, kind = row["source_id"], row["load_kind"]
    value = _num(row["load_value"]) if row["load_value"] not in ("inf", "") else None
    n = int(_num(row["num_prompts"]) or 0)
    ilen, olen = int(_num(row["input_len"]) or 0), int(_num(row["output_len"]) or 0)
    note = ""
    load = None
    if kind == "batch":
        load = Load(int(value), ilen, olen)
    elif kind == "offline":
        load = Load(n, ilen, olen)
    elif kind == "concurrency":
        c = int(value)
        if src == "vllm_pr_25444":  # 10 prompts at request rate inf, no --max-concurrency: one burst
            load = Load(n, ilen, olen)
        else:
            load = Load(n or max(6 * c, 30), ilen, olen, concurrency=c)
            if not n:
                note = f"request count not stated: {load.requests} (6 per user)"
    elif kind == "rate":  # Poisson at the rate; inf: every request sent at once (no --max-concurrency)
        load = Load(n, ilen, olen, rate=value or 0.0)
    if src == "vllm_blog_fp8_kvcache_2026":
        load = replace(load, input_len=20000, output_len=2000, range_ratio=0.15)
    elif src == "vllm_pr_20759":  # vllm bench serve's sonnet defaults: 550 in (200 of them a shared prefix), 150 out
        load = replace(load, input_len=350, output_len=150, prefix_len=200)
        note = "sonnet lengths not printed: its defaults (550 in, 200 shared; 150 out) as random tokens"
    elif row["dataset"].startswith("sharegpt") and not ilen:
        # ShareGPT: the offline row's own tok/s over req/s gives the mean output (194); the mean
        # input is an assumption; uniform spreads stand in for ShareGPT's long tails
        load = replace(load, input_len=230, output_len=194, range_ratio=0.9)
        note = "ShareGPT lengths approximated: uniform, mean 230 in (assumed) / 194 out (from the row's own figures)"
    llm_class = kind in ("batch", "offline")  # vLLM's LLM class: no API server in front
    if max_requests and load.requests > max_requests and kind != "batch" and not _burst(load, not llm_class):
        # whole loads: a batch's latency and a burst's figures are the whole load's
        whole = load.requests
        load = replace(load, requests=max(max_requests, 2 * (load.concurrency or 0)))
        note = (note + "; " if note else "") + f"{load.requests} of {whole} requests replayed"
    seqs, tokens = _engine_limits(row, llm_class)
    published = {}
    for col, (key, _) in METRICS.items():
        v = _num(row[col])
        if v is None:
            continue
        if col.startswith("e2e_ms") and kind == "batch":  # one batch's latency, its mean or median
            if "batch_ms" in published:
                continue
            key = "batch_ms"
        elif col == "itl_ms_mean" and row["engine"] == "nim":
            key = "tpot_ms_mean"  # AIPerf's ITL is vLLM's TPOT: (latency - TTFT) / (output - 1)
        published[key] = v
    if src == "nim_benchmarking_llm_perf" and "saturated" in row["flags"]:
        published.pop("ttft_ms_mean", None)  # queueing for a slot: depends on the unstated request count
        note = (note + "; " if note else "") + "TTFT left out: queueing behind a full pool"
    unfitted = ()
    if row["point_id"] == "gpustack-qwen3-14b-h100-random-128-burst":
        unfitted = ("ttft_ms_mean", "ttft_ms_p50", "tpot_ms_mean")
        note = ("TTFT and TPOT not fitted: the API process, saturated by 1,000 requests in 23 s, also streams "
                "every output token, first ones included; kvbench's front end delays requests on their way in only")
    if src == "vllm_pr_23151":  # the PR tunes exactly this kernel: its baseline's prefill is far off any roofline
        unfitted = ("ttft_ms_mean", "ttft_ms_p50")
        note = "TTFT not fitted: untuned fused_moe Triton configs (the PR's subject) slow the prefill"
    flag = _flag(row)
    role = "flagged" if flag else ("fit" if src in V1_SOURCES else "other engine")
    dtype = row["weight_dtype"] if row["weight_dtype"] in ("bf16", "fp8") else "bf16"
    kv = row["kv_dtype"] if row["kv_dtype"] in ("bf16", "fp8") else "auto"
    if kv == "auto" and row["engine"] in ("trt-llm", "nim") and dtype == "fp8":
        kv = "fp8"  # NVIDIA's FP8 checkpoints and profiles quantize the KV cache too (not stated per row)
        note = (note + "; " if note else "") + "FP8 KV assumed"
    if row["dataset"].startswith("sharegpt") and ilen:  # the source's own totals give the means
        load = replace(load, range_ratio=0.9)
        note = (note + "; " if note else "") + "ShareGPT lengths: the printed means, uniform ±90%"
    return Point(row["point_id"], src, row["engine"], row["gpu"], int(row["tp"]), MODEL_PRESETS[row["model"]],
                 dtype, kv, load, published, role, flag, seqs, tokens,
                 prefix_cache=src != "vllm_pr_20759", note=note, unfitted=unfitted, front_end=not llm_class)


def load_points(path: str = POINTS_CSV, max_requests: int | None = None) -> list[Point]:
    with open(path, newline="", encoding="utf-8") as fh:
        return [point_of(row, max_requests) for row in csv.DictReader(fh)]


# -- the sim's parameters ------------------------------------------------------------------------
PARAMS = ("compute_eff", "mem_eff", "step_s", "seq_s", "allreduce_s", "request_s", "token_s", "latency_s")


# Where --fit starts: the derating the presets held before any fit (0.7 of the tensor-core peak, 0.85
# of the memory bandwidth, 4 ms per step, 10 us per all-reduce), so a fit does not depend on the
# presets it is about to replace.
START = {"compute_eff": 0.70, "mem_eff": 0.85, "step_s": 4e-3, "seq_s": 1e-7, "allreduce_s": 10e-6,
         "request_s": 5e-3, "token_s": 1e-6, "latency_s": 5e-3}


def defaults() -> dict[str, float]:
    """The presets' fitted parameters (kvbench.executors.presets)."""
    p = presets
    return {"compute_eff": p.MATMUL_EFFICIENCY, "mem_eff": p.MEM_EFFICIENCY, "step_s": p.STEP_OVERHEAD_S,
            "seq_s": p.SEQ_OVERHEAD_S, "allreduce_s": p.ALLREDUCE_LATENCY_S, "request_s": p.REQUEST_S,
            "token_s": p.REQUEST_TOKEN_S, "latency_s": p.REQUEST_LATENCY_S}


def coefficients(theta: dict, gpu: str, dtype: str) -> dict[str, float]:
    """A calibration file's coefficients for one GPU and weight dtype under parameters ``theta``."""
    g = get_gpu(gpu)
    peak = g.peak_fp8_flops if dtype == "fp8" and g.peak_fp8_flops else g.peak_bf16_flops
    return {"matmul_flops": peak * theta["compute_eff"], "attn_flops": g.peak_bf16_flops * presets.ATTN_EFFICIENCY,
            "attn_ramp_tokens": presets.ATTN_RAMP_TOKENS,
            "mem_bw": g.peak_mem_bw * theta["mem_eff"], "kv_bw": g.peak_mem_bw * theta["mem_eff"],
            "step_overhead_s": theta["step_s"], "seq_overhead_s": theta["seq_s"],
            "allreduce_latency_s": theta["allreduce_s"],
            "layer_overhead_s": theta.get("layer_s") or presets.LAYER_OVERHEAD_S,
            "prefill_token_s": 0.0, "decode_seq_s": 0.0, "context_token_s": 0.0,
            "request_s": theta["request_s"], "request_token_s": theta["token_s"],
            "request_latency_s": theta["latency_s"]}


# -- replaying a point ---------------------------------------------------------------------------
class Recorder:
    """The sim executor, recording each step's work (for re-timing under other parameters)."""

    def __init__(self, inner):
        self.inner, self.works = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch):
        self.works.append(self.inner.work(batch))
        return self.inner.execute(batch)


@dataclass
class Recording:
    """One replay's schedule: per step its work and start; per request its arrival and token steps."""

    point: Point
    works: list
    start_s: float  # the first step's start (the first arrival)
    ends: np.ndarray  # [steps] engine seconds at each step's end
    gaps: np.ndarray  # [steps] the step starts no earlier: an idle wait, or an arrival it schedules
    arrival_step: np.ndarray  # [requests] step whose end issued it (-1: a fixed time)
    arrival_s: np.ndarray
    first_step: np.ndarray
    finish_step: np.ndarray
    output_tokens: np.ndarray
    prompt_tokens: np.ndarray
    scheduled_step: np.ndarray  # [requests] the step that first worked on it
    waited_s: np.ndarray  # [requests] from its arrival to that step's start
    summary: dict = field(default_factory=dict)


def write_trace_of(point: Point, path: str, seed: int = 0) -> None:
    ld = point.load
    params = WORKLOADS["random"].params(input_len=ld.input_len, output_len=ld.output_len,
                                        range_ratio=ld.range_ratio, prefix_len=ld.prefix_len, rate=ld.rate)
    write_trace(generate(WORKLOADS["random"], Common(requests=ld.requests, seed=seed), params), path)


def replay_point(point: Point, theta: dict | None = None, record: bool = False, workdir: str | None = None):
    """The point's summary on the sim (``theta``: these parameters in a calibration file; None: the
    presets), and, with ``record``, its Recording."""
    import pandas as pd

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="kvbench-published-")
    trace = os.path.join(workdir, f"{point.id}.jsonl")
    if not os.path.exists(trace):
        write_trace_of(point, trace)
    cal = None
    if theta is not None:
        cal = os.path.join(workdir, f"{point.id}-cal.json")
        with open(cal, "w", encoding="utf-8") as fh:
            json.dump({"kvbench_calibration": CALIBRATION_VERSION, "dtype": point.dtype,
                       "coefficients": coefficients(theta, point.gpu, point.dtype)}, fh)
    out = os.path.join(workdir, f"{point.id}-run")
    # A recording keeps the front end only where it decides when the engine sees a request (a burst: the
    # API server hands the requests over one by one); elsewhere the re-timing adds it (Retimer.front_end)
    front = point.front_end and (not record or point.burst)
    rp = Replay(trace, point.config(calibration=cal, front_end=front).validate(), out, force=True)
    rec = None
    if record:
        rec = Recorder(rp.replicas[0].executor)
        rp.replicas[0].executor = rec
        rp.step_log = []
    summary = rp.run()
    summary["batch_ms"] = summary["duration_s"] * 1e3
    if not record:
        if own:
            _rmtree(workdir)
        return summary, None
    steps = pd.read_parquet(os.path.join(out, "steps.parquet"), columns=["t_s", "dur_ms"])
    reqs = pd.read_parquet(os.path.join(out, "requests.parquet"))
    ends = (steps["t_s"] + steps["dur_ms"] / 1e3).to_numpy()
    starts = steps["t_s"].to_numpy()
    prev = np.concatenate([[starts[0]], ends[:-1]])
    gaps = np.where(starts > prev + 1e-9, starts, -np.inf)

    def step_of(t):
        k = np.searchsorted(ends, t - 1e-9)
        return np.minimum(k, len(ends) - 1)
    arr = reqs["arrival_s"].to_numpy()
    k = step_of(arr)
    anchored = (point.load.concurrency is not None) & (np.abs(ends[k] - arr) < 1e-9)
    first_scheduled = {}
    for i, (seqs, _) in enumerate(rp.step_log):
        for rid, *_ in seqs:
            first_scheduled.setdefault(rid, i)
    sched = np.array([first_scheduled[rid] for rid in reqs["id"]])
    for j, t, fixed in zip(sched, arr, ~anchored):  # no step starts before a request it schedules
        if fixed:
            gaps[j] = max(gaps[j], t)
    recording = Recording(point, rec.works, float(starts[0]), ends, gaps, np.where(anchored, k, -1), arr,
                          step_of(reqs["first_token_s"].to_numpy()), step_of(reqs["finish_s"].to_numpy()),
                          reqs["output_tokens"].to_numpy(), reqs["prompt_tokens"].to_numpy(), sched,
                          starts[sched] - arr, summary)
    if own:
        _rmtree(workdir)
    return summary, recording


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# -- re-timing a recording -----------------------------------------------------------------------
class Retimer:
    """A recording's step times as a vectorised function of the parameters (the sim's own roofline,
    summed per operation in numpy)."""

    def __init__(self, rec: Recording):
        self.rec = rec
        p = rec.point
        g = get_gpu(p.gpu)
        self.peak_mm = g.peak_fp8_flops if p.dtype == "fp8" and g.peak_fp8_flops else g.peak_bf16_flops
        self.peak_attn, self.peak_bw, self.link = g.peak_bf16_flops, g.peak_mem_bw, g.link_bw
        w = rec.works

        def arr(f):
            return np.array([f(x) for x in w], dtype=np.float64)
        self.lin = arr(lambda x: x.linear_flops), arr(lambda x: x.linear_bytes)
        self.head = arr(lambda x: x.lm_head_flops), arr(lambda x: x.lm_head_bytes)
        self.dec = arr(lambda x: x.decode_flops), arr(lambda x: x.decode_bytes)
        self.kvw = arr(lambda x: x.kv_write_bytes)
        chunks = [(i, f, b) for i, x in enumerate(w) for f, b in x.prefill]
        self.chunk_step = np.array([c[0] for c in chunks], dtype=np.int64)
        self.chunk = np.array([c[1] for c in chunks]), np.array([c[2] for c in chunks])
        self.allreduces = arr(lambda x: x.allreduces)
        tp = p.tp
        self.ring = arr(lambda x: 2 * (tp - 1) / tp * x.allreduce_bytes / self.link if tp > 1 else 0.0)
        self.seqs = arr(lambda x: x.seqs)
        self.decodes = arr(lambda x: x.decode_seqs)
        spans = [(f, b, s) for x in w for (f, b), s in zip(x.prefill, x.prefill_span)]
        self.chunk_span = np.array([c[2] for c in spans], dtype=np.float64)
        # the attention rate of each chunk (not fitted: presets.ATTN_EFFICIENCY on its ramp)
        self.chunk_rate = self.peak_attn * presets.ATTN_EFFICIENCY * -np.expm1(-self.chunk_span / presets.ATTN_RAMP_TOKENS)
        order = np.argsort(rec.arrival_s, kind="stable")  # the API server takes requests in issue order
        self.issue_order = order

    def front_end(self, t: dict) -> np.ndarray:
        """Seconds from each request's issue to the engine: the API server's queue and its own time,
        request_s + token_s x prompt, one request at a time in issue order (0 without a front end)."""
        r = self.rec
        if not r.point.front_end:
            return np.zeros(len(r.arrival_s))
        o = self.issue_order
        service = t["request_s"] + t["token_s"] * r.prompt_tokens[o]
        done = np.cumsum(service)  # a_i = S_i + max_{j <= i} (t_j - S_{j-1}), the queue's recursion
        leave = done + np.maximum.accumulate(r.arrival_s[o] - (done - service))
        out = np.empty(len(o))
        out[o] = leave - r.arrival_s[o] + t["latency_s"]
        return out

    def durations(self, t: dict) -> np.ndarray:
        mm, at, bw = self.peak_mm * t["compute_eff"], self.peak_attn * presets.ATTN_EFFICIENCY, self.peak_bw * t["mem_eff"]
        d = np.maximum(self.lin[0] / mm, self.lin[1] / bw) + np.maximum(self.head[0] / mm, self.head[1] / bw)
        d += np.maximum(self.dec[0] / at, self.dec[1] / bw) + self.kvw / bw
        if len(self.chunk_step):
            d += np.bincount(self.chunk_step, np.maximum(self.chunk[0] / self.chunk_rate, self.chunk[1] / bw), len(d))
        d += self.allreduces * (t["allreduce_s"] + self.ring) + t["step_s"] + self.seqs * t["seq_s"]
        return d

    def summary(self, t: dict) -> dict:
        r = self.rec
        d = self.durations(t)
        fe = self.front_end(t)
        if r.point.load.rate:
            return self._open(d, fe)
        gaps, start = r.gaps, r.start_s
        if r.point.burst and r.point.front_end:  # each request reaches the engine as the API server lets it go
            gaps = np.full(len(d), -np.inf)
            np.maximum.at(gaps, r.scheduled_step, r.arrival_s + fe)
            start = float(np.min(r.arrival_s + fe))
        # end_k = max(end_{k-1}, gap_k) + d_k, in closed form: c_k + max(start, max_{j<=k} gap_j - c_{j-1})
        c = np.cumsum(d)
        floor = np.maximum.accumulate(gaps - np.concatenate([[0.0], c[:-1]]))
        ends = c + np.maximum(start, floor)
        arrival = np.where(r.arrival_step >= 0, ends[np.maximum(r.arrival_step, 0)], r.arrival_s)
        first, finish = ends[r.first_step], ends[r.finish_step]
        if not r.point.burst:  # recorded without it: the API server's time before the engine, added
            first, finish = first + fe, finish + fe
        out = r.output_tokens
        ttft = (first - arrival) * 1e3
        multi = out > 1
        tpot = (finish - first)[multi] / (out[multi] - 1) * 1e3
        e2e = (finish - arrival) * 1e3
        duration = ends[-1] - r.start_s
        if not r.point.burst and r.point.load.concurrency:  # each user waits on the front end once a request
            duration += fe.sum() / r.point.load.concurrency
        elif r.point.burst:  # from the first issue, as the replay counts it
            duration = ends[-1] - float(np.min(r.arrival_s))
        s = {"ttft_ms_mean": ttft.mean(), "ttft_ms_p50": np.percentile(ttft, 50),
             "tpot_ms_mean": tpot.mean() if len(tpot) else None,
             "tpot_ms_p50": np.percentile(tpot, 50) if len(tpot) else None,
             "e2e_ms_mean": e2e.mean(), "e2e_ms_p50": np.percentile(e2e, 50),
             "batch_ms": duration * 1e3, "output_tok_per_s": out.sum() / duration,
             "total_tok_per_s": (out.sum() + r.prompt_tokens.sum()) / duration, "req_per_s": len(out) / duration}
        return s | self._itl(d)

    def _itl(self, d: np.ndarray) -> dict:
        w = self.decodes.astype(np.int64)
        if not w.sum():
            return {}
        return {"itl_ms_mean": float((d * w).sum() / w.sum() * 1e3), "itl_ms_p50": weighted_percentile(d * 1e3, w, 50)}

    def _open(self, d: np.ndarray, fe: np.ndarray) -> dict:
        """Arrivals at fixed times (a Poisson load): a slower step cannot hold a later arrival back
        as a fixed schedule would, so each request is timed by its own steps, from the one it first
        joined (its wait for that step scaled with the step before it). Sound while the engine keeps
        up with the load; the fit replays again under its result."""
        r = self.rec
        c = np.concatenate([[0.0], np.cumsum(d)])  # c[k]: the start of step k, from the first step's start
        ref = np.diff(np.concatenate([[r.start_s], r.ends]))
        before = np.maximum(r.scheduled_step - 1, 0)
        scale = np.where(r.scheduled_step > 0, d[before] / ref[before], 1.0)
        wait = np.maximum(r.waited_s, 0.0) * scale + fe  # recorded without the front end: added
        first, finish, out = r.first_step + 1, r.finish_step + 1, r.output_tokens
        ttft = (wait + c[first] - c[r.scheduled_step]) * 1e3
        e2e = (wait + c[finish] - c[r.scheduled_step]) * 1e3
        multi = out > 1
        tpot = (c[finish] - c[first])[multi] / (out[multi] - 1) * 1e3
        return {"ttft_ms_mean": ttft.mean(), "ttft_ms_p50": np.percentile(ttft, 50),
                "tpot_ms_mean": tpot.mean() if len(tpot) else None,
                "tpot_ms_p50": np.percentile(tpot, 50) if len(tpot) else None,
                "e2e_ms_mean": e2e.mean(), "e2e_ms_p50": np.percentile(e2e, 50)} | self._itl(d)


# -- errors and the fit --------------------------------------------------------------------------
def errors(point: Point, predicted: dict) -> dict[str, float]:
    """predicted / published - 1 per published metric."""
    return {k: predicted[k] / v - 1 for k, v in point.published.items() if predicted.get(k) is not None}


def loss(retimers: list[Retimer], theta: dict) -> float:
    """Mean squared log error, each source weighing the same (its points' mean), each point the mean
    of its metrics."""
    by_source: dict[str, list[float]] = {}
    for rt in retimers:
        pred = rt.summary(theta)
        p = rt.rec.point
        e = [math.log(pred[k] / v) ** 2 for k, v in p.published.items() if pred.get(k) and k not in p.unfitted]
        if e:
            by_source.setdefault(rt.rec.point.source, []).append(sum(e) / len(e))
    return float(np.mean([np.mean(v) for v in by_source.values()]))


BOUNDS = {"compute_eff": (0.2, 1.0), "mem_eff": (0.3, 1.0), "step_s": (1e-5, 2e-2), "seq_s": (1e-7, 1e-3),
          "allreduce_s": (1e-6, 2e-4), "request_s": (1e-4, 0.2), "token_s": (1e-9, 1e-4),
          "latency_s": (1e-4, 0.2)}


def _to_theta(x: np.ndarray) -> dict:
    """Parameters from log coordinates, held inside BOUNDS."""
    return {name: min(max(math.exp(v), BOUNDS[name][0]), BOUNDS[name][1]) for name, v in zip(PARAMS, x)}


def _from_theta(theta: dict) -> np.ndarray:
    return np.log([min(max(theta[name], BOUNDS[name][0]), BOUNDS[name][1]) for name in PARAMS])


# Every fit point mixes weight streaming with the per-step overhead (a slower read and a smaller
# overhead predict the same steps), so the corpus leaves their split free: a weak prior holds the
# streaming efficiency near what a plain HBM read reaches. Weak: 10% off it costs what a 2% miss on
# every point of a source does.
MEM_PRIOR, PRIOR_WEIGHT = 0.85, 0.05
# Likewise the GEMM share: only the long prompts (one source) pin it, and a fold without them walks it
# to the bound; the same weak prior holds it near the derating the presets had before any fit.
COMPUTE_PRIOR = START["compute_eff"]


def _objective(retimers, x: np.ndarray) -> float:
    """The loss and the prior, plus a wall outside the bounds (so the simplex walks back in)."""
    lo, hi = (np.log([BOUNDS[n][i] for n in PARAMS]) for i in (0, 1))
    out = float(np.sum(np.maximum(lo - x, 0) + np.maximum(x - hi, 0)))
    theta = _to_theta(x)
    return (loss(retimers, theta) + PRIOR_WEIGHT * math.log(theta["mem_eff"] / MEM_PRIOR) ** 2
            + PRIOR_WEIGHT * math.log(theta["compute_eff"] / COMPUTE_PRIOR) ** 2 + out)


def nelder_mead(f, x0: np.ndarray, step: float = 0.5, iters: int = 600, tol: float = 1e-10) -> np.ndarray:
    """Minimise ``f`` from ``x0`` (the textbook simplex: reflect, expand, contract, shrink)."""
    pts = [x0] + [x0 + step * e for e in np.eye(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centre = np.mean(pts[:-1], axis=0)
        xr = centre + (centre - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centre + 2 * (centre - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centre + 0.5 * (pts[-1] - centre)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[int(np.argmin(vals))]


def fit(retimers: list[Retimer], start: dict) -> dict:
    """The parameters minimising ``loss`` on these recordings (restarts from the best found)."""
    x = _from_theta(start)
    for _ in range(4):
        x = nelder_mead(lambda v: _objective(retimers, v), x)
    return _to_theta(x)


def fit_points(points: list[Point], start: dict, rounds: int = 2, workdir: str | None = None,
               say=print) -> dict:
    """Fit on ``points``, re-recording their schedules under each round's result."""
    theta = dict(start)
    for r in range(rounds):
        retimers = [Retimer(replay_point(p, theta, record=True, workdir=workdir)[1]) for p in points]
        theta = fit(retimers, theta)
        say(f"  round {r + 1}: " + ", ".join(f"{k} {v:.4g}" for k, v in theta.items())
            + f"  (loss {loss(retimers, theta):.4f})")
    return theta


# -- the table -----------------------------------------------------------------------------------
def table(points: list[Point], predicted: dict[str, dict], heldout: dict[str, dict] | None = None) -> list[str]:
    """One line per (point, metric): published, predicted, error; held-out prediction where given."""
    lines = [f"{'point':44s} {'role':12s} {'metric':16s} {'published':>10s} {'predicted':>10s} {'error':>7s}"
             + ("  held-out" if heldout else "") + "  load / flag"]
    for p in points:
        for key, pub in p.published.items():
            pred = predicted[p.id].get(key)
            err = "" if pred is None else f"{pred / pub - 1:+7.1%}"
            ho = ""
            if heldout:
                h = heldout.get(p.id, {}).get(key)
                ho = f"  {h / pub - 1:+7.1%} " if h is not None else "          "
            why = p.flag or p.note or ""
            lines.append(f"{p.id[:44]:44s} {p.role:12s} {key:16s} {pub:10.4g} "
                         f"{(pred if pred is not None else float('nan')):10.4g} {err:>7s}{ho}  "
                         f"{p.load.describe()}{'; ' + why if why else ''}")
    return lines


def digest(points: list[Point], predicted: dict[str, dict]) -> dict:
    """Median and worst |error| by role, by metric kind, by source and by GPU."""
    rows = []
    for p in points:
        for key, e in errors(p, predicted[p.id]).items():
            rows.append((p, key, KIND_OF[key], e))

    def stats(sel):
        a = np.abs([e for *_, e in sel])
        return {"points": len({p.id for p, *_ in sel}), "metrics": len(a),
                "median": float(np.median(a)) if len(a) else None, "worst": float(a.max()) if len(a) else None}
    out: dict = {}
    for role in ("fit", "other engine", "flagged"):
        sel = [r for r in rows if r[0].role == role]
        out[role] = {"all": stats(sel)}
        for kind in sorted({r[2] for r in sel}):
            out[role][kind] = stats([r for r in sel if r[2] == kind])
    out["by_source"] = {s: stats([r for r in rows if r[0].source == s]) for s in sorted({p.source for p in points})}
    out["by_gpu"] = {g: stats([r for r in rows if r[0].gpu == g and r[0].role == "fit"])
                     for g in sorted({p.gpu for p in points if p.role == "fit"})}
    out["misses"] = [{"point": p.id, "metric": key, "error": e, "goal": GOALS[kind]}
                     for p, key, kind, e in rows if p.role == "fit" and abs(e) > GOALS[kind]]
    return out


def print_digest(d: dict, title: str) -> None:
    print(f"\n{title}: median / worst |error| (metrics)")
    for role in ("fit", "other engine", "flagged"):
        for kind, s in d[role].items():
            if s["metrics"]:
                print(f"  {role:12s} {kind:10s} {s['median']:6.1%} / {s['worst']:6.1%}  ({s['metrics']})")
    print("  by source (every role):")
    for src, s in d["by_source"].items():
        if s["metrics"]:
            print(f"    {src:34s} {s['median']:6.1%} / {s['worst']:6.1%}  ({s['metrics']})")
    print("  by GPU (fit points):")
    for g, s in d["by_gpu"].items():
        if s["metrics"]:
            print(f"    {g:8s} {s['median']:6.1%} / {s['worst']:6.1%}  ({s['metrics']})")


def eager_layer_s(points: list[Point], theta: dict, workdir: str | None = None) -> float | None:
    """Per-layer cost of launching a layer's kernels without a CUDA graph, from the one source that ran
    the same burst under piecewise graphs (attention launched eagerly) and under full graphs: the time
    the piecewise runs lost, per step and layer. A lower bound for a wholly eager layer."""
    by_id = {p.id: p for p in points}
    pairs = [("default", "full"), ("async", "full-async")]
    stem = "vllmpr25444-qwen3coder30ba3b-fp8-h100-c10-"
    got = []
    for pw, full in pairs:
        a, b = by_id.get(stem + pw), by_id.get(stem + full)
        if a is None or b is None:
            continue
        steps = replay_point(b, theta, workdir=workdir)[0]["steps"]
        lost = b.load.requests / a.published["req_per_s"] - b.load.requests / b.published["req_per_s"]
        got.append(lost / steps / get_model(b.model).num_layers)
    return float(np.mean(got)) if got else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true", help="fit the defaults on the fit points, leave-one-source-out")
    ap.add_argument("-o", "--out", help="write the fit and the table as JSON (default: print only)")
    ap.add_argument("--points", default="", help="only points whose id contains this")
    ap.add_argument("--max-requests", type=int, default=None, help="replay at most this many requests per point")
    ap.add_argument("--rounds", type=int, default=3, help="--fit: re-record the schedules this many times")
    a = ap.parse_args(argv)
    logging.getLogger("kvbench").setLevel(logging.ERROR)  # the per-point calibration files' dtype notes
    points = [p for p in load_points(max_requests=a.max_requests) if a.points in p.id]
    work = tempfile.mkdtemp(prefix="kvbench-published-")
    theta, heldout, folds = (dict(START) if a.fit else defaults()), None, {}
    try:
        if a.fit:
            fitting = [p for p in points if p.role == "fit"]
            print("excluded before the fit (predicted, never fitted):", file=sys.stderr)
            for why, _ in ERAS:
                n = sum(p.flag == why for p in points)
                print(f"  {n:2d} points: {why}", file=sys.stderr)
            print(f"fitting {', '.join(PARAMS)} on {len(fitting)} points of {len(V1_SOURCES)} sources", file=sys.stderr)
            theta = fit_points(fitting, theta, a.rounds, work, say=lambda m: print(m, file=sys.stderr))
            theta["layer_s"] = eager_layer_s(points, theta, work)
            print(f"  eager: {theta['layer_s']}", file=sys.stderr)
            heldout = {}
            for src in V1_SOURCES:
                train = [p for p in fitting if p.source != src]
                print(f"leaving out {src}", file=sys.stderr)
                folds[src] = fit_points(train, theta, 1, work, say=lambda m: print(m, file=sys.stderr))
                for p in fitting:
                    if p.source == src:
                        heldout[p.id] = replay_point(p, folds[src], workdir=work)[0]
        predicted = {p.id: replay_point(p, theta if a.fit else None, workdir=work)[0] for p in points}
    finally:
        _rmtree(work)
    print("\n".join(table(points, predicted, heldout)))
    d = digest(points, predicted)
    print_digest(d, "fitted defaults" if a.fit else "sim defaults")
    result = {"parameters": theta, "defaults": d, "excluded": {why: [p.id for p in points if p.flag == why]
                                                               for why, _ in ERAS}}
    if heldout is not None:
        ho_pred = {p.id: heldout.get(p.id, {}) for p in points}
        h = digest([p for p in points if p.id in heldout], ho_pred)
        print_digest(h, "held out (each source predicted by the fit on the others)")
        result.update(heldout=h, folds=folds)
    if a.out:
        result["points"] = [{"point": p.id, "source": p.source, "role": p.role, "flag": p.flag, "note": p.note,
                             "load": p.load.describe(), "gpu": p.gpu, "tp": p.tp, "model": p.model, "dtype": p.dtype,
                             "published": p.published,
                             "predicted": {k: predicted[p.id].get(k) for k in p.published},
                             **({"heldout": {k: heldout[p.id].get(k) for k in p.published}}
                                if heldout and p.id in heldout else {})}
                            for p in points]
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
