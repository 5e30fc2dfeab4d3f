"""Disaggregated prefill and decode (engine.disagg, engine.link): the rules of vLLM 0.34's KV-connector
P/D that kvbench follows, and the invariants every run keeps -- on the shipped traces, on a real
Mooncake slice and on random traces."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.engine.config import ReplayConfig
from kvbench.engine.disagg import DisaggReplay
from kvbench.engine.link import LINKS, Links
from kvbench.engine.runs import replay
from kvbench.errors import InputError, RunError
from kvbench.trace.format import Request, Segment

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"
BS = 16
BLOCK_BYTES = 2_097_152  # llama-3-8b bf16: 16 tokens x 32 layers x 2 x 8 heads x 128 x 2 bytes


def cfg(**kw) -> ReplayConfig:
    base = dict(executor="sim", model="llama-3-8b", disagg="1:1", max_model_len=16384)
    base.update(kw)
    return ReplayConfig(**base)


def run(trace, c: ReplayConfig, out: Path, requests=None, events=False):
    rp = DisaggReplay(str(trace), c, str(out), requests)
    if events:
        rp.events = []
    summary = rp.run()
    return rp, summary


# -- the link -------------------------------------------------------------------------------
def test_one_transfer_takes_its_bytes_over_the_rate_plus_the_latency():
    links = Links({0: 1e9, 1: 1e9}, latency_s=1e-3)
    links.start(2.0, 7, 500_000_000, 0, 1)
    assert links.next_end() == pytest.approx(2.0 + 1e-3)  # its bytes begin to flow
    assert links.advance(2.001) == [] and links.next_end() == pytest.approx(2.501)
    assert links.advance(2.5) == []
    assert links.advance(2.501) == [7]
    assert links.bytes_total == 500_000_000 and links.busy_bytes[1] == pytest.approx(5e8)


def test_transfers_share_a_link_max_min_fairly():
    """Two transfers into one decode link split it; when one ends the other takes the whole rate. A
    sender feeding two receivers is the bottleneck of both (its rate split in two), and a third
    transfer elsewhere is not slowed by them."""
    links = Links({0: 1e9, 1: 1e9, 2: 1e9, 3: 1e9}, latency_s=0.0)
    links.start(0.0, 1, 1_000_000_000, 0, 2)  # 1 GB
    links.start(0.0, 2, 500_000_000, 1, 2)  # 0.5 GB, same receiver
    # both at 0.5 GB/s: #2 ends at 1 s, then #1 has 0.5 GB left at the full rate: 1.5 s
    assert links.advance(1.0) == [2]
    assert links.advance(1.5) == [1]
    links = Links({0: 1e9, 1: 1e9, 2: 1e9, 3: 1e9, 4: 1e9}, latency_s=0.0)
    links.start(0.0, 1, 500_000_000, 0, 2)
    links.start(0.0, 2, 500_000_000, 0, 3)  # one sender, two receivers: 0.5 GB/s each
    links.start(0.0, 3, 500_000_000, 1, 4)  # its own links: 1 GB/s
    assert links.advance(0.5) == [3]
    assert links.advance(1.0) == [1, 2]


def test_presets_are_line_rates_per_gpu():
    assert LINKS["ib-400"].bytes_per_s == 50e9 and LINKS["ib-200"].bytes_per_s == 25e9
    assert LINKS["nvlink"].bytes_per_s == 450e9 and LINKS["tcp"].bytes_per_s == 12.5e9


# -- a run's parts ---------------------------------------------------------------------------
def _two_turns() -> list[Request]:
    """A conversation of two turns: the second re-sends the first prompt and its answer."""
    a, q1 = Segment("shared", 160, "sys"), Segment("shared", 100, "q1")
    ans, q2 = Segment("shared", 64, "ans"), Segment("unique", 40)
    return [Request(id="t1", t=0.0, prompt=(a, q1), output_len=64, session="s", output="ans", index=0, line=1,
                    prompt_len=260),
            Request(id="t2", t=5.0, prompt=(a, q1, ans, q2), output_len=8, session="s", index=1, line=2,
                    prompt_len=364)]


def test_the_answer_is_cached_on_the_decode_side_only(tmp_path):
    """The prefill instance never generates the answer, so a later turn's prefill misses the answer's
    blocks (it hits the first prompt's 16 whole blocks only), while the decode instance -- which wrote
    them -- hits them and loads only the rest; the bytes moved are the blocks the decode side lacks."""
    rp, s = run("<two-turns>", cfg(), tmp_path / "r", requests=_two_turns())
    t = pd.read_parquet(tmp_path / "r" / "transfers.parquet").set_index("id")
    assert t.loc["t1", "prefill_cached_tokens"] == 0 and t.loc["t1", "decode_cached_tokens"] == 0
    assert t.loc["t2", "prefill_cached_tokens"] == 256  # 260 prompt tokens: 16 whole blocks
    assert t.loc["t2", "decode_cached_tokens"] == 320  # prompt 1 + answer (323 written: 20 whole blocks)
    assert list(t["blocks"]) == [17, 23 - 20]
    assert list(t["bytes"]) == [17 * BLOCK_BYTES, 3 * BLOCK_BYTES]
    assert s["prefix_hit_rate"] == pytest.approx(256 / (260 + 364))
    assert s["disagg"]["decode_hit_rate"] == pytest.approx(320 / (260 + 364))
    assert s["disagg"]["transfer_bytes"] == 20 * BLOCK_BYTES
    # decode-side blocks awaiting KV: each load's blocks from its start to its landing
    assert s["disagg"]["decode_awaiting_blocks_peak"] == 17
    assert s["disagg"]["decode_awaiting_blocks_mean"] == pytest.approx(
        (t["blocks"] * t["transfer_ms"]).sum() / 1e3 / s["duration_s"], rel=1e-6)


def test_ttft_is_the_sum_of_its_parts_on_chat(tmp_path):
    c = cfg(limit=120, time_scale=0.05, disagg="2:2", link="ib-200")
    rp, s = run(TRACES / "chat.jsonl", c, tmp_path / "r")
    t = pd.read_parquet(tmp_path / "r" / "transfers.parquet").set_index("id")
    r = pd.read_parquet(tmp_path / "r" / "requests.parquet").set_index("id")
    assert s["completed"] == 120 and len(t) == 120
    parts = t[["prefill_wait_ms", "prefill_ms", "hop_ms", "admit_ms", "transfer_ms", "first_step_ms"]]
    assert (parts.to_numpy() >= -1e-9).all()
    np.testing.assert_allclose(parts.sum(axis=1), t["ttft_ms"], rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(t["ttft_ms"], r.loc[t.index, "ttft_ms"], rtol=1e-12)
    # a transfer takes at least its bytes over the link (25 GB/s per GPU) plus the latency
    assert (t["transfer_ms"] >= t["bytes"] / 25e9 * 1e3 + LINKS["ib-200"].latency_s * 1e3 - 1e-9).all()
    np.testing.assert_array_equal(t["bytes"], t["blocks"] * BLOCK_BYTES)
    r_all = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    assert set(r_all["replica"]) <= {2, 3}  # requests finish on decode instances
    assert set(t["prefill"]) == {0, 1} and set(t["decode"]) == {2, 3}
    for rep in rp.replicas:  # nothing held or loading at the end
        assert not rep.sched.held and not rep.sched.holding and rep.kv.stats()[0] == 0
    assert s["disagg"]["prefill_held_blocks_peak"] > 0 and s["disagg"]["link_util_recv"] > 0


def _check_order(rp: DisaggReplay, out: Path) -> None:
    """No decode step for a request before its KV landed; its prefill blocks freed when it landed, not
    before; a load starts after the request reached the decode instance."""
    ev = pd.DataFrame(rp.events, columns=["t", "what", "id", "inst", "tokens"])
    t = pd.read_parquet(out / "transfers.parquet").set_index("id")
    landed = ev[ev.what == "landed"].set_index("id")["t"]
    freed = ev[ev.what == "free"].set_index("id")["t"]
    loads = ev[ev.what == "load"].set_index("id")["t"]
    steps = ev[ev.what == "step"].groupby("id")["t"].min()
    first = ev[ev.what == "step"].groupby("id")["tokens"].first()
    assert (first.loc[t.index] == 1).all()  # the first step recomputes the prompt's last token, and samples
    loaded = ev[ev.what == "load"].set_index("id")["tokens"]  # the prompt less the decode side's hit
    np.testing.assert_array_equal(loaded.loc[t.index] + t["decode_cached_tokens"],
                                  rp_prompt_lens(rp, t.index))
    assert landed.index.is_unique and set(landed.index) == set(t.index)
    assert (steps.loc[landed.index] >= landed - 1e-12).all()
    assert (freed.loc[landed.index] == landed).all()
    assert (loads.loc[t.index] >= 0).all()
    bytes_time = t["bytes"] / min(rp.link_rates)
    assert (landed.loc[t.index] - loads.loc[t.index] >= bytes_time + rp.links.latency_s - 1e-9).all()


def rp_prompt_lens(rp: DisaggReplay, ids) -> np.ndarray:
    lens = {rp.trace.request(i).id: rp.trace.request(i).prompt_len for i in range(len(rp.trace))}
    return np.array([lens[i] for i in ids])


def test_the_order_of_a_requests_events_on_mooncake_under_pressure(tmp_path):
    """The real Mooncake slice with few decode blocks: preemptions on the decode side (each recomputes
    there), and every event in its order."""
    c = cfg(num_blocks=3000, time_scale=0.5, max_model_len=32768, disagg="2:1")
    rp, s = run(TRACES / "mooncake_slice.jsonl", c, tmp_path / "r", events=True)
    assert s["completed"] + s["rejected"] == s["requests"]
    assert s["preemptions"] > 0
    _check_order(rp, tmp_path / "r")


@st.composite
def traces(draw):
    n = draw(st.integers(2, 14))
    reqs, t = [], 0.0
    for i in range(n):
        t += draw(st.floats(0.0, 0.3))
        shared = draw(st.sampled_from([0, 16, 40]))
        own = draw(st.integers(1, 90))
        segs = ([Segment("shared", shared, "sys")] if shared else []) + [Segment("unique", own)]
        reqs.append(Request(id=f"r{i}", t=round(t, 6), prompt=tuple(segs), output_len=draw(st.integers(1, 40)),
                            index=i, line=i + 1, prompt_len=shared + own))
    return reqs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=traces(), blocks=st.integers(12, 60), p=st.integers(1, 2), d=st.integers(1, 2),
       gbps=st.sampled_from([0.5, 5.0, 400.0]), local=st.sampled_from([0, 0, 40]),
       router=st.sampled_from(["round-robin", "kv-aware", "conductor"]),
       model=st.sampled_from(["llama-3-8b", "llama-3-8b", "gpt-oss-120b"]), store=st.sampled_from([None, "16MiB"]))
def test_random_traces_keep_every_invariant(tmp_path_factory, reqs, blocks, p, d, gbps, local, router, model,
                                            store):
    """Over random traces, pools, instances, links, routers, a full-attention or a sliding-window model
    and a shared store (full attention only): no decode step before a request's KV landed, no prefill
    block freed before, TTFT the sum of its parts, nothing held or leaked at the end."""
    out = tmp_path_factory.mktemp("r")
    hybrid = model == "gpt-oss-120b"  # (a token takes a block slot in each of its two groups)
    c = cfg(num_blocks=blocks * (2 if hybrid else 1), disagg=f"{p}:{d}", link_gbps=gbps, max_num_seqs=4,
            disagg_local_prefill=local, max_batched_tokens=64, max_model_len=256, router=router, model=model,
            store_kv_mem=store if model == "llama-3-8b" else None)
    rp, s = run("<random>", c, out / "r", requests=reqs, events=True)
    assert s["completed"] == len(reqs)
    assert len(pd.read_parquet(out / "r" / "transfers.parquet")) + s["disagg"]["local_prefills"] == len(reqs)
    _check_order(rp, out / "r")
    t = pd.read_parquet(out / "r" / "transfers.parquet")
    parts = t[["prefill_wait_ms", "prefill_ms", "hop_ms", "admit_ms", "transfer_ms", "first_step_ms"]]
    np.testing.assert_allclose(parts.sum(axis=1), t["ttft_ms"], rtol=1e-9, atol=1e-6)
    for rep in rp.replicas:
        assert not rep.sched.held and not rep.sched.holding and rep.kv.stats()[0] == 0


def test_a_slower_link_only_delays(tmp_path):
    """The same trace over TCP instead of NVLink: the same requests, the same prefill-side hits (a pool
    that never fills), transfers tens of times slower."""
    a = run(TRACES / "chat.jsonl", cfg(limit=80, time_scale=0.05, link="nvlink"), tmp_path / "a")[1]
    b = run(TRACES / "chat.jsonl", cfg(limit=80, time_scale=0.05, link="tcp"), tmp_path / "b")[1]
    assert a["completed"] == b["completed"] == 80
    assert b["disagg"]["transfer_ms_p50"] > 10 * a["disagg"]["transfer_ms_p50"]
    assert a["prefix_hit_rate"] == b["prefix_hit_rate"] and a["disagg"]["transfer_bytes"] == b["disagg"]["transfer_bytes"]


def test_the_lane_changes_nothing(tmp_path, monkeypatch):
    from kvbench.scheduler import Scheduler

    c = cfg(limit=100, time_scale=0.05, disagg="1:2")
    a = run(TRACES / "chat.jsonl", c, tmp_path / "a")[1]
    monkeypatch.setattr(Scheduler, "lane_enabled", False)
    b = run(TRACES / "chat.jsonl", c, tmp_path / "b")[1]
    for k in ("ttft_ms_p50", "tpot_ms_p99", "steps", "prefix_hit_rate", "output_tokens"):
        assert a[k] == b[k]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a" / "transfers.parquet"),
                                  pd.read_parquet(tmp_path / "b" / "transfers.parquet"))


@pytest.mark.parametrize("kw,field", [
    (dict(replicas=2), "--replicas"),
    (dict(layout="slab"), "--layout"),
    (dict(prefix_mode="radix"), "--prefix-mode"),
    (dict(cpu_kv_mem="8GiB"), "--cpu-kv-mem"),
    (dict(eviction="h2o"), "--eviction"),
    (dict(cache_policy="belady"), "--cache-policy"),
    (dict(disagg="0:2"), "--disagg"),
    (dict(link="carrier-pigeon"), "--link"),
    (dict(link_gbps=-1.0), "--link-gbps"),
    (dict(decode_gpu="zz"), "--decode-gpu"),
    (dict(decode_kv_mem="1KiB"), "--decode-kv-mem"),
    (dict(model="granite-4.0-h-tiny"), "--disagg"),  # (a recurrent state per sequence)
])
def test_what_is_not_modelled_is_refused(tmp_path, kw, field):
    with pytest.raises(InputError) as e:
        run(TRACES / "chat.jsonl", cfg(limit=5, **kw), tmp_path / "r")
    assert e.value.field == field


def test_the_cli_runs_it_and_refuses_in_one_line(tmp_path):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kvbench", "replay", str(TRACES / "chat.jsonl"), "--limit", "30",
                               "--time-scale", "0.05", *args], capture_output=True, text=True, cwd=REPO)
    out = tmp_path / "r"
    r = cli("--disagg", "1:2", "--link", "ib-200", "--slo", "ttft=500,tpot=50",
            "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["disagg"]["gpus"] == 3 and s["disagg"]["goodput_req_per_s_per_gpu"] is not None
    assert math.isclose(s["disagg"]["goodput_req_per_s_per_gpu"] * 3, s["goodput_req_per_s"])
    assert (out / "transfers.parquet").exists()
    r = cli("--disagg", "1:2", "--replicas", "2", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--replicas" in r.stderr
    r = cli("--disagg", "1:x", "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "--disagg" in r.stderr
    import subprocess as sp
    import sys as system
    rep = sp.run([system.executable, "-m", "kvbench", "report", str(out), "--out", str(tmp_path / "report")],
                 capture_output=True, text=True, cwd=REPO)
    assert rep.returncode == 0 and "left out" not in rep.stderr, rep.stderr  # (the summary's disagg object)


@pytest.mark.parametrize("model", ["llama-3-8b", "gpt-oss-120b"])  # (one table; a full and a sliding group)
def test_blocks_being_loaded_are_not_hit_until_they_arrive(tmp_path, model):
    """vLLM caches a load's blocks only once they arrive (allocate_slots' delay_cache_blocks): a second
    request with the same prompt that reaches the decode instance while the first one's KV is still on
    the wire hits nothing there and loads it all; a third, after, hits the first one's blocks (a sliding
    group's too: the window before the prompt's end is cached when the load lands)."""
    sys_seg = Segment("shared", 320, "doc")
    reqs = [Request(id=f"q{i}", t=t, prompt=(sys_seg, Segment("unique", 8)), output_len=4, index=i, line=i + 1,
                    prompt_len=328) for i, t in enumerate((0.0, 0.001, 30.0))]
    c = cfg(link_gbps=0.1, disagg="2:1", router="round-robin", model=model)
    rp, s = run("<same-prompt>", c, tmp_path / "r", requests=reqs, events=True)
    t = pd.read_parquet(tmp_path / "r" / "transfers.parquet").set_index("id")
    assert t.loc["q0", "decode_cached_tokens"] == 0 and t.loc["q1", "decode_cached_tokens"] == 0
    assert t.loc["q2", "decode_cached_tokens"] == 320
    _check_order(rp, tmp_path / "r")


def test_the_decode_pool_has_its_own_gpus_pool_and_limits(tmp_path):
    """--decode-tp, --decode-num-blocks, --decode-max-num-seqs: the decode instances' own. A GQA model's
    block is split over the decode GPUs, so the bytes a request moves do not change with --decode-tp, but
    each GPU brings its own link; with MLA every decode GPU holds and reads a whole copy of the latent,
    so the bytes grow with the decode GPUs (vLLM's NIXL with MLA: each decode rank pulls the whole)."""
    base = dict(limit=40, time_scale=0.05)
    a = run(TRACES / "chat.jsonl", cfg(**base), tmp_path / "a")[1]
    b = run(TRACES / "chat.jsonl", cfg(**base, decode_tp=2, decode_num_blocks=3000, decode_max_num_seqs=8),
            tmp_path / "b")[1]
    assert b["disagg"]["decode_num_blocks"] == 3000 and b["disagg"]["gpus"] == 3
    assert b["disagg"]["link_gbps_per_decode_instance"] == 2 * a["disagg"]["link_gbps_per_decode_instance"] == 800
    gqa = [pd.read_parquet(tmp_path / x / "transfers.parquet").eval("bytes / blocks") for x in "ab"]
    assert set(gqa[0]) == set(gqa[1]) == {BLOCK_BYTES}
    assert b["per_replica"][1]["peak_running"] <= 8 < a["per_replica"][1]["peak_running"]
    mla = dict(model="deepseek-v3", tp=8, num_blocks=4000, limit=20, time_scale=0.05)
    run(TRACES / "chat.jsonl", cfg(**mla), tmp_path / "c")
    run(TRACES / "chat.jsonl", cfg(**mla, decode_tp=16), tmp_path / "d")
    per_block = [pd.read_parquet(tmp_path / x / "transfers.parquet").eval("bytes / blocks") for x in "cd"]
    assert per_block[0].nunique() == per_block[1].nunique() == 1
    assert per_block[1].iloc[0] == 2 * per_block[0].iloc[0]
    with pytest.raises(InputError) as e:
        cfg(decode_tp=0).validate()
    assert e.value.field == "--decode-tp"
    with pytest.raises(RunError) as e:  # a prompt the decode pool can never hold: refused before the run
        run(TRACES / "chat.jsonl", cfg(limit=40, decode_num_blocks=64), tmp_path / "e")
    assert "chat.jsonl:2:" in str(e.value) and "a decode instance's pool holds 64" in str(e.value)
    assert "--decode-num-blocks" in str(e.value) and e.value.usage


@pytest.mark.parametrize("threshold,local", [(0, set()), (43, set()), (44, {"t2"}), (260, {"t1", "t2"})])
def test_conditional_disaggregation_prefills_short_uncached_prompts_on_the_decode_side(tmp_path, threshold, local):
    """NVIDIA Dynamo's conditional disaggregation (--disagg-local-prefill N): the decode instance a request
    reaches prefills it itself when its prompt less what that instance caches is at most N tokens. The
    second turn re-sends the first turn's prompt and answer, which the decode instance holds (320 of its
    364 tokens): 44 uncached tokens, local from N = 44 on; the first turn (260, nothing cached) from 260."""
    rp, s = run("<two-turns>", cfg(disagg_local_prefill=threshold), tmp_path / "r", requests=_two_turns())
    t = pd.read_parquet(tmp_path / "r" / "transfers.parquet")
    r = pd.read_parquet(tmp_path / "r" / "requests.parquet").set_index("id")
    assert set(t["id"]) == {"t1", "t2"} - local and s["disagg"]["local_prefills"] == len(local)
    assert s["completed"] == 2 and (r["replica"] == 1).all()  # both finish on the decode instance
    if "t2" in local:  # prefilled where the answer is: its hit is the decode side's 320 tokens
        assert r.loc["t2", "cached_tokens"] == 320
    if local == {"t1", "t2"}:
        assert s["disagg"]["transfer_bytes"] == 0 and rp.replicas[0].st.busy_s == 0
    np.testing.assert_allclose(t[["prefill_wait_ms", "prefill_ms", "hop_ms", "admit_ms", "transfer_ms",
                                  "first_step_ms"]].sum(axis=1), t["ttft_ms"], rtol=1e-9, atol=1e-6)


def test_a_hybrid_models_transfer_moves_each_groups_blocks(tmp_path):
    """gpt-oss (sliding window 128 + full attention, one group each): the decode side allocates, and the
    link moves, every full-attention block it lacks but only the window's last blocks of the sliding group
    (vLLM: allocate_external_computed_blocks; NIXL get_exchange_clipped_blocks). A later prompt extending
    the first hits it on the decode side: the loaded blocks were cached in both groups when they landed."""
    reqs = [Request(id="a", t=0.0, prompt=(Segment("shared", 3000, "doc"),), output_len=16, index=0, line=1,
                    prompt_len=3000),
            Request(id="b", t=50.0, prompt=(Segment("shared", 3000, "doc"), Segment("unique", 500)), output_len=8,
                    index=1, line=2, prompt_len=3500)]
    rp, s = run("<gpt-oss>", cfg(model="gpt-oss-120b", gpu="h200"), tmp_path / "r", requests=reqs)
    kinds = [g.kind for g in rp.kv_layout.groups]
    assert sorted(kinds) == ["full", "sliding"]
    per_block = dict(zip(kinds, rp.decode_group_bytes))
    t = pd.read_parquet(tmp_path / "r" / "transfers.parquet").set_index("id")
    # a: 188 full blocks; the window (128 tokens) ending at token 2,999 spans 9 blocks
    assert t.loc["a", "blocks"] == 188 + 9
    assert t.loc["a", "bytes"] == 188 * per_block["full"] + 9 * per_block["sliding"]
    # b: its first 2,992 tokens hit on the decode side; 219 - 187 full blocks and the window's 9 move
    assert t.loc["b", "decode_cached_tokens"] == 2992 and t.loc["b", "blocks"] == 32 + 9
    # the prefill side holds, once a request finished, its full blocks and its window's (b: 219 + 9)
    assert s["disagg"]["prefill_held_blocks_peak"] == 219 + 9


def test_each_group_moves_its_own_layers_bytes(tmp_path):
    """Gemma 3 27B: its 52 sliding layers are split into groups of unequal sizes beside the full ones, and
    a transfer moves each group's blocks times that group's layers -- so the bytes are the full layers'
    blocks and the sliding layers' window blocks, whatever the grouping."""
    reqs = [Request(id="a", t=0.0, prompt=(Segment("unique", 3000),), output_len=4, index=0, line=1, prompt_len=3000)]
    rp, _ = run("<gemma>", cfg(model="gemma-3-27b", gpu="h200"), tmp_path / "r", requests=reqs)
    groups = rp.kv_layout.groups
    assert len({len(g.layers) for g in groups}) > 1  # (unequal groups: the case this test is for)
    page = rp.decode_group_bytes[0] // len(groups[0].layers)
    full = sum(len(g.layers) for g in groups if g.kind == "full")
    sliding = sum(len(g.layers) for g in groups if g.kind == "sliding")
    window = {g.window for g in groups if g.kind == "sliding"}.pop()
    window_blocks = -(-3000 // BS) - max(0, 3000 - window + 1) // BS
    t = pd.read_parquet(tmp_path / "r" / "transfers.parquet").set_index("id")
    assert t.loc["a", "bytes"] == (188 * full + window_blocks * sliding) * page
