"""Sliding-window layers on the model executor: the engine's hybrid KV manager frees the blocks a window
left (table entries -1), and the forward, eager or under decode graphs, reads each layer's group table
and never what lies before its window; held to transformers (Qwen2 and Ministral with ``layer_types``)
with the same weights. The kernels' own window tests are in tests/test_kernels.py."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbench.engine import selfcheck
from kvbench.engine.config import ReplayConfig
from kvbench.engine.selfcheck import SLIDING_CONFIG, run_selfcheck, run_sliding_selfcheck
from kvbench.engine.setup import check_hybrid
from kvbench.errors import InputError
from kvbench.executors import model as model_mod
from kvbench.executors.model import DecodeGraphs, ModelExecutor, eager_capture
from kvbench.executors.modeling import build_model, check_runnable, kv_planes, make_kv_pool
from kvbench.executors.presets import MODELS, SIM_MODELS, ModelSpec
from kvbench.memory.groups import group_layers

# Qwen2 with q/k/v biases, sliding and full layers alternating; a Llama (no biases: Ministral) with one of each.
QWEN2_SWA = ModelSpec("tiny-qwen2-swa", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                      intermediate_size=256, vocab_size=1000, max_model_len=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                      qkv_bias=True, architecture="qwen2", layer_kinds=("sliding", "full") * 2, sliding_window=13)
LLAMA_SWA = replace(MODELS["tiny"], name="tiny-swa", layer_kinds=("sliding", "full"), sliding_window=11)


@pytest.mark.parametrize("spec", [QWEN2_SWA, LLAMA_SWA], ids=["qwen2", "ministral"])
def test_hand_driven_selfcheck_with_windows_matches_transformers(spec):
    """Prefix hits, chunked prefill, copy-on-write and recompute, every context longer than the window."""
    r = run_selfcheck(device="cpu", model=spec, seed=1)
    assert r["ok"] and r["max_logit_diff"] < 1e-3 and r["greedy_agree"] == 1.0, r


@pytest.mark.parametrize("off_by", [1, -1])
def test_selfcheck_sees_a_window_one_token_off(monkeypatch, off_by):
    """transformers' window one token longer or shorter than ours: the selfcheck fails (the window
    convention is W tokens, the query included, in both)."""
    real = selfcheck.hf_model
    monkeypatch.setattr(selfcheck, "hf_model", lambda spec, *a: real(
        replace(spec, sliding_window=spec.sliding_window + off_by), *a))
    r = run_selfcheck(device="cpu", model=QWEN2_SWA, seed=1)
    assert not r["ok"] and r["max_logit_diff"] > 3e-3, r


def test_engine_replay_over_freed_blocks_matches_transformers_under_decode_graphs(monkeypatch):
    """The selfcheck's sliding case through the real engine (HybridKV, two groups, prefix hits, chunked
    prefill, a preemption, n=2), its decode-only steps replayed from decode graphs (eagerly off the GPU:
    the same static buffers per group), every table entry the window freed handed to the forward as -1."""
    replays = []
    real_bind, real_run = ModelExecutor.bind_pool, model_mod._DecodeGraph.run

    def bind(self, *args, **kw):
        real_bind(self, *args, **kw)
        self.graphs = DecodeGraphs(self.net, capture=eager_capture)

    def run(self, inputs):
        replays.append(len(self.tables))
        return real_run(self, inputs)

    monkeypatch.setattr(ModelExecutor, "bind_pool", bind)
    monkeypatch.setattr(model_mod._DecodeGraph, "run", run)
    r = run_sliding_selfcheck(device="cpu", seed=0, attention="torch")
    x = r["exercised"]
    assert r["ok"] and r["greedy_agree"] == 1.0 and r["max_logit_diff"] < 1e-3 and r["completed"] == 6, r
    assert x["kv_groups"].startswith("sliding 20 x 2, full x 2") and r["window"] == 20
    assert x["prefix_hit_tokens"] > 0 and x["preemptions"] > 0 and x["cow_copies"] > 0
    assert x["freed_table_entries_max_step"] > 0
    assert replays and set(replays) == {2}  # graphs replayed, each with both groups' tables


def test_sliding_groups_share_the_pool_as_vllm_lays_it_out():
    """Layer i of every group in one pair of planes: a block costs the largest group's layers."""
    groups = group_layers(QWEN2_SWA.kv_layers("fp32"), 8).layer_groups()
    assert groups == [0, 1, 0, 1] and kv_planes(groups) == [0, 0, 1, 1]
    assert kv_planes([0, 0, 1, 2, 0]) == [0, 1, 0, 0, 2]
    assert make_kv_pool(QWEN2_SWA, 5, 8, "cpu", torch.float32, groups).shape[0] == 4
    assert make_kv_pool(QWEN2_SWA, 5, 8, "cpu", torch.float32).shape[0] == 8
    net = build_model(QWEN2_SWA, "cpu")
    net.bind_kv_groups(groups)
    assert net.group_windows == [13, 0] and net.layer_planes == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="one window"):
        net.bind_kv_groups([0, 0, 1, 1])  # a sliding and a full layer in one group


def test_what_the_model_executor_still_refuses():
    check_runnable(QWEN2_SWA)
    check_runnable(LLAMA_SWA)
    for name, why in (("llama-4-scout", "chunked attention is not implemented"),
                      ("deepseek-v3", "mla attention is not implemented"),
                      ("gpt-oss-20b", "mxfp4 quantized weights"),
                      ("gemma-3-27b", "gemma3_text model")):
        with pytest.raises(InputError, match="--executor sim") as e:
            check_runnable(SIM_MODELS[name])
        assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(InputError, match="--eviction"):
        model_mod.make_model_executor(ReplayConfig(executor="model", model="tiny", device="cpu", eviction="h2o"),
                                     LLAMA_SWA)
    # the engine's refusal of a hybrid layout now names only what the forward lacks
    cfg = ReplayConfig(executor="model", device="cpu")
    check_hybrid(cfg, group_layers(QWEN2_SWA.kv_layers("fp32"), 8), QWEN2_SWA.name)
    chunked = replace(LLAMA_SWA, layer_kinds=("chunked", "full"), sliding_window=0, attention_chunk_size=64)
    with pytest.raises(InputError, match="--executor.*chunked local attention, MLA and recurrent layers are not implemented"):
        check_hybrid(cfg, group_layers(chunked.kv_layers("fp32"), 8), chunked.name)


def test_the_sliding_config_is_read_as_transformers_builds_it(tmp_path):
    """The selfcheck's config.json: sliding and full layers alternating, its window, Qwen2's biases."""
    import json

    import transformers

    from kvbench.executors.hf_config import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(SLIDING_CONFIG))
    spec = read_hf_config(str(tmp_path))
    theirs = transformers.Qwen2Config(**{k: v for k, v in SLIDING_CONFIG.items() if k != "model_type"})
    assert spec.kinds == tuple("sliding" if t == "sliding_attention" else "full" for t in theirs.layer_types)
    assert spec.sliding_window == theirs.sliding_window == 20 and spec.qkv_bias
    assert np.array_equal(np.array(spec.kinds) == "sliding", [True, False, True, False])


@pytest.mark.slow
def test_engine_replay_through_the_triton_kernels_over_freed_blocks():
    """The same replay with the Triton kernels (the interpreter off the GPU: ~1 min of CPU), in a fresh
    process so that TRITON_INTERPRET is set before triton is first imported."""
    import json
    import os
    import subprocess
    import sys

    cuda = torch.cuda.is_available()
    code = ("import json; from kvbench.engine.selfcheck import run_sliding_selfcheck; "
            f"r = run_sliding_selfcheck({'cuda' if cuda else 'cpu'!r}, 0, attention='triton'); r.pop('per_request'); "
            "print(json.dumps(r))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not cuda:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    x = r["exercised"]
    assert r["ok"] and r["max_logit_diff"] <= r["tolerance"], r  # float32 here: 1e-3 and every token equal
    assert x["preemptions"] > 0 and x["prefix_hit_tokens"] > 0 and x["freed_table_entries"] > 0, r
