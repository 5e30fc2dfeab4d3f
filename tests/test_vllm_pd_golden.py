"""kvbench's disaggregated replay (engine.disagg) against vLLM 0.34's own prefill and decode Schedulers with
a KV connector, driven without a model (benchmarks/vllm_reference/pd.py: two real Schedulers, a connector
of the driver's own that answers as NIXL's pull scheduler does, loads and sends finished after the
modelled times; the waiting states, the delayed frees and the KV cache managers are vLLM's).

Each golden (tests/data/vllm-pd-0.34-*.json.gz, written by make_pd_golden.py) holds every step that
computed something on either side, and per request its load and its hits: kvbench must make the same
prefill steps and decode steps (every scheduled request and token count, every preemption, in order),
start and land every load at the same time, move the same blocks -- those the decode side lacks, the
block ids vLLM's connector was handed -- and produce each first token and finish at the same time."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.disagg import DisaggReplay
from test_vllm_golden import MOONCAKE, golden_trace, step_digest

DATA = Path(__file__).resolve().parent / "data"
GOLDENS = sorted(DATA.glob("vllm-pd-0.34-*.json.gz"))


@pytest.mark.parametrize("path", GOLDENS, ids=[p.name[len("vllm-pd-0.34-"):-len(".json.gz")] for p in GOLDENS])
def test_same_steps_loads_and_frees_as_vllm_0_34(path, tmp_path):
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        golden = json.load(fh)
    if "mooncake" in golden["trace_spec"] and not MOONCAKE.exists():
        pytest.skip("the real Mooncake trace is not beside the checkout")
    c = golden["config"]
    blocks = golden["kvbench_num_blocks"]
    assert c["max_num_inflight_kv_loads"] is None
    clock = tmp_path / "linear.json"
    clock.write_text(json.dumps({"kind": "linear", "prefill_ms_per_token": c["prefill_ms_per_token"],
                                 "decode_step_ms": c["decode_step_ms"], "overhead_ms": 0}))
    model = c.get("layers") or "llama-3-8b"  # (a hybrid golden names the preset whose layers it built)
    cfg = ReplayConfig(executor="sim", model=model, calibration=str(clock), front_end=False,
                       num_blocks=blocks["prefill"], block_size=c["block_size"], max_num_seqs=c["p_max_num_seqs"],
                       max_batched_tokens=c["p_max_num_batched_tokens"], max_model_len=131072,
                       decode_num_blocks=blocks["decode"], decode_max_num_seqs=c["d_max_num_seqs"],
                       decode_max_batched_tokens=c["d_max_num_batched_tokens"],
                       disagg="1:1", link_gbps=c["link_bandwidth_bytes_per_s"] * 8 / 1e9,
                       link_latency_us=c["link_latency_ms"] * 1e3)
    rp = DisaggReplay(str(golden_trace(golden["trace_spec"], tmp_path / "trace.jsonl")), cfg, str(tmp_path / "run"))
    kinds = [g.kind for g in rp.kv_layout.groups]
    if "hybrid" in golden:  # the same KV cache groups, in vLLM's order
        assert kinds == [g["kind"] for g in golden["hybrid"]["kv_cache_groups"]]
    assert rp.decode_group_bytes == c.get("bytes_per_block_per_group", [c["bytes_per_block"]])
    assert rp._block_bytes == c["bytes_per_block"]
    rp.step_log, rp.events = [], []
    legs, held = {}, {}
    finished = rp._done

    def done(rs, rep, writer, st):  # each leg's blocks per group, before the engine forgets it
        leg = rp.legs.get(rs)
        if leg is not None:
            legs[rs.req.id], held[rs.req.id] = leg.group_blocks, leg.held
        finished(rs, rep, writer, st)
    rp._done = done
    summary = rp.run()
    for side, inst in (("prefill", 0), ("decode", 1)):
        ours = [step_digest([(rid, n) for rid, _, n in sched], pre) for i, sched, pre in rp.step_log if i == inst]
        theirs = golden[f"{side}_step_digests"]
        for k, (a, b) in enumerate(zip(ours, theirs)):
            assert a == b, f"{side} step {k} differs from vLLM's"
        assert len(ours) == len(theirs)
    decode_steps = [(sched, pre) for i, sched, pre in rp.step_log if i == 1]
    assert [[k, pre] for k, (_, pre) in enumerate(decode_steps) if pre] == golden["decode_preemptions"]
    t = pd.read_parquet(tmp_path / "run" / "transfers.parquet").set_index("id")
    r = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("id")
    ev = pd.DataFrame(rp.events, columns=["t", "what", "id", "inst", "tokens"])
    load = ev[ev.what == "load"].set_index("id")["t"]
    landed = ev[ev.what == "landed"].set_index("id")["t"]
    assert summary["completed"] == len(golden["requests"])
    for rid, (start, end, nblocks, nbytes, d_hit, p_hit, first, finish) in golden["requests"].items():
        assert (t.loc[rid, "blocks"], t.loc[rid, "bytes"]) == (nblocks, nbytes), rid
        if "load_blocks_per_group" in golden:  # (each group's blocks: a sliding window's only its window)
            assert legs[rid] == golden["load_blocks_per_group"][rid], rid
            assert held[rid] == sum(golden["p_held_blocks_per_group"][rid]), rid
        assert (t.loc[rid, "decode_cached_tokens"], t.loc[rid, "prefill_cached_tokens"]) == (d_hit, p_hit), rid
        for ours, theirs in ((load[rid], start), (landed[rid], end), (r.loc[rid, "first_token_s"], first),
                             (r.loc[rid, "finish_s"], finish)):
            assert abs(ours - theirs) < 1e-6, rid
