"""The compiled block keys and their memo give exactly the keys of the plain definition: xxhash's
xxh3_64 over each whole block of the expanded cached sequence, chained from ROOT_KEY (computed here
with the xxhash library, one block at a time, nothing memoised). On the shipped traces, the real
ones, random traces, and the cases a memo of (parent key, stream, length) could get wrong."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.trace import compiled
from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.ideal import (
    IdealCounter,
    dense_block_ids,
    ideal_hit_blocks,
    parent_block_ids,
)
from kvbench.trace.importers import convert
from kvbench.trace.keys import (
    PrefixKeys,
    cached_sequence,
    lookup_blocks,
    sequence_tokens,
    sequence_tokens_of,
)
from kvbench.trace.tokens import FEW_BLOCKS, ROOT_KEY, TokenStreams, block_keys

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "traces").glob("*.jsonl"))
REAL = ROOT.parent / "shared" / "traces" / "real"
STREAMS = TokenStreams()


def plain_keys(req: Request, bs: int) -> np.ndarray:
    tokens = cached_sequence(req, STREAMS.expand(req), STREAMS)
    keys, key = [], ROOT_KEY
    for b in range(len(tokens) // bs):
        key = xxhash.xxh3_64_intdigest(np.ascontiguousarray(tokens[b * bs:(b + 1) * bs], dtype=np.int32).tobytes(), key)
        keys.append(key)
    return np.array(keys, dtype=np.uint64)


def check_trace(reqs, bs, keys_of: PrefixKeys | None = None) -> PrefixKeys:
    """PrefixKeys.many and PrefixKeys(req) give the plain keys and prompt lengths of every request."""
    keys_of = keys_of or PrefixKeys(bs)
    keys_of.count_once(reqs)
    flat, starts, prompt_lens = keys_of.many(reqs)
    one_by_one = PrefixKeys(bs, memo_keys=64, memo_entries=8)  # tiny: flushed again and again
    for i, r in enumerate(reqs):
        want = plain_keys(r, bs)
        assert np.array_equal(flat[starts[i]:starts[i + 1]], want), (r.id, bs)
        assert prompt_lens[i] == len(STREAMS.expand(r))
        k, plen = one_by_one(r)
        assert np.array_equal(k, want) and plen == prompt_lens[i]
        k, plen, pieces, _ = keys_of.with_pieces(r)  # the replay's arrival: keys, then tokens at admission
        assert np.array_equal(k, want) and plen == prompt_lens[i]
        tokens = sequence_tokens_of(r, pieces)
        assert tokens.dtype == np.int32
        assert np.array_equal(tokens, sequence_tokens(r, STREAMS.expand(r), STREAMS)), (r.id, bs)
    return keys_of


# ------------------------------------------------------------------------- the compiled cores

@settings(max_examples=300, deadline=None, derandomize=True)
@given(words=st.integers(0, 700), seed=st.integers(0, 2**64 - 1), data=st.randoms(use_true_random=False))
def test_xxh3_is_the_xxhash_librarys(words, seed, data):
    w = np.array([data.getrandbits(32) for _ in range(words + 2)], dtype=np.uint32)
    got = compiled.xxh3(w, 1, words, np.uint64(seed), np.empty(8, np.uint64), np.empty(24, np.uint64))
    assert int(got) == xxhash.xxh3_64_intdigest(w[1:1 + words].tobytes(), seed)


@pytest.mark.parametrize("bs", [1, 2, 3, 4, 16, 32, 33, 60, 61, 64, 256, 512, 1024])
def test_block_keys_are_chained_xxh3(bs):
    n = FEW_BLOCKS + 3  # in one compiled call; the first few blocks in Python
    tokens = STREAMS.stream("doc", n * bs + bs // 2)  # and a partial block, left out
    key, want = 7, []
    for b in range(n):
        key = xxhash.xxh3_64_intdigest(tokens[b * bs:(b + 1) * bs].tobytes(), key)
        want.append(key)
    assert block_keys(tokens, bs, parent=7) == want
    for few in (1, 2, FEW_BLOCKS, FEW_BLOCKS + 1):
        assert block_keys(tokens, bs, few, parent=7) == want[:few]


def test_dense_ids_are_pandas_factorize():
    rng = np.random.default_rng(1)
    fresh = rng.integers(0, 2**64 - 1, 250_000, dtype=np.uint64, endpoint=True)
    fresh[7] = 0  # a key may be 0
    keys = np.concatenate([fresh, fresh[rng.integers(0, 250_000, 10_000)]])  # the table grows once
    ids, distinct = dense_block_ids(keys)
    want_ids, want_distinct = pd.factorize(keys)
    assert np.array_equal(ids, want_ids) and np.array_equal(distinct, np.asarray(want_distinct, dtype=np.uint64))
    assert np.array_equal(distinct[ids], keys)


def check_ideal(reqs, bs):
    """ideal_hit_blocks over dense ids gives IdealCounter's hits, request by request; parent_block_ids
    the parents as numpy's scatter gives them."""
    keys_of = PrefixKeys(bs)
    keys_of.count_once(reqs)
    flat, starts, prompt_lens = keys_of.many(reqs)
    lookups = np.minimum(lookup_blocks(prompt_lens, bs), np.diff(starts))
    ids, distinct = dense_block_ids(flat)
    hits = ideal_hit_blocks(ids, starts, lookups)
    parent = np.full(len(distinct), -1, dtype=np.int64)  # the numpy statement prepare made before
    if len(ids):
        before = np.concatenate(([-1], ids[:-1]))
        before[starts[:-1][np.diff(starts) > 0]] = -1
        parent[ids] = before
    assert np.array_equal(parent_block_ids(ids, starts, len(distinct)), parent)
    counter = IdealCounter(bs)
    for i, r in enumerate(reqs):
        k, plen = keys_of(r)
        assert counter.add(k, plen, keys_of.shareable_blocks(r)) == hits[i] * bs


# --------------------------------------------------------------------------- traces, whole

@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
@pytest.mark.parametrize("bs", [1, 16, 512])
def test_shipped_traces(path, bs):
    reqs = load_trace(str(path))
    check_trace(reqs, bs)
    check_ideal(reqs, bs)


@pytest.mark.parametrize("fmt,name,limit", [("mooncake", "mooncake_conversation.jsonl", 1500),
                                            ("azure", "azure_conv_2023.csv", 3000)])
def test_real_traces(tmp_path, fmt, name, limit):
    if not (REAL / name).exists():
        pytest.skip(f"real trace not found at {REAL}")
    convert(fmt, REAL / name, tmp_path / "t.jsonl", limit=limit)
    reqs = load_trace(str(tmp_path / "t.jsonl"))
    for bs in (16, 512):
        keys_of = check_trace(reqs, bs)
        if fmt == "mooncake":  # prefix-chained hash ids: the memo is used, not merely correct
            assert keys_of.memo_state[2] > 0
        check_ideal(reqs, bs)


segment = st.one_of(
    st.builds(lambda n, k: Segment("shared", k, name=f"s{n}"), st.integers(0, 3), st.sampled_from([4, 8, 12, 16, 5, 31])),
    st.builds(lambda k: Segment("unique", k), st.integers(1, 20)),
    st.builds(lambda t: Segment("tokens", len(t), tokens=tuple(t)), st.lists(st.integers(0, 15), min_size=1, max_size=9)),
    st.builds(lambda t: Segment("text", text=t), st.text("ab", min_size=1, max_size=9)),
)
request = st.tuples(st.lists(segment, min_size=1, max_size=5), st.integers(1, 12),
                    st.sampled_from([None, "s0", "s1", "ans"]))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(request, min_size=1, max_size=10), st.sampled_from([1, 4, 8, 16]),
       st.sampled_from([(64, 8), (4, 2), (2**12, 2**8)]))
def test_random_traces(reqs, bs, memo):
    trace = [Request(f"r{i}", float(i), tuple(segs), out, output=name) for i, (segs, out, name) in enumerate(reqs)]
    keys_of = PrefixKeys(bs, memo_keys=memo[0], memo_entries=memo[1])
    check_trace(trace, bs, keys_of)
    check_ideal(trace, bs)


# ------------------------------------------------------------------- what the memo could get wrong

def shared(name, n):
    return Segment("shared", n, name=name)


def test_a_segment_after_another_parent_has_other_keys():
    a = Request("a", 0.0, (shared("p", 16), shared("x", 32), shared("y", 5)), 1)
    b = Request("b", 0.0, (shared("q", 16), shared("x", 32), shared("y", 5)), 1)
    c = Request("c", 0.0, (shared("x", 32), shared("y", 5)), 1)  # the root as parent
    keys_of = check_trace([a, b, c, a], 16)
    assert keys_of.memo_state[2] > 0  # a's segments, again


def test_a_stream_read_longer_or_shorter_has_its_own_keys():
    reqs = [Request(str(i), 0.0, (shared("p", 16), shared("x", n), shared("q", 16)), 1)
            for i, n in enumerate([32, 48, 16, 40, 32, 48])]
    check_trace(reqs, 16)


def test_unique_literal_and_text_segments_are_never_memoised():
    reqs = [Request("a", 0.0, (shared("p", 16), Segment("unique", 16), shared("p2", 16)), 1),
            Request("b", 0.0, (shared("p", 16), Segment("unique", 16), shared("p2", 16)), 1),
            Request("c", 0.0, (shared("p", 16), Segment("tokens", 16, tokens=tuple(range(16))), shared("p2", 16)), 1),
            Request("d", 0.0, (shared("p", 16), Segment("tokens", 16, tokens=tuple(range(1, 17))), shared("p2", 16)), 1),
            Request("e", 0.0, (shared("p", 16), Segment("text", text="x" * 16), shared("p2", 16)), 1),
            Request("f", 0.0, (shared("p", 16), Segment("text", text="y" * 16), shared("p2", 16)), 1)]
    keys_of = check_trace(reqs, 16)
    # stored: "p" after the root, once (p2 follows a different block in every request)
    assert keys_of.memo_state[0] == 7


def test_a_stream_after_a_partial_block_is_not_looked_up():
    # "x" starts inside a block here: its keys depend on the tokens before it, not only on its parent
    reqs = [Request("a", 0.0, (shared("x", 32),), 1),
            Request("b", 0.0, (shared("p", 8), shared("x", 32)), 1),
            Request("c", 0.0, (shared("q", 8), shared("x", 32)), 1)]
    check_trace(reqs, 16)


@pytest.mark.parametrize("memo_entries", [64, 4])  # flushed for want of keys; of entries
def test_the_memo_is_bounded_and_flushed(memo_entries):
    # runs of 5 requests after the same "p": hits within a run, a flush at the next
    reqs = [Request(str(i), 0.0, (shared(f"p{i // 5}", 32), shared("x", 64)), 1) for i in range(40)]
    keys_of = PrefixKeys(16, memo_keys=8, memo_entries=memo_entries)
    check_trace(reqs, 16, keys_of)
    entries, pool_used, hits, flushes = keys_of.memo_state.tolist()
    assert 2 * entries <= memo_entries and pool_used <= 8 and flushes > 0 and hits > 0
