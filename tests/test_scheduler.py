"""The scheduler, rule by rule (vLLM v1, 0.33): driven directly over a hand-built paged pool, step by
step (who is scheduled, how many tokens, who is preempted, what is recomputed), then differentially
against an independent re-implementation of vLLM's rules (tests/vllm_reference.py) on random traces,
and through the engine on the counting rules of spec §4."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import vllm_reference as ref
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.memory.paged import PagedKV
from kvbench.memory.slab import SlabKV
from kvbench.scheduler import RequestState, Scheduler, SchedulerConfig, StepResult
from kvbench.trace.format import Request, Segment
from kvbench.trace.keys import sequence_tokens
from kvbench.trace.tokens import TokenStreams

STREAMS = TokenStreams()


def request(rid: str, segs, output_len: int, *, t: float = 0.0, n: int = 1, index: int = 0,
            output: str | None = None) -> Request:
    """``segs``: (shared stream name, length) pairs; None as the name makes a unique segment."""
    prompt = tuple(Segment("shared", ln, name=name) if name else Segment("unique", ln) for name, ln in segs)
    return Request(id=rid, t=t, prompt=prompt, output_len=output_len, n=n, output=output, index=index,
                   line=index + 1, prompt_len=sum(ln for _, ln in segs))


class Harness:
    """A Scheduler over a PagedKV (or SlabKV) with no executor: each step commits what was planned."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, max_num_seqs: int = 256,
                 max_batched_tokens: int = 8192, admission: str = "full-prompt", layout: str = "paged",
                 prefix_cache: bool = True, reserve: int = 0, admission_window: int = 0,
                 admission_threshold: float = 0.5):
        cls = PagedKV if layout == "paged" else SlabKV
        self.kv = cls(num_blocks, block_size, prefix_cache=prefix_cache)
        self.sched = Scheduler(self.kv, SchedulerConfig(max_num_seqs, max_batched_tokens, admission, 0.0,
                                                        admission_window, admission_threshold),
                               streams=STREAMS)
        self.reserve = reserve
        self.finished: list[RequestState] = []
        self.lost_tokens = 0  # KV tokens that preemptions freed

    def add(self, req: Request):
        prompt = STREAMS.expand(req)
        rs = RequestState(req=req, arrival_s=req.t, prompt=prompt)
        tokens = sequence_tokens(req, prompt, STREAMS) if self.kv.prefix_cache else None
        s = self.sched.new_seq(rs, tokens, reserve=self.reserve or req.prompt_len + req.output_len)
        self.sched.add(s)
        return s

    def step(self):
        plan = self.sched.schedule(0.0)
        out = ([(s.rs.req.id, s.sample, n) for s, n in zip(plan.seqs, plan.num_new)],
               [s.rs.req.id for s in plan.preempted])
        self.sched.build_batch(plan)
        self.finished += self.sched.update(plan, StepResult(duration_s=0.0), 0.0)
        self.last_plan = plan
        self.lost_tokens += sum(s.computed_before for s in plan.preempted)
        return out

    def run(self, limit: int = 10_000):
        log = []
        while self.sched.has_work():
            assert len(log) < limit, "no progress"
            log.append(self.step())
        return log


# -------------------------------------------------------------------- rules, step by step

def test_chunked_prefill_splits_the_token_budget_in_admission_order():
    h = Harness(100, 16, max_batched_tokens=64)
    h.add(request("a", [(None, 100)], 3))
    h.add(request("b", [(None, 50)], 3))
    assert h.step() == ([("a", 0, 64)], [])  # the budget is spent: b waits
    assert h.step() == ([("a", 0, 36), ("b", 0, 28)], [])  # a's last chunk, then b's first
    assert h.step() == ([("a", 0, 1), ("b", 0, 22)], [])  # a decodes first: running go first
    assert h.step() == ([("a", 0, 1), ("b", 0, 1)], [])


def test_max_num_seqs_caps_admission_until_a_sequence_finishes():
    h = Harness(100, 16, max_num_seqs=2)
    for r in "abc":
        h.add(request(r, [(None, 20)], 2))
    assert [x[0] for x in h.step()[0]] == ["a", "b"]
    assert [x[0] for x in h.step()[0]] == ["a", "b"]  # both finish in this step
    assert [x[0] for x in h.step()[0]] == ["c"]


def test_n_samples_count_against_max_num_seqs_from_admission():
    h = Harness(200, 16, max_num_seqs=4)
    h.add(request("a", [(None, 20)], 5, n=3))
    h.add(request("b", [(None, 20)], 5, n=2))  # 3 + 2 > 4: waits for a
    h.add(request("c", [(None, 20)], 5))  # first come, first served: waits behind b
    peak, admitted = 0, []
    for _ in range(40):
        if not h.sched.has_work():
            break
        sched, _ = h.step()
        admitted += [rid for rid, _, n in sched if n > 1]
        peak = max(peak, h.last_plan.running, h.sched.num_seats)
        assert len(h.sched.running) <= 4
    assert admitted == ["a", "b", "c"] and peak == 3 and not h.sched.has_work()
    assert {rs.req.id: rs.output_tokens for rs in h.finished} == {"a": 15, "b": 10, "c": 5}


def test_preemption_takes_the_last_admitted_until_the_step_fits():
    """b decodes into a new block of a full pool: the last running sequence, a's forked sample,
    frees nothing (its blocks are shared with a), so a goes too; both wait at the head, the last
    preempted first; nothing is lost: every sample finishes with its tokens."""
    h = Harness(4, 4, prefix_cache=False)
    h.add(request("b", [(None, 8)], 6))
    h.add(request("a", [(None, 7)], 6, n=2))
    assert h.step() == ([("b", 0, 8), ("a", 0, 7)], [])  # a forks after its first token
    assert [(s.rs.req.id, s.sample) for s in h.sched.running] == [("b", 0), ("a", 0), ("a", 1)]
    sched, preempted = h.step()
    assert preempted == ["a", "a"] and sched == [("b", 0, 1)]
    assert [s.sample for s in h.last_plan.preempted] == [1, 0]
    assert [(s.rs.req.id, s.sample) for s in h.sched.waiting] == [("a", 0), ("a", 1)]
    h.run()
    by_id = {rs.req.id: rs for rs in h.finished}
    assert by_id["b"].output_tokens == 6 and by_id["a"].output_tokens == 12
    # without a prefix cache every token a preemption freed is computed again
    assert by_id["a"].preemptions >= 2 and by_id["a"].recomputed_tokens == h.lost_tokens > 0


def test_a_step_that_preempts_admits_nothing():
    h = Harness(4, 4, prefix_cache=False)
    for r in "ab":
        h.add(request(r, [(None, 8)], 6))
    h.step()
    h.add(request("c", [(None, 3)], 2))  # one block: it would fit once b is gone
    sched, preempted = h.step()
    assert preempted == ["b"] and [x[0] for x in sched] == ["a"] and h.kv.pool.num_available == 1
    first_seen = []
    for sched, _ in h.run():
        first_seen += [rid for rid, _, _ in sched if rid not in first_seen]
    assert first_seen == ["a", "b", "c"]  # b, preempted, goes before c: first come, first served


def test_resumed_request_re_hits_its_own_prompt_and_generated_blocks():
    """An unnamed answer's tokens are a stream of the sample's own: a preempted request finds the
    blocks it computed (prompt and decode) still cached and recomputes only its uncached tail."""
    h = Harness(9, 4)  # a and b need 5 blocks each at the end: b is preempted once a grows
    h.add(request("a", [(None, 8)], 10))
    h.add(request("b", [(None, 8)], 10))
    for _ in range(30):
        h.step()
        if any(s.rs.req.id == "b" for s in h.sched.waiting):
            break
    b = next(s for s in h.sched.waiting if s.rs.req.id == "b")
    computed = b.computed_before
    assert computed > 8  # it had decoded past its prompt
    h.run()
    rs = {r.req.id: r for r in h.finished}["b"]
    assert rs.preemptions == 1
    hit = h.sched.resumed_hit_tokens
    assert hit > 8  # its prompt's two blocks and blocks of tokens it generated
    # it recomputes only what was not in a full cached block: less than one block
    assert rs.recomputed_tokens == computed - hit < 4


def test_prefix_cached_while_waiting_is_found_at_the_next_try():
    """Admission fails for b (its whole prompt does not fit); a then computes the prefix b needs;
    b's next lookup hits it and b is admitted though fewer blocks are free than b once lacked."""
    h = Harness(12, 4, max_batched_tokens=8)
    h.add(request("a", [("doc", 32), (None, 4)], 2))
    h.add(request("b", [("doc", 32), (None, 4)], 2))
    sched, _ = h.step()
    assert [x[0] for x in sched] == ["a"]  # a took the budget (one 8-token chunk)
    # a holds 9 blocks for its prompt; b alone would need 9 more of the 3 left
    admitted_at = None
    for i in range(8):
        sched, _ = h.step()
        if any(x[0] == "b" for x in sched):
            admitted_at = i
            break
    assert admitted_at is not None
    rs_b = next(s for s in h.sched.running if s.rs.req.id == "b").rs
    assert rs_b.cached_tokens == 32  # the whole shared prefix, cached by a meanwhile


def test_same_step_burst_hits_the_prefix_registered_in_that_step():
    """vLLM caches blocks when it allocates them: four requests arriving together that share a
    2,000-token prefix are all scheduled in the first step and the last three hit it."""
    h = Harness(2000, 16)
    for r in "abcd":
        h.add(request(r, [("sys", 2000), (None, 50)], 5))
    sched, _ = h.step()
    assert [x[0] for x in sched] == ["a", "b", "c", "d"]
    assert [x[2] for x in sched] == [2050, 50, 50, 50]  # 2,000 tokens = 125 whole blocks hit
    assert h.sched.hit_tokens == 3 * 2000  # as vLLM 0.33's own scheduler does (benchmarks/vllm_reference)


def test_full_prompt_admission_against_first_chunk():
    """With chunked prefill, first-chunk admission lets a request in whose prompt cannot fit and
    preempts it back out later; full-prompt admission waits."""
    def run(admission):
        # each request holds 11 blocks at most (40 prompt + 4 output tokens); the pool holds 12
        h = Harness(12, 4, max_batched_tokens=16, admission=admission, prefix_cache=False)
        h.add(request("a", [(None, 40)], 4))
        h.add(request("b", [(None, 40)], 4))
        log = h.run()
        return log, sum(len(p) for _, p in log)
    full, full_pre = run("full-prompt")
    first, first_pre = run("first-chunk")
    assert full_pre == 0 and first_pre > 0

    def together(log):
        return any({"a", "b"} <= {x[0] for x in sched} for sched, _ in log)
    assert not together(full)  # b's whole prompt never fits beside a: it waits for a to finish
    assert together(first)  # its first chunk does: admitted, then preempted


def test_no_admission_in_a_step_that_preempts_on_random_traces():
    """After a preemption the head of the queue can fit (with first-chunk admission and no prefix
    cache, a victim's first chunk back may need fewer blocks than it freed); the step still admits
    nothing, as vLLM's schedule skips the waiting queue once it preempted."""
    preempting_steps = 0
    for seed in range(150):
        rng = np.random.default_rng(seed)
        h = Harness(int(rng.integers(6, 30)), 4, max_batched_tokens=int(rng.choice([4, 8, 16, 64])),
                    admission=str(rng.choice(["first-chunk", "full-prompt"])), prefix_cache=bool(rng.integers(2)))
        for i in range(int(rng.integers(2, 8))):
            h.add(request(f"r{i}", [("s", int(rng.integers(0, 24))), (None, int(rng.integers(1, 12)))],
                          int(rng.integers(1, 20)), index=i))
        before: set = set()
        for _ in range(3000):
            if not h.sched.has_work():
                break
            sched, pre = h.step()
            if pre:
                preempting_steps += 1
                gone = {(v.rs.req.id, v.sample) for v in h.last_plan.preempted}
                assert all((rid, k) in before - gone for rid, k, _ in sched), (seed, sched, pre)
            before = {(s.rs.req.id, s.sample) for s in h.sched.running}
    assert preempting_steps > 50


def cache_aware_first_admissions(window: int, threshold: float = 0.5) -> list:
    """a's 160-token prompt (its first 64 the shared "p") holds 10 of 20 blocks; then b (48 unique
    tokens) and c ("p" + 16 unique) arrive in that order. The step that admits them, as ids."""
    h = Harness(20, 16, admission_window=window, admission_threshold=threshold)
    h.add(request("a", [("p", 64), (None, 96)], 50))
    h.step()
    h.add(request("b", [(None, 48)], 4, index=1))
    h.add(request("c", [("p", 64), (None, 16)], 4, index=2))
    sched, _ = h.step()
    return [(rid, n) for rid, _, n in sched]


def test_cache_aware_admission_puts_the_cached_prefix_first_once_the_pool_is_half_held():
    """vLLM 0.34's cache_aware_admission_window: with a's 11 blocks held (0.55 >= 0.5), c, whose
    64-token prefix is cached, is admitted before b, which arrived first; window 0 keeps arrival order,
    a threshold above the usage keeps it, and a window of 1 has no peer to swap with."""
    assert cache_aware_first_admissions(2) == [("a", 1), ("c", 16), ("b", 48)]
    assert cache_aware_first_admissions(0) == [("a", 1), ("b", 48), ("c", 16)]
    assert cache_aware_first_admissions(2, threshold=0.6) == [("a", 1), ("b", 48), ("c", 16)]
    assert cache_aware_first_admissions(1) == [("a", 1), ("b", 48), ("c", 16)]


def test_cache_aware_admission_leaves_a_preempted_request_in_its_place():
    """Only requests waiting for their first admission trade places: a preempted one at the head of
    the queue stays there (vLLM: status WAITING and no computed tokens), the others reorder behind it."""
    h = Harness(20, 16, admission_window=8, admission_threshold=0.0)
    h.add(request("a", [("p", 64)], 2))
    h.step()
    h.step()  # a finishes: "p" stays cached, nothing held
    for i, (rid, segs) in enumerate([("r", [(None, 32)]), ("b", [(None, 32)]), ("c", [("p", 64), (None, 8)])]):
        h.add(request(rid, segs, 2, index=i + 1))
    h.sched.waiting[0].resumed = True  # as a preempted request waits
    h.sched._reorder_by_cached_prefix()
    assert [s.rs.req.id for s in h.sched.waiting] == ["r", "c", "b"]


def test_slab_reserves_every_sample_at_admission():
    h = Harness(64, 16, layout="slab", prefix_cache=False, reserve=128)  # 8 blocks per slab
    h.add(request("a", [(None, 100)], 10, n=3))
    sched, _ = h.step()
    assert sched == [("a", 0, 100)]
    assert h.kv.blocks_reserved == 24  # three slabs
    log = h.run()
    prefill = sum(n for sched, _ in log for _, _, n in sched if n > 1)
    assert prefill == 0 and h.kv.blocks_reserved == 0  # no sample recomputed its prompt
    assert h.finished[0].output_tokens == 30


def test_samples_of_a_one_token_answer_finish_when_forked():
    h = Harness(64, 16)
    h.add(request("a", [(None, 20)], 1, n=4))
    h.run()
    assert h.finished[0].output_tokens == 4 and not h.sched.running and h.sched.num_seats == 0
    assert h.kv.pool.num_used == 0


# ------------------------------------------------------------------- against the reference

def _linear_clock(tmp_path) -> str:
    p = tmp_path / "linear.json"
    p.write_text(json.dumps({"kind": "linear", "prefill_ms_per_token": 0.1, "decode_step_ms": 20}))
    return str(p)


def _kvbench_log(reqs, tmp_path, **cfg):
    rp = Replay("<random>", ReplayConfig(executor="sim", model="llama-3-8b", calibration=_linear_clock(tmp_path),
                                         max_model_len=100_000, **cfg), str(tmp_path / "run"), requests=reqs)
    rp.step_log = []
    rp.finished = []
    summary = rp.run()
    log = [([(rid, n) for rid, _, n in sched], pre) for sched, pre in rp.step_log]
    hits = {rs.req.id: rs.cached_tokens for rs in rp.finished}
    return log, hits, summary


def _reference_log(reqs, num_blocks, block_size, max_num_seqs, max_batched_tokens):
    eng = ref.RefEngine(num_blocks, block_size, max_num_seqs, max_batched_tokens)
    rreqs = [ref.RefRequest(r.id, r.t, STREAMS.expand(r).tolist(), r.output_len,
                            (lambda r: lambda k: int(STREAMS.output_tokens(r, 1, k)[0]))(r)) for r in reqs]
    log = ref.replay(rreqs, eng, lambda prefill, decodes: 0.1 * prefill + (20 if decodes else 0))
    return log, {r.id: r.first_hits for r in rreqs}, eng


trace_params = st.fixed_dictionaries({
    "requests": st.lists(st.tuples(st.integers(0, 3), st.integers(0, 90), st.integers(1, 40),
                                   st.integers(1, 30), st.floats(0, 1.5)), min_size=2, max_size=14),
    "block_size": st.sampled_from([4, 16]),
    "blocks": st.integers(0, 16),
    "max_num_seqs": st.sampled_from([2, 4, 256]),
    "budget": st.sampled_from([16, 48, 512]),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=trace_params)
def test_same_schedule_hits_and_preemptions_as_the_vllm_reference(p, tmp_path_factory):
    reqs = []
    for i, (shared, shared_len, unique, out, t) in enumerate(p["requests"]):
        segs = ([(f"s{shared}", shared_len)] if shared_len else []) + [(None, unique)]
        reqs.append(request(f"r{i}", segs, out, t=round(t, 3), index=i))
    bs = p["block_size"]
    biggest = max(-(-(r.prompt_len + r.output_len) // bs) for r in reqs)
    num_blocks = biggest + p["blocks"]
    tmp = tmp_path_factory.mktemp("diff")
    ours, our_hits, summary = _kvbench_log(reqs, tmp, block_size=bs, num_blocks=num_blocks,
                                           max_num_seqs=p["max_num_seqs"],
                                           max_batched_tokens=p["budget"])
    theirs, their_hits, eng = _reference_log(reqs, num_blocks, bs, p["max_num_seqs"], p["budget"])
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"step {i}: kvbench {a} != reference {b}"
    assert our_hits == their_hits
    assert summary["preemptions"] == eng.preemptions
    event(f"preempted: {eng.preemptions > 0}")
    event(f"hit: {sum(their_hits.values()) > 0}")


def test_the_reference_comparison_preempts_and_hits():
    """The differential test above means something only if its traces exercise the rules: a fixed
    trace of the same kind that preempts, hits across requests and hits after resumption."""
    reqs = [request(f"r{i}", [("s0", 60), (None, 10 + i)], 30, t=0.01 * i, index=i) for i in range(8)]
    theirs, hits, eng = _reference_log(reqs, 40, 4, 256, 48)
    assert eng.preemptions > 0 and sum(hits.values()) > 0 and eng.resumed_hits > 0


# ----------------------------------------------------------------------- counting (spec §4)

def test_running_counts_the_sequences_each_step_worked_on(tmp_path):
    rp = Replay("traces/chat.jsonl", ReplayConfig(executor="sim", model="llama-3-8b", limit=60,
                                                 time_scale=0.05, num_blocks=3000), str(tmp_path / "r"))
    rp.run()
    steps = pd.read_parquet(tmp_path / "r" / "steps.parquet")
    assert (steps.decode_seqs <= steps.running).all()
    assert steps.running.max() == json.loads((tmp_path / "r" / "summary.json").read_text())["peak_running"]
    # the step that finishes the last request still counts it
    assert steps.running.iloc[-1] >= 1


def test_ideal_hit_rate_covers_the_admitted_requests_only(tmp_path):
    reqs = [request("a", [("sys", 64), (None, 8)], 4, index=0),
            request("b", [("sys", 64), (None, 4000)], 4, index=1),  # rejected: over max_model_len
            request("c", [("sys", 64), (None, 8)], 4, t=1.0, index=2)]
    rp = Replay("<t>", ReplayConfig(executor="sim", model="llama-3-8b", max_model_len=1000), str(tmp_path / "r"),
                requests=reqs)
    s = rp.run()
    assert s["rejected"] == 1
    assert math.isclose(s["ideal_hit_rate"], 64 / 144) and math.isclose(s["prefix_hit_rate"], 64 / 144)


def test_a_kv_load_starts_when_the_step_leaves_token_budget():
    """A decode leg's load (engine.disagg) takes no tokens, but vLLM 0.34 starts one only while the step
    has token budget left (otherwise ``loads_only``, which admits nothing without
    --max-num-inflight-kv-loads): behind a 300-token prompt that spends each step's 64 tokens, a load
    waits for the prompt's last chunk; then it takes its blocks, and the request runs once its KV is in."""
    h = Harness(24, 16, max_batched_tokens=64)
    h.add(request("a", [(None, 300)], 1))
    assert h.step() == ([("a", 0, 64)], [])
    s = h.add(request("b", [(None, 64)], 2))
    s.remote = True
    for chunk in (64, 64, 64):
        assert h.step() == ([("a", 0, chunk)], []) and not h.last_plan.loads
    assert h.step() == ([("a", 0, 44)], []) and [x[1] for x in h.last_plan.loads] == [64]  # 20 tokens left
    assert not h.sched.has_work()  # nothing to run until its KV arrives
    h.sched.loaded(s)
    assert h.step() == ([("b", 0, 1)], [])  # the prompt's last token again, and its first token
