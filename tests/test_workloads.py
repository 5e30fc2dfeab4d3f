"""Generated workloads: determinism, structure (history re-sent, answers named), sizes, arrivals,
and the hit-rate character of each (bounds measured on seeds 1-3 at these sizes)."""
import numpy as np
import pytest

from kvbench.trace.ideal import ideal_hits
from kvbench.workloads import WORKLOADS, Common, generate
from kvbench.workloads.chat import ChatParams


def _gen(name, requests=300, seed=7, params=None, **common):
    return generate(WORKLOADS[name], Common(requests=requests, seed=seed, **common), params)


def _hits_by_request(reqs, block_size=16):
    per = {}
    total = ideal_hits(reqs, block_size, on_request=lambda r, h: per.__setitem__(r.id, h))
    return total, per


def test_same_seed_same_trace_other_seed_other_trace():
    for name in WORKLOADS:
        a = [r.to_json() for r in _gen(name, 60, seed=5)]
        assert a == [r.to_json() for r in _gen(name, 60, seed=5)]
        assert a != [r.to_json() for r in _gen(name, 60, seed=6)]
        assert len(a) == 60 and all(r["meta"] == {"workload": name} for r in a)


def test_traces_are_in_arrival_order_and_start_at_zero():
    for name in WORKLOADS:
        ts = [r.t for r in _gen(name, 100)]
        assert ts[0] == 0.0 and ts == sorted(ts)


def test_chat_sizes_suit_an_8k_slab_baseline():
    reqs = _gen("chat", 600)
    total = np.array([r.prompt_len + r.output_len for r in reqs])
    assert 1500 <= total.mean() <= 3000
    assert total.max() <= 8000
    # A tighter --max-context is respected too.
    short = _gen("chat", 200, params=ChatParams(max_context=2000))
    assert max(r.prompt_len + r.output_len for r in short) <= 2000


def test_chat_turns_resend_history_and_hit_the_named_answer():
    reqs = _gen("chat", 300)
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        assert turns[0].prompt[0].name.startswith("sys/chat-v")
        for prev, cur in zip(turns, turns[1:]):
            answer = cur.prompt[len(prev.prompt)]
            assert cur.prompt[:len(prev.prompt)] == prev.prompt
            assert (answer.name, answer.length) == (prev.output, prev.output_len)
            assert cur.t >= prev.t


def test_hit_rate_character_chat_high():
    total, per = _hits_by_request(_gen("chat"))
    assert total.hit_rate >= 0.85  # measured 0.93-0.95: system prompt + history


def test_hit_rate_character_rag_partial():
    total, _ = _hits_by_request(_gen("rag"))
    assert 0.3 <= total.hit_rate <= 0.7  # measured 0.38-0.56: system prompt + popular first documents


def test_hit_rate_character_agent_near_one_after_first_step():
    reqs = _gen("agent")
    total, per = _hits_by_request(reqs)
    first = [r for r in reqs if r.id.endswith("-s1")]
    later = [r for r in reqs if not r.id.endswith("-s1")]
    rate = lambda rs: sum(per[r.id] for r in rs) / sum(r.prompt_len for r in rs)
    assert rate(later) >= 0.92  # measured 0.93-0.96: only the newest tool result is new
    assert rate(first) < rate(later)  # a first step shares only the scaffold
    for r in later:  # each step re-sends the previous one's prompt and answer
        k = int(r.id.rsplit("-s", 1)[1])
        prev = next(p for p in reqs if p.id == f"{r.session}-s{k - 1}")
        assert r.prompt[:len(prev.prompt)] == prev.prompt
        assert r.prompt[len(prev.prompt)].name == prev.output


def test_rag_documents_follow_zipf_popularity():
    reqs = _gen("rag", 400)
    counts = {}
    for r in reqs:
        docs = [s.name for s in r.prompt if s.kind == "shared" and s.name.startswith("rag/doc-")]
        assert len(docs) == 4 and len(set(docs)) == 4 and r.prompt[-1].kind == "unique"
        for d in docs:
            counts[d] = counts.get(d, 0) + 1
    top = max(counts, key=counts.get)
    assert top == "rag/doc-0" and counts[top] > 0.3 * len(reqs)


def test_best_of_n_is_n_samples_of_unique_prompts():
    reqs = _gen("best-of-n", 30)
    assert all(r.n == 8 for r in reqs)
    assert ideal_hits(reqs, 16).hit_tokens == 0


@pytest.mark.parametrize("arrival,burstiness,lo,hi", [("poisson", 1.0, 0.8, 1.2),
                                                      ("gamma", 3.0, 2.0, 4.5)])
def test_arrival_rate_and_burstiness(arrival, burstiness, lo, hi):
    reqs = _gen("rag", 3000, rate=4.0, arrival=arrival, burstiness=burstiness)
    gaps = np.diff([r.t for r in reqs])
    assert gaps.mean() == pytest.approx(0.25, rel=0.15)
    assert lo <= gaps.std() / gaps.mean() <= hi
