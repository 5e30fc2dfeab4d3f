"""The ideal hit rate's infinite cache keeps only keys a later request could hit: the same figures
as keeping every key, on the shipped traces and random ones, with far fewer keys held."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.ideal import IdealCounter
from kvbench.trace.keys import PrefixKeys

TRACES = Path(__file__).resolve().parents[1] / "traces"


def _both(requests, bs):
    keys_of = PrefixKeys(bs)
    keys_of.count_once(requests)  # shared streams one request uses are its own, as unique segments are
    kept, every = IdealCounter(bs), IdealCounter(bs)
    for r in requests:
        keys, plen = keys_of(r)
        assert kept.add(keys, plen, keys_of.shareable_blocks(r)) == every.add(keys, plen)
    return kept, every


@pytest.mark.parametrize("name", ["chat", "rag", "agent", "best_of_n"])
@pytest.mark.parametrize("bs", [16, 256])
def test_same_figures_fewer_keys_on_shipped_traces(name, bs):
    kept, every = _both(load_trace(str(TRACES / f"{name}.jsonl")), bs)
    assert kept.result() == every.result()
    if any(seg.kind == "unique" for r in load_trace(str(TRACES / f"{name}.jsonl")) for seg in r.prompt):
        assert len(kept.seen) < len(every.seen)


segments = st.lists(st.one_of(
    st.tuples(st.just("shared"), st.sampled_from(["a", "b", "c"]), st.integers(1, 40)),
    st.tuples(st.just("unique"), st.none(), st.integers(1, 40))), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(segments, min_size=1, max_size=12), bs=st.sampled_from([1, 4, 16]))
def test_same_figures_on_random_traces(prompts, bs):
    reqs = []
    for i, segs in enumerate(prompts):
        prompt = [Segment("shared", name=f"{n}{ln}", length=ln) if kind == "shared" else Segment("unique", length=ln)
                  for kind, n, ln in segs]
        reqs.append(Request(id=f"r{i}", t=float(i), prompt=prompt, output_len=2))
    kept, every = _both(reqs, bs)
    assert kept.result() == every.result()


def test_a_text_segment_counts_its_tokens_before_a_unique_one():
    # Segment.length is 0 for text (known once tokenized): shareable_blocks must count its tokens, or
    # it drops keys a later request hits (here block 12, the text's token)
    a = Request("a", 0.0, (Segment("shared", 12, name="p"), Segment("text", text="a"), Segment("unique", 1)), 1)
    b = Request("b", 1.0, (Segment("shared", 12, name="p"), Segment("text", text="aa")), 1)
    kept, every = _both([a, b], 1)
    assert kept.result() == every.result() and kept.result().hit_tokens == 13


def test_a_shared_stream_one_request_uses_is_not_kept():
    # "own" is read by one request only (count_once): like a unique segment, its blocks and every
    # block after them can never be hit, so they are counted, not kept
    a = Request("a", 0.0, (Segment("shared", 32, name="p"), Segment("shared", 32, name="own"),
                           Segment("shared", 32, name="q")), 1)
    b = Request("b", 1.0, (Segment("shared", 32, name="p"), Segment("shared", 32, name="q")), 1)
    kept, every = _both([a, b], 16)
    assert kept.result() == every.result() and kept.result().hit_tokens == 32
    assert len(kept.seen) == len(every.seen) - 4
