"""``kvbench selfcheck`` and ``kvbench calibrate`` on the CPU (tiny model, float32)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import replay
from kvbench.executors.presets import get_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True,
                          cwd=ROOT, env=ENV)


def test_selfcheck_cpu_passes_with_every_engine_path_exercised():
    r = _cli("selfcheck", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    f, e, r = out["forwards"], out["engine"], out["engine_radix"]
    assert f["max_logit_diff"] < 1e-3 and f["greedy_agree"] == 1.0
    for run in (e, r):
        assert run["greedy_agree"] == 1.0 and run["max_logit_diff"] < 1e-3 and run["completed"] == 6
        x = run["exercised"]
        assert x["prefix_hit_tokens"] > 0 and x["preemptions"] > 0 and x["cow_copies"] > 0
    assert r["exercised"]["partial_hit_tokens"] > 0  # radix served tokens from inside a block
    assert r["exercised"]["prefix_hit_tokens"] > e["exercised"]["prefix_hit_tokens"]
    w = out["engine_sliding"]  # two KV cache groups: a sliding window's blocks freed as it moves on
    assert w["ok"] and w["greedy_agree"] == 1.0 and w["max_logit_diff"] < 1e-3
    assert w["exercised"]["freed_table_entries"] > 0 and w["exercised"]["prefix_hit_tokens"] > 0


def test_calibrate_writes_coefficients_the_sim_uses(tmp_path):
    cal = tmp_path / "cal.json"
    r = _cli("calibrate", "--device", "cpu", "--quick", "--repeats", "2", "-o", str(cal))
    assert r.returncode == 0, r.stderr
    c = json.loads(cal.read_text())
    co = c["coefficients"]
    assert co["matmul_flops"] > 0 and co["mem_bw"] > 0 and co["step_overhead_s"] >= 0
    assert c["fit"]["points_heldout"] > 0 and c["fit"]["mape_heldout"] >= 0
    for p in c["points"]:
        assert p["measured_s"] > 0 and p["predicted_s"] > 0
    # all arrivals at once, so the schedule does not depend on step times (and no API server in front:
    # the calibration prices the engine's steps only)
    base = dict(executor="sim", model="tiny", limit=15, num_blocks=4096, time_scale=1e-9, front_end=False)
    a = replay(str(ROOT / "traces" / "chat.jsonl"), ReplayConfig(**base), str(tmp_path / "a"))
    b = replay(str(ROOT / "traces" / "chat.jsonl"), ReplayConfig(**base, calibration=str(cal)),
               str(tmp_path / "b"))
    assert a["tpot_ms_mean"] != b["tpot_ms_mean"]  # the CPU's coefficients, not the H200 preset's
    for k in ("prefix_hit_rate", "peak_running", "peak_slots_allocated", "steps", "preemptions"):
        assert a[k] == b[k], k  # memory behaviour does not depend on the cost model


def test_bad_calibration_file_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"coefficients": {"mem_bw": -1}}))
    r = _cli("replay", "traces/chat.jsonl", "--executor", "sim", "--calibration", str(bad),
             "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "mem_bw" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_hf_config_rope_theta_read_from_rope_parameters(tmp_path):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 1000, "rope_parameters": {"rope_theta": 500000.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert get_model(str(tmp_path)).rope_theta == 500000.0


def test_replay_of_a_sliding_window_model_on_the_model_executor(tmp_path):
    """A config.json with sliding-window layers (the selfcheck's tiny Qwen2) replays on the model executor
    over its two KV cache groups; a chunked-local one is refused in one line naming --model."""
    from kvbench.engine.selfcheck import SLIDING_CONFIG

    model = tmp_path / "swa"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SLIDING_CONFIG))
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "t": i * 0.01, "output_len": 24,
                                         "prompt": [{"shared": "sys", "len": 40}, {"unique": 30 + i}]}) + "\n"
                             for i in range(3)))
    r = _cli("replay", str(trace), "--executor", "model", "--device", "cpu", "--model", str(model),
             "--block-size", "8", "--json", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["completed"] == 3 and out["prefix_hit_rate"] > 0
    chunked = {**SLIDING_CONFIG, "layer_types": ["chunked_attention", "full_attention"] * 2,
               "attention_chunk_size": 32}
    (model / "config.json").write_text(json.dumps(chunked))
    r = _cli("replay", str(trace), "--executor", "model", "--device", "cpu", "--model", str(model),
             "--out", str(tmp_path / "bad"))
    assert r.returncode == 2 and "--model" in r.stderr and "chunked attention is not implemented" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
