"""The model executor (tiny model, CPU) through the real engine: measured step times, and the same
memory behaviour as the sim executor on the same settings."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import replay

TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "agent.jsonl")
MEMORY = ["blocks_used", "blocks_cached", "blocks_free", "tokens_live", "slots_allocated", "running",
          "waiting", "prefill_tokens", "decode_seqs", "hit_tokens_cum", "query_tokens_cum"]


def test_model_and_sim_executors_share_memory_behaviour(tmp_path):
    torch.set_num_threads(1)
    # every request arrives at once, so the schedule does not depend on how long steps take
    runs = {}
    for ex in ("sim", "model"):
        cfg = ReplayConfig(executor=ex, model="tiny", device="cpu", limit=12, num_blocks=3000,
                           time_scale=1e-9, front_end=False)  # the sim as the engine alone, as the model is
        runs[ex] = (replay(TRACE, cfg, str(tmp_path / ex)), pd.read_parquet(tmp_path / ex / "steps.parquet"))
    (s_sim, st_sim), (s_model, st_model) = runs["sim"], runs["model"]
    assert s_model["completed"] == 12 and s_model["prefix_hit_rate"] > 0.3
    pd.testing.assert_frame_equal(st_sim[MEMORY], st_model[MEMORY])
    # step times are measured (perf_counter on CPU), not modelled
    assert (st_model["dur_ms"] > 0).all() and not st_model["dur_ms"].equals(st_sim["dur_ms"])
    cfg_json = (tmp_path / "model" / "config.json").read_text()
    assert '"device_name": "cpu"' in cfg_json


def test_the_slab_baseline_runs_on_the_model_executor(tmp_path):
    """The slab layout under the model executor, which feeds token ids (built when a request is first
    considered for admission, as for the paged layout): it completes with the sim's memory behaviour."""
    torch.set_num_threads(1)
    trace = str(Path(TRACE).with_name("chat_cpu.jsonl"))
    runs = {}
    for ex in ("sim", "model"):
        cfg = ReplayConfig(executor=ex, model="tiny", device="cpu", layout="slab", limit=4, max_model_len=2048,
                           num_blocks=600, time_scale=1e-9, front_end=False)
        runs[ex] = (replay(trace, cfg, str(tmp_path / ex)), pd.read_parquet(tmp_path / ex / "steps.parquet"))
    (s_sim, st_sim), (s_model, st_model) = runs["sim"], runs["model"]
    assert s_model["completed"] == 4 and s_model["slab_reserve_tokens"] == 2048
    pd.testing.assert_frame_equal(st_sim[MEMORY], st_model[MEMORY])
