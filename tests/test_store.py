"""The KV store every instance shares (--store-kv-mem: Mooncake Store, LMCache's remote backend) and
Mooncake's Conductor router (--router conductor), over mixed replicas and prefill/decode instances."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.disagg import DisaggReplay
from kvbench.engine.replay import Replay
from kvbench.engine.routing import Router
from kvbench.errors import InputError
from kvbench.memory.tiers import Tier, Tiers, TierSpec
from kvbench.trace.format import Request, Segment
from kvbench.trace.tokens import ROOT_KEY

REPO = Path(__file__).resolve().parents[1]
BS = 16
BLOCK_BYTES = 2_097_152  # llama-3-8b bf16: 16 tokens x 32 layers x 2 x 8 heads x 128 x 2 bytes


def req(i, t, segs, out=2, session=None, output=None):
    prompt = tuple(Segment("shared", ln, name=name) if name else Segment("unique", ln) for name, ln in segs)
    return Request(id=f"r{i}", t=t, prompt=prompt, output_len=out, index=i, line=i + 1, session=session,
                   output=output, prompt_len=sum(ln for _, ln in segs))


def two_turns(second_at: float = 5.0) -> list[Request]:
    """Turn 2 re-sends turn 1's prompt (260 tokens) and its 64-token answer, then 40 new tokens."""
    return [req(0, 0.0, [("sys", 160), ("q1", 100)], out=64, session="s", output="ans"),
            req(1, second_at, [("sys", 160), ("q1", 100), ("ans", 64), (None, 40)], out=8, session="s")]


# -- the store's visibility ----------------------------------------------------------------------
def test_a_stored_block_is_found_only_from_its_steps_end_plus_the_delay():
    store = Tier(TierSpec("store", 8, 50e9)).share(2.0)
    chain = Tiers([], store=store, load_policy="always", block_bytes=BLOCK_BYTES)
    chain.clock = 1.0
    chain.stored([0, 1], [11, 12], [ROOT_KEY, 11])
    assert len(chain.match([11, 12], 0, 2, ROOT_KEY, BS)) == 0  # its step has not ended
    store.settle(3.0)  # the step ended at 3 s: found from 5 s
    chain.clock = 4.999
    assert len(chain.match([11, 12], 0, 2, ROOT_KEY, BS)) == 0
    assert store.prefix([11, 12], ROOT_KEY, 4.999) == 0
    chain.clock = 5.0
    assert len(chain.match([11, 12], 0, 2, ROOT_KEY, BS)) == 2
    assert store.prefix([11, 12], ROOT_KEY, 5.0) == 2 and store.prefix([12], ROOT_KEY, 5.0) == 0  # (its chain)
    # once every write is due, lookups take the plain path again (no per-slot check left pending)
    assert store.hidden(4.999) and not store.hidden(5.0)
    # instances settle out of time order: a step ending later, then one ending earlier -- the later
    # write stays unfound until its own time
    chain.stored([2], [13], [12])
    store.settle(10.0)
    chain.stored([3], [14], [ROOT_KEY])
    store.settle(1.0)
    assert store.hidden(11.999) and not store.hidden(12.0)
    assert store.prefix([11, 12, 13], ROOT_KEY, 11.0) == 2 and store.prefix([11, 12, 13], ROOT_KEY, 12.0) == 3


def test_an_instance_that_only_writes_never_finds_the_store():
    store = Tier(TierSpec("store", 8, 50e9)).share(0.0)
    writer = Tiers([], store=store, reads_store=False, load_policy="always", block_bytes=BLOCK_BYTES)
    writer.stored([0], [11], [ROOT_KEY])
    store.settle(0.0)
    assert store.prefix([11], ROOT_KEY, 0.0) == 1
    assert len(writer.match([11], 0, 1, ROOT_KEY, BS)) == 0


# -- mixed replicas ------------------------------------------------------------------------------
def _mixed(tmp_path, name, reqs, **kw):
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", block_size=BS, num_blocks=400, replicas=2,
                       router="round-robin", load_policy="always", **kw)
    rp = Replay("<test>", cfg, str(tmp_path / name), requests=reqs)
    s = rp.run()
    return s, pd.read_parquet(tmp_path / name / "requests.parquet").set_index("id")


def test_a_replica_finds_what_another_replica_computed(tmp_path):
    """Round-robin sends the same document to both replicas; the second loads it from the store --
    its 9 whole blocks before the one holding its last token -- only when there is a store."""
    reqs = [req(0, 0.0, [("doc", 160)]), req(1, 10.0, [("doc", 160)])]
    s0, rows0 = _mixed(tmp_path, "none", reqs)
    assert rows0.loc["r1", "cached_tokens"] == 0 and s0["hit_rate_store"] is None
    s, rows = _mixed(tmp_path, "store", reqs, store_kv_mem="1GiB")
    assert rows.loc["r1", "cached_tokens"] == 144 and rows.loc["r1", "loaded_tokens"] == 144
    assert s["hit_rate_store"] == pytest.approx(144 / 320)
    assert s["bytes_loaded_store"] == 9 * BLOCK_BYTES
    assert s["store_evictions"] == 0  # (counted once, not once per replica)
    s, rows = _mixed(tmp_path, "late", reqs, store_kv_mem="1GiB", store_delay=30.0)
    assert rows.loc["r1", "cached_tokens"] == 0  # written, not yet in the store's index
    # a store of 10 blocks: r2's 6 new blocks push 6 of the document's out, counted once for the run
    s, rows = _mixed(tmp_path, "small", [*reqs, req(2, 20.0, [(None, 100)])], store_kv_mem="20MiB")
    assert rows.loc["r1", "cached_tokens"] == 144 and s["store_evictions"] == 6


# -- prefill and decode instances ----------------------------------------------------------------
def _pd(tmp_path, name, reqs, **kw):
    base = dict(executor="sim", model="llama-3-8b", disagg="1:1", max_model_len=16384, load_policy="always")
    base.update(kw)
    rp = DisaggReplay("<test>", ReplayConfig(**base), str(tmp_path / name), reqs)
    s = rp.run()
    return s, pd.read_parquet(tmp_path / name / "transfers.parquet").set_index("id")


def test_the_store_gives_a_later_prefill_the_answer_the_decode_instance_wrote(tmp_path):
    """Without a store a prefill instance never holds an answer (it never generates one): turn 2's prefill
    hits turn 1's prompt only (16 whole blocks). With one, the decode instance writes the answer's blocks
    and the prefill finds them (20 whole blocks) -- unless decode instances do not write, or the second
    turn comes before the store's index shows them."""
    _, t = _pd(tmp_path, "none", two_turns())
    assert t.loc["r1", "prefill_cached_tokens"] == 256
    s, t = _pd(tmp_path, "store", two_turns(), store_kv_mem="1GiB")
    assert t.loc["r1", "prefill_cached_tokens"] == 320
    assert t.loc["r1", "decode_cached_tokens"] == 320 and list(t["blocks"]) == [17, 3]  # (the link's bytes as before)
    assert s["hit_rate_store"] == pytest.approx(64 / (260 + 364))
    _, t = _pd(tmp_path, "nodec", two_turns(), store_kv_mem="1GiB", store_decode=False)
    assert t.loc["r1", "prefill_cached_tokens"] == 256
    _, t = _pd(tmp_path, "late", two_turns(), store_kv_mem="1GiB", store_delay=60.0)
    assert t.loc["r1", "prefill_cached_tokens"] == 256


def test_kv_aware_routing_sees_the_prefill_instances_cache(tmp_path):
    """r1 finds instance 0 busy with r0 and goes to instance 1; r2 repeats r1's document once both are idle:
    kv-aware sends it where the document is cached (its events reach the router), least-loaded to the
    first idle instance."""
    reqs = [req(0, 0.0, [(None, 3000)]), req(1, 0.001, [("doc", 1600)]), req(2, 30.0, [("doc", 1600)])]
    _, t = _pd(tmp_path, "kv", reqs, disagg="2:1", router="kv-aware")
    assert list(t["prefill"]) == [0, 1, 1] and t.loc["r2", "prefill_cached_tokens"] == 1584
    _, t = _pd(tmp_path, "ll", reqs, disagg="2:1", router="least-loaded")
    assert list(t["prefill"]) == [0, 1, 0] and t.loc["r2", "prefill_cached_tokens"] == 0


# -- the conductor -------------------------------------------------------------------------------
def _conductor(n=2, store=None, block_s=0.0):
    # 1 ms a cached token's worth of attention is not modelled: 10 us per new token, 0.1 us per cached one
    return Router("conductor", n, block_size=BS, prefill_s=lambda cached, new: new * 1e-5 + cached * 1e-7,
                  store_match=store, store_block_s=block_s)


def test_the_conductor_takes_the_cached_instance_unless_its_queue_costs_more():
    r = _conductor()
    r.index.publish(1, 0.0, [(True, list(range(1, 61)))])  # instance 1 caches 60 blocks of the prompt
    keys = list(range(1, 101))
    assert r.route(0.0, None, keys, 100, None, 1600) == (1, 60)  # 640 new tokens there, 1,600 on 0
    assert r.busy_until[1] == pytest.approx(640e-5 + 960e-7)
    # instance 1's queue (6.5 ms) + 6.5 ms beats instance 0's 16 ms; once it holds 3 such prompts it does not
    assert r.route(0.0, None, keys, 100, None, 1600)[0] == 1
    assert r.route(0.0, None, keys, 100, None, 1600)[0] == 0
    assert r.busy_until[0] == pytest.approx(0.016)
    # the queue drains with time: an hour later both are idle and the cache decides again
    assert r.route(3600.0, None, keys, 100, None, 1600)[0] == 1
    assert r.busy_until[1] == pytest.approx(3600.0 + 640e-5 + 960e-7)  # (its work starts now, not back then)


def test_the_conductor_loads_from_the_store_where_that_is_faster():
    keys = list(range(1, 101))
    fast = _conductor(store=lambda k, now: 100, block_s=1e-6)
    assert fast.route(0.0, None, keys, 100, None, 1600) == (0, 100)  # the whole prompt from the store
    assert fast.busy_until[0] == pytest.approx(100e-6 + 1600e-7)
    slow = _conductor(store=lambda k, now: 100, block_s=1.0)
    assert slow.route(0.0, None, keys, 100, None, 1600) == (0, 0)  # computing it is faster
    assert slow.busy_until[0] == pytest.approx(0.016)


def test_the_conductor_on_prefill_instances_uses_the_cost_model(tmp_path):
    """Over P/D the conductor spreads uncached prompts by their prefill times and sends a repeat where
    it is cached."""
    reqs = [req(0, 0.0, [(None, 3000)]), req(1, 0.001, [("doc", 1600)]), req(2, 30.0, [("doc", 1600)])]
    s, t = _pd(tmp_path, "c", reqs, disagg="2:1", router="conductor")
    assert list(t["prefill"]) == [0, 1, 1] and t.loc["r2", "prefill_cached_tokens"] == 1584
    assert s["router_mispredicted_blocks"] == 0


# -- the command line ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(store_kv_mem="1KiB"), "--store-kv-mem"),
    (dict(store_kv_mem="1GiB", store_delay=-1.0), "--store-delay"),
    (dict(store_kv_mem="1GiB", store_bw=0.0), "--store-bw"),
    (dict(store_kv_mem="1GiB", prefix_mode="radix"), "--store-kv-mem"),
    (dict(cpu_kv_mem="1GiB"), "--cpu-kv-mem"),
])
def test_bad_store_settings_are_refused_naming_the_option(tmp_path, kw, field):
    with pytest.raises(InputError) as e:
        _pd(tmp_path, "bad", two_turns(), **kw)
    assert e.value.field == field


def test_the_cli_takes_the_store_and_the_conductor(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kvbench", "replay", str(REPO / "traces" / "chat.jsonl"),
                               "--limit", "30", "--time-scale", "0.05", *args], capture_output=True, text=True,
                              cwd=REPO)
    r = cli("--disagg", "2:1", "--router", "conductor", "--store-kv-mem", "64GiB", "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    r = cli("--store-kv-mem", "64GiB", "--store-delay", "x", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--store-delay" in r.stderr


def test_the_router_matters_with_prefill_instances_and_the_store_settings_with_a_store():
    """A sweep collapses what a configuration does not use: the router is used by P:D's prefill
    instances (one replica), the store's settings only with a store."""
    from kvbench.sweep.grid import not_applicable

    assert "router" in not_applicable(ReplayConfig(router="conductor").to_dict())
    assert "router" not in not_applicable(ReplayConfig(router="conductor", disagg="2:1").to_dict())
    assert {"store_bw", "store_delay", "store_decode"} <= not_applicable(ReplayConfig(store_bw=7.0).to_dict())
    assert "store_bw" not in not_applicable(ReplayConfig(store_kv_mem="1TiB", store_bw=7.0).to_dict())
    assert "store_decode" in not_applicable(ReplayConfig(store_kv_mem="1TiB").to_dict())  # (no decode instances)
    assert "offload" in not_applicable(ReplayConfig(store_kv_mem="1TiB").to_dict())  # (a store is written through)
    assert "offload" not in not_applicable(ReplayConfig(store_kv_mem="1TiB", cpu_kv_mem="1TiB").to_dict())


def test_the_ideal_is_one_caches_whatever_the_instances_and_a_store_stays_under_it(tmp_path):
    """The ideal hit rate is one unbounded cache's over the trace: the same for one replica, four, or P:D
    instances -- whose API servers let a short prompt reach the engine before a long one issued first --
    and a shared store, which every instance reaches, never passes it."""
    from kvbench.engine.runs import replay

    trace = str(REPO / "traces" / "mooncake_slice.jsonl")
    base = dict(executor="sim", model="llama-3-8b", gpu="h200", kv_mem="24GiB", max_model_len=131072)
    one = replay(trace, ReplayConfig(**base), str(tmp_path / "one"))
    four = replay(trace, ReplayConfig(**base, replicas=4, router="round-robin", store_kv_mem="1TiB"),
                  str(tmp_path / "four"))
    pd31 = replay(trace, ReplayConfig(**base, disagg="3:1", router="least-loaded"), str(tmp_path / "pd"))
    assert four["ideal_hit_rate"] == pd31["ideal_hit_rate"] == one["ideal_hit_rate"] > 0
    assert one["prefix_hit_rate"] < four["prefix_hit_rate"] <= four["ideal_hit_rate"]


def test_a_decode_instance_loads_its_prompt_over_the_link_not_from_the_store(tmp_path):
    """r1 repeats r0's document while r0 still decodes on the first decode instance, so it goes to the
    second, whose pool never held it: it loads it all over the link -- the store, where the prefill
    instance wrote it, is not a decode instance's to read (NIXL pulls from the prefill instance)."""
    reqs = [req(0, 0.0, [("doc", 1600)], out=400), req(1, 1.0, [("doc", 1600)], out=4)]
    _, t = _pd(tmp_path, "r", reqs, disagg="1:2", store_kv_mem="1GiB")
    assert t.loc["r0", "decode"] != t.loc["r1", "decode"]
    assert t.loc["r1", "prefill_cached_tokens"] == 1584 and t.loc["r1", "decode_cached_tokens"] == 0
    assert t.loc["r1", "blocks"] == 100


def test_a_store_needs_the_sim_and_one_table(tmp_path):
    """The model executor's tiers are its own memory, and a hybrid model keeps several tables: a shared
    store is refused there, naming --store-kv-mem; so is the conductor without the sim's cost model."""
    with pytest.raises(InputError) as e:
        ReplayConfig(executor="model", model="tiny", store_kv_mem="64MiB").validate()
    assert e.value.field == "--store-kv-mem"
    with pytest.raises(InputError) as e:
        ReplayConfig(executor="model", model="tiny", replicas=2, router="conductor").validate()
    assert e.value.field == "--router"
    with pytest.raises(InputError) as e:
        Replay("<t>", ReplayConfig(executor="sim", model="gpt-oss-120b", store_kv_mem="1GiB"), str(tmp_path / "h"),
               requests=two_turns())
    assert e.value.field == "--store-kv-mem"


def test_write_back_tiers_and_a_store_together(tmp_path):
    """A CPU tier written back and a store written through, behind two replicas: the same document is
    found by the second replica in the store, and the hit rates by tier add up to the total."""
    reqs = [req(0, 0.0, [("doc", 160)]), req(1, 10.0, [("doc", 160)])]
    s, rows = _mixed(tmp_path, "wb", reqs, cpu_kv_mem="1GiB", offload="write-back", store_kv_mem="1GiB")
    assert rows.loc["r1", "cached_tokens"] == 144 and s["hit_rate_store"] == pytest.approx(144 / 320)
    assert s["hit_rate_disk"] is None
    assert s["hit_rate_gpu"] + s["hit_rate_cpu"] + s["hit_rate_store"] == pytest.approx(s["prefix_hit_rate"])


def test_the_reports_tiers_chart_stacks_the_stores_hits(tmp_path):
    """A sweep over store sizes on two replicas: the report's tiers chart is drawn, each run's store share
    stacked on the GPU pool's."""
    from kvbench.cli.replay import REPLAY_OPTIONS
    from kvbench.report.cluster_charts import tiers as tiers_chart
    from kvbench.report.data import load_inputs
    from kvbench.sweep import parse_grid, run_sweep

    grid = parse_grid({"executor": "sim", "model": "llama-3-8b", "num_blocks": "300", "limit": "80", "replicas": "2",
                       "router": "round-robin", "store_kv_mem": "0,8GiB"}, REPLAY_OPTIONS)
    run_sweep(str(REPO / "traces" / "chat.jsonl"), grid, str(tmp_path / "sw"))
    (section,) = load_inputs([str(tmp_path / "sw")]).sections
    fig = tiers_chart(section)
    assert fig is not None
    n = len(section.runs)
    gpu, store = fig.axes[0].patches[:n], fig.axes[0].patches[n:2 * n]
    assert [r.metric("hit_rate_store") is None for r in section.runs] == [True, False]
    for r, g, st in zip(section.runs, gpu, store):
        assert st.get_width() == pytest.approx(100 * (r.metric("hit_rate_store") or 0.0))
        assert st.get_x() == pytest.approx(g.get_width())
    assert section.runs[1].metric("hit_rate_store") > 0
