"""Radix mode against SGLang: node-granular eviction held to a brute-force re-implementation of SGLang's
RadixCache on random traces (tests/radix_reference.py) and to SGLang 0.5.23's own RadixCache on the
real Mooncake trace (tests/data/sglang-0.5.23-radix-mooncake.json.gz, from
benchmarks/sglang_reference/drive.py), through both PagedKV's radix mode and the what-if; and the
token-granular ideal against a brute-force token trie, and as the ceiling of radix runs."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from radix_reference import RadixReference

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.memory import PagedKV, SeqKV
from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.ideal import ideal_hits, radix_ideal_hits
from kvbench.trace.importers import convert
from kvbench.trace.keys import cached_sequence, sequence_tokens
from kvbench.trace.tokens import TokenStreams
from kvbench.whatif.blocktrace import prepare
from kvbench.whatif.curve import simulate

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
GOLDEN = REPO / "tests" / "data" / "sglang-0.5.23-radix-mooncake.json.gz"
STREAMS = TokenStreams()


def sequential_hits(reqs, bs: int, num_blocks: int, *, decode: bool = False, eviction: str = "node",
                    partial: bool = False) -> tuple[list[int], int]:
    """Requests one at a time through PagedKV's radix mode, as drive.py walks SGLang: lookup, allocate
    and commit the prompt (then, with ``decode``, one token at a time the output_len - 1 generated
    ones), free. -> (hit tokens per request, blocks evicted)."""
    kv = PagedKV(num_blocks, bs, prefix_mode="radix", radix_eviction=eviction, radix_partial=partial)
    hits = []
    for r in reqs:
        prompt = STREAMS.expand(r)
        s = SeqKV(tokens=sequence_tokens(r, prompt, STREAMS) if decode else prompt)
        found = kv.lookup(s, r.prompt_len)
        cached = kv.num_cached_tokens(s, found)
        assert kv.allocate(s, r.prompt_len - cached, found)
        kv.take_copies()
        kv.commit(s, r.prompt_len - cached)
        for _ in range(r.output_len - 1 if decode else 0):
            assert kv.allocate(s, 1)
            kv.commit(s, 1)
        kv.free(s)
        hits.append(cached)
    kv.pool.recount()
    return hits, kv.pool.evictions


# ------------------------------------------------------------------ random traces vs the reference

@st.composite
def traces(draw):
    """A few dozen requests over a handful of shared streams cut at any length (prefixes end inside
    blocks and inside nodes), some repeated outright (a block computed again), with unique tails."""
    n = draw(st.integers(2, 30))
    reqs = []
    for i in range(n):
        segs = []
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                segs.append(Segment("shared", draw(st.integers(1, 24)), name=f"s{draw(st.integers(0, 3))}"))
            else:
                segs.append(Segment("unique", draw(st.integers(1, 12))))
        if reqs and draw(st.integers(0, 4)) == 0:
            segs = list(reqs[draw(st.integers(0, len(reqs) - 1))].prompt)  # the same prompt again
        prompt_len = sum(s.length for s in segs)
        reqs.append(Request(id=f"r{i}", t=0.0, prompt=tuple(segs), output_len=draw(st.integers(1, 20)),
                            prompt_len=prompt_len))
    return reqs


def recomputes_a_cached_block(reqs, bs: int) -> bool:
    """Some prompt ends on a block boundary and an earlier sequence continued it: its last block is
    cached when it is computed again (it is never looked up). SGLang then drops its copy and hangs
    what the request adds next (its output) below the tree's; kvbench keeps the copy, as vLLM does,
    so the output starts a root of its own (a documented difference)."""
    seqs = []
    for r in reqs:
        prompt = STREAMS.expand(r)
        if r.prompt_len % bs == 0 and any(len(q) >= r.prompt_len and (q[:r.prompt_len] == prompt).all()
                                         for q in seqs):
            return True
        seqs.append(sequence_tokens(r, prompt, STREAMS))
    return False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(reqs=traces(), bs=st.sampled_from([1, 2, 4]), slack=st.integers(0, 40), decode=st.booleans())
def test_node_eviction_matches_sglang_reference(reqs, bs, slack, decode):
    """Request by request, kvbench's radix mode (node eviction, whole blocks) hits what the brute-force
    SGLang RadixCache hits, and evicts as many blocks; the what-if too (prompts only). With decode,
    but for a prompt whose last block is computed again (recomputes_a_cached_block)."""
    if decode:
        assume(not recomputes_a_cached_block(reqs, bs))
    need = max(-(-(r.prompt_len + (r.output_len - 1 if decode else 0)) // bs) for r in reqs)
    capacity = need + slack
    ref = RadixReference(capacity, bs)
    want = ref.run(reqs, STREAMS, outputs=decode)
    got, evicted = sequential_hits(reqs, bs, capacity, decode=decode)
    assert got == want
    assert evicted * bs == ref.evicted_tokens
    if not decode:
        bt = prepare(reqs, bs, future=False)
        seen: list[int] = []
        simulate(bt, capacity, "lru", on_request=lambda i, h: seen.append(h * bs), prefix_mode="radix")
        assert seen == want


def test_node_eviction_frees_whole_nodes_lru_leaves_first():
    """The rule spelled out: three prompts share a 4-block trunk, each adds a 3-block branch. A
    shortfall of one block evicts the least recently used branch whole (node eviction, SGLang)
    where block eviction takes one block; the trunk goes only after every branch."""
    bs = 4
    trunk = STREAMS.stream("trunk", 16)
    prompts = [np.concatenate([trunk, STREAMS.stream(f"branch{k}", 12), [7]]) for k in range(3)]
    for eviction, first in (("node", 3), ("block", 1)):
        kv = PagedKV(14, bs, prefix_mode="radix", radix_eviction=eviction, radix_partial=False)
        order: list[int] = []
        kv.pool.on_evict = order.append
        branches = []
        for p in prompts:  # 29 tokens: the trunk (hit after the first), 3 branch blocks, a partial one
            s = SeqKV(tokens=p)
            hits = kv.lookup(s, len(p))
            assert kv.allocate(s, len(p) - len(hits) * bs, hits)
            kv.commit(s, len(p) - len(hits) * bs)
            branches.append(s.table[4:7])
            trunk_blocks = s.table[:4]
            kv.free(s)
        assert not order and kv.pool.num_cached == 13 and kv.pool.num_free == 1
        other = SeqKV(tokens=STREAMS.stream("other", 2 * bs))
        assert kv.allocate(other, 2 * bs)  # one block short
        assert len(order) == first and set(order) <= set(branches[0])
        kv.commit(other, 2 * bs)
        kv.free(other)  # cached too, the most recently used
        rest = SeqKV(tokens=STREAMS.stream("rest", 14 * bs))
        assert kv.allocate(rest, 14 * bs)  # everything
        assert len(order) == 15
        last_branch = max(i for i, b in enumerate(order[:13]) if any(b in br for br in branches))
        assert last_branch < min(i for i, b in enumerate(order) if b in trunk_blocks)  # leaves first
        if eviction == "node":  # branch by branch, least recently used first, then the trunk
            assert [set(order[:3]), set(order[3:6]), set(order[6:9])] == [set(b) for b in branches]
            assert set(order[9:13]) == set(trunk_blocks)
        kv.pool.recount()


def test_a_recomputed_cached_block_is_stamped_as_sglang_inserts_it():
    """A prompt ending on a block boundary computes its last block again (never looked up); SGLang's
    insert walks the tree's copy and stamps it, so that copy outlives older leaves."""
    bs = 2

    def req(i, *segs):
        segs = tuple(Segment("unique", n) if name is None else Segment("shared", n, name=name) for name, n in segs)
        return Request(id=f"q{i}", t=0.0, prompt=segs, output_len=1, prompt_len=sum(x.length for x in segs))

    reqs = [req(0, ("s0", 4)),  # node [a0 a1]
            req(1, ("s0", 2), (None, 2)),  # hits a0: splits [a0] | [a1]; adds its own block below a0
            req(2, ("s9", 4)),  # an unrelated node
            req(3, ("s0", 4)),  # hits a0; a1 is past its lookup: computed again, stamped
            req(4, ("s7", 4)),  # one block short: evicts the least recently used leaf, not a1
            req(5, ("s0", 4), (None, 2))]  # hits a0 a1
    want = RadixReference(6, bs).run(reqs, STREAMS)
    assert want[-1] == 4
    assert sequential_hits(reqs, bs, 6)[0] == want
    seen: list[int] = []
    simulate(prepare(reqs, bs, future=False), 6, "lru", on_request=lambda i, h: seen.append(h * bs),
             prefix_mode="radix")
    assert seen == want


# ------------------------------------------------------------------------- SGLang's own numbers

@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN} missing")
    return json.loads(gzip.open(GOLDEN, "rt", encoding="utf-8").read())


@pytest.fixture(scope="module")
def mooncake_slice(golden, tmp_path_factory):
    if not REAL.exists():
        pytest.skip(f"real trace not found at {REAL}")
    out = tmp_path_factory.mktemp("mooncake") / "slice.jsonl"
    convert("mooncake", REAL, out, limit=golden["slice"]["requests"])
    return load_trace(out)


def test_sglang_golden_slice_whatif(golden, mooncake_slice):
    """The what-if's radix mode gives SGLang 0.5.23's own hits, request by request, and evicts the same
    tokens, on the first Mooncake requests at every budget SGLang ran (prompts only); block eviction
    (the what-if's hash mode) gives other hits."""
    bs = golden["page"]
    bt = prepare(mooncake_slice, bs, future=False)
    differ = 0
    for run in golden["slice"]["runs"]:
        if run["outputs"]:
            continue
        seen: list[int] = []
        pt = simulate(bt, run["tokens"] // bs, "lru", on_request=lambda i, h, seen=seen: seen.append(h * bs),
                      prefix_mode="radix")
        assert seen == run["hits"], run["tokens"]
        assert pt.evicted_blocks * bs == run["evicted_tokens"]
        differ += simulate(bt, run["tokens"] // bs, "lru").hit_tokens != run["hit_tokens"]
    assert differ >= 2


def test_sglang_golden_slice_pagedkv(golden, mooncake_slice):
    """PagedKV's radix mode, one request at a time, with every output token decoded: SGLang's hits and
    evicted tokens (the decode steps' blocks form one node, as SGLang inserts the output at finish);
    and prompts only at 768,000 tokens, where block eviction hits otherwise."""
    bs = golden["page"]
    for run in golden["slice"]["runs"]:
        if run["outputs"] or run["tokens"] == 768_000:
            hits, evicted = sequential_hits(mooncake_slice, bs, run["tokens"] // bs, decode=run["outputs"])
            assert hits == run["hits"], (run["tokens"], run["outputs"])
            assert evicted * bs == run["evicted_tokens"]
            if run["tokens"] == 768_000 and not run["outputs"]:
                block, _ = sequential_hits(mooncake_slice, bs, run["tokens"] // bs, eviction="block")
                assert block != run["hits"]


@pytest.mark.slow
def test_sglang_golden_whole_trace(golden, tmp_path):
    """The issue's figures: the whole Mooncake conversation trace, 768,000 and 4,000,000 tokens of
    cache, page 16: SGLang hits 0.04887 and 0.17855, and so does the what-if's radix mode."""
    if not REAL.exists():
        pytest.skip(f"real trace not found at {REAL}")
    out = tmp_path / "mooncake.jsonl"
    convert("mooncake", REAL, out)
    reqs = load_trace(out)
    bt = prepare(reqs, golden["page"], future=False)
    for run in (r for r in golden["whole"]["runs"] if not r["outputs"]):
        pt = simulate(bt, run["tokens"] // golden["page"], "lru", prefix_mode="radix")
        assert (pt.hit_tokens, bt.window_prompt_tokens) == (run["hit_tokens"], run["prompt_tokens"])
        assert pt.evicted_blocks * golden["page"] == run["evicted_tokens"]
    assert [round(r["hit_rate"], 5) for r in golden["whole"]["runs"] if not r["outputs"]] == [0.04887, 0.17855]


# ------------------------------------------------------------------- the token-granular ideal

def trie_ideal(reqs, bs: int) -> int:
    """The token-granular ideal by brute force: each request hits the longest common prefix of its
    prompt (never its last token) with anything cached before it: every earlier sample's tokens
    (prompt and generated), as a token trie would hold them."""
    cached: list[np.ndarray] = []
    total = 0
    for r in reqs:
        prompt = STREAMS.expand(r)
        want = prompt[:r.prompt_len - 1]
        best = 0
        for c in cached:
            n = min(len(c), len(want))
            diff = np.flatnonzero(c[:n] != want[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        # whole blocks past the prompt's end never hit but by chance: count them only up to there
        total += best
        for sample in range(r.n):
            seq = sequence_tokens(r, prompt, STREAMS, sample)
            cached.append(seq[:max(len(cached_sequence(r, prompt, STREAMS)), -(-r.prompt_len // bs) * bs)])
    return total


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=traces(), bs=st.sampled_from([1, 4, 16]), named=st.booleans())
def test_radix_ideal_is_a_token_trie(reqs, bs, named):
    """radix_ideal_hits equals a token trie of every earlier cached sequence, and lies between the
    block ideal and the prompt tokens less one per request."""
    for i, r in enumerate(reqs):
        r.n = 1 + i % 3  # parallel samples: each leaves its own first tokens after the prompt
        if named:  # answers that a later prompt may re-send
            r.output = f"ans{i % 3}"
    got = radix_ideal_hits(reqs, bs, STREAMS)
    assert got.hit_tokens == trie_ideal(reqs, bs)
    assert ideal_hits(reqs, bs, STREAMS).hit_tokens <= got.hit_tokens <= sum(r.prompt_len - 1 for r in reqs)


def test_radix_ideal_counts_the_generated_tokens_after_the_prompt():
    """The engine keeps the block after a prompt with the first generated tokens in it, and a later
    prompt may match them (here on purpose; in a real trace by chance): the ideal counts them, so a
    radix run cannot pass it there either."""
    bs = 4
    a = Request(id="a", t=0.0, prompt=(Segment("shared", 10, name="doc"),), output_len=8, prompt_len=10)
    g0 = int(STREAMS.output_tokens(a, 1)[0])
    b = Request(id="b", t=1.0, prompt=(Segment("shared", 10, name="doc"), Segment("tokens", 1, tokens=(g0,)),
                                       Segment("unique", 5)), output_len=2, prompt_len=16)
    reqs = [a, b]
    engine, _ = sequential_hits(reqs, bs, 64, decode=True, partial=True)
    ideal = radix_ideal_hits(reqs, bs, STREAMS)
    assert engine == [0, 11] and ideal.hit_tokens == 11 == trie_ideal(reqs, bs)
    assert ideal_hits(reqs, bs, STREAMS).hit_tokens == 8


def test_radix_ideal_counter_covers_the_requests_fed():
    """An interrupted radix run's ideal covers the requests it admitted, as the block ideal's does."""
    from kvbench.trace.ideal import RadixIdealCounter
    from kvbench.trace.keys import PrefixKeys

    reqs = load_trace(REPO / "traces" / "rag.jsonl")
    counter, keys_of = RadixIdealCounter(16, reqs), PrefixKeys(16)
    for r in reqs[:100]:
        counter.add(*keys_of(r))
    part = radix_ideal_hits(reqs[:100], 16)
    assert (counter.result().hit_tokens, counter.result().prompt_tokens) == (part.hit_tokens, part.prompt_tokens)


@pytest.mark.parametrize("trace", ["rag", "chat", "agent"])
def test_radix_runs_stay_under_their_token_granular_ideal(trace, tmp_path):
    """summary.json: a radix run's ideal is token-granular, and its hit rate never exceeds it (on
    rag.jsonl the block ideal is 0.3934 and radix hits 0.3968: the partial blocks), while hash runs
    keep the block ideal."""
    path = REPO / "traces" / f"{trace}.jsonl"
    out = {}
    for mode in ("hash", "radix"):
        cfg = ReplayConfig(executor="sim", prefix_mode=mode)
        out[mode] = Replay(str(path), cfg, str(tmp_path / mode)).run()
    reqs = load_trace(path)
    block, token = ideal_hits(reqs, 16).hit_rate, radix_ideal_hits(reqs, 16).hit_rate
    assert out["hash"]["ideal_hit_rate"] == pytest.approx(block, abs=0)
    assert out["radix"]["ideal_hit_rate"] == pytest.approx(token, abs=0)
    assert out["hash"]["prefix_hit_rate"] <= block
    assert out["radix"]["prefix_hit_rate"] <= token
    assert token > block
    if trace == "rag":
        assert out["radix"]["prefix_hit_rate"] > block  # what the block ideal could not bound
        assert round(block, 4) == 0.3934 and round(token, 4) == 0.3968


# ------------------------------------------------------------------------------ the option

def test_radix_eviction_option_in_config_and_sweep_grid():
    """--radix-eviction: node (default) orders nodes by recency, so another --cache-policy needs block;
    a sweep collapses cache_policy under node and radix_eviction under hash, and nothing else."""
    from kvbench.errors import InputError
    from kvbench.sweep.grid import expand

    assert ReplayConfig().radix_eviction == "node"
    with pytest.raises(InputError) as e:
        ReplayConfig(prefix_mode="radix", cache_policy="fifo").validate()
    assert e.value.field == "--cache-policy"
    ReplayConfig(prefix_mode="radix", cache_policy="fifo", radix_eviction="block").validate()
    ReplayConfig(prefix_mode="hash", cache_policy="fifo").validate()
    with pytest.raises(InputError):
        ReplayConfig(prefix_mode="radix", radix_eviction="leaf").validate()
    grid = {"prefix_mode": ["hash", "radix"], "radix_eviction": ["node", "block"], "cache_policy": ["lru", "fifo"]}
    names = sorted(c.name for c in expand(grid))
    assert names == ["paged-hash-fifo", "paged-hash-lru", "paged-radix-ev_block-fifo", "paged-radix-ev_block-lru",
                     "paged-radix-ev_node"]
    kv = {c.name: c.cfg for c in expand(grid)}
    assert kv["paged-radix-ev_node"].cache_policy == "lru" and kv["paged-hash-fifo"].radix_eviction == "node"


def test_replay_radix_eviction_block_and_node(tmp_path):
    """Both evictions run in the engine on a pool small enough to evict, and config.json says which."""
    path = REPO / "traces" / "chat.jsonl"
    got = {}
    for ev in ("node", "block"):
        cfg = ReplayConfig(executor="sim", prefix_mode="radix", radix_eviction=ev, num_blocks=400)
        got[ev] = Replay(str(path), cfg, str(tmp_path / ev)).run()
        assert json.loads((tmp_path / ev / "config.json").read_text())["settings"]["radix_eviction"] == ev
        assert got[ev]["complete"] and got[ev]["prefix_hit_rate"] <= got[ev]["ideal_hit_rate"]
    assert got["node"]["prefix_hit_rate"] != got["block"]["prefix_hit_rate"]
