"""The sim's defaults against the published GPU measurements (benchmarks/published/): every point has a
load the sim replays and a role; the vLLM V1 points the defaults were fitted to stay within the stated
error, so a change to the cost model that breaks agreement with measured engines fails here; the
presets hold the parameters the fit found; the fit's re-timing of recorded steps is the replay's."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbench.executors import presets
from kvbench.executors.presets import GPUS, MODELS
from kvbench.executors.sim import StepCost, make_sim
from kvbench.scheduler.batch import StepBatch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("published_check", ROOT / "benchmarks" / "published_check.py")
pc = sys.modules["published_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)
FITTED = json.loads((ROOT / "benchmarks" / "published" / "fitted.json").read_text())

# Loads cut to this many requests (a closed loop keeps at least two per user): the errors below were
# measured at this size; the full loads' are in fitted.json.
MAX_REQUESTS = 40
# Fit points whose error the goals (20% TPOT, ITL, throughput and one batch's latency; 30% TTFT) do not
# hold, each with the bound it keeps and the reason (the table in fitted.json says the same).
MISSES = {
    # untuned fused_moe Triton configs (the PR's subject) slow this MoE's prefill far below any roofline
    ("vllmpr23151-qwen3-30b-a3b-h100-c10", "ttft_ms_mean"): 0.70,
    ("vllmpr23151-qwen3-30b-a3b-h100-c10", "ttft_ms_p50"): 0.75,
    # the API server's time at low load differs by version and endpoint more than one front end can
    # follow: vLLM ~0.9.2 on completions left ~16 ms of a 45 ms TTFT to it, vLLM 0.11 on chat ~50 ms of
    # 60; the fitted 34 ms is over the first (+31-42%) and under the second (-21-35%)
    **{(f"vllmpr20759-llama70b-b200-tp4-sonnet-qps{q}", k): 0.45 for q in (1, 5, 10)
       for k in ("ttft_ms_mean", "ttft_ms_p50")},
    **{(f"gpustack-qwen3-8b-h100-sharegpt-c{c}", k): 0.40 for c in (1, 2, 4, 8) for k in ("ttft_ms_mean", "ttft_ms_p50")},
    # 1,000 requests through vLLM 0.11's API process in 23 s: it also streams every output token, first
    # ones included, which queue behind the requests coming in (not fitted; kvbench's front end holds
    # requests on their way in only)
    ("gpustack-qwen3-14b-h100-random-128-burst", "ttft_ms_mean"): 0.45,
    ("gpustack-qwen3-14b-h100-random-128-burst", "ttft_ms_p50"): 0.45,
}
# Misses no bound describes: the metric is not modelled. Each is checked to stay the miss it is documented
# as (the error below this), so modelling it fails here until README and fitted.json say so.
UNMODELLED = {
    # the output stream through a saturated API process: 525 ms measured, ~12 predicted
    ("gpustack-qwen3-14b-h100-random-128-burst", "tpot_ms_mean"): -0.9,
}


@pytest.fixture(scope="module")
def points():
    return pc.load_points(max_requests=MAX_REQUESTS)


@pytest.fixture(scope="module")
def predicted(points, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("published"))
    return {p.id: pc.replay_point(p, workdir=work)[0] for p in points if p.role == "fit"}


def test_every_point_has_a_load_and_a_role(points):
    assert len(points) == 77
    roles = {p.role for p in points}
    assert roles == {"fit", "other engine", "flagged"}
    for p in points:
        assert p.published and p.load.requests >= 1 and p.model in MODELS and p.gpu in GPUS
        assert (p.flag is not None) == (p.role == "flagged")
        if p.role == "fit":
            assert p.source in pc.V1_SOURCES and p.engine == "vllm"
        if p.role == "other engine":
            assert p.engine in ("sglang", "trt-llm", "nim")
    by_id = {p.id: p for p in points}
    assert "pre-V1" in by_id["sglreadme-vllm-8b-a100-rps4"].flag  # vLLM 0.6, multi-step
    assert "NVFP4" in by_id["trtllm-qwen3moe-b200-1000-1000"].flag
    assert "piecewise" in by_id["vllmpr25444-qwen3coder30ba3b-fp8-h100-c10-default"].flag
    blog = by_id["vllmblog-fp8kv-8b-h100-c8-fp8kv"]
    assert (blog.load.input_len, blog.load.output_len, blog.load.range_ratio, blog.load.concurrency) == \
        (20000, 2000, 0.15, 8)
    assert blog.kv_dtype == "fp8" and blog.published == {"ttft_ms_p50": 742.8, "itl_ms_p50": 12.93,
                                                         "output_tok_per_s": 517.5}
    rocm = by_id["rocm-70bfp8-mi300x-tp8-2048-2048-bs64"]
    assert (rocm.gpu, rocm.tp, rocm.dtype, rocm.load.requests) == ("mi300x", 8, "fp8", 64)
    assert rocm.published == {"batch_ms": 35324.0}  # benchmark_latency: the whole batch's latency


def test_fit_points_stay_within_the_stated_error(points, predicted):
    """Each fitted vLLM V1 point within its goal (or its documented miss), and the median within the
    stated in-sample median (fitted.json) plus two points."""
    errs, out = [], []
    for p in points:
        if p.role != "fit":
            continue
        for key, e in pc.errors(p, predicted[p.id]).items():
            errs.append(abs(e))
            if (p.id, key) in UNMODELLED:
                if e > UNMODELLED[p.id, key]:
                    out.append(f"{p.id} {key}: {e:+.1%}, no longer the documented miss")
                continue
            bound = MISSES.get((p.id, key), pc.GOALS[pc.KIND_OF[key]])
            if abs(e) > bound:
                out.append(f"{p.id} {key}: {e:+.1%} (bound {bound:.0%})")
    assert not out, "\n".join(out)
    assert np.median(errs) <= FITTED["defaults"]["fit"]["all"]["median"] + 0.02


def test_presets_hold_the_fitted_parameters():
    """presets.py's constants are the fit's (rounded): change one and refit (published_check.py --fit)."""
    got = pc.defaults()
    for name, value in FITTED["parameters"].items():
        mine = got.get(name, presets.LAYER_OVERHEAD_S if name == "layer_s" else None)
        assert mine == pytest.approx(value, rel=0.02), name
    assert presets.KV_EFFICIENCY == presets.MEM_EFFICIENCY
    # every fitted parameter has its preset, and nothing else was fitted: attention is FlashAttention's
    # published curve (test_sim holds it to the kernel's figures)
    assert set(got) == set(pc.PARAMS) and set(FITTED["parameters"]) == set(pc.PARAMS) | {"layer_s"}


def test_held_out_errors_are_recorded():
    """fitted.json keeps each source's leave-one-source-out prediction beside the fitted one."""
    h = FITTED["heldout"]["fit"]
    assert h["all"]["metrics"] == FITTED["defaults"]["fit"]["all"]["metrics"]
    assert set(FITTED["folds"]) == set(pc.V1_SOURCES)
    assert all("heldout" in row for row in FITTED["points"] if row["role"] == "fit")


def test_retiming_a_recording_is_the_replay(points):
    """The fit's fast path (a recorded schedule re-timed under other parameters) gives the replay's own
    figures, exactly, at the parameters it was recorded with: for a closed loop and for a batch, and for a
    burst through the API server (its requests reach the engine one front end's time apart)."""
    by_id = {p.id: p for p in points}
    theta = pc.defaults()
    no_front = theta | {"request_s": 0.0, "token_s": 0.0, "latency_s": 0.0}  # a closed loop's is added after
    for pid, t in (("vllmpr23151-qwen3-30b-a3b-h100-c10", no_front), ("rocm-70bfp8-mi300x-tp8-128-2048-bs8", theta),
                   ("gpustack-qwen3-14b-h100-random-128-burst", theta)):
        summary, rec = pc.replay_point(by_id[pid], t, record=True)
        if not by_id[pid].burst:
            summary = pc.replay_point(by_id[pid], t)[0]
        again = pc.Retimer(rec).summary(t)
        for key in ("ttft_ms_mean", "tpot_ms_p50", "itl_ms_p50", "output_tok_per_s", "batch_ms"):
            if key in summary and key in again:
                assert again[key] == pytest.approx(summary[key], rel=1e-9), (pid, key)
    assert pc.replay_point(by_id["gpustack-qwen3-14b-h100-random-128-burst"], theta)[0]["duration_s"] >= \
        40 * presets.REQUEST_S  # the burst's 40 requests leave the API process one at a time


def test_a_batch_point_is_its_steps_added_up():
    """benchmark_latency's batch of 1 on the MI300X (Llama-3.1-70B fp8 over 8 GPUs, 128 in, 2,048 out),
    worked out step by step from the cost model: one prefill step, then 2,047 decodes over 129 to 2,175
    keys; the replay's duration is that sum."""
    ex = make_sim(MODELS["llama-3.1-70b"], GPUS["mi300x"], tp=8, dtype="fp8")
    cost = StepCost(MODELS["llama-3.1-70b"], 8, "fp8", "bf16")
    c = ex.cost

    def step(chunks, contexts):
        b = StepBatch(block_size=16)
        for i, n in enumerate(chunks):
            b.prefill_seq_ids.append(i)
            b.prefill_starts.append(0)
            b.prefill_lens.append(n)
            b.prefill_last.append(True)
        for j, ctx in enumerate(contexts):
            b.decode_seq_ids.append(10 + j)
            b.decode_positions.append(ctx - 1)
        return cost.work(b).time(c)
    total = step([128], []) + sum(step([], [ctx]) for ctx in range(129, 129 + 2047))
    point = next(p for p in pc.load_points() if p.id == "rocm-70bfp8-mi300x-tp8-128-2048-bs1")
    assert pc.replay_point(point)[0]["batch_ms"] == pytest.approx(total * 1e3, rel=1e-9)
    assert total == pytest.approx(17.236, rel=0.15)  # published: 17.236 s
