"""Segment expansion: identical token ids in separate processes, and two requests share exactly the
prefix their segments say they share (property test)."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.ideal import ideal_hits
from kvbench.trace.keys import cached_sequence
from kvbench.trace.tokens import TOKEN_HI, TOKEN_LO, TokenStreams, block_keys

REPO = Path(__file__).resolve().parents[1]
DIGEST = """
import hashlib, sys
from kvbench.trace.format import load_trace
from kvbench.trace.tokens import TokenStreams
s = TokenStreams(max_cached_tokens=4096)  # a tiny memo: chunks are dropped and regenerated
h = hashlib.sha256()
for r in load_trace(sys.argv[1]):
    h.update(s.expand(r).tobytes())
    if r.output:
        h.update(s.output_tokens(r, r.output_len).tobytes())
print(h.hexdigest())
"""


def test_expansion_is_identical_across_processes():
    trace = str(REPO / "traces" / "chat.jsonl")
    digests = set()
    for seed in ("1", "2"):  # a different PYTHONHASHSEED must change nothing
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", DIGEST, trace], capture_output=True, text=True,
                           env=env, timeout=60, check=True)
        digests.add(r.stdout.strip())
    s, h = TokenStreams(), hashlib.sha256()
    for r in load_trace(trace):
        h.update(s.expand(r).tobytes())
        if r.output:
            h.update(s.output_tokens(r, r.output_len).tobytes())
    digests.add(h.hexdigest())
    assert len(digests) == 1


def test_stream_is_prefix_consistent_across_chunks():
    s = TokenStreams(max_cached_tokens=1024)
    whole = s.stream("doc", 5000)
    assert np.array_equal(s.stream("doc", 1500, start=1000), whole[1000:2500])
    assert whole.dtype == np.int32 and whole.min() >= TOKEN_LO


# Segments from a small name space so that shared names repeat; literal token ids lie below TOKEN_LO,
# so they can never coincide with a generated stream.
segment = st.one_of(
    st.builds(lambda n, k: Segment("shared", k, name=f"s{n}"), st.integers(0, 3), st.integers(1, 40)),
    st.builds(lambda k: Segment("unique", k), st.integers(1, 40)),
    st.builds(lambda t: Segment("tokens", len(t), tokens=tuple(t)),
              st.lists(st.integers(0, TOKEN_LO - 1), min_size=1, max_size=6)),
)


def expected_common_prefix(a: list[Segment], b: list[Segment]) -> int:
    """What the segments promise: equal segments match whole; the same shared name matches over the
    shorter length; literal tokens match where equal; anything else (unique, other names) not at all."""
    n = 0
    for x, y in zip(a, b):
        if x.kind == y.kind == "shared" and x.name == y.name:
            n += min(x.length, y.length)
            if x.length != y.length:
                return n
        elif x.kind == y.kind == "tokens":
            k = next((i for i, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q),
                     min(len(x.tokens), len(y.tokens)))
            n += k
            if x.tokens != y.tokens:
                return n
        else:
            return n
    return n


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(segment, max_size=4), st.lists(segment, min_size=1, max_size=4),
       st.lists(segment, min_size=1, max_size=4))
def test_requests_share_exactly_the_promised_prefix(common, tail_a, tail_b):
    a = Request("a", 0.0, tuple(common + tail_a), 1)
    b = Request("b", 0.0, tuple(common + tail_b), 1)
    s = TokenStreams()
    ta, tb = s.expand(a), s.expand(b)
    n = min(len(ta), len(tb))
    mismatch = np.nonzero(ta[:n] != tb[:n])[0]
    lcp = int(mismatch[0]) if mismatch.size else n
    assert lcp == min(expected_common_prefix(list(a.prompt), list(b.prompt)), n)
    # The ideal count agrees: b hits exactly the whole blocks of that prefix (bounded by its lookup).
    bs = 4
    assert ideal_hits([a, b], bs, s).hit_tokens - ideal_hits([a], bs, s).hit_tokens == \
        min(lcp // bs, (len(tb) - 1) // bs) * bs


def test_fast_block_keys_match_the_plain_definition():
    # ideal_hits memoises keys of block-aligned shared segments; it must count as the plain
    # definition does: keys of the whole cached sequence, longest seen prefix, last token excluded.
    s = TokenStreams()
    reqs = [Request("1", 0, (Segment("shared", 37, name="p"), Segment("unique", 5)), 20, output="o1"),
            Request("2", 0, (Segment("shared", 37, name="p"), Segment("shared", 20, name="o1"),
                             Segment("shared", 64, name="q")), 3),
            Request("3", 0, (Segment("shared", 32, name="p"), Segment("shared", 64, name="q")), 3),
            Request("4", 0, (Segment("shared", 37, name="p"), Segment("shared", 20, name="o1"),
                             Segment("shared", 64, name="q"), Segment("tokens", 1, tokens=(1,))), 3)]
    for bs in (1, 4, 16):
        seen, hit = set(), 0
        for r in reqs:
            prompt = s.expand(r)
            keys = block_keys(cached_sequence(r, prompt, s), bs)
            h = 0
            while h < (len(prompt) - 1) // bs and keys[h] in seen:
                h += 1
            hit += h * bs
            seen.update(keys)
        got = ideal_hits(reqs, bs, s)
        assert (got.hit_tokens, got.distinct_blocks) == (hit, len(seen))


def splitmix_tokens(seed: int, start: int, length: int) -> np.ndarray:
    """The stream's definition, restated in numpy (as stream_tokens computed it before it was compiled)."""
    x = np.arange(start + 1, start + length + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x % np.uint64(TOKEN_HI - TOKEN_LO)).astype(np.int32) + TOKEN_LO


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.integers(0, 3000))
def test_stream_tokens_are_splitmix64(seed, start, length):
    from kvbench.trace import compiled
    from kvbench.trace.tokens import stream_tokens
    # compiled.py restates the token range (numba freezes a global into its cached code): one range
    assert (compiled.TOKEN_LO, compiled.TOKEN_HI) == (TOKEN_LO, TOKEN_HI)
    assert np.array_equal(stream_tokens(seed, start, length), splitmix_tokens(seed, start, length))


def test_commands_that_never_hash_never_import_numba(tmp_path):
    # numba costs ~0.2 s and ~60 MB to import: kvbench.trace.compiled is loaded on first use
    # (tokens.compiled()), so importing kvbench, loading a trace and generating one must not pull it in
    code = f"""
import sys
import kvbench, kvbench.cli, kvbench.trace.ideal, kvbench.memory.paged
from kvbench.trace.format import load_trace
load_trace({str(REPO / "traces" / "chat.jsonl")!r})
kvbench.cli.main(["trace", "gen", "chat", "--requests", "5", "-o", {str(tmp_path / "t.jsonl")!r}])
assert len(load_trace({str(tmp_path / "t.jsonl")!r})) == 5
print(sorted(m for m in sys.modules if m == "numba" or m.startswith("numba.") or m == "kvbench.trace.compiled"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_block_keys_as_an_array_are_the_lists_keys():
    """PagedKV keeps a sequence's keys as a uint64 array under the compiled pool: block_keys gives
    that array straight (the compiled path's and the few-block path's), the same keys as its list."""
    toks = np.random.default_rng(7).integers(0, 2**31 - 1, 40 * 16, dtype=np.int64).astype(np.int32)
    for n in (0, 1, 3, 12, 13, 40):  # around FEW_BLOCKS (12): both paths
        for parent in (0, 2**64 - 1, 12345):
            got = block_keys(toks, 16, n, parent, as_array=True)
            assert got.dtype == np.uint64 and got.tolist() == block_keys(toks, 16, n, parent)
