"""The ideal hit rate's infinite cache keeps only keys a later request could hit: the same figures
as keeping every key, on the shipped traces and random ones, with far fewer keys held."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.trace import compiled_ideal
from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.ideal import NEVER, IdealCounter, _seen_prefix, block_expiry
from kvbench.trace.keys import PrefixKeys, lookup_blocks
from kvbench.trace.stream import SharedNames

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


# ------------------------------------------------------------- the compiled table against a set

class SetCounter:
    """IdealCounter as it was: a Python set of the kept keys, and the keys to let go under their
    expiry, each let go (once counted) by a request placed after it."""

    def __init__(self, bs):
        self.bs, self.seen, self.expiring = bs, set(), {}
        self.kept_blocks = self.private_blocks = self.hit_tokens = self.prompt_tokens = 0

    def add(self, keys, prompt_len, shareable=None, expires=None, at=0):
        for e in [e for e in self.expiring if e < at]:
            self.seen.difference_update(self.expiring.pop(e))
        m = _seen_prefix(keys, self.seen)
        h = min(m, lookup_blocks(prompt_len, self.bs)) * self.bs
        self.hit_tokens += h
        self.prompt_tokens += prompt_len
        end = len(keys) if shareable is None or shareable >= len(keys) else shareable
        if end < len(keys):
            self.private_blocks += len(keys) - max(m, end)
        if m < end:
            before = len(self.seen)
            self.seen.update(keys[m:end].tolist())
            self.kept_blocks += len(self.seen) - before
            if expires is not None:
                for k, e in zip(keys[m:end].tolist(), expires[m:end].tolist()):
                    if e != NEVER:
                        self.expiring.setdefault(e, []).append(k)
        return h


def _same_as_a_set(calls, bs=4):
    got, want = IdealCounter(bs), SetCounter(bs)
    for keys, plen, shareable, expires, at in calls:
        keys = np.array(keys, dtype=np.uint64)
        expires = None if expires is None else np.array(expires, dtype=np.int64)
        assert got.add(keys, plen, shareable, expires, at) == want.add(keys, plen, shareable, expires, at)
        assert len(got.seen) == len(want.seen) and set(got.seen) == want.seen
        assert all(k in got.seen for k in keys[:3].tolist()) == all(k in want.seen for k in keys[:3].tolist())
        assert (got.kept_blocks, got.private_blocks, got.hit_tokens, got.prompt_tokens) == \
               (want.kept_blocks, want.private_blocks, want.hit_tokens, want.prompt_tokens)
        # a list node per key still to let go (none for NEVER, none left once let go)
        assert len(got._nkey) - got._c[compiled_ideal.NFREE] == sum(len(ks) for ks in want.expiring.values())
    return got


# keys sharing their low bits (one home slot: long probe runs, wrapping, shifted back on delete), the
# extremes of uint64, and keys in no order (a table not prefix-closed: the same probes of the search)
KEYS = st.sampled_from([0, 1, 2, 3, 2**64 - 1, 2**63, 1023, 2047] + [j << 20 for j in range(1, 9)]
                       + [(j << 20) + 1023 for j in range(1, 5)])
call = st.integers(0, 10).flatmap(lambda n: st.tuples(
    st.lists(KEYS, min_size=n, max_size=n), st.integers(1, 60), st.one_of(st.none(), st.integers(-1, n + 1)),
    st.one_of(st.none(), st.lists(st.sampled_from([-1, 0, 1, 2, 3, 5, 8, NEVER]), min_size=n, max_size=n)),
    st.integers(0, 9)))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(call, min_size=1, max_size=25))
def test_the_compiled_table_keeps_and_lets_go_as_a_set_does(calls):
    _same_as_a_set(calls)


def test_the_compiled_table_grows_as_a_set_does():
    """Thousands of keys, many on one home slot, kept and let go as positions pass: the table, the
    lists of keys to let go and their heap all grow past their first sizes."""
    rng = np.random.default_rng(7)
    calls = []
    for at in range(300):
        n = int(rng.integers(0, 120))
        keys = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) << np.uint64(rng.integers(0, 12))
        expires = np.where(rng.random(n) < 0.1, NEVER, at + rng.integers(-2, 40, n))
        calls.append((keys.tolist(), int(rng.integers(1, 2000)), None if at % 3 else n // 2, expires.tolist(), at))
    got, first = _same_as_a_set(calls), IdealCounter(4)
    assert len(got._occ) > len(first._occ) and len(got._nkey) > len(first._nkey)
    assert got._heap.shape[1] > first._heap.shape[1]


def _expiry_by_numpy(pieces, n_blocks, bs, names):
    """block_expiry as numpy states it: the piece of each block's last token, by searchsorted."""
    ends = np.cumsum(pieces.lengths)
    piece = np.searchsorted(ends, np.arange(1, n_blocks + 1, dtype=np.int64) * bs - 1, side="right")
    return np.where(pieces.literal_at >= 0, NEVER, names.last_uses(pieces.seeds))[piece]


class _AskedNames:
    """A ``names`` that only answers last_uses (block_expiry asks it, not SharedNames' arrays)."""

    def __init__(self, names):
        self.names = names

    def last_uses(self, seeds):
        return self.names.last_uses(seeds)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40), st.booleans()), min_size=1, max_size=8),
       st.sampled_from([1, 4, 16]), st.lists(st.tuples(st.integers(0, 6), st.integers(-1, 50)), max_size=6))
def test_block_expiry_is_numpys(pieces, bs, shared):
    seeds = np.array([s * 0x9E3779B97F4A7C15 % 2**64 for s, _, _ in pieces], dtype=np.uint64)
    p = SimpleNamespace(seeds=seeds, lengths=np.array([n for _, n, _ in pieces], dtype=np.int64),
                        literal_at=np.array([0 if lit else -1 for _, _, lit in pieces], dtype=np.int64))
    # (a seed named twice, as two names of one hash would be: the first in sorted order answers)
    names = SharedNames(np.array([s * 0x9E3779B97F4A7C15 % 2**64 for s, _ in shared], dtype=np.uint64),
                        np.array([last for _, last in shared], dtype=np.int64))
    n_blocks = int(p.lengths.sum()) // bs
    for blocks in {0, n_blocks // 2, n_blocks}:
        want = _expiry_by_numpy(p, blocks, bs, names)
        for asked in (names, _AskedNames(names)):
            got = block_expiry(p, blocks, bs, asked)
            assert got.dtype == np.int64 and np.array_equal(got, want)
    with pytest.raises(IndexError):
        block_expiry(p, n_blocks + 1, bs, names)
