"""KV memory layer: invariants under random operation sequences (hypothesis), the published
best-of-8 sharing figure, prefix hits against the ideal on the real Mooncake trace, and policies."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.memory import PagedKV, SeqKV, SlabKV
from kvbench.memory.future import next_uses_from_keys
from kvbench.memory.policies import CACHE_POLICIES
from kvbench.trace.ideal import ideal_hits
from kvbench.trace.keys import cached_sequence, lookup_blocks
from kvbench.trace.tokens import TokenStreams, block_keys

STREAMS = TokenStreams()
# prefix modes under test: hash (vLLM), radix with block eviction, radix with node eviction (SGLang's
# default), and radix with node eviction matching whole blocks only (SGLang at page size = block size)
MODES = ["hash", "radix-block", "radix-node", "radix-node-whole"]


def make_paged(n_blocks: int, bs: int, policy: str, mode: str) -> PagedKV:
    """A PagedKV in one of MODES; node eviction orders by recency, so it takes lru whatever ``policy``."""
    if mode == "hash":
        return PagedKV(n_blocks, bs, prefix_cache=True, cache_policy=policy)
    node = mode.startswith("radix-node")
    return PagedKV(n_blocks, bs, prefix_cache=True, cache_policy="lru" if node else policy, prefix_mode="radix",
                   radix_eviction="node" if node else "block", radix_partial=mode != "radix-node-whole")


def check_invariants(kv: PagedKV, seqs: list[SeqKV]) -> None:
    p = kv.pool
    held: dict[int, int] = {}
    for s in seqs:
        for b in s.table:
            held[b] = held.get(b, 0) + 1
    free = set(p._free)
    for b in range(p.num_blocks):
        assert p.refcnt[b] == held.get(b, 0), f"block {b}: refcount {p.refcnt[b]} != holders {held.get(b, 0)}"
        assert not (b in free and p.refcnt[b] > 0), f"block {b} is free and referenced"
        if b in free:
            assert p.key[b] is None
    rc = p.recount()
    assert (p.num_used, p.tokens_live, p.num_cached, p.num_free) == (
        rc["num_used"], rc["tokens_live"], rc["num_cached"], rc["num_free"])
    assert p.num_used + p.num_cached + p.num_free == p.num_blocks
    for s in seqs:  # every token of a sequence has a slot
        assert len(s.table) * kv.block_size >= s.num_kv
        if p.kids is not None:  # leaves-only (radix): whoever holds a counted child holds its parent
            mine = set(s.table)
            assert all(p.kid_of[b] < 0 or p.kid_of[b] in mine for b in s.table)
        if p.nodes is not None:  # node eviction: the same, through the tree's parent links
            mine = set(s.table)
            assert all(p.nodes.up[b] < 0 or p.nodes.up[b] in mine for b in s.table if p.key[b] is not None)


def apply_op(kv: PagedKV, seqs: list[SeqKV], prompts: list[np.ndarray], op: str, k: int, n: int) -> bool:
    """One random allocator operation (new/append/fork/free) as the scheduler would do it;
    False for an operation this does not know (the caller's own)."""
    if op == "new":
        s = SeqKV(tokens=prompts[k])
        plen = min(len(prompts[k]), n * 3)
        hits = kv.lookup(s, plen)
        cached = kv.num_cached_tokens(s, hits)
        assert cached < plen  # never the last prompt token
        if kv.allocate(s, plen - cached, hits):
            kv.take_copies()  # the executor would copy these now; partial-hit sources unpinned
            kv.commit(s, plen - cached)
            assert len(s.table) == -(-s.num_kv // kv.block_size)  # no block more than its tokens need
            seqs.append(s)
    elif op == "append":
        if seqs:
            s = seqs[k % len(seqs)]
            if kv.allocate(s, n):
                kv.commit(s, n)
                assert len(s.table) == -(-s.num_kv // kv.block_size)
    elif op == "fork":
        if seqs:
            s = seqs[k % len(seqs)]
            child = SeqKV(tokens=s.tokens)
            kv.fork(s, child)
            seqs.append(child)
    elif op == "free":
        if seqs:
            kv.free(seqs.pop(k % len(seqs)))
    else:
        return False
    return True


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]),
                         st.integers(0, 7), st.integers(1, 40)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, policy=st.sampled_from(sorted(CACHE_POLICIES)), bs=st.sampled_from([1, 4, 16]),
       n_blocks=st.integers(8, 64), mode=st.sampled_from(MODES))
def test_pool_invariants_random_ops(ops, policy, bs, n_blocks, mode):
    kv = make_paged(n_blocks, bs, policy, mode)
    # 3 distinct prompt streams, and a fourth that shares 100 tokens with the first (radix: a prefix
    # ending inside a block)
    prompts = [STREAMS.stream(f"p{k % 3}", 200) for k in range(7)]
    prompts.append(np.concatenate([prompts[0][:100], STREAMS.stream("p-tail", 100)]))
    seqs: list[SeqKV] = []
    for op, k, n in ops:
        apply_op(kv, seqs, prompts, op, k, n)
        check_invariants(kv, seqs)
    for s in seqs:
        kv.free(s)
    check_invariants(kv, [])
    assert kv.pool.num_used == 0 and kv.pool.tokens_live == 0
    assert kv.pool.num_free + kv.pool.num_cached == n_blocks


evict_ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "evict", "evict"]),
                               st.integers(0, 7), st.integers(1, 40), st.integers(0, 2**31)),
                     min_size=1, max_size=60)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=evict_ops, policy=st.sampled_from(sorted(CACHE_POLICIES)), bs=st.sampled_from([1, 4, 16]),
       n_blocks=st.integers(8, 64), mode=st.sampled_from(MODES))
def test_pool_invariants_under_token_eviction(ops, policy, bs, n_blocks, mode):
    """Compaction (token eviction) among prefix hits, forks and frees: refcounts and counters stay
    exact, whole blocks come back, and no block shared or in the prefix cache is ever written."""
    kv = make_paged(n_blocks, bs, policy, mode)
    prompts = [STREAMS.stream(f"p{k % 3}", 200) for k in range(8)]
    seqs: list[SeqKV] = []
    for op, k, n, r in ops:
        rng = np.random.default_rng(r)
        if not apply_op(kv, seqs, prompts, op, k, n) and seqs:  # evict
            s = seqs[k % len(seqs)]
            if not s.num_kv:
                continue
            keep = np.flatnonzero(rng.random(s.num_kv) < rng.random())
            append = int(rng.integers(0, 3))
            frozen = {b: kv.pool.fill[b] for b in range(n_blocks)
                      if kv.pool.refcnt[b] > 1 or kv.pool.key[b] is not None}
            before = (s.num_kv, s.dropped, list(s.table))
            c = kv.compact(s, keep, append)
            if c is None:
                assert (s.num_kv, s.dropped, list(s.table)) == before
                continue
            n_new = len(keep) + append
            assert s.num_kv == n_new and s.num_kv + s.dropped == before[0] + before[1]
            assert len(s.table) == -(-n_new // bs)
            assert len(c.src) + len(c.append) == n_new - (len(keep) - len(c.src))
            written = set((np.concatenate([c.dst_phys, c.append_phys]) // bs).tolist())
            for b in written:  # only private, unindexed blocks are written
                assert kv.pool.refcnt[b] == 1 and kv.pool.key[b] is None and b in s.table
            for b, f in frozen.items():  # shared and cached blocks keep their contents, unless the
                # pool reclaimed a cached one (it then left the prefix index: no hit can read it)
                assert kv.pool.fill[b] == f or kv.pool.key[b] is None and b not in kv.pool.index.values()
                if kv.pool.refcnt[b] and b not in s.table:  # still another sequence's: untouched
                    assert kv.pool.fill[b] == f
        check_invariants(kv, seqs)
    for s in seqs:
        kv.free(s)
    check_invariants(kv, [])
    assert kv.pool.num_used == 0 and kv.pool.tokens_live == 0


@settings(max_examples=60, deadline=None)
@given(order=st.lists(st.integers(0, 5), min_size=1, max_size=25), bs=st.sampled_from([4, 16]))
def test_hits_never_exceed_ideal(order, bs):
    """Processed one after another, cache hits are bounded by the ideal of the same order,
    and equal it when the pool never has to evict."""
    from kvbench.trace.format import Request, Segment

    reqs = [Request(id=str(i), t=0.0, output_len=1, prompt_len=0,
                    prompt=(Segment("shared", 64, name="sys"), Segment("shared", 8 * (k + 1), name=f"d{k % 3}"),
                            Segment("unique", 5)))
            for i, k in enumerate(order)]
    for r in reqs:
        r.prompt_len = sum(s.length for s in r.prompt)
    ideal = ideal_hits(reqs, bs, STREAMS)
    for n_blocks, exact in ((10_000, True), (32, False)):
        kv = PagedKV(n_blocks, bs)
        hit = 0
        for r in reqs:
            s = SeqKV(tokens=STREAMS.expand(r))
            hits = kv.lookup(s, r.prompt_len)
            assert kv.allocate(s, r.prompt_len - len(hits) * bs, hits)
            kv.commit(s, r.prompt_len - len(hits) * bs)
            hit += len(hits) * bs
            kv.free(s)
        assert hit <= ideal.hit_tokens
        if exact:
            assert hit == ideal.hit_tokens


def test_best_of_8_sharing_figure():
    """design.md: best-of-8, 2,000-token prompt, 100 output tokens each: 125 + 8 x 7 = 181 blocks
    (2,896 slots, 2,800 live tokens) with sharing; 16,800 live tokens without."""
    prompt = STREAMS.stream("bo8", 2000)
    kv = PagedKV(4096, 16)
    parent = SeqKV(tokens=prompt)
    assert kv.allocate(parent, 2000)
    kv.commit(parent, 2000)
    seqs = [parent]
    for _ in range(7):
        child = SeqKV(tokens=prompt)
        kv.fork(parent, child)
        seqs.append(child)
    for s in seqs:
        for _ in range(100):
            assert kv.allocate(s, 1)
            kv.commit(s, 1)
    used, cached, free, slots, live = kv.stats()
    assert (used, slots, live) == (181, 2896, 2800)

    # without sharing: every sample holds its own copy of the prompt
    kv2 = PagedKV(4096, 16, prefix_cache=False)
    for _ in range(8):
        s = SeqKV(tokens=prompt)
        assert kv2.allocate(s, 2100)
        kv2.commit(s, 2100)
    used2, _, _, slots2, live2 = kv2.stats()
    assert live2 == 16800 and slots2 == 8 * 132 * 16


def test_fork_copy_on_write_reports_copies():
    prompt = STREAMS.stream("cow", 40)  # 2 full blocks + 8 tokens in a partial tail
    kv = PagedKV(64, 16)
    a = SeqKV(tokens=prompt)
    kv.allocate(a, 40)
    kv.commit(a, 40)
    b = SeqKV(tokens=prompt)
    kv.fork(a, b)
    tail = a.table[-1]
    assert kv.pool.refcnt[tail] == 2
    assert kv.allocate(b, 1)  # b appends into the shared partial tail: copy it first
    assert kv.take_copies() == [(tail, b.table[-1])]
    assert b.table[:2] == a.table[:2] and b.table[-1] != tail
    kv.commit(b, 1)
    assert kv.allocate(a, 1) and kv.take_copies() == []  # a now owns the tail alone: in place
    kv.commit(a, 1)
    assert kv.pool.fill[tail] == 9 and kv.pool.fill[b.table[-1]] == 9


@pytest.mark.parametrize("compiled", [True, False], ids=["ArrayBlockPool", "BlockPool"])
def test_hash_collision_cannot_return_wrong_kv(compiled):
    """A forged index entry whose key matches but whose tokens differ is not a hit: the match stops
    at the first block whose stored tokens differ; and a chain from another parent key is no hit."""
    kv = PagedKV(64, 4, compiled=compiled)
    t1 = STREAMS.stream("x", 16)
    s = SeqKV(tokens=t1)
    kv.allocate(s, 16)
    kv.commit(s, 16)
    other = STREAMS.stream("y", 16)
    s2 = SeqKV(tokens=other, keys=block_keys(t1, 4))  # same keys, different tokens: a collision
    assert kv.lookup(s2, 16) == []
    half = t1.copy()
    half[9] += 1  # the third block differs: only the comparison can tell
    assert kv.lookup(SeqKV(tokens=half, keys=block_keys(t1, 4)), 16) == list(s.table[:2])
    assert kv.pool.match(block_keys(t1, 4), t1, 3, 12345) == []
    s3 = SeqKV(tokens=t1)
    assert len(kv.lookup(s3, 16)) == 3  # never the block holding the last token


def test_lookup_never_takes_last_token_block():
    kv = PagedKV(64, 4)
    t = STREAMS.stream("z", 12)
    s = SeqKV(tokens=t)
    kv.allocate(s, 12)
    kv.commit(s, 12)
    assert len(kv.lookup(SeqKV(tokens=t), 12)) == 2
    assert len(kv.lookup(SeqKV(tokens=t), 13)) == 3 == lookup_blocks(13, 4)


def test_slab_first_fit_and_fragmentation():
    slab = SlabKV(100, 16)
    seqs = []
    for reserve in (480, 800, 320):  # 30, 50, 20 blocks: the pool is full
        s = SeqKV(reserve=reserve)
        assert slab.allocate(s, 10)
        slab.commit(s, 10)
        seqs.append(s)
    assert not slab.allocate(SeqKV(reserve=16), 1)
    slab.free(seqs[0])  # a 30-block hole at the front
    assert not slab.allocate(SeqKV(reserve=16 * 31), 1)  # 30 free blocks, but no 31-block hole
    big = SeqKV(reserve=16 * 30)
    assert slab.allocate(big, 1) and big.table == range(30)
    slab.free(seqs[1])
    slab.free(seqs[2])
    slab.free(big)
    assert slab._starts == [0] and slab._lens == [100]  # holes merged back into one
    used, cached, free, slots, live = slab.stats()
    assert (used, free, slots, live) == (0, 100, 0, 0)


def _mooncake_requests(limit=None):
    from pathlib import Path

    from kvbench.trace.format import Request, Segment

    path = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
    if not path.exists():
        pytest.skip(f"real trace not found at {path}")
    import json

    out = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            o = json.loads(line)
            k = len(o["hash_ids"])
            segs = [Segment("shared", 512, name=f"mooncake/{h}") for h in o["hash_ids"]]
            segs[-1] = Segment("shared", o["input_length"] - 512 * (k - 1), name=f"mooncake/{o['hash_ids'][-1]}")
            out.append(Request(id=str(i), t=o["timestamp"] / 1000, prompt=tuple(segs),
                               output_len=max(1, o["output_length"]), prompt_len=o["input_length"]))
    return out


def _sequential_hits(reqs, bs, n_blocks, policy, future=None) -> int:
    kv = PagedKV(n_blocks, bs, cache_policy=policy)
    hit = 0
    for i, r in enumerate(reqs):
        s = SeqKV(tokens=STREAMS.expand(r), next_use=None if future is None else future[i])
        hits = kv.lookup(s, r.prompt_len)
        n_new = r.prompt_len - len(hits) * bs
        if not kv.allocate(s, n_new, hits):  # a prompt larger than the pool: skip it
            continue
        kv.pool.clock = i
        kv.commit(s, n_new)
        hit += len(hits) * bs
        kv.free(s)
    return hit


def test_real_mooncake_hits_equal_ideal_with_a_large_pool():
    reqs = _mooncake_requests(limit=1500)
    ideal = ideal_hits(reqs, 16, STREAMS)
    assert ideal.hit_tokens > 0
    assert _sequential_hits(reqs, 16, ideal.distinct_blocks + 16, "lru") == ideal.hit_tokens


def test_real_mooncake_belady_beats_online_policies_with_a_small_pool():
    reqs = _mooncake_requests(limit=1500)
    bs = 64
    keys, looks = [], []
    for r in reqs:
        p = STREAMS.expand(r)
        keys.append(block_keys(cached_sequence(r, p, STREAMS), bs))
        looks.append(lookup_blocks(len(p), bs))
    future = next_uses_from_keys(keys, looks)
    n_blocks = 3000  # ~190k tokens: a fraction of the distinct prefix blocks
    hits = {p: _sequential_hits(reqs, bs, n_blocks, p, future if p == "belady" else None)
            for p in CACHE_POLICIES}
    ideal = ideal_hits(reqs, bs, STREAMS).hit_tokens
    assert hits["belady"] <= ideal
    for p in ("lru", "fifo", "lfu"):
        assert hits["belady"] >= hits[p], hits
    assert hits["belady"] > hits["fifo"]  # the small pool makes the choice matter


def test_radix_matches_inside_a_block_and_copies_it():
    """Radix serves a prefix that ends inside a cached block: whole blocks by reference, the partial
    block's matching tokens by a copy into a fresh block; hash mode stops at the last whole block."""
    base = STREAMS.stream("rx", 64)
    other = np.concatenate([base[:40], STREAMS.stream("rx-b", 24)])  # shares 40 = 2.5 blocks of 16
    for mode, want in (("hash", 32), ("radix", 40)):
        kv = PagedKV(64, 16, prefix_mode=mode)
        a = SeqKV(tokens=base)
        kv.allocate(a, 64)
        kv.commit(a, 64)
        kv.free(a)
        b = SeqKV(tokens=other)
        hits = kv.lookup(b, 64)
        assert len(hits) == 2 and kv.num_cached_tokens(b, hits) == want
        assert kv.allocate(b, 64 - want, hits)
        copies = kv.take_copies()
        if mode == "radix":
            (src, dst), = copies
            assert kv.pool.key[src] is not None and dst == b.table[2] and kv.pool.fill[dst] == 8
        else:
            assert copies == []
        kv.commit(b, 64 - want)
        check_invariants(kv, [b])


def test_radix_keeps_finished_partial_tails():
    """A finished sequence's partial last block (known tokens) stays matchable in radix mode."""
    turn1 = STREAMS.stream("conv", 40)  # 2 whole blocks + 8 tokens
    turn2 = np.concatenate([turn1, STREAMS.stream("conv-2", 30)])
    kv = PagedKV(64, 16, prefix_mode="radix")
    a = SeqKV(tokens=turn1)
    kv.allocate(a, 40)
    kv.commit(a, 40)
    kv.free(a)
    assert kv.pool.num_cached == 3  # the partial tail too
    b = SeqKV(tokens=turn2)
    hits = kv.lookup(b, 70)
    assert kv.num_cached_tokens(b, hits) == 40
    hash_kv = PagedKV(64, 16)
    a = SeqKV(tokens=turn1)
    hash_kv.allocate(a, 40)
    hash_kv.commit(a, 40)
    hash_kv.free(a)
    c = SeqKV(tokens=turn2)
    assert hash_kv.num_cached_tokens(c, hash_kv.lookup(c, 70)) == 32


def test_radix_never_hits_less_than_hash_on_real_mooncake():
    reqs = _mooncake_requests(limit=300)
    got = {}
    for mode in ("hash", "radix"):
        kv = PagedKV(200_000, 16, prefix_mode=mode)
        hit = 0
        for r in reqs:
            s = SeqKV(tokens=STREAMS.expand(r))
            hits = kv.lookup(s, r.prompt_len)
            cached = kv.num_cached_tokens(s, hits)
            assert kv.allocate(s, r.prompt_len - cached, hits)
            kv.take_copies()
            kv.commit(s, r.prompt_len - cached)
            hit += cached
            kv.free(s)
        got[mode] = hit
    assert got["radix"] > got["hash"] > 0  # Mooncake's last 512-token segment ends inside blocks


def test_radix_copy_source_is_pinned_until_handed_over():
    """The partly matched block must survive the allocations of the same admission: it is the
    oldest cached block here, so an unpinned source would be the first one evicted."""
    a_toks = STREAMS.stream("pin-a", 48)  # 3 blocks of 16, released tail first: block 2 oldest
    kv = PagedKV(6, 16, prefix_mode="radix")
    a = SeqKV(tokens=a_toks)
    kv.allocate(a, 48)
    kv.commit(a, 48)
    src = a.table[2]
    kv.free(a)
    c = SeqKV(tokens=STREAMS.stream("pin-c", 16))  # another cached block, released after a's
    kv.allocate(c, 16)
    kv.commit(c, 16)
    kv.free(c)
    b_toks = np.concatenate([a_toks[:40], STREAMS.stream("pin-b", 40)])  # 2 blocks + 8 tokens shared
    b = SeqKV(tokens=b_toks)
    hits = kv.lookup(b, 80)
    assert len(hits) == 2 and b.partial_block == src and b.partial_len == 8
    assert kv.allocate(b, 80 - 40, hits)  # 3 new blocks: the 2 free ones and one eviction
    assert src not in b.table and kv.pool.key[src] is not None
    assert kv.take_copies() == [(src, b.table[2])]
    check_invariants(kv, [b])


def test_radix_evicts_leaves_only():
    """Radix mode with block eviction (SGLang's rule at block granularity): a cached block that another cached block continues is not evicted
    before it, whatever the policy — a shared prefix outlives every branch hanging off it, even under
    fifo, which would take the prefix first (it was cached first). Hash mode (vLLM) has no such rule."""
    bs = 4
    trunk = STREAMS.stream("trunk", 16)
    prompts = [np.concatenate([trunk, STREAMS.stream(f"branch{k}", 9)]) for k in range(3)]
    for mode, policy in (("radix", "fifo"), ("radix", "lfu"), ("radix", "lru"), ("hash", "fifo")):
        kv = PagedKV(24, bs, cache_policy=policy, prefix_mode=mode, radix_eviction="block")
        order = []
        kv.pool.on_evict = (lambda b, prev=kv.pool.on_evict: (order.append(b), prev and prev(b)))
        seqs: list[SeqKV] = []
        for k in range(3):  # three requests share 4 trunk blocks, each adds 2 blocks and a partial one
            apply_op(kv, seqs, prompts, "new", k, 9)  # the whole 25-token prompt
        assert [s.num_kv for s in seqs] == [25, 25, 25]
        trunk = seqs[0].table[:4]
        trunk_blocks = set(trunk)
        for s in seqs:
            kv.free(s)
        check_invariants(kv, [])
        big = SeqKV(tokens=STREAMS.stream("other", 24 * bs))
        assert kv.allocate(big, 24 * bs)  # takes every block: all cached ones are evicted
        first_trunk = min(i for i, b in enumerate(order) if b in trunk_blocks)
        if mode == "radix":
            assert len(order) == 13 and first_trunk == 9  # 3 x (2 branch + 1 partial) first, the trunk last
            assert [b for b in order if b in trunk_blocks] == trunk[::-1]  # then from its end to the root
        else:
            assert first_trunk < 4  # fifo takes the oldest registered blocks: the trunk's


def test_radix_node_hit_past_a_private_copy_splits_the_node_it_leaves():
    """A partial hit makes a sequence compute a cached prefix again (private copies), so the next
    block it registers hangs apart from the cached chain; a later match runs through the cached
    chain into that block and must split the node it leaves, or the node is partly held."""
    kv = make_paged(8, 4, "lru", "radix-node")
    prompts = [STREAMS.stream(f"p{k % 3}", 200) for k in range(7)]
    seqs: list[SeqKV] = []
    for op, k, n in [("new", 1, 3), ("free", 0, 1), ("new", 1, 1), ("append", 0, 9), ("new", 1, 5)]:
        apply_op(kv, seqs, prompts, op, k, n)
        check_invariants(kv, seqs)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_recomputed_cached_block_is_cached_twice_as_vllm_does(tmp_path, compiled):
    """vLLM's BlockPool caches a block computed again under a cached key beside the first copy
    (BlockHashToBlockMap.insert), so the copy takes a cached slot. Five requests, 63 usable blocks of
    16: B re-sends A (whose last block no lookup covers, so B recomputes it: a second copy); C needs 59
    blocks, the empty ones and then the least recently released cached block, E's tail, because the
    copy holds the slot that would have been empty; F, E plus 16 tokens, hits 16 tokens as vLLM 0.34's
    own scheduler does, not 32 (mutation: keep the copy private -> F hits 32)."""
    import json

    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import Replay

    rng = np.random.default_rng(1)
    e, a, c, x = (rng.integers(100, 30000, n).tolist() for n in (32, 32, 942, 16))
    trace = tmp_path / "dup.jsonl"
    trace.write_text("".join(json.dumps({"id": i, "t": t, "output_len": 2, "prompt": [{"tokens": toks}]}) + "\n"
                             for i, t, toks in (("E", 0, e), ("A", 1, a), ("B", 2, a), ("C", 3, c), ("F", 4, e + x))))
    PagedKV.compiled_pool, before = compiled, PagedKV.compiled_pool
    try:
        rp = Replay(str(trace), ReplayConfig(num_blocks=63, block_size=16), str(tmp_path / f"r{compiled}"))
        rp.finished = []
        rp.run()
    finally:
        PagedKV.compiled_pool = before
    assert {rs.req.id: rs.cached_tokens for rs in rp.finished} == {"E": 0, "A": 0, "B": 16, "C": 0, "F": 16}
    rp.kv.pool.recount()
