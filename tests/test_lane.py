"""The decode lane (kvbench.scheduler.lane): the running batch's decodes in arrays under compiled code.
A replay with it must be the replay without it, row for row, on the shipped and real traces, in the
configurations it serves (pools short enough that blocks are evicted and requests preempted, blocks of
1 to 32 tokens, no prefix cache, samples of n > 1, dependent turns); and it must actually take the
decodes, so that these comparisons test it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
MOONCAKE = ROOT.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"

CASES = {
    # name: (trace, settings)
    "chat-short-pool": ("chat.jsonl", dict(num_blocks=900, time_scale=0.05, max_model_len=8192)),
    "chat-no-cache": ("chat.jsonl", dict(num_blocks=900, time_scale=0.05, max_model_len=8192, prefix_cache=False)),
    "chat-block-1": ("chat.jsonl", dict(num_blocks=9000, block_size=1, time_scale=0.05, max_model_len=4096,
                                        limit=60)),
    "rag-block-32-first-chunk": ("rag.jsonl", dict(num_blocks=400, block_size=32, admission="first-chunk",
                                                   max_batched_tokens=512, limit=120)),
    "best-of-n": ("best_of_n.jsonl", dict(num_blocks=800, block_size=8)),
    "chat-budget-of-8": ("chat.jsonl", dict(num_blocks=3000, max_batched_tokens=8, time_scale=0.02, max_model_len=8192,
                                            limit=60)),  # every prompt in chunks of 8
    "agent-closed-loop": ("agent.jsonl", dict(num_blocks=1500, max_concurrency=6, dependent_turns=True, limit=80)),
    "mooncake-slice-replicas": ("mooncake_slice.jsonl", dict(num_blocks=5000, replicas=2, time_scale=0.5,
                                                             max_model_len=32768)),
    "mooncake-real": ("real", dict(num_blocks=9000)),
}


def rows(run: Path, name: str) -> list[dict]:
    return [{k: "nan" if isinstance(v, float) and v != v else v for k, v in row.items()}
            for row in pq.read_table(run / name).to_pylist()]


def replay(trace: str, out: Path, lane: bool, **kw) -> tuple[dict, list, list, int]:
    """(summary but its wall time, request rows, step rows, sequence-steps the lanes took)."""
    before = Scheduler.lane_enabled
    Scheduler.lane_enabled = lane
    try:
        rp = Replay(trace, ReplayConfig(executor="sim", model="llama-3-8b", **kw), str(out))
        rp.run()
    finally:
        Scheduler.lane_enabled = before
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("wall_s")
    taken = sum(r.sched.lane.taken for r in rp.replicas if r.sched.lane is not None)
    assert all((r.sched.lane is not None) == lane for r in rp.replicas)
    return summary, rows(out, "requests.parquet"), rows(out, "steps.parquet"), taken


def trace_path(name: str, tmp_path: Path) -> str:
    if name != "real":
        return str(TRACES / name)
    if not MOONCAKE.exists():
        pytest.skip("the real Mooncake trace is not beside the checkout")
    from kvbench.trace.importers import convert
    path = str(tmp_path / "mooncake.jsonl")
    convert("mooncake", str(MOONCAKE), path, limit=400)
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_lane_changes_no_row(name, tmp_path):
    trace, kw = CASES[name]
    path = trace_path(trace, tmp_path)
    on = replay(path, tmp_path / "on", True, **kw)
    off = replay(path, tmp_path / "off", False, **kw)
    assert on[0] == off[0]
    assert on[1] == off[1]
    assert on[2] == off[2]
    decodes = sum(r["decode_seqs"] for r in on[2])
    if name == "best-of-n":  # every request samples n > 1: its samples share a RequestState
        assert on[3] == 0 and decodes > 0
    else:
        assert on[3] > 0.5 * decodes  # the lane took most decodes: the comparison tests it
    if name in ("chat-short-pool", "mooncake-real"):
        assert on[0]["preemptions"] > 0 and on[0]["cache_evictions"] > 0  # the pool was short


@pytest.mark.parametrize("kw", [dict(eviction="h2o", kv_budget=0.5), dict(cpu_kv_mem="1GiB"),
                                dict(replicas=2, router="kv-aware"), dict(cache_policy="fifo"),
                                dict(layout="slab", max_model_len=8192), dict(prefix_mode="radix")],
                         ids=["token-eviction", "tiers", "kv-events", "fifo", "slab", "radix"])
def test_the_lane_stays_off_where_it_does_not_serve(kw, tmp_path):
    """Where something else reads or changes the running sequences mid-run, or the pool is not the
    compiled one, every sequence-step runs the Python path."""
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", num_blocks=2000, limit=5, **kw)
    rp = Replay(str(TRACES / "chat.jsonl"), cfg, str(tmp_path / "run"))
    rp.run()
    assert all(r.sched.lane is None for r in rp.replicas)


def test_a_step_log_keeps_the_lane_off(tmp_path):
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", num_blocks=2000, limit=5)
    rp = Replay(str(TRACES / "chat.jsonl"), cfg, str(tmp_path / "logged"))
    rp.step_log = []
    rp.run()
    assert rp.sched.lane is None and rp.step_log
    plain = Replay(str(TRACES / "chat.jsonl"), cfg, str(tmp_path / "plain"))
    plain.run()
    assert plain.sched.lane is not None and plain.sched.lane.taken > 0


def test_the_lane_reads_and_writes_no_array_out_of_bounds(tmp_path):
    """Two of the comparisons again with numba's bounds checks on, compiled afresh (numba checks no
    index by default: a write past an array is a silent heap overwrite)."""
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                        "-k", "changes_no_row and (chat-short-pool or chat-block-1)"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "2 passed" in r.stdout


def direct(num_blocks: int, block_size: int, lane: bool, max_num_seqs: int = 256):
    """A Scheduler over a PagedKV driven directly (no executor), and a function adding a request of a
    unique prompt; the lane as asked."""
    from kvbench.memory.paged import PagedKV
    from kvbench.scheduler import RequestState, SchedulerConfig
    from kvbench.trace.format import Request, Segment
    from kvbench.trace.keys import sequence_tokens
    from kvbench.trace.tokens import TokenStreams

    streams = TokenStreams()
    kv = PagedKV(num_blocks, block_size)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=max_num_seqs), streams=streams)
    if lane:
        assert sched.enable_lane()

    def add(rid: str, prompt_len: int, output_len: int):
        req = Request(id=rid, t=0.0, prompt=(Segment("unique", prompt_len),), output_len=output_len, index=0,
                      line=1, prompt_len=prompt_len)
        prompt = streams.expand(req)
        s = sched.new_seq(RequestState(req=req, arrival_s=0.0, prompt=prompt), sequence_tokens(req, prompt, streams))
        sched.add(s)
        return s
    return kv, sched, add


def step(sched):
    from kvbench.scheduler import StepResult

    plan = sched.schedule(0.0)
    sched.build_batch(plan)
    return plan, sched.update(plan, StepResult(duration_s=0.01), 0.01 * (sched.steps + 1))


def test_a_decode_into_a_shared_last_block_takes_the_python_path():
    """The lane writes only into a last block its sequence holds alone (PagedKV.allocate's fast path);
    a shared one is copied on write by the Python path, which the lane leaves it to."""
    kv, sched, add = direct(64, 4, True)
    s = add("a", 6, 10)
    assert step(sched)[0].seqs == [s]  # the prefill: the Python path
    assert [step(sched)[0].lane for _ in range(3)] == [1, 1, 1]  # into its block, filling it, a new one
    sched.sync()
    assert (s.num_kv, len(s.table), s.num_registered) == (9, 3, 2)
    kv.pool.incref_many([s.table[-1]])  # another holder of its partly filled last block
    plan, _ = step(sched)
    assert plan.lane == 0 and plan.seqs == [s] and kv.cow_copies == 1


def test_a_lane_grows_past_its_first_slots():
    """More sequences running than the lane's first arrays hold: it grows, keeping every column, and
    the run is the run without it (who finishes when, with which counts)."""
    from kvbench.scheduler.lane import DecodeLane

    runs = []
    for lane in (True, False):
        kv, sched, add = direct(4000, 4, lane)
        if lane:
            sched.lane = DecodeLane(kv, kv.pool, capacity=1)  # 8 slots
        for i in range(30):
            add(f"r{i}", 5 + i, 3 + i % 7)
        log = []
        while sched.has_work():
            plan, done = step(sched)
            log.append((plan.lane, [(rs.req.id, rs.output_tokens, rs.finish_s, rs.itl_max_s) for rs in done]))
        runs.append((log, sched.itl_gaps, kv.pool.index, sched.lane.cap if lane else 0))
    (on, gaps_on, index_on, cap), (off, gaps_off, index_off, _) = runs
    assert cap >= 32 and sum(n for n, _ in on) > 0
    assert [d for _, d in on] == [d for _, d in off] and gaps_on == gaps_off
    assert index_on == index_off and len(index_on) > 30 * 3  # the same blocks cached under the same keys


def test_a_budget_below_the_decodes_stops_the_lane_where_the_loop_stops():
    """Ten sequences decoding, then a budget of four tokens a step: the lane gives them to the first
    four in running order, as the Python loop does (vLLM's schedule never starves an earlier one)."""
    from kvbench.scheduler import StepResult

    given = []
    for lane in (True, False):
        _, sched, add = direct(4000, 4, lane)
        for i in range(10):
            add(f"r{i}", 6, 40)
        for _ in range(5):
            step(sched)
        sched.cfg.max_batched_tokens = 4
        ids = []
        for k in range(6):
            plan = sched.schedule(0.0)
            ids.append(sorted(sched.build_batch(plan).decode_seq_ids))
            sched.update(plan, StepResult(duration_s=0.01), 1.0 + k)
        given.append((ids, plan.lane))
    (on, last_lane), (off, _) = given
    assert on == off and all(len(x) == 4 for x in on) and last_lane == 4


def test_a_sequence_admitted_into_a_used_slot_keeps_its_own_state_until_pushed():
    """A step cut short after scheduling (Ctrl-C before its update: the replay's finally syncs every
    running sequence): one admitted into the slot a finished sequence left keeps what allocate gave it,
    not that sequence's counts."""
    _, sched, add = direct(400, 4, True)
    first = add("a", 6, 12)
    while sched.has_work():
        step(sched)
    assert first.lane == -1 and sched.lane.taken > 0
    second = add("b", 9, 5)
    sched.schedule(0.0)  # admitted into slot 0, not yet updated
    assert second.lane == 0
    sched.sync()
    assert (second.num_kv, second.num_tokens, second.num_out, len(second.table)) == (0, 9, 0, 3)
