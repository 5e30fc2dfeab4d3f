"""The tiered what-if and the external-store semantics (kvbench.whatif.tiers).

belady against a brute-force optimum on tiny random traces, under each semantics (the GPU pool,
``simulate``; the external store with bypass, ``simulate_store``). Under the prefix-chain hit rule it
is the optimum wherever every block a request holds is one it looks up. Where a request holds
blocks it does not look up (the block of the last prompt token, a named answer's blocks) it computes
them and stores them again for free, which a next use counted in lookups does not see: belady may
keep such a block for its next lookup while the optimum gives it up and gets it back from the
request that recomputes it (test_belady_misses_the_blocks_a_request_restores). In the pool, belady is
the optimum again with a block's next use taken as the next request that holds it, never if that
request only recomputes it (tested); in the store the optimum may even store a block whose parent
it declined, to be completed by the parent's recompute, which no per-block rule of next uses sees.

Then the tiers: no lower tier is today's what-if, point for point; a block the GPU evicted is a cpu
hit; a chain broken in cpu continues in disk block by block; a tier that holds everything reaches
the ceiling; and a bigger lru cpu tier never loses a hit (its input does not depend on its size).
"""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.cli.main import main as kvbench_main
from kvbench.memory.policies import CACHE_POLICIES, make_policy
from kvbench.memory.policy_base import NEVER
from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.importers import convert
from kvbench.whatif.blocktrace import prepare
from kvbench.whatif.curve import run_points, simulate
from kvbench.whatif.tiers import (
    GpuStream,
    Store,
    gpu_stream,
    parse_tiers,
    run_stores,
    simulate_store,
    simulate_tiers,
)

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
BS = 2  # tokens per block in the hand-built traces


def _trace(paths, looked_up=None, answers=None):
    """Requests whose prompts are root-to-node paths of blocks (block k: BS tokens of value k+1).
    ``looked_up[i]``: one more prompt token past the blocks, so every block is looked up; else the
    last block holds the last prompt token and is held but not looked up."""
    reqs = []
    for i, path in enumerate(paths):
        tokens = [k + 1 for k in path for _ in range(BS)]
        if looked_up is None or looked_up[i]:
            tokens.append(10_000 + i)
        reqs.append(Request(id=f"r{i}", t=float(i), prompt=(Segment("tokens", tokens=tuple(tokens)),),
                            output_len=1, index=i))
    return prepare(reqs, BS, warmup=0.0, future=True)


def _random_paths(rng: random.Random, nodes: int = 6, requests: int = 7) -> list[list[int]]:
    parent = [-1] + [rng.randrange(-1, k) for k in range(1, nodes)]
    paths = []
    for _ in range(requests):
        x, path = rng.randrange(nodes), []
        while x >= 0:
            path.append(x)
            x = parent[x]
        paths.append(path[::-1])
    return paths


def _requests(bt):
    for i in range(bt.requests):
        yield bt.ids[bt.starts[i]:bt.starts[i + 1]].tolist(), int(bt.lookups[i])


def _prefix_hits(cached, blocks, look):
    h = 0
    while h < look and blocks[h] in cached:
        h += 1
    return h


def optimum_pool(bt, budget: int) -> int:
    """The most hit blocks any eviction choice gets in the pool: a request runs as its first
    ``budget`` blocks, its hits stay, every other cached block may go, and it needs a block for each
    of the rest while it runs; afterwards its blocks are cached."""
    best = {frozenset(): 0}
    for blocks, look in _requests(bt):
        blocks = blocks[:budget]
        look = min(look, len(blocks))
        after: dict[frozenset, int] = {}
        for cached, got in best.items():
            h = _prefix_hits(cached, blocks, look)
            evictable = [b for b in cached if b not in blocks[:h]]
            for k in range(len(evictable) + 1):
                if len(cached) - k + len(blocks) - h > budget:
                    continue
                for gone in itertools.combinations(evictable, k):
                    s = (cached - set(gone)) | set(blocks)
                    after[s] = max(after.get(s, -1), got + h)
        best = after
    return max(best.values())


def optimum_store(bt, capacity: int) -> int:
    """The most hit blocks any store-or-evict choice gets in an external store: after each request
    it may hold any ``capacity`` blocks of what it held and what the request computed."""
    best = {frozenset(): 0}
    for blocks, look in _requests(bt):
        after: dict[frozenset, int] = {}
        for cached, got in best.items():
            h = _prefix_hits(cached, blocks, look)
            pool = sorted(cached | set(blocks))
            for k in range(min(capacity, len(pool)) + 1):
                for s in itertools.combinations(pool, k):
                    s = frozenset(s)
                    after[s] = max(after.get(s, -1), got + h)
        best = after
    return max(best.values())


# ------------------------------------------------------------------- belady against the optimum

@settings(max_examples=40, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_belady_is_the_optimum_when_every_held_block_is_looked_up(rng):
    bt = _trace(_random_paths(rng))
    assert (bt.lookups == np.diff(bt.starts)).all()
    for budget in (1, 2, 3, 4):  # budgets below the largest request too (it runs as its first blocks)
        best = optimum_pool(bt, budget) * BS
        assert simulate(bt, budget, "belady").hit_tokens == best, budget  # compiled
        assert simulate(bt, budget, make_policy("belady", bt.distinct_blocks, budget)).hit_tokens == best
        assert simulate_store(bt, budget, "belady").hit_tokens == optimum_store(bt, budget) * BS, budget


def _restore_aware(bt) -> np.ndarray:
    """Next uses where a block's next use is the next request that holds it, NEVER if that request
    holds it without looking it up (it computes and stores it again, for free)."""
    out = np.empty(len(bt.ids), dtype=np.int64)
    nxt: dict[int, int] = {}
    for i in range(bt.requests - 1, -1, -1):
        s, e = int(bt.starts[i]), int(bt.starts[i + 1])
        out[s:e] = [nxt.get(b, NEVER) for b in bt.ids[s:e].tolist()]
        for k, b in enumerate(bt.ids[s:e].tolist()):
            nxt[b] = i if k < bt.lookups[i] else NEVER
    return out


@settings(max_examples=40, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_pool_belady_with_restores_seen_is_the_optimum(rng):
    paths = _random_paths(rng)
    bt = _trace(paths, looked_up=[rng.random() < 0.5 for _ in paths])
    for budget in (1, 2, 3):
        # the next-lookup belady never beats the optimum: the brute force spans every choice it makes
        assert simulate(bt, budget, "belady").hit_tokens <= optimum_pool(bt, budget) * BS
        assert simulate_store(bt, budget, "belady").hit_tokens <= optimum_store(bt, budget) * BS
    bt.next_use = _restore_aware(bt)
    for budget in range(int(np.diff(bt.starts).max()), 6):  # every request runs whole
        assert simulate(bt, budget, "belady").hit_tokens == optimum_pool(bt, budget) * BS, budget


def test_belady_misses_the_blocks_a_request_restores():
    """Pool of 2: r2 holds block 0 without looking it up; evicting the cached 0 there is free (r2
    stores it again) and keeps block 1 for r3, but belady's next uses tie (both r3) and it evicts 1.
    Store of 2: r2's bypass keeps 3 out; the optimum stores it, evicting 0, which r4 restores."""
    bt = _trace([[0, 1], [0, 1], [0], [0, 1], [0, 1]], looked_up=[True, True, False, True, True])
    assert simulate(bt, 2, "belady").hit_tokens < optimum_pool(bt, 2) * BS
    bt.next_use = _restore_aware(bt)
    assert simulate(bt, 2, "belady").hit_tokens == optimum_pool(bt, 2) * BS
    bt = _trace([[0, 1], [0, 2], [3], [3], [0], [0, 2], [0, 1]],
                looked_up=[False, True, False, True, False, True, False])
    assert simulate_store(bt, 2, "belady").hit_tokens < optimum_store(bt, 2) * BS


def test_belady_bypasses_a_block_needed_no_sooner_than_every_stored_one():
    """Store of 2 holding r0's [0, 1], which r3 needs again: r1's [2, 3] is needed later (r4) and
    r2's [4, 5] never: belady declines both (a tie with the furthest stored, never = never, is
    declined too: no churn); lru stores them and loses r3's hits."""
    bt = _trace([[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]])
    opt = simulate_store(bt, 2, "belady")
    assert opt.hit_tokens == optimum_store(bt, 2) * BS == 2 * BS and opt.evicted_blocks == 0
    assert simulate_store(bt, 2, "lru").hit_tokens == 0
    # after r3 nothing is needed again: r4's blocks (never used again) do not displace r3's
    bt = _trace([[0, 1], [0, 1], [2, 3]])
    assert simulate_store(bt, 2, "belady").evicted_blocks == 0


# ------------------------------------------------------------------- the tiers, rule by rule

def _shipped(name):
    return load_trace(REPO / "traces" / f"{name}.jsonl")


@pytest.fixture(scope="module")
def mooncake():
    if not REAL.exists():
        pytest.skip(f"real trace not found at {REAL}")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        convert("mooncake", REAL, Path(tmp) / "m.jsonl", limit=600)
        return load_trace(Path(tmp) / "m.jsonl")


POLICIES = [p for p in CACHE_POLICIES if p != "learned"]


@pytest.mark.parametrize("name", ["chat", "rag", "agent", "mooncake"])
def test_no_lower_tier_is_the_whatif(name, request):
    reqs, bs = (request.getfixturevalue("mooncake"), 64) if name == "mooncake" else (_shipped(name), 16)
    bt = prepare(reqs, bs, warmup=0.5)
    d = bt.distinct_blocks
    budgets = sorted({max(1, d // 40), max(1, d // 8), d // 2 + 1})
    today = run_points(bt, budgets, POLICIES)
    for (b, p), pt in today.items():
        for offload in ("write-through", "write-back") if p in ("lru", "belady") else ("write-through",):
            tp = simulate_tiers(bt, [b, 0, 0], p, "lru", offload)
            assert tp.hit_tokens == (pt.hit_tokens, 0, 0), (name, b, p, offload)
            assert tp.evicted_blocks == (pt.evicted_blocks, 0, 0), (name, b, p, offload)


def test_a_block_the_gpu_evicted_is_a_cpu_hit():
    """GPU of 4 blocks: r1 (4 blocks) evicts r0's; r2 sends r0's prompt again: it finds none in the GPU
    and its 3 looked-up blocks in cpu, stored when computed (write-through) or when evicted (write-back)."""
    bt = _trace([[0, 1, 2], [3, 4, 5, 6], [0, 1, 2]])
    for offload in ("write-through", "write-back"):
        per_request = []
        gpu = gpu_stream(bt, 4, "lru", victims=offload == "write-back")
        run_stores(bt, gpu, [Store(8, "lru", bt), None], offload, on_request=lambda i, got, out=per_request: out.append(got))
        assert gpu.hits.tolist() == [0, 0, 0]
        assert per_request == [[0, 0], [0, 0], [3, 0]], offload
        # no cpu: recomputed
        assert simulate_tiers(bt, [4, 0, 0], "lru", offload=offload).hit_tokens == (0, 0, 0)
        assert simulate_tiers(bt, [4, 8, 0], "lru", offload=offload).hit_tokens == (0, 3 * BS, 0)
    # write-back: what cpu evicts goes to disk. cpu of 1 keeps block 0 of r0's (the prefix: most
    # recently used of the GPU's victims), gives it up to disk for r1's block 3 when r2 evicts r1;
    # r3 finds 0 in disk, then 1 in no tier
    bt = _trace([[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10], [0, 1, 2]])
    wb = simulate_tiers(bt, [4, 1, 8], "lru", offload="write-back")
    assert wb.hit_tokens == (0, 0, 1 * BS), wb
    # the GPU evicts r0's 3 for r1, r1's 4 for r2, 3 of r2's for r3; cpu: r3 evicts r2 in turn, 8
    # displaces 3 (after r3 looked up)
    assert wb.evicted_blocks == (3 + 4 + 3, 2, 0)


def test_a_request_larger_than_the_gpu_runs_as_its_first_blocks_in_every_tier():
    """GPU of 2: r0 (4 blocks) runs as its first 2, so cpu is offered only those, and r1 looks up
    no further than them (the what-if's rule for a request a pool would refuse)."""
    bt = _trace([[0, 1, 2, 3], [0, 1, 2, 3]])
    for offload in ("write-through", "write-back"):
        assert simulate_tiers(bt, [2, 8, 0], "lru", offload=offload).hit_tokens == (2 * BS, 0, 0)


def test_a_chain_broken_in_cpu_continues_in_disk_block_by_block():
    bt = _trace([[0, 1, 2, 3, 4]])
    a, b, c, _d, e = bt.ids.tolist()
    cpu, disk = Store(8, "lru", bt), Store(8, "lru", bt)
    cpu.put(np.array([a, c]), 0.0, None)
    disk.put(np.array([a, b, e]), 0.0, None)
    got = []
    no_gpu = GpuStream(np.zeros(1, dtype=np.int64), np.array([5]))
    run_stores(bt, no_gpu, [cpu, disk], "write-back", on_request=lambda i, g: got.append(g))
    assert got == [[2, 1]]  # a from cpu (before disk), b from disk, c from cpu; d in neither: e is not reached
    got.clear()
    cpu2, disk2 = Store(8, "lru", bt), Store(8, "lru", bt)
    disk2.put(np.array([b, c]), 0.0, None)
    run_stores(bt, no_gpu, [cpu2, disk2], "write-back", on_request=lambda i, g: got.append(g))
    assert got == [[0, 0]]  # the first block is in no tier


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_the_tiers_next_uses_are_the_gpu_budgets_without_recounting(name):
    """simulate_tiers hands the lower tiers bt.next_use, not bt.future(gpu budget): they see only a
    request's first gpu-budget blocks, where the two agree (a chained block has one depth)."""
    bt = prepare(_shipped(name), 16, warmup=0.5)
    depth = np.concatenate([np.arange(n) for n in np.diff(bt.starts)])
    for gpu in (1, 3, 40):
        assert (bt.future(gpu) != bt.next_use).any()  # the requests larger than the gpu look up less
        within = depth < gpu
        assert (bt.future(gpu)[within] == bt.next_use[within]).all(), gpu
        for offload in ("write-through", "write-back"):
            assert simulate_tiers(bt, [gpu, 50, 0], "lru", "belady", offload).hit_tokens[1] > 0


@pytest.mark.parametrize("name", ["chat", "rag", "agent"])
def test_a_tier_that_holds_everything_reaches_the_ceiling(name):
    bt = prepare(_shipped(name), 16, warmup=0.5)
    biggest = int(np.diff(bt.starts).max())  # every request runs whole
    for tier in (1, 2):
        budgets = [biggest, 0, 0]
        budgets[tier] = bt.distinct_blocks
        pt = simulate_tiers(bt, budgets, "lru", "lru", "write-through")
        assert pt.hit_tokens[3 - tier] == 0
        assert sum(pt.hit_tokens) == bt.ceiling_hit_tokens, (name, tier)
    assert simulate_store(bt, bt.distinct_blocks, "lru").hit_tokens == bt.ceiling_hit_tokens


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_a_bigger_lru_cpu_tier_never_loses_a_hit(name):
    """cpu is fed the same runs whatever its size (write-through: the request's blocks past its GPU
    hit; write-back: the GPU's victims) and a store releases runs tail first, so lru keeps a stack
    order: more cpu holds a superset. Not with disk behind it (what cpu finds changes what disk is
    offered), nor for other policies: neither is asserted."""
    bt = prepare(_shipped(name), 16, warmup=0.5)
    gpu = max(1, bt.distinct_blocks // 40)
    sizes = sorted({1, 7, bt.distinct_blocks // 20, bt.distinct_blocks // 5, bt.distinct_blocks})
    for offload in ("write-through", "write-back"):
        stream = gpu_stream(bt, gpu, "lru", victims=offload == "write-back")
        cpu = [simulate_tiers(bt, [gpu, c, 0], "lru", "lru", offload, stream).hit_tokens[1] for c in sizes]
        assert cpu == sorted(cpu) and cpu[-1] > cpu[0], (offload, cpu)
    store = [simulate_store(bt, c, "lru").hit_tokens for c in sizes]
    assert store == sorted(store) == [simulate(bt, c, "lru").hit_tokens for c in sizes]


@settings(max_examples=30, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_lru_store_inclusion_on_random_traces(rng):
    paths = _random_paths(rng, nodes=8, requests=10)
    bt = _trace(paths, looked_up=[rng.random() < 0.5 for _ in paths])
    hits = [simulate_store(bt, c, "lru").hit_tokens for c in range(1, bt.distinct_blocks + 2)]
    assert hits == sorted(hits)
    # one request at a time, lru's store and lru's pool both hold the c blocks released last (a
    # request larger than c: its first c), so the two semantics differ only for policies that
    # decline or choose otherwise
    assert hits == [simulate(bt, c, "lru").hit_tokens for c in range(1, bt.distinct_blocks + 2)]


# ------------------------------------------------------------------- --tiers and the CLI

def test_parse_tiers_lists_and_absent_tiers():
    t = parse_tiers("gpu=16GiB,32GiB,cpu=0,128GiB,disk=4TiB")
    assert [x for x, _ in t["gpu"]] == [16 << 30, 32 << 30]
    assert t["cpu"] == [(0, "0"), (128 << 30, "128GiB")] and t["disk"] == [(4 << 40, "4TiB")]
    assert parse_tiers("gpu=1GiB")["disk"] == [(0, "0")]
    assert parse_tiers("gpu=1GiB,cpu=0KiB,disk=0.0") == parse_tiers("gpu=1GiB")  # 0 in any unit: no tier


def _cli(capsys, *args):
    try:
        kvbench_main(["trace", "whatif", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_tiers_table_json_and_out(tmp_path, capsys):
    trace = str(REPO / "traces/chat.jsonl")
    code, out, err = _cli(capsys, trace, "--tiers", "gpu=256MiB,1GiB,cpu=0,1GiB,disk=8GiB", "--policies", "lru,belady",
                          "--out", str(tmp_path / "w"))
    assert code == 0, err
    for word in ("hit gpu", "hit cpu", "hit disk", "total", "ceiling", "256MiB", "8GiB", "belady"):
        assert word in out
    df = pd.read_parquet(tmp_path / "w" / "whatif.parquet")
    assert len(df) == 2 * 2 * 2
    assert np.allclose(df.hit_rate, df.hit_rate_gpu + df.hit_rate_cpu + df.hit_rate_disk)
    assert (df.hit_rate <= df.ceiling + 1e-12).all() and set(df.offload) == {"write-through"}
    assert (df.gpu_blocks == df.gpu_bytes // (131072 * 16)).all() and set(df.disk_bytes) == {8 << 30}
    code, out, err = _cli(capsys, trace, "--tiers", "gpu=1GiB,cpu=1GiB", "--policies", "lru", "--offload",
                          "write-back", "--tier-policy", "belady", "--json")
    assert code == 0, err
    w = json.loads(out)
    assert w["offload"] == "write-back" and w["tier_policy"] == "belady" and len(w["rows"]) == 1
    assert w["rows"][0]["hit_rate_disk"] == 0 and w["rows"][0]["hit_rate_cpu"] > 0
    code, out, err = _cli(capsys, trace, "--budgets", "256MiB,64GiB", "--budget-counts", "cache", "--policies",
                          "lru,belady", "--json", "-j", "2")
    assert code == 0, err
    assert "-j 2: the tiered and store what-ifs run in one process" in err  # not silently ignored
    rows = {(r["budget"], r["policy"]): r for r in json.loads(out)["rows"]}
    assert rows[("64GiB", "lru")]["hit_rate"] == rows[("64GiB", "lru")]["ceiling"]
    assert rows[("256MiB", "belady")]["hit_rate"] >= rows[("256MiB", "lru")]["hit_rate"]


@pytest.mark.parametrize("args, says", [
    (["--tiers", "gpu=1GiB,ram=4GiB"], "unknown tier"),
    (["--tiers", "gpu=1GiB,cpu=lots"], "not a size"),
    (["--tiers", "gpu=1GiB,cpu=1GiB,cpu=2GiB"], "given twice"),
    (["--tiers", "cpu=4GiB"], "no gpu tier"),
    (["--tiers", "4GiB,gpu=1GiB"], "names no tier"),
    (["--tiers", "gpu=1GiB,cpu=-4GiB"], "not a size"),
    (["--tiers", "gpu=0"], "at least one byte"),
    (["--tiers", "gpu=0KiB,1GiB"], "at least one byte"),
    (["--tiers", "gpu=1GiB,1024MiB"], "given twice"),
    (["--tiers", "gpu=1GiB,cpu=0,0B"], "given twice"),
    (["--tiers", "gpu=1GiB,cpu=1KiB"], "holds no block"),
    (["--tiers", "gpu=1GiB", "--tier-policy", "mru"], "unknown cache policy"),
    (["--tiers", "gpu=1GiB,cpu=1GiB", "--tier-policy", "learned:/no/such/policy.json"], "cannot read learned policy"),
    (["--budget-counts", "cache", "--budgets", "1KiB"], "holds no block"),
    (["--tiers", "gpu=1GiB", "--budgets", "1GiB"], "not both"),
    (["--budget-counts", "cache", "--replicas", "2"], "--replicas 1"),
    (["--budget-counts", "pool", "--offload", "sideways"], "--offload"),
])
def test_cli_bad_tiers_are_one_line_exit_2(args, says, capsys):
    code, out, err = _cli(capsys, str(REPO / "traces/chat.jsonl"), *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    assert out == ""
