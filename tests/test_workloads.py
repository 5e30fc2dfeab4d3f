"""Generated workloads: determinism, structure (history re-sent, answers named), sizes, arrivals,
and the hit-rate character of each (bounds measured on seeds 1-3 at these sizes)."""
import numpy as np
import pytest
from kvbench.workloads import WORKLOADS, Common, generate
from kvbench.workloads.chat import ChatParams
from kvbench.workloads.random_lengths import RandomParams

from kvbench.trace.ideal import ideal_hits


def _gen(name, requests=300, seed=7, params=None, **common):
    return generate(WORKLOADS[name], Common(requests=requests, seed=seed, **common), params)


def _hits_by_request(reqs, block_size=16):
    per = {}
    total = ideal_hits(reqs, block_size, on_request=lambda r, h: per.__setitem__(r.id, h))
    return total, per


# random at its defaults (fixed lengths, all at t = 0) draws nothing a seed could change
DRAWS = {"random": RandomParams(range_ratio=0.5, rate=2.0)}


def test_same_seed_same_trace_other_seed_other_trace():
    for name in WORKLOADS:
        a = [r.to_json() for r in _gen(name, 60, seed=5, params=DRAWS.get(name))]
        assert a == [r.to_json() for r in _gen(name, 60, seed=5, params=DRAWS.get(name))]
        assert a != [r.to_json() for r in _gen(name, 60, seed=6, params=DRAWS.get(name))]
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


# -- random: vllm bench serve's random dataset ---------------------------------------------------
def test_random_defaults_are_fixed_lengths_at_t0():
    """As ``vllm bench serve --dataset-name random`` at its defaults: 1024 tokens in, 128 out, every
    prompt its own tokens, every request sent at once (--request-rate inf)."""
    reqs = _gen("random", 50)
    assert [r.id for r in reqs] == [f"r{i}" for i in range(50)]
    assert all(r.t == 0.0 and r.output_len == 128 and r.prompt_len == 1024 for r in reqs)
    assert all([s.to_json() for s in r.prompt] == [{"unique": 1024}] for r in reqs)
    assert ideal_hits(reqs, 16).hit_tokens == 0


def test_random_range_ratio_draws_uniformly_over_vllms_interval():
    """[floor(L (1 - r)), ceil(L (1 + r))], both ends reached, mean L; outputs never below 1."""
    reqs = _gen("random", 4000, params=RandomParams(input_len=1000, output_len=101, range_ratio=0.25))
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert (ins.min(), ins.max()) == (750, 1250) and (outs.min(), outs.max()) == (75, 127)
    assert ins.mean() == pytest.approx(1000, rel=0.01) and outs.mean() == pytest.approx(101, rel=0.01)
    assert len(np.unique(ins)) > 400  # uniform over the integers, not a few values
    short = _gen("random", 500, params=RandomParams(output_len=1, range_ratio=0.9))
    assert {r.output_len for r in short} == {1, 2}  # floor(0.1) = 0 held at 1, ceil(1.9) = 2


def test_random_prefix_is_one_shared_stream_before_each_prompt():
    reqs = _gen("random", 20, params=RandomParams(input_len=100, prefix_len=256))
    assert all(r.prompt[0].to_json() == {"shared": "random/prefix-s7", "len": 256} for r in reqs)
    assert all(r.prompt_len == 356 and r.prompt[1].kind == "unique" for r in reqs)
    assert ideal_hits(reqs, 16).hit_tokens == 19 * 256  # every request after the first hits the prefix
    other = _gen("random", 2, seed=8, params=RandomParams(prefix_len=256))
    assert other[0].prompt[0].name != reqs[0].prompt[0].name  # vLLM draws a new prefix per seed


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_random_burstiness_is_vllms_gamma_shape(burstiness):
    """Gaps gamma(shape b, mean 1/rate): CV 1/sqrt(b) (b = 1: Poisson); times scaled so the last request
    arrives at requests / rate (vLLM's get_request)."""
    reqs = _gen("random", 4000, params=RandomParams(rate=4.0, burstiness=burstiness))
    t = np.array([r.t for r in reqs])
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert t[-1] == pytest.approx(1000.0) and gaps.mean() == pytest.approx(0.25, rel=1e-3)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / burstiness ** 0.5, rel=0.1)
    assert t[0] > 0  # the first request waits a gap too


def test_random_range_ratio_of_one_is_refused():
    with pytest.raises(ValueError, match="range-ratio"):
        _gen("random", 5, params=RandomParams(range_ratio=1.0))
