"""Many replicas (--replicas, --router): one replica is the single engine under every router; each
router's rule on hand-made traces; the kv-aware router's index lags by its event delay and the
prediction error counts it; balance figures; the cluster's files (spec §3)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay, replay
from kvbench.engine.routing import ROUTERS, KVIndex, Router, jain, max_over_mean

ROOT = Path(__file__).resolve().parents[1]
CHAT = str(ROOT / "traces" / "chat.jsonl")
REAL = ROOT.parent / "shared" / "traces" / "real"


def sim(**kw) -> ReplayConfig:
    base = dict(executor="sim", model="llama-3-8b", gpu="h200", num_blocks=4096, max_model_len=8192)
    base.update(kw)
    return ReplayConfig(**base)


def write_trace(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _figures(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "wall_s"}


# The single engine before replicas existed (commit 62e233e, the parent of the one that added them),
# on 100 chat requests in 1,200 blocks at 20x the rate: its step count, preemptions, output tokens,
# engine time, and a digest of every request's first token, finish, hits and preemptions (re-pinned
# when the pool began to cache a recomputed key twice, as vLLM does: 33 -> 35 preemptions; and when
# the sim's default costs were fitted to published GPU measurements: 35 -> 38; and when the defaults
# gained the API server's front end and FlashAttention's prefill rate, refitted: 38 -> 30).
# And the same at the trace's own rate, 60 requests in 4,096 blocks: mostly idle, arrivals in the gaps.
SINGLE_ENGINE = {
    "busy": dict(num_blocks=1200, limit=100, time_scale=0.05, steps=1681, preemptions=30, output_tokens=25727,
                 duration_s=12.229137108524693, requests="4eedb6a50fda8d89"),
    "idle": dict(num_blocks=4096, limit=60, time_scale=1.0, steps=10111, preemptions=0, output_tokens=16447,
                 duration_s=119.81429307270194, requests="3fb0fc8a012d8d13"),
}


def _requests_digest(run_dir: Path) -> str:
    import hashlib

    r = pd.read_parquet(run_dir / "requests.parquet")
    cols = ["id", "first_token_s", "finish_s", "cached_tokens", "preemptions"]
    return hashlib.sha256(r[cols].to_csv(index=False).encode()).hexdigest()[:16]


@pytest.mark.parametrize("case", sorted(SINGLE_ENGINE))
@pytest.mark.parametrize("router", ROUTERS)
def test_one_replica_is_the_single_engine_under_every_router(tmp_path, router, case):
    """One replica under any router replays exactly as the engine did before replicas existed
    (memory-bound with preemptions, and mostly idle)."""
    g = SINGLE_ENGINE[case]
    s = replay(CHAT, sim(num_blocks=g["num_blocks"], limit=g["limit"], time_scale=g["time_scale"], replicas=1,
                         router=router), str(tmp_path / "one"))
    assert {k: s[k] for k in ("steps", "preemptions", "output_tokens")} == \
        {k: g[k] for k in ("steps", "preemptions", "output_tokens")}
    assert s["duration_s"] == pytest.approx(g["duration_s"], rel=1e-12)
    assert _requests_digest(tmp_path / "one") == g["requests"]
    assert (pd.read_parquet(tmp_path / "one" / "requests.parquet")["replica"] == 0).all()


def _prefix_trace(tmp_path, burst: bool = False) -> str:
    """Six families of prompts: each family shares its first 64 tokens (4 blocks of 16), then differs.
    ``burst``: a member of every family arrives at once, every second, the families in a rotating order."""
    rows = []
    for i in range(48):
        fam = (i + (i // 6 if burst else 0)) % 6
        rows.append({"id": f"r{i}", "t": (i // 6) * 1.0 if burst else i * 0.5, "session": f"s{i}", "output_len": 4,
                     "prompt": [{"shared": f"family/{fam}", "len": 64}, {"unique": 40}]})
    return write_trace(tmp_path / "prefix.jsonl", rows)


def test_prefix_router_keeps_requests_with_the_same_first_blocks_together(tmp_path):
    trace = _prefix_trace(tmp_path)
    replay(trace, sim(replicas=4, router="prefix"), str(tmp_path / "run"))
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    req["family"] = req["id"].str[1:].astype(int) % 6
    per_family = req.groupby("family")["replica"].nunique()
    assert (per_family == 1).all(), per_family
    assert req["replica"].nunique() > 1  # the families spread over replicas
    # so each family computes its prefix once: every later member hits its 64 shared tokens
    later = req[req.duplicated("family")]
    assert (later["cached_tokens"] >= 64).all()


def test_round_robin_spreads_families_and_loses_hits(tmp_path):
    trace = _prefix_trace(tmp_path)
    rr = replay(trace, sim(replicas=4, router="round-robin"), str(tmp_path / "rr"))
    px = replay(trace, sim(replicas=4, router="prefix"), str(tmp_path / "px"))
    req = pd.read_parquet(tmp_path / "rr" / "requests.parquet")
    assert list(req.sort_values("arrival_s")["replica"]) == [i % 4 for i in range(48)]
    assert px["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert rr["jain_requests"] == pytest.approx(1.0)
    assert rr["balance_requests_max_over_mean"] == pytest.approx(1.0)


def test_session_router_keeps_a_session_together(tmp_path):
    rows = [{"id": f"q{i}", "t": i * 0.2, "session": f"user{i % 5}", "output_len": 3,
             "prompt": [{"unique": 30}]} for i in range(40)]
    rows += [{"id": f"anon{i}", "t": 8 + i * 0.2, "output_len": 3, "prompt": [{"unique": 30}]} for i in range(6)]
    trace = write_trace(tmp_path / "s.jsonl", rows)
    replay(trace, sim(replicas=3, router="session"), str(tmp_path / "run"))
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    named = req[req["session"].notna()]
    assert (named.groupby("session")["replica"].nunique() == 1).all()
    assert req["replica"].notna().all()  # requests without a session go somewhere (least-loaded)


def test_least_loaded_picks_fewest_sequences_then_most_free_blocks():
    loads = [(3, 10, 0), (1, 5, 0), (1, 9, 0), (2, 100, 0)]
    assert Router.least_loaded(loads) == 2
    assert Router.least_loaded([(0, 5, 0), (0, 5, 0)]) == 0


def test_least_loaded_balances_a_burst(tmp_path):
    rows = [{"id": f"b{i}", "t": 0.0, "output_len": 50, "prompt": [{"unique": 200}]} for i in range(12)]
    trace = write_trace(tmp_path / "burst.jsonl", rows)
    s = replay(trace, sim(replicas=3, router="least-loaded"), str(tmp_path / "run"))
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert sorted(req["replica"].value_counts().tolist()) == [4, 4, 4]
    assert s["jain_requests"] == pytest.approx(1.0)
    assert [r["requests"] for r in s["per_replica"]] == [4, 4, 4]


def test_kv_aware_with_no_load_weight_goes_where_the_longest_prefix_is_cached():
    r = Router("kv-aware", 3, cache_weight=1.0, load_weight=0.0)
    r.index.publish(0, 0.0, [(True, [11, 12])])
    r.index.publish(2, 0.0, [(True, [11, 12, 13])])
    loads = [(0, 0, 0), (0, 0, 0), (50, 0, 500)]  # replica 2 is far busier: weight 0 ignores it
    assert r.route(1.0, None, [11, 12, 13, 14], 4, loads) == (2, 3)
    r.index.publish(2, 1.0, [(False, [12])])  # its block 12 evicted: the chain breaks after 11
    assert r.route(2.0, None, [11, 12, 13, 14], 4, loads) == (0, 2)
    # with load weight the busy replica loses even with the longer prefix
    r2 = Router("kv-aware", 3, load_weight=1.0)
    r2.index.publish(2, 0.0, [(True, [11, 12, 13])])
    assert r2.route(1.0, None, [11, 12, 13, 14], 4, loads)[0] == 0


def test_kv_index_events_become_visible_after_the_delay():
    idx = KVIndex(2, delay_s=5.0)
    idx.publish(1, 10.0, [(True, [1, 2])])
    idx.advance(14.9)
    assert idx.match(1, [1, 2]) == 0
    idx.advance(15.0)
    assert idx.match(1, [1, 2]) == 2 and idx.match(0, [1, 2]) == 0


def test_a_lagging_index_mispredicts_and_the_summary_counts_it(tmp_path):
    trace = _prefix_trace(tmp_path, burst=True)
    fresh = replay(trace, sim(replicas=4, router="kv-aware", router_load_weight=0.0), str(tmp_path / "fresh"))
    # events that never arrive in time: the router sees no cache, so load alone spreads each burst
    stale = replay(trace, sim(replicas=4, router="kv-aware", router_event_delay=1e5), str(tmp_path / "stale"))
    # fresh events: every later family member goes where its family's prefix is, as predicted
    assert fresh["router_predicted_blocks"] == fresh["router_hit_blocks"] > 0
    assert fresh["router_mispredicted_blocks"] == 0
    # the stale router predicts nothing, so whatever hits was mispredicted
    assert stale["router_predicted_blocks"] == 0
    assert stale["router_mispredicted_blocks"] == stale["router_hit_blocks"]
    assert stale["prefix_hit_rate"] < fresh["prefix_hit_rate"]


def test_balance_figures():
    assert jain([5, 5, 5]) == pytest.approx(1.0)
    assert jain([9, 0, 0]) == pytest.approx(1 / 3)
    assert jain([1, 3]) == pytest.approx(16 / 20)
    assert max_over_mean([1, 3]) == pytest.approx(1.5)


def test_cluster_run_files(tmp_path):
    s = replay(CHAT, sim(limit=120, time_scale=0.05, replicas=3, router="least-loaded"), str(tmp_path / "run"))
    assert s["replicas"] == 3 and s["router"] == "least-loaded" and s["complete"]
    per = s["per_replica"]
    assert [p["replica"] for p in per] == [0, 1, 2]
    assert sum(p["requests"] for p in per) == s["requests"] - s["rejected"]
    assert sum(p["completed"] for p in per) == s["completed"]
    assert sum(p["steps"] for p in per) == s["steps"]
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert (req["queue_ms"] >= 0).all() and (req["first_token_s"] > req["arrival_s"]).all()
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    assert set(steps["replica"]) == {0, 1, 2}
    for rep, g in steps.groupby("replica"):  # each replica's steps follow its own clock
        assert list(g["step"]) == list(range(len(g)))
        assert (g["t_s"].diff().dropna() > 0).all()
        assert len(g) == per[rep]["steps"]
    # the cluster's hit rate is the replicas' hit tokens over their prompt tokens
    last = steps.groupby("replica").last()
    assert s["prefix_hit_rate"] == pytest.approx(last["hit_tokens_cum"].sum() / last["query_tokens_cum"].sum())


def test_each_replica_is_its_own_engine(tmp_path):
    """Two replicas with a pool each: what a request computes on one is no hit on the other."""
    rows = [{"id": "a", "t": 0.0, "session": "x", "output_len": 2, "prompt": [{"shared": "doc", "len": 160}]},
            {"id": "b", "t": 5.0, "session": "y", "output_len": 2, "prompt": [{"shared": "doc", "len": 160}]},
            {"id": "c", "t": 9.0, "session": "z", "output_len": 2, "prompt": [{"shared": "doc", "len": 160}]}]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    rp = Replay(trace, sim(replicas=2, router="round-robin"), str(tmp_path / "run"))
    rp.run()
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("id")
    assert list(req["replica"]) == [0, 1, 0]
    assert req.loc["b", "cached_tokens"] == 0  # replica 1 never saw the document
    assert req.loc["c", "cached_tokens"] > 0  # replica 0 did
    assert rp.replicas[0].kv is not rp.replicas[1].kv


@pytest.mark.slow
def test_mooncake_four_replicas_every_router(tmp_path):
    """The whole real Mooncake conversation trace on 4 replicas: the prefix-aware routers beat
    round-robin's hit rate, prefix hashing over the first 64 blocks (every Mooncake prompt starts with
    the same 512 tokens, so hashing the default first 4 blocks sends every request to one replica:
    README's hot-prefix row)."""
    from kvbench.trace.importers import convert

    trace = str(tmp_path / "mooncake.jsonl")
    convert("mooncake", str(REAL / "mooncake_conversation.jsonl"), trace)
    hit = {}
    for router in ("round-robin", "prefix", "kv-aware"):
        s = replay(trace, ReplayConfig(executor="sim", model="llama-3-8b", gpu="h200", replicas=4,
                                       router=router, router_prefix_blocks=64, limit=3000), str(tmp_path / router))
        hit[router] = s["prefix_hit_rate"]
    assert hit["kv-aware"] > hit["round-robin"] and hit["prefix"] > hit["round-robin"], hit


def test_the_index_forgets_evicted_blocks(tmp_path):
    """A replica whose small pool evicts a family's prefix tells the router so: it predicts no hit there."""
    rows = [{"id": "a0", "t": 0.0, "output_len": 2, "prompt": [{"shared": "family/a", "len": 64}, {"unique": 40}]}]
    rows += [{"id": f"u{i}", "t": 1.0 + i, "output_len": 2, "prompt": [{"unique": 200}]} for i in range(5)]
    rows += [{"id": "a1", "t": 10.0, "output_len": 2, "prompt": [{"shared": "family/a", "len": 64}, {"unique": 40}]}]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    s = replay(trace, sim(replicas=2, router="kv-aware", router_load_weight=0.0, num_blocks=20),
               str(tmp_path / "run"))
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("id")
    assert req.loc["a1", "cached_tokens"] == 0  # the family's blocks were evicted
    assert s["cache_evictions"] > 0
    assert s["router_predicted_blocks"] == s["router_hit_blocks"] == 0
    assert s["router_mispredicted_blocks"] == 0


def test_report_draws_routing_and_sums_replicas_over_time(tmp_path):
    from kvbench.report import build_report
    from kvbench.report.charts import binned

    # two replicas running one sequence each over the same second: the cluster runs two
    steps = pd.DataFrame({"replica": [0, 1, 0, 1], "t_s": [0.0, 0.0, 0.5, 0.5], "dur_ms": [500.0] * 4,
                          "running": [1, 1, 1, 1]})
    _, v = binned(steps, "running", hold=False, bins=4)
    assert v == pytest.approx([2, 2, 2, 2])
    runs = tmp_path / "runs"
    for n, router in ((1, "round-robin"), (2, "prefix"), (2, "round-robin")):
        replay(CHAT, sim(limit=40, replicas=n, router=router), str(runs / f"x{n}-{router}"))
    out = tmp_path / "report"
    build_report([str(runs)], str(out))
    assert (out / "chat-routing.png").exists()


@pytest.mark.parametrize("router", ["least-loaded", "kv-aware"])
def test_the_router_sees_a_replica_busy_during_its_step(tmp_path, router):
    """A request arriving while replica 0 runs a long prefill goes to the idle replica 1: the router
    sees a replica's load as its step started, not the state after the step the loop already ran."""
    rows = [{"id": "long", "t": 0.0, "output_len": 1, "prompt": [{"unique": 8000}]},
            {"id": "short", "t": 0.01, "output_len": 2, "prompt": [{"unique": 50}]}]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    replay(trace, sim(replicas=2, router=router), str(tmp_path / "run"))
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("id")
    assert req.loc["long", "ttft_ms"] > 100  # a long prefill
    assert req.loc["short", "replica"] != req.loc["long", "replica"]
    assert req.loc["short", "ttft_ms"] < 50


def test_identical_prompts_are_predicted_exactly(tmp_path):
    """The router predicts only the blocks a prompt can hit (never the last prompt token's block)."""
    rows = [{"id": f"q{i}", "t": float(i), "output_len": 2, "prompt": [{"shared": "same", "len": 64}]}
            for i in range(6)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    s = replay(trace, sim(replicas=2, router="kv-aware", router_load_weight=0.0), str(tmp_path / "run"))
    assert s["router_predicted_blocks"] == s["router_hit_blocks"] > 0
    assert s["router_mispredicted_blocks"] == 0


def test_sweep_table_has_the_cluster_columns_after_a_one_replica_run(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "sw"
    r = subprocess.run([sys.executable, "-m", "kvbench", "sweep", CHAT, "--executor", "sim", "--model", "llama-3-8b",
                        "--num-blocks", "2000", "--max-model-len", "8192", "--limit", "40", "--replicas", "1,2",
                        "--router", "kv-aware", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    rows = pd.read_parquet(out / "sweep.parquet").set_index("run")
    assert list(rows.index) == ["paged-x1", "paged-x2"]
    assert pd.isna(rows.loc["paged-x1", "jain_busy"]) and rows.loc["paged-x2", "jain_busy"] > 0
    assert rows.loc["paged-x2", "router_predicted_blocks"] >= 0


def test_attention_mass_across_replicas_weighs_every_measurement(tmp_path):
    cfg = ReplayConfig(executor="model", device="cpu", limit=6, eviction="h2o", replicas=2, router="round-robin")
    rp = Replay(str(ROOT / "traces" / "agent.jsonl"), cfg, str(tmp_path / "run"))
    s = rp.run()
    ev = [r.evictor for r in rp.replicas]
    assert all(e.mass_n for e in ev) and ev[0].mass_n != ev[1].mass_n
    assert s["attention_mass_kept"] == pytest.approx(sum(e.mass_sum for e in ev) / sum(e.mass_n for e in ev))
    assert s["evicted_tokens"] == sum(e.evicted for e in ev)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_replica_never_steps_before_its_last_step_ended(tmp_path, replicas):
    """A request arriving during the step that empties its replica starts after that step, not at its
    arrival (the replica was busy until then): steps of one replica never overlap."""
    rows = [{"id": "a", "t": 0.0, "output_len": 1, "prompt": [{"unique": 8000}]},
            {"id": "b", "t": 0.05, "output_len": 2, "prompt": [{"unique": 50}]}]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    replay(trace, sim(replicas=replicas, router="round-robin" if replicas == 1 else "prefix",
                      router_prefix_blocks=1), str(tmp_path / "run"))
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    for _, g in steps.groupby("replica"):
        end = (g["t_s"] + g["dur_ms"] / 1e3).to_numpy()
        assert (g["t_s"].to_numpy()[1:] >= end[:-1] - 1e-12).all()


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_kv_aware_router_over_slabs_runs(tmp_path, replicas):
    """A slab has no block pool to publish KV events from: the kv-aware router then sees no cache
    (it was an AttributeError), and a replay says when --router does nothing."""
    from kvbench.cli.replay import unused_options

    cfg = ReplayConfig(executor="sim", model="llama-3-8b", layout="slab", router="kv-aware", replicas=replicas,
                       max_model_len=4096, limit=20)
    s = Replay(str(ROOT / "traces/chat.jsonl"), cfg, str(tmp_path / "r")).run()
    assert s["completed"] == 20
    notes = unused_options(ReplayConfig(router="kv-aware", replicas=replicas))
    assert notes == ([] if replicas > 1 else ["--router has no effect with --replicas 1"])
