"""``kvbench calibrate``: the grid covers prefill after a cached prefix, decode over a range of contexts
and mixed steps; the fit recovers known coefficients; the file records what it was measured on; and
on the CPU the calibrated sim replays traces/chat_cpu.jsonl with the model executor's latencies."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import replay
from kvbench.executors.calibrate import (
    Point,
    calibrate,
    errors,
    fit,
    grid,
    make_batch,
    write,
)
from kvbench.executors.presets import GPUS, MODELS
from kvbench.executors.sim import CostModel, StepCost, make_sim
from kvbench.scheduler.batch import StepResult

ROOT = Path(__file__).resolve().parents[1]


def whole_steps(gpu: str) -> CostModel:
    """A preset's coefficients as ``kvbench calibrate`` fits them: a step's fixed cost all in
    step_overhead_s (the grid times whole steps), no per-sequence, per-layer or linear terms."""
    c = CostModel.from_gpu(GPUS[gpu])
    for name in CostModel.OVERHEADS + CostModel.LINEAR:
        setattr(c, name, 0.0)
    c.attn_ramp_tokens = 0.0  # one attention rate, flat over the span
    return c


def synthetic(model: str, quick: bool, truth: CostModel) -> list[Point]:
    """The grid's steps timed exactly by ``truth``."""
    spec, rng = MODELS[model], np.random.default_rng(0)
    cost = StepCost(spec)
    out = []
    for s in grid(quick):
        w = cost.work(make_batch(s, 16, spec.vocab_size, rng)[0])
        out.append(Point(s.kind, s.prefix, s.chunk, s.batch, s.context, w, w.time(truth), s.heldout))
    return out


def test_grid_covers_cached_prefixes_context_ranges_and_mixed_steps():
    for quick in (True, False):
        g = grid(quick)
        pre = [s for s in g if s.kind == "prefill"]
        dec = [s for s in g if s.kind == "decode"]
        mix = [s for s in g if s.kind == "mixed"]
        assert any(s.prefix > 0 for s in pre) and any(s.prefix == 0 for s in pre)
        assert max(s.context for s in dec) >= 8 * min(s.context for s in dec)
        assert len({s.batch for s in dec}) >= (1 if quick else 4)  # quick: a CPU decodes one at a time
        assert mix and all(s.chunk > 0 and s.batch > 0 for s in mix)
        for kind in ("prefill", "decode", "mixed"):  # each kind has fitted and held-out steps
            assert {s.heldout for s in g if s.kind == kind} == {True, False}
        # every size is fitted somewhere: holding out a whole row would leave it to extrapolation
        for key in ("prefix", "chunk"):
            assert {getattr(s, key) for s in pre if not s.heldout} == {getattr(s, key) for s in pre}
        fitted = {s.context for s in dec if not s.heldout}
        if quick:  # one batch size: the held-out contexts lie inside the fitted range
            assert all(min(fitted) < s.context < max(fitted) for s in dec if s.heldout)
        else:
            for key in ("batch", "context"):
                assert {getattr(s, key) for s in dec if not s.heldout} == {getattr(s, key) for s in dec}
        if quick:  # one sampled row per step at most (see grid)
            assert all(s.batch + (s.chunk > 0 and s.samples) <= 1 for s in g)


def test_fit_recovers_the_coefficients_that_timed_the_steps():
    """Steps of Llama-3-8B timed by known coefficients (H100-like, with slower attention and KV reads):
    the fit finds them again, and predicts the held-out steps to 0.1%."""
    truth = whole_steps("h100")
    truth.attn_flops, truth.kv_bw, truth.step_overhead_s = 400e12, 2.2e12, 1.5e-3
    points = synthetic("llama-3-8b", False, truth)
    got = fit([p for p in points if not p.heldout])
    for name in CostModel.FITTED:
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    for kind, row in errors(got, points).items():
        assert row["heldout"] < 1e-3 and row["train"] < 1e-6, kind
    # the quick grid, whose small steps leave the linear layers memory bound: still an exact fit
    truth.matmul_flops, truth.kv_bw, truth.step_overhead_s = 500e12, 2.5e12, 2e-3
    points = synthetic("llama-3-8b", True, truth)
    assert errors(fit([p for p in points if not p.heldout]), points)["all"]["train"] < 1e-6


class FakeExecutor:
    """Times each step with known coefficients, as a GPU would with its own."""

    name, needs_tokens = "fake", True
    device_name, dtype = "NVIDIA H100 80GB HBM3", "torch.bfloat16"

    def __init__(self, spec, truth: CostModel):
        self.cost, self.truth, self.steps = StepCost(spec), truth, []

    def bind_pool(self, num_blocks, block_size):
        self.num_blocks = num_blocks

    def execute(self, batch):
        self.steps.append(batch)
        assert all(max(t) < self.num_blocks for t in batch.block_tables.values())
        return StepResult(duration_s=self.cost.work(batch).time(self.truth))


def test_calibration_file_records_what_it_measured_and_the_sim_replays_with_it(tmp_path, caplog):
    from kvbench import __version__

    spec = MODELS["llama-3-8b"]
    truth = whole_steps("h100")
    truth.matmul_flops, truth.kv_bw, truth.step_overhead_s = 500e12, 2.5e12, 2e-3
    ex = FakeExecutor(spec, truth)
    result = calibrate(ex, spec, quick=True, repeats=1)
    assert result["device_name"] == ex.device_name and result["dtype"] == "bf16"
    assert result["model_spec"] == spec.to_dict() and result["kvbench_version"] == __version__
    per_kind = result["fit"]["per_kind"]
    assert set(per_kind) == {"prefill", "decode", "mixed", "all"}
    for kind in ("prefill", "decode", "mixed"):
        assert per_kind[kind]["points_train"] > 0 and per_kind[kind]["points_heldout"] > 0
        assert per_kind[kind]["heldout"] < 0.01
    measured = {(p["kind"], p["prefix"] > 0) for p in result["points"]}
    assert ("prefill", True) in measured and ("mixed", False) in measured and ("decode", False) in measured
    after_prefix = [b for b in ex.steps if b.prefill_lens and not b.decode_seq_ids and b.prefill_starts[0] > 0]
    assert after_prefix and all(len(b.block_tables[0]) * 16 >= b.prefill_starts[0] + b.prefill_lens[0]
                                for b in after_prefix)
    mixed = [b for b in ex.steps if b.prefill_lens and b.decode_seq_ids]
    assert mixed and all(b.prefill_starts[0] + b.prefill_lens[0] <= 2048 for b in mixed)
    cal = tmp_path / "h100.json"
    write(result, str(cal))
    with caplog.at_level("WARNING"):
        sim = make_sim(spec, GPUS["h100"], str(cal))
    assert caplog.text == ""  # same model, device kind, dtype and version: nothing to warn about
    for b in ex.steps[:20]:
        assert sim.step_time(b) == pytest.approx(ex.cost.work(b).time(truth), rel=0.02)


class SpikyExecutor(FakeExecutor):
    """Every fifth step takes three times as long, as when another process takes the CPU."""

    calls = 0

    def execute(self, batch):
        self.calls += 1
        r = super().execute(batch)
        return StepResult(duration_s=r.duration_s * (3 if self.calls % 5 == 0 else 1))


def test_occasional_slow_steps_do_not_move_the_fit():
    spec, truth = MODELS["llama-3-8b"], whole_steps("h100")
    result = calibrate(SpikyExecutor(spec, truth), spec, quick=True, repeats=5)
    for kind, row in result["fit"]["per_kind"].items():
        assert row["train"] < 0.01 and row["heldout"] < 0.01, kind


class NoisyExecutor(FakeExecutor):
    """Each run of a step takes its time x a log-normal factor (sigma 0.2), as on a shared machine."""

    rng = np.random.default_rng(1)

    def execute(self, batch):
        r = super().execute(batch)
        return StepResult(duration_s=r.duration_s * float(np.exp(self.rng.normal(0.0, 0.2))))


def test_timing_spread_reports_the_machines_noise():
    """The file says how much the repeats of a step scattered, so a reader can tell the machine's noise
    from the cost model's error: none on a steady clock; the interquartile range of a log-normal of
    sigma 0.2 (1.349 x 0.2 = 27%) on a noisy one."""
    spec, truth = MODELS["llama-3-8b"], whole_steps("h100")
    steady = calibrate(FakeExecutor(spec, truth), spec, quick=True, repeats=5)
    assert steady["fit"]["timing_spread"] == 0.0 and all(p["spread"] == 0.0 for p in steady["points"])
    noisy = calibrate(NoisyExecutor(spec, truth), spec, quick=True, repeats=15)
    assert 0.15 < noisy["fit"]["timing_spread"] < 0.40


def test_calibrate_cli_prints_the_error_per_step_kind(tmp_path):
    cal = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "kvbench", "calibrate", "--device", "cpu", "--quick", "--repeats", "1",
                        "-o", str(cal)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    for kind in ("prefill", "decode", "mixed"):
        assert kind in r.stdout
    c = json.loads(cal.read_text())
    assert c["device_name"] == "cpu" and c["dtype"] == "fp32" and c["model"] == "tiny"
    assert set(c["coefficients"]) == set(CostModel.TIMING) and c["kvbench_calibration"] == 3
    assert all(c["coefficients"][name] == 0 for name in CostModel.TIMING if name not in CostModel.FITTED)


def _p50s(summary: dict) -> tuple[float, float]:
    return summary["ttft_ms_p50"], summary["tpot_ms_p50"]


@pytest.mark.slow
def test_calibrated_sim_matches_the_model_executor_on_chat_cpu(tmp_path):
    """CPU, tiny model (torch reference attention): calibrate, replay traces/chat_cpu.jsonl on the model
    executor and on the calibrated sim: TTFT and TPOT p50 agree within 10%.

    The CPU is timed by the wall clock, so other processes' load changes its speed between the
    calibration and the replay. Each attempt measures the calibration grid before and after the model
    replay and fits the sim to the mean of the two (a slow drift cancels); an attempt whose grid took
    more than 10% longer or shorter after than before says nothing (the machine changed speed). On a
    shared machine steady attempts still scatter by about +-15%, so up to four attempts are made:
    the test passes on the first steady one within 10%, fails when steady ones were made and none
    was, and skips, saying so, when none was steady."""
    from kvbench.executors.calibrate import measure
    from kvbench.executors.model import ModelExecutor

    def grid_times():
        ex = ModelExecutor("tiny", "cpu", 0)
        return measure(ex, ex.spec, quick=True, repeats=30)  # kvbench calibrate --quick's default

    trace = str(ROOT / "traces" / "chat_cpu.jsonl")
    unsteady, steady = [], []
    for attempt in range(4):
        before = grid_times()
        model = replay(trace, ReplayConfig(executor="model", device="cpu"), str(tmp_path / f"model{attempt}"))
        after = grid_times()
        drift = sum(q.measured_s for q in after) / sum(p.measured_s for p in before)
        for p, q in zip(before, after):
            p.measured_s = (p.measured_s + q.measured_s) / 2
        fitted = fit([p for p in before if not p.heldout])
        cal = tmp_path / f"cpu{attempt}.json"
        cal.write_text(json.dumps({"dtype": "fp32", "device_name": "cpu",
                                   "coefficients": {name: getattr(fitted, name) for name in CostModel.TIMING}}))
        sim = replay(trace, ReplayConfig(executor="sim", model="tiny", calibration=str(cal), front_end=False),
                     str(tmp_path / f"sim{attempt}"))
        (mt, mp), (st, sp) = _p50s(model), _p50s(sim)
        report = (f"TTFT p50 model {mt:.2f} ms, sim {st:.2f} ms; TPOT p50 model {mp:.2f} ms, sim {sp:.2f} ms; "
                  f"the calibration grid took {drift - 1:+.1%} longer after the replay than before")
        print(f"attempt {attempt + 1}: {report}")  # shown with pytest -s
        if abs(drift - 1) > 0.10:
            unsteady.append(report)
            continue
        if abs(st / mt - 1) <= 0.10 and abs(sp / mp - 1) <= 0.10:
            return
        steady.append(report)
    if steady:
        pytest.fail("no steady attempt within 10%: " + " | ".join(steady))
    pytest.skip("the CPU changed speed during every attempt (other load): " + " | ".join(unsteady))
