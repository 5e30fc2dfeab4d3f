"""The one-pass lru curve (kvbench.whatif.curve.lru_curve) equals the per-budget lru simulation,
point for point (hit tokens, evicted blocks, requests too large), at every budget of small random
traces and at budgets from one block to past every distinct block on the shipped traces and the real
Mooncake trace: requests larger than the budget, blocks past the first miss still cached, named
answers re-sent."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.memory.policies import make_policy
from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.importers import convert
from kvbench.whatif.blocktrace import prepare
from kvbench.whatif.compiled import COMPILED
from kvbench.whatif.curve import lru_curve, run_points, simulate

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"


def _budgets(bt) -> list[int]:
    """One block, a few, half and all of the largest request, shares of the distinct blocks, past them."""
    biggest, d = int(np.diff(bt.starts).max()), bt.distinct_blocks
    return sorted({b for b in (1, 2, 3, 7, biggest // 2, biggest - 1, biggest, biggest + 1, d // 50, d // 10,
                               d // 3, d - 1, d, 2 * d) if b >= 1})


def _assert_same(bt, budgets, name=""):
    curve = lru_curve(bt)
    hits = curve.hit_tokens(np.asarray(budgets))
    assert (np.diff(hits) >= 0).all(), name  # inclusion: more memory never loses a hit
    for b, h in zip(budgets, hits):
        assert curve.point(b) == simulate(bt, b, "lru"), (name, b)
        assert h == curve.point(b).hit_tokens


@pytest.mark.parametrize("name", ["chat", "rag", "agent"])
def test_one_pass_equals_simulation_on_shipped_traces(name):
    bt = prepare(load_trace(REPO / "traces" / f"{name}.jsonl"), 16, warmup=0.5, future=False)
    budgets = _budgets(bt)
    assert simulate(bt, budgets[0], "lru").too_large > 0  # the rule for requests too large is exercised
    _assert_same(bt, budgets, name)


def test_one_pass_equals_simulation_on_the_real_mooncake_trace(tmp_path):
    """The whole conversation trace (12,031 requests) at block 512, and its first 2,000 at block 64."""
    if not REAL.exists():
        pytest.skip(f"real trace not found at {REAL}")
    convert("mooncake", REAL, tmp_path / "m.jsonl")
    reqs = load_trace(tmp_path / "m.jsonl")
    for reqs, bs in ((reqs, 512), (reqs[:2000], 64)):
        bt = prepare(reqs, bs, warmup=0.5, future=False)
        _assert_same(bt, _budgets(bt), f"mooncake/{bs}")


def _assert_compiled_same(bt, budgets, name=""):
    """The compiled core (a policy by name) and the policy classes (an object) hit the same blocks,
    request by request, and evict as many."""
    for b in budgets:
        for p in COMPILED:
            got: list[int] = []
            want: list[int] = []
            fast = simulate(bt, b, p, on_request=lambda i, h: got.append(h))
            slow = simulate(bt, b, make_policy(p, max(bt.distinct_blocks, 1), b),
                            on_request=lambda i, h: want.append(h))
            assert (got, fast) == (want, slow), (name, b, p)


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_compiled_core_equals_the_policy_classes_on_shipped_traces(name):
    bt = prepare(load_trace(REPO / "traces" / f"{name}.jsonl"), 16, warmup=0.5)
    _assert_compiled_same(bt, _budgets(bt)[::2], name)


def test_compiled_core_equals_the_policy_classes_past_a_thousand_requests():
    """Past 1,024 requests the compiled core's buckets (lfu's use counts, belady's next uses) span
    several words of its bitmap's summary: a system prompt every request shares climbs lfu's
    buckets, and zipf-chosen documents spread belady's next uses."""
    rng = np.random.default_rng(7)
    trace = []
    for i in range(1500):
        doc = int(rng.zipf(1.3)) % 60
        prompt = (Segment("shared", name="system", length=8),
                  Segment("shared", name=f"doc{doc}", length=4 + doc % 20),
                  Segment("unique", length=int(rng.integers(1, 12))))
        trace.append(Request(id=f"r{i}", t=float(i), prompt=prompt, output_len=4, index=i))
    bt = prepare(trace, 4, warmup=0.5)
    _assert_compiled_same(bt, [6, 40, bt.distinct_blocks // 4], "generated")


def test_compiled_future_equals_next_uses_from_keys():
    """belady's next uses over dense ids (compiled) are kvbench.memory.future's over keys, at the
    trace's lookups and at a budget below some request's."""
    from kvbench.memory.future import next_uses_from_keys

    for name in ("chat", "agent"):
        bt = prepare(load_trace(REPO / "traces" / f"{name}.jsonl"), 16)
        keys = [bt.ids[bt.starts[i]:bt.starts[i + 1]].tolist() for i in range(bt.requests)]
        for lookups in (bt.lookups, np.minimum(bt.lookups, 50)):
            want = np.concatenate(next_uses_from_keys(keys, lookups.tolist()))
            got = bt.next_use if lookups is bt.lookups else bt.future(50)
            assert np.array_equal(got, want), name
        assert not np.array_equal(bt.future(50), bt.next_use)


def test_run_points_takes_lru_from_the_curve():
    bt = prepare(load_trace(REPO / "traces/rag.jsonl"), 16, warmup=0.5)
    budgets = [bt.distinct_blocks // 20, bt.distinct_blocks // 4]
    for jobs in (1, 2):
        points = run_points(bt, budgets, ["lru", "fifo"], jobs=jobs)
        for b in budgets:
            assert points[(b, "lru")] == simulate(bt, b, "lru")
            assert points[(b, "fifo")] == simulate(bt, b, "fifo")


def test_whatif_carries_the_whole_lru_curve(tmp_path):
    """whatif's lru_curve runs between the smallest and largest budget through the lru rows."""
    from kvbench.whatif.curve import budgets_from_blocks
    from kvbench.whatif.output import write_outputs
    from kvbench.whatif.query import whatif

    reqs = load_trace(REPO / "traces/chat.jsonl")
    budgets = budgets_from_blocks([100, 400, 3000], 16 * 1024)
    w = whatif(reqs, trace="chat", model="m", kv_dtype="bf16", kv_bytes_per_token=1024, block_size=16,
               budgets=budgets, policies=["fifo", "lru"])
    full = dict(zip(w.lru_curve["budget_bytes"], w.lru_curve["hit_rate"]))
    assert len(full) > 100 and min(full) == budgets[0].bytes and max(full) == budgets[-1].bytes
    for r in w.rows:
        if r["policy"] == "lru":
            assert full[r["budget_bytes"]] == r["hit_rate"]
    assert w.lru_curve["hit_rate"] == sorted(w.lru_curve["hit_rate"])
    assert len(set(w.lru_curve["hit_rate"])) > 3  # a curve, not three steps
    write_outputs(w, str(tmp_path))
    assert whatif(reqs, trace="chat", model="m", kv_dtype="bf16", kv_bytes_per_token=1024, block_size=16,
                  budgets=budgets, policies=["fifo"]).lru_curve is None


# a small alphabet of shared prefixes and answers: requests share, repeat and re-send them
NAMES = ["a", "b", "c"]
segments = st.lists(st.one_of(
    st.tuples(st.just("shared"), st.sampled_from(NAMES), st.integers(1, 24)),
    st.tuples(st.just("unique"), st.none(), st.integers(1, 24))), min_size=1, max_size=3)
requests = st.lists(st.tuples(segments, st.sampled_from([None, *NAMES]), st.integers(1, 20)),
                    min_size=1, max_size=14)


@settings(max_examples=200, deadline=None)
@given(reqs=requests, bs=st.sampled_from([1, 2, 4, 8]), warmup=st.sampled_from([0.0, 0.5]))
def test_one_pass_equals_simulation_at_every_budget_on_random_traces(reqs, bs, warmup):
    trace = []
    for i, (segs, answer, out_len) in enumerate(reqs):
        prompt = tuple(Segment("shared", name=n, length=ln) if kind == "shared" else Segment("unique", length=ln)
                       for kind, n, ln in segs)
        trace.append(Request(id=f"r{i}", t=float(i), prompt=prompt, output_len=out_len, output=answer, index=i))
    bt = prepare(trace, bs, warmup=warmup)
    _assert_same(bt, range(1, bt.distinct_blocks + 2))
    _assert_compiled_same(bt, range(1, bt.distinct_blocks + 2, 3))
