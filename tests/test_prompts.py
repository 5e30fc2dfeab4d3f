"""What the live client sends (kvbench.engine.prompts): a later prompt that continues an earlier
request's prompt and answer goes as that request's sent prompt and received answer up to where it
continues them, then as the trace's own tokens (spec §2). Held to the sim without a server: given
answers that differ from the trace's streams in content and in length, the prompts sent hit, per
request, exactly what the sim's requests hit with a cache that never evicts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.engine.lengths import shape_lengths
from kvbench.engine.prompts import Continuations, PromptBuilder
from kvbench.errors import InputError
from kvbench.trace.format import Request, load_trace, write_trace
from kvbench.trace.ideal import ideal_hits
from kvbench.trace.tokens import TokenStreams
from kvbench.workloads import WORKLOADS
from kvbench.workloads.common import Common, generate

REPO = Path(__file__).resolve().parents[1]
VOCAB = 32000


def _trace(tmp_path, rows: list[dict], name: str = "t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _shaped(reqs: list[Request], max_len: int | None) -> list[Request]:
    """The requests a vLLM-rule engine serves, outputs cut at the limit, in trace order."""
    if max_len is None:
        return sorted(reqs, key=lambda r: r.index)
    import dataclasses

    ok, out = shape_lengths(np.array([r.prompt_len for r in reqs]), np.array([r.output_len for r in reqs]),
                            max_len, "vllm")
    return sorted((dataclasses.replace(r, output_len=int(o)) for r, k, o in zip(reqs, ok, out) if k),
                  key=lambda r: r.index)


def per_request_hits(reqs: list[Request], block_size: int, max_len: int | None = None,
                     seed: int = 0) -> tuple[list[int], list[int], PromptBuilder]:
    """(the sim's no-eviction hits, the sent prompts' hits) per request, in trace order. The server is
    faked: each answer is random tokens (never the trace's stream) of the length the server returns."""
    reqs = _shaped(reqs, max_len)
    rng = np.random.default_rng(seed)
    pb = PromptBuilder(reqs, VOCAB, False, "trace.jsonl")
    for r in reqs:  # in trace order, each answer back before the next is sent: the ideal's order
        pb.build(r)
        pb.answer(r, rng.integers(0, VOCAB, r.output_len))
    sim: list[int] = []
    live: list[int] = []
    ideal_hits(reqs, block_size, on_request=lambda r, h: sim.append(h))
    pb.ideal_hits(reqs, block_size, on_request=lambda r, h: live.append(h))
    return sim, live, pb


def test_a_continued_answer_is_resent_as_received(tmp_path):
    path = _trace(tmp_path, [
        {"id": "a1", "t": 0, "output_len": 6, "output": "s/a1", "prompt": [{"shared": "sys", "len": 16}]},
        {"id": "a2", "t": 1, "output_len": 2, "prompt": [{"shared": "sys", "len": 16},
                                                          {"shared": "s/a1", "len": 4}, {"unique": 3}]}])
    a1, a2 = load_trace(path)
    streams = TokenStreams()
    pb = PromptBuilder([a1, a2], VOCAB, False, path)
    assert np.array_equal(pb.build(a1), streams.expand(a1))
    own = streams.expand(a2)
    assert np.array_equal(pb.build(a2), own)  # a1's answer is not back: the trace's tokens go
    assert [(f.request, f.answer_of) for f in pb.fallbacks] == [("a2", "a1")] and pb.resent == 0
    assert "a2 (answer of a1)" in pb.fallback_note()
    pb.answer(a2, None, refused=True)  # refused (too long): it hit nothing, so it lost nothing
    assert not pb.fallbacks and pb.fallback_note() is None
    pb.answer(a1, [901, 902, 903])  # fewer than the 4 the prompt continues: the rest goes as the trace's
    sent = pb.build(a2)
    assert sent[16:19].tolist() == [901, 902, 903] and sent[19] == own[19] and len(pb.fallbacks) == 1
    pb2 = PromptBuilder([a1, a2], VOCAB, False, path)
    pb2.build(a1)
    pb2.answer(a1, [901, 902, 903, 904, 905, 906])
    sent = pb2.build(a2)
    assert sent[16:20].tolist() == [901, 902, 903, 904]  # the first 4 of the server's answer
    assert np.array_equal(sent[:16], own[:16]) and np.array_equal(sent[20:], own[20:])
    assert pb2.resent == 1 and not pb2.fallbacks


def test_content_that_shares_an_answers_name_is_never_replaced(tmp_path):
    # the agent workload's quoting step: s1's answer is named after the task, which s1's prompt holds
    path = _trace(tmp_path, [
        {"id": "s1", "t": 0, "output_len": 8, "output": "task",
         "prompt": [{"shared": "sys", "len": 16}, {"shared": "task", "len": 12}]},
        {"id": "s2", "t": 1, "output_len": 4, "output": "a2",
         "prompt": [{"shared": "sys", "len": 16}, {"shared": "task", "len": 12}, {"shared": "task", "len": 8},
                    {"shared": "tool1", "len": 5}]},
        {"id": "other", "t": 2, "output_len": 2,  # another run quoting the same task name: not a continuation
         "prompt": [{"shared": "task", "len": 12}, {"unique": 4}]}])
    s1, s2, other = load_trace(path)
    streams = TokenStreams()
    pb = PromptBuilder([s1, s2, other], VOCAB, False, path)
    pb.build(s1)
    answer = list(range(500, 508))
    pb.answer(s1, answer)
    sent = pb.build(s2)
    own = streams.expand(s2)
    assert np.array_equal(sent[:28], own[:28])  # the task itself stays the task's tokens
    assert sent[28:36].tolist() == answer and np.array_equal(sent[36:], own[36:])
    assert np.array_equal(pb.build(other), streams.expand(other))  # no continuation: its own tokens


def test_a_prompt_continuing_a_continuation_keeps_every_earlier_answer(tmp_path):
    rows = [{"id": "t1", "t": 0, "output_len": 5, "output": "c/a1", "prompt": [{"shared": "c/u1", "len": 7}]},
            {"id": "t2", "t": 1, "output_len": 6, "output": "c/a2",
             "prompt": [{"shared": "c/u1", "len": 7}, {"shared": "c/a1", "len": 5}, {"shared": "c/u2", "len": 3}]},
            {"id": "t3", "t": 2, "output_len": 2,
             "prompt": [{"shared": "c/u1", "len": 7}, {"shared": "c/a1", "len": 5}, {"shared": "c/u2", "len": 3},
                        {"shared": "c/a2", "len": 6}, {"unique": 2}]}]
    t1, t2, t3 = load_trace(_trace(tmp_path, rows))
    pb = PromptBuilder([t1, t2, t3], VOCAB, False, "t")
    pb.build(t1)
    pb.answer(t1, [1, 2, 3, 4, 5])
    pb.build(t2)
    pb.answer(t2, [6, 7, 8, 9, 10, 11])
    sent = pb.build(t3)
    assert sent[7:12].tolist() == [1, 2, 3, 4, 5] and sent[15:21].tolist() == [6, 7, 8, 9, 10, 11]
    assert np.array_equal(sent[:15], pb.sent["t2"]) and pb.resent == 2


def test_the_tree_splits_and_keeps_the_first_writers_tokens():
    tree = Continuations()
    tree.insert(np.arange(10), np.arange(100, 110), None)
    tree.insert(np.array([0, 1, 2, 50, 51]), np.array([100, 101, 102, 7, 7]), None)
    m = tree.match(np.array([0, 1, 2, 50, 99]))
    assert m.length == 4 and m.sent.tolist() == [100, 101, 102, 7] and m.waiting_for is None
    tree.insert(np.array([0, 1, 60, 61, 62]), np.array([100, 101]), "r9")  # its answer pending
    m = tree.match(np.array([0, 1, 60, 61]))
    assert m.length == 2 and m.waiting_for == "r9"
    tree.receive(np.array([0, 1, 60, 61, 62]), 2, np.array([5]), "r9")  # one token back of three
    m = tree.match(np.array([0, 1, 60, 61]))
    assert m.length == 3 and m.sent.tolist() == [100, 101, 5] and m.waiting_for == "r9" and m.through_answer


@pytest.mark.parametrize("name,block_size,max_len", [("agent.jsonl", 16, None), ("agent.jsonl", 32, 4096),
                                                     ("chat.jsonl", 16, None), ("chat.jsonl", 16, 2048),
                                                     ("best_of_n.jsonl", 16, None), ("rag.jsonl", 16, None),
                                                     ("mooncake_slice.jsonl", 16, None)])
def test_the_shipped_traces_hit_as_in_the_sim_per_request(name, block_size, max_len):
    reqs = load_trace(str(REPO / "traces" / name))
    sim, live, pb = per_request_hits(reqs, block_size, max_len)
    assert live == sim
    assert not pb.fallbacks
    if name in ("agent.jsonl", "chat.jsonl"):  # their turns continue answers: a toothless test otherwise
        assert pb.resent > 0 and sum(sim) > 0


def _best_of_n_turns(rng: np.random.Generator, k: int) -> list[dict]:
    """Best-of-n questions with named answers and a follow-up turn continuing sample 0's answer."""
    rows = []
    for i in range(k):
        n, olen, plen = int(rng.integers(1, 5)), int(rng.integers(1, 40)), int(rng.integers(1, 80))
        first = [{"shared": "bon/sys", "len": int(rng.integers(1, 40))}, {"shared": f"bon/q{i}", "len": plen}]
        rows.append({"id": f"q{i}", "t": float(2 * i), "n": n, "output_len": olen, "output": f"bon/a{i}",
                     "prompt": first})
        quoted = int(rng.integers(1, olen + 8))  # may quote past the answer's end
        rows.append({"id": f"f{i}", "t": float(2 * i + 1), "output_len": 3,
                     "prompt": [*first, {"shared": f"bon/a{i}", "len": quoted}, {"unique": 5}]})
    return rows


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), quote=st.floats(0.0, 1.0), block_size=st.sampled_from([4, 16, 32]),
       cut=st.booleans())
def test_generated_agent_and_best_of_n_traces_hit_as_in_the_sim(tmp_path, seed, quote, block_size, cut):
    agent = generate(WORKLOADS["agent"], Common(requests=40, seed=seed),
                     WORKLOADS["agent"].params(quote=quote, steps=5.0, system_len=300, task_len=60,
                                               output_len=50, tool_len=60))
    path = str(tmp_path / f"agent-{seed}.jsonl")
    write_trace(agent, path)
    reqs = load_trace(path)  # as a file gives them (index, line)
    max_len = int(np.median([r.prompt_len + r.output_len for r in reqs])) if cut else None
    sim, live, pb = per_request_hits(reqs, block_size, max_len, seed)
    assert live == sim and not pb.fallbacks
    rows = _best_of_n_turns(np.random.default_rng(seed), 8)
    bon = load_trace(_trace(tmp_path, rows, f"bon-{seed}.jsonl"))
    sim, live, pb = per_request_hits(bon, block_size, None, seed)
    assert live == sim and not pb.fallbacks and pb.resent == 8


def test_ids_outside_the_vocabulary_are_refused_or_remapped(tmp_path):
    path = _trace(tmp_path, [
        {"id": "ok", "t": 0, "output_len": 1, "prompt": [{"shared": "sys", "len": 8}]},
        {"id": "big", "t": 0, "output_len": 1, "prompt": [{"unique": 2}, {"tokens": [40000, 7, 40000]}]}])
    reqs = load_trace(path)
    with pytest.raises(InputError) as e:
        PromptBuilder(reqs, 32000, False, path).check_vocab(reqs)
    assert str(e.value).startswith(f"{path}:2: field 'prompt[1].tokens': token id 40000")
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match=r"prompt\[0\]\.shared.*--remap-vocab"):  # drawn ids on a small vocab
        PromptBuilder(reqs, 1000, False, path).check_vocab(reqs)
    pb = PromptBuilder(reqs, 32000, True, path)
    pb.check_vocab(reqs)  # nothing refused
    ids = pb.build(reqs[1])
    assert ids[2:].tolist() == [8000, 7, 8000] and ids.max() < 32000  # equal ids stay equal
    assert np.array_equal(pb.build(reqs[0]), TokenStreams().expand(reqs[0]))  # ids below the vocab unchanged


