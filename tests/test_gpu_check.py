"""GPU readiness without a GPU.

- benchmarks/gpu_check.sh, the script to run first on a GPU, runs end to end on the CPU (--dry-run:
  tiny shapes) so it cannot rot before one is available.
- Decode under CUDA graphs (model.DecodeGraphs): the capture/replay mechanics (static buffers, padded
  rows that write nowhere, a batch that shrinks, a block table that outgrows the capture) against eager
  steps. Off the GPU the capture is an eager stand-in; on a GPU (gpu_check.sh runs this file) the same
  test captures real CUDA graphs over the Triton kernels.
- The attention-statistics pass (H2O/InfiniGen scores): layer by layer in bounded chunks, inside the
  step's clock only when the eviction policy consumes it.
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvbench.executors import model as model_mod
from kvbench.executors import modeling
from kvbench.executors.model import (
    DecodeGraphs,
    ModelExecutor,
    eager_capture,
    make_model_executor,
)
from kvbench.executors.presets import get_model
from kvbench.scheduler.batch import StepBatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()
STEPS = ["environment", "selfcheck", "kernel_bench", "calibrate", "model_replay", "sim_replay", "compare_replays",
         "kernel_tests"]


def test_gpu_check_dry_run_writes_every_result(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)  # as on a fresh shell: the script sets what it needs
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [line.split("|")[1:4] for line in (tmp_path / "status.md").read_text().splitlines()[2:]]
    assert [name.strip() for name, _, _ in rows] == STEPS
    assert all(rc.strip() == "0" for _, rc, _ in rows), rows
    assert json.loads((tmp_path / "selfcheck.json").read_text())["ok"] is True
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    titles = [s["title"] for s in kernels["sections"]]
    for word in ("Correctness", "Decode (", "Prefill", "Launch table", "CUDA graph", "Targets"):
        assert any(t.startswith(word) or word in t for t in titles), (word, titles)
    checks = kernels["sections"][0]["rows"]
    assert checks and all(row[-1] == "ok" for row in checks), checks
    assert all(len(s["rows"]) > 0 and not any("ERROR" in str(c) for row in s["rows"] for c in row)
               for s in kernels["sections"]), kernels["sections"]
    assert "## kvbench kernels on" in (tmp_path / "kernels.md").read_text()
    assert "coefficients" in json.loads((tmp_path / "calibration.json").read_text())
    for run in ("model", "sim"):
        assert json.loads((tmp_path / f"summary_{run}.json").read_text())["completed"] == 3
        assert (tmp_path / f"run_{run}" / "summary.json").is_file()
    compare = json.loads((tmp_path / "replay_compare.json").read_text())
    assert {r["metric"] for r in compare} >= {"tpot_ms_p50", "ttft_ms_p50", "output_tok_per_s"}
    assert {r["metric"]: r["within 10%"] for r in compare if r["within 10%"]}.keys() == {"ttft_ms_p50", "tpot_ms_p50"}
    assert "| tpot_ms_p50 |" in (tmp_path / "replay_compare.md").read_text()


# ---------------------------------------------------------------------------------------------
# Decode under CUDA graphs


def _executor(graphs: bool) -> ModelExecutor:
    ex = ModelExecutor("tiny", "cuda" if CUDA else "cpu", seed=3, cuda_graphs=graphs and CUDA)
    if graphs and not CUDA:
        ex.graphs = DecodeGraphs(ex.net, capture=eager_capture)
    ex.bind_pool(num_blocks=256, block_size=2)
    return ex


def _steps():
    """Four prompts from block 1 on (block 0 is where padding rows point), then decodes: all four (graph
    bucket 4, sequence 0 in its last row), then three once sequence 0 finishes (bucket 4 again: its
    row is padding now). Past its own 50 blocks sequence 2 takes sequence 0's blocks, last first, so a
    row left from the four-row steps would overwrite its KV. The contexts grow past 128 tokens (65
    two-token blocks: wider than the first capture's 64 columns)."""
    rng = np.random.default_rng(0)
    lens = [100, 37, 90, 20]
    blocks = {0: list(range(1, 81)), 1: list(range(81, 161)), 2: list(range(161, 211)) + list(range(54, 0, -1)),
              3: list(range(211, 256))}

    def tables(upto):  # each sequence's table holds the blocks its tokens need, as the engine's
        return {s: blocks[s][:n // 2 + 1] for s, n in enumerate(upto)}
    b = StepBatch(block_size=2, block_tables=tables(lens))
    for s, n in enumerate(lens):
        b.prefill_seq_ids.append(s)
        b.prefill_starts.append(0)
        b.prefill_lens.append(n)
        b.prefill_last.append(True)
        b.prefill_tokens.append(rng.integers(16, 32000, size=n, dtype=np.int32))
    yield b
    pos = list(lens)
    for step in range(40):
        live = [1, 2, 3, 0] if step < 8 else [1, 2, 3]
        d = StepBatch(block_size=2, block_tables=tables(pos))
        for s in live:
            d.decode_seq_ids.append(s)
            d.decode_positions.append(pos[s])
            d.decode_tokens.append(int(rng.integers(16, 32000)))
            pos[s] += 1
        yield d


def test_decode_under_graphs_matches_eager_steps(monkeypatch):
    captures = []

    class Recorded(model_mod._DecodeGraph):
        def __init__(self, net, pool, bucket, width, *args):
            captures.append((bucket, width))
            super().__init__(net, pool, bucket, width, *args)

    monkeypatch.setattr(model_mod, "_DecodeGraph", Recorded)
    eager, graphed = _executor(False), _executor(True)
    eager.logits_log, graphed.logits_log = {}, {}
    for batch in _steps():
        eager.execute(batch)
        graphed.execute(batch)
    # float32 on the CPU; bf16 on a GPU, where the padded batch may take other GEMM kernels (the
    # selfcheck's bf16 logit tolerance). The decodes' input tokens are fixed, so nothing compounds.
    tol = 5e-2 if CUDA else 1e-4
    ours, theirs = (np.concatenate([np.stack(log[s]) for s in sorted(log)]) for log in (graphed.logits_log,
                                                                                           eager.logits_log))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=tol)
    assert np.mean(ours.argmax(-1) == theirs.argmax(-1)) >= (0.95 if CUDA else 1.0)
    # Padding rows wrote nowhere and no stale row of the larger batch wrote again: the same KV.
    torch.testing.assert_close(graphed.pool.float(), eager.pool.float(), rtol=0, atol=tol / 2)
    # One bucket: captured at 64 table columns, then again at 128 past 128 tokens.
    assert captures == [(4, 64), (4, 128)], captures
    assert {key: g.width for key, g in graphed.graphs.graphs.items()} == {(4, 2): 128}


def test_graphs_only_for_plain_decode_steps():
    g = DecodeGraphs(net=None, capture=eager_capture)
    b = StepBatch(block_size=16, decode_seq_ids=[0, 1], decode_positions=[5, 6], decode_tokens=[1, 2])
    assert g.wants(b)
    assert not g.wants(StepBatch(block_size=16, prefill_seq_ids=[2], decode_seq_ids=[0]))
    assert not g.wants(StepBatch(block_size=16, decode_seq_ids=[0], kept_masks={0: np.ones(5, bool)}))
    assert not g.wants(StepBatch(block_size=16, decode_seq_ids=list(range(257))))
    assert DecodeGraphs.bucket(3) == 4 and DecodeGraphs.bucket(200) == 224


def test_cpu_executor_has_no_graphs():
    assert ModelExecutor("tiny", "cpu").graphs is None


# ---------------------------------------------------------------------------------------------
# The attention-statistics pass


def _decode_step(ex: ModelExecutor):
    rng = np.random.default_rng(1)
    ex.bind_pool(num_blocks=64, block_size=4)
    tables = {s: list(range(8 * s, 8 * s + 8)) for s in range(4)}
    pre = StepBatch(block_size=4, block_tables=tables)
    for s, n in enumerate([20, 7, 30, 13]):
        pre.prefill_seq_ids.append(s)
        pre.prefill_starts.append(0)
        pre.prefill_lens.append(n)
        pre.prefill_last.append(True)
        pre.prefill_tokens.append(rng.integers(16, 32000, size=n, dtype=np.int32))
    ex.execute(pre)
    dec = StepBatch(block_size=4, block_tables=tables, decode_seq_ids=[0, 1, 2, 3],
                    decode_positions=[20, 7, 30, 13], decode_tokens=[5, 6, 7, 8])
    return dec


def test_attention_totals_in_bounded_chunks_equal_the_whole_pass(monkeypatch):
    ex = ModelExecutor("tiny", "cpu", seed=1, attention="torch", collect_attention=True)
    ex.execute(_decode_step(ex))
    meta, pool, _ = ex._last
    whole = modeling.decode_attention_stats(ex.net, pool, meta).sum(2).mean(0)  # [D, max_len]
    seen = []
    real = modeling.kernels.attention_weights

    def spy(q, *args, **kwargs):
        w = real(q, *args, **kwargs)
        seen.append(w.numel() * 4)
        return w

    monkeypatch.setattr(modeling.kernels, "attention_weights", spy)
    one_row = 2 * 31 * 4  # Hkv x max_len x float32
    chunked = modeling.decode_attention_totals(ex.net, pool, meta, chunk_bytes=one_row + 1)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)  # summed in another order
    assert seen and max(seen) <= one_row + 1
    assert len(seen) == 4 * ex.spec.num_layers  # row by row, layer by layer


class _ClockSpy:
    """Stands in for model._Timer; records whether a statistics pass ran while the clock was running."""
    running = False

    def __init__(self, device):
        self.seconds = 0.0

    def __enter__(self):
        _ClockSpy.running = True
        return self

    def __exit__(self, *exc):
        _ClockSpy.running = False


@pytest.mark.parametrize("scores,inside", [("policy", True), ("measure", False)])
def test_attention_scores_timed_only_when_the_policy_uses_them(monkeypatch, scores, inside):
    ex = ModelExecutor("tiny", "cpu", seed=1, attention="torch", collect_attention=True, attention_scores=scores)
    batch = _decode_step(ex)
    runs = []
    real = model_mod.decode_attention_totals

    def spy(*args, **kwargs):
        runs.append(_ClockSpy.running)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_mod, "_Timer", _ClockSpy)
    monkeypatch.setattr(model_mod, "decode_attention_totals", spy)
    result = ex.execute(batch)
    assert runs == [inside]
    assert set(result.attention) == {0, 1, 2, 3} and len(result.attention[2]) == 31


@pytest.mark.parametrize("eviction,scores", [("none", "off"), ("streaming", "off"), ("h2o", "policy"),
                                             ("infinigen", "policy")])
def test_replay_computes_scores_only_for_a_scoring_policy(eviction, scores):
    cfg = SimpleNamespace(model="tiny", device="cpu", seed=0, attention="torch", eviction=eviction, kv_dtype="auto")
    ex = make_model_executor(cfg, get_model("tiny"))
    assert ex.attention_scores == scores
    assert ex.collect_attention == (eviction != "none")
