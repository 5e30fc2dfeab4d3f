"""Replay engine with the sim executor: published figures (fragmentation, concurrency), prefix hits
against the ideal on real traces, determinism, limits, interruption, and the run directory (spec §3)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay, replay
from kvbench.trace.format import load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
REAL = ROOT.parent / "shared" / "traces" / "real"

SPEC_SUMMARY = ("requests completed rejected duration_s output_tok_per_s prefix_hit_rate ideal_hit_rate "
                "internal_frag kv_util peak_running mean_running preemptions recomputed_tokens "
                "evicted_tokens recalled_tokens attention_mass_kept peak_slots_allocated "
                "peak_tokens_live busy_s complete").split()
SPEC_REQUESTS = ("id session arrival_s first_token_s finish_s prompt_tokens cached_tokens output_tokens n "
                 "ttft_ms tpot_ms e2e_ms queue_ms preemptions recomputed_tokens evicted_tokens "
                 "recalled_tokens").split()
SPEC_STEPS = ("step t_s dur_ms prefill_tokens decode_seqs running waiting blocks_total blocks_used "
              "blocks_cached blocks_free slots_allocated tokens_live internal_frag kv_util "
              "hit_tokens_cum query_tokens_cum").split()


def sim(**kw) -> ReplayConfig:
    base = dict(executor="sim", model="llama-3-8b", gpu="h200")
    base.update(kw)
    return ReplayConfig(**base)


@pytest.fixture(scope="module")
def chat_layouts(tmp_path_factory):
    """Chat at max_model_len 8192 on a pool of 4,096 blocks (65,536 tokens: eight 8k slabs),
    arrivals compressed 20x so memory, not traffic, bounds concurrency."""
    out = {}
    for layout in ("slab", "paged"):
        d = tmp_path_factory.mktemp(layout)
        cfg = sim(layout=layout, max_model_len=8192, num_blocks=4096, time_scale=0.05,
                  prefix_cache=False)
        out[layout] = (replay(str(TRACES / "chat.jsonl"), cfg, str(d)), d)
    return out


def test_published_fragmentation_and_concurrency(chat_layouts):
    slab, _ = chat_layouts["slab"]
    paged, _ = chat_layouts["paged"]
    assert 0.60 <= slab["internal_frag"] <= 0.80, slab["internal_frag"]
    assert paged["internal_frag"] < 0.06, paged["internal_frag"]
    assert paged["mean_running"] >= 2 * slab["mean_running"], (paged["mean_running"], slab["mean_running"])
    assert slab["peak_running"] <= 8  # eight 8k slabs fit
    assert slab["completed"] == paged["completed"] == slab["requests"]


def test_slab_reserves_the_longest_request_unless_max_model_len_says(tmp_path):
    reqs = load_trace(str(TRACES / "chat.jsonl"))
    longest = max(r.prompt_len + r.output_len for r in reqs)
    rp = Replay(str(TRACES / "chat.jsonl"), sim(layout="slab"), str(tmp_path / "a"))
    assert rp.slab_reserve_tokens == -(-longest // 16) * 16 < rp.max_len  # not the model's 128k context
    rp = Replay(str(TRACES / "chat.jsonl"), sim(layout="slab", max_model_len=8192), str(tmp_path / "b"))
    assert rp.slab_reserve_tokens == 8192
    s = Replay(str(TRACES / "chat.jsonl"), sim(layout="slab", limit=40, slab_reserve="exact"), str(tmp_path / "c")).run()
    assert s["slab_reserve_tokens"] == -(-max(r.prompt_len + r.output_len for r in reqs[:40]) // 16) * 16


def test_run_directory_matches_spec(chat_layouts):
    summary, d = chat_layouts["paged"]
    for k in SPEC_SUMMARY:
        assert k in summary, k
    for stat in ("mean", "p50", "p90", "p99"):
        for m in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
            assert f"{m}_{stat}" in summary
    assert json.loads((d / "summary.json").read_text())["complete"] is True
    cfg = json.loads((d / "config.json").read_text())
    assert len(cfg["trace"]["sha256"]) == 64 and cfg["environment"]["kvbench"]
    assert cfg["settings"]["layout"] == "paged"
    req = pd.read_parquet(d / "requests.parquet")
    steps = pd.read_parquet(d / "steps.parquet")
    assert set(SPEC_REQUESTS) <= set(req.columns)
    assert set(SPEC_STEPS) <= set(steps.columns)
    assert len(req) == summary["requests"] and len(steps) == summary["steps"]
    # figures in summary.json are the time-weighted ones of steps.parquet, over its busy time
    assert summary["busy_s"] == pytest.approx(steps["dur_ms"].sum() / 1e3)
    w = steps["dur_ms"]
    assert summary["mean_running"] == pytest.approx((steps["running"] * w).sum() / w.sum())
    frag = 1 - (steps["tokens_live"] * w).sum() / (steps["slots_allocated"] * w).sum()
    assert summary["internal_frag"] == pytest.approx(frag)
    assert steps["running"].max() == summary["peak_running"]
    # spec §4 definitions, request by request
    done = req[req["rejected"].isna()]
    assert np.allclose(done["ttft_ms"], (done["first_token_s"] - done["arrival_s"]) * 1e3)
    assert np.allclose(done["e2e_ms"], (done["finish_s"] - done["arrival_s"]) * 1e3)
    multi = done[done["output_tokens"] > 1]
    assert np.allclose(multi["tpot_ms"],
                       (multi["finish_s"] - multi["first_token_s"]) * 1e3 / (multi["output_tokens"] - 1))
    assert (done["queue_ms"] >= 0).all() and (done["queue_ms"] <= done["ttft_ms"] + 1e-9).all()
    # blocks are conserved every step
    assert ((steps["blocks_used"] + steps["blocks_cached"] + steps["blocks_free"]) == steps["blocks_total"]).all()


def test_replay_is_deterministic(tmp_path):
    cfg = sim(limit=60)
    a = replay(str(TRACES / "agent.jsonl"), cfg, str(tmp_path / "a"))
    b = replay(str(TRACES / "agent.jsonl"), cfg, str(tmp_path / "b"))
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    for f in ("requests.parquet", "steps.parquet"):
        assert pq.read_table(tmp_path / "a" / f).equals(pq.read_table(tmp_path / "b" / f))


def test_a_run_tunes_the_collector_and_gives_it_back(tmp_path):
    """Replay.run raises the young generation's threshold and freezes the heap it starts with
    (engine.replay.steady_gc), and restores both when it ends, also when a step raises; a heap the
    caller froze stays frozen, and is not added to."""
    import gc

    from kvbench.engine.replay import GC_YOUNG_THRESHOLD

    gc.unfreeze()
    before = gc.get_threshold()
    seen = []
    rp = Replay(str(TRACES / "chat.jsonl"), sim(limit=20), str(tmp_path / "a"))
    # (the freeze count is counted object by object: asked at the first step only)
    rp.step_hook = lambda *a: seen.append((gc.get_threshold()[0], gc.get_freeze_count() if not seen else 1))
    rp.run()
    assert seen and all(t == max(before[0], GC_YOUNG_THRESHOLD) and f > 0 for t, f in seen)
    assert (gc.get_threshold(), gc.get_freeze_count()) == (before, 0)
    gc.freeze()  # the caller's own
    frozen = gc.get_freeze_count()
    Replay(str(TRACES / "chat.jsonl"), sim(limit=20), str(tmp_path / "c")).run()
    assert gc.get_threshold() == before and frozen - 100 < gc.get_freeze_count() <= frozen  # (a few freed)
    gc.unfreeze()

    def boom(*a):
        raise RuntimeError("a step fails")
    rp = Replay(str(TRACES / "chat.jsonl"), sim(limit=20), str(tmp_path / "b"))
    rp.step_hook = boom
    with pytest.raises(RuntimeError, match="a step fails"):
        rp.run()
    assert (gc.get_threshold(), gc.get_freeze_count()) == (before, 0)


def test_mooncake_slice_hit_rate_bounded_by_ideal(tmp_path):
    s = replay(str(TRACES / "mooncake_slice.jsonl"), sim(), str(tmp_path / "small"))
    assert s["prefix_hit_rate"] <= s["ideal_hit_rate"] + 1e-12
    big = replay(str(TRACES / "mooncake_slice.jsonl"), sim(num_blocks=400_000), str(tmp_path / "big"))
    assert big["ideal_hit_rate"] - 0.02 <= big["prefix_hit_rate"] <= big["ideal_hit_rate"] + 1e-12


@pytest.mark.slow
def test_real_mooncake_full_replay_within_two_points_of_ideal(tmp_path):
    from kvbench.trace.importers import convert

    trace = tmp_path / "mooncake.jsonl"
    convert("mooncake", str(REAL / "mooncake_conversation.jsonl"), str(trace))
    s = replay(str(trace), sim(num_blocks=6_000_000), str(tmp_path / "run"))
    assert s["completed"] == 12031
    assert abs(s["ideal_hit_rate"] - 0.3736) < 0.001
    assert s["ideal_hit_rate"] - 0.02 <= s["prefix_hit_rate"] <= s["ideal_hit_rate"]


def test_chat_prefix_cache_hits_and_agent_reuse(tmp_path):
    chat = replay(str(TRACES / "chat.jsonl"), sim(), str(tmp_path / "chat"))
    assert chat["prefix_hit_rate"] > 0.8 and chat["prefix_hit_rate"] <= chat["ideal_hit_rate"]
    off = replay(str(TRACES / "chat.jsonl"), sim(prefix_cache=False), str(tmp_path / "off"))
    assert off["prefix_hit_rate"] == 0.0
    assert chat["ttft_ms_mean"] < off["ttft_ms_mean"]  # skipped prefill shows in latency


def test_best_of_n_shares_prompt_blocks(tmp_path):
    paged = replay(str(TRACES / "best_of_n.jsonl"), sim(num_blocks=20_000, max_model_len=8192),
                   str(tmp_path / "p"))
    slab = replay(str(TRACES / "best_of_n.jsonl"),
                  sim(num_blocks=20_000, max_model_len=8192, layout="slab", slab_reserve="exact"),
                  str(tmp_path / "s"))
    req = pd.read_parquet(tmp_path / "p" / "requests.parquet")
    assert (req["n"] == 8).all() and paged["completed"] == 30
    # every sample produced its tokens
    assert req["output_tokens"].sum() == paged["output_tokens"]
    assert paged["cow_copies"] > 0  # partial prompt tails copied on first divergent append
    assert paged["peak_slots_allocated"] * 2 < slab["peak_slots_allocated"]


def test_requests_over_max_model_len_are_rejected_or_cut_and_counted(tmp_path):
    trace = load_trace(str(TRACES / "chat.jsonl"))
    for rule, refused in (("reject", lambda r: r.prompt_len + r.output_len > 2048),
                          ("vllm", lambda r: r.prompt_len >= 2048)):
        s = replay(str(TRACES / "chat.jsonl"), sim(max_model_len=2048, overlong=rule), str(tmp_path / rule))
        req = pd.read_parquet(tmp_path / rule / "requests.parquet").set_index("id")
        assert s["rejected"] > 0 and s["rejected"] + s["completed"] == s["requests"]
        assert (req.loc[req["rejected"].notna(), "rejected"] == "max_model_len").all()
        # exactly the requests the rule refuses, and only those; the others stop at the limit
        assert set(req.index[req["rejected"].notna()]) == {r.id for r in trace if refused(r)}
        ran = [r for r in trace if not refused(r)]
        assert [req.loc[r.id, "output_tokens"] for r in ran] == [min(r.output_len, 2048 - r.prompt_len) for r in ran]
        assert s["truncated"] == sum(r.prompt_len + r.output_len > 2048 for r in ran)
    assert s["truncated"] > 0  # (vLLM's rule cut some)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_pool_too_small_for_a_request_exits_2(tmp_path):
    r = _cli("replay", "traces/chat.jsonl", "--executor", "sim", "--num-blocks", "8",
             "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "traces/chat.jsonl:" in lines[0] and "--num-blocks" in lines[0]
    assert "Traceback" not in r.stderr


def test_bad_options_exit_2_with_one_line(tmp_path):
    for args in (["--block-size", "0"], ["--layout", "ring"], ["--cache-policy", "mru"],
                 ["--kv-mem", "lots"], ["--no-such-flag"]):
        r = _cli("replay", "traces/chat.jsonl", "--executor", "sim", *args, "--out", str(tmp_path / "y"))
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_interrupted_run_keeps_a_readable_partial_run(tmp_path):
    rp = Replay(str(TRACES / "chat.jsonl"), sim(), str(tmp_path / "cut"))

    def stop(progress):
        if progress.steps >= 256:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rp.run(stop)
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["complete"] is False and 0 < summary["completed"] < summary["requests"]
    steps = pd.read_parquet(tmp_path / "cut" / "steps.parquet")
    assert len(steps) >= 256
    assert len(pd.read_parquet(tmp_path / "cut" / "requests.parquet")) == summary["completed"]


def test_cli_replay_json(tmp_path):
    r = _cli("replay", "traces/rag.jsonl", "--executor", "sim", "--limit", "20", "--json",
             "--out", str(tmp_path / "j"))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["completed"] == 20 and s["run_dir"] == str(tmp_path / "j")


@pytest.mark.parametrize("trace,kw", [("chat.jsonl", {}), ("best_of_n.jsonl", {}),
                                      ("agent.jsonl", {"prefix_mode": "radix"}), ("rag.jsonl", {"cache_policy": "fifo"})])
def test_a_pool_larger_than_the_trace_holds_only_what_the_trace_can_use(tmp_path, monkeypatch, trace, kw):
    """The sim's default pool of a small model is millions of blocks; a run that can never fill it
    materialises only the blocks it can take, with the same results as the whole pool."""
    cfg = sim(model="tiny", limit=60, time_scale=0.05, **kw)
    rp = Replay(str(TRACES / trace), cfg, str(tmp_path / "bounded"))
    assert rp.physical_blocks is not None and rp.physical_blocks * 100 < rp.num_blocks
    assert rp.kv.pool.physical == rp.physical_blocks and len(rp.kv.pool.refcnt) == rp.physical_blocks
    a = rp.run()
    monkeypatch.setattr(Replay, "_physical_blocks", lambda self: None)
    whole = Replay(str(TRACES / trace), cfg, str(tmp_path / "whole"))
    assert len(whole.kv.pool.refcnt) == whole.num_blocks
    b = whole.run()
    assert {k: v for k, v in a.items() if k != "wall_s"} == {k: v for k, v in b.items() if k != "wall_s"}
    for f in ("requests.parquet", "steps.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "bounded" / f), pd.read_parquet(tmp_path / "whole" / f))


@pytest.mark.parametrize("layout", ["paged", "slab"])
def test_the_pools_counters_match_a_recount_after_every_step(tmp_path, layout):
    """tokens_live and the block counts kept incrementally (commit, allocate, free, preemption) equal a
    recount from the blocks' own state after every step, and a finished run holds nothing."""
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", layout=layout, num_blocks=300, limit=60,
                       max_model_len=4096, max_batched_tokens=512)
    rp = Replay(str(TRACES / "chat.jsonl"), cfg, str(tmp_path / "r"))
    kv = rp.kv
    checked = []
    execute = rp.executor.execute

    def checking(batch):
        if layout == "paged":
            counts = kv.pool.recount()
            assert counts["tokens_live"] == kv.pool.tokens_live and counts["num_used"] == kv.pool.num_used
        else:
            assert kv.tokens_live == sum(s.num_kv for s in rp.sched.running)
        checked.append(1)
        return execute(batch)
    rp.executor.execute = checking
    s = rp.run()
    assert s["completed"] == 60 and len(checked) == s["steps"]
    assert (kv.pool.tokens_live if layout == "paged" else kv.tokens_live) == 0
