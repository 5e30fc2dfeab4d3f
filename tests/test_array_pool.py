"""The compiled pool (kvbench.memory.array_pool.ArrayBlockPool) is BlockPool under lru, call for call:
the same blocks handed out, the same victims, hits, KV events, write-back spills and counters on
random operation sequences (hypothesis), and the same steps and requests, row for row, on whole
replays of the shipped and real traces."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import REAL, TRACES
from test_memory import apply_op

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.memory import PagedKV, SeqKV
from kvbench.memory.array_pool import ArrayBlockPool
from kvbench.memory.block_pool import BlockPool
from kvbench.trace.tokens import TokenStreams

STREAMS = TokenStreams()


def state(kv: PagedKV) -> dict:
    """Everything a pool's callers can observe, and the order it will evict in."""
    p = kv.pool
    n = p.physical
    lru = p.lru_order() if isinstance(p, ArrayBlockPool) else list(p.policy._q)
    return {"refcnt": list(p.refcnt), "fill": list(p.fill), "key": [p.key[b] for b in range(n)],
            "free": list(p._free), "lru": lru, "index": dict(p.index) if p.enable_cache else {},
            "dups": p.dup_chains() if p.enable_cache else {},
            "counters": (p.num_used, p.tokens_live, p.num_cached, p.num_free, p.num_available, p.evictions),
            "tokens": None if p.tokens is None else p.tokens[[b for b in range(n) if p.key[b] is not None]].tolist()}


def pair(n_blocks: int, bs: int, prefix_cache: bool = True, physical: int | None = None):
    kvs = [PagedKV(n_blocks, bs, prefix_cache=prefix_cache, compiled=c, physical=physical) for c in (True, False)]
    assert isinstance(kvs[0].pool, ArrayBlockPool) and isinstance(kvs[1].pool, BlockPool)
    logs = ([], [])
    for kv, log in zip(kvs, logs):  # a router's KV events and a write-back tier's spills, recorded
        kv.pool.events = log
        kv.pool.spill = lambda blocks, keys, parents, log=log: log.append(("spill", blocks, keys, parents))
    return kvs, logs


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "evict"]),
                         st.integers(0, 7), st.integers(1, 40), st.integers(0, 2**31)), min_size=20, max_size=120)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, bs=st.sampled_from([1, 4, 16]), n_blocks=st.integers(8, 64), prefix_cache=st.booleans())
def test_same_state_as_blockpool_after_every_operation(ops, bs, n_blocks, prefix_cache):
    """new (lookup, hits, allocate, register), append, fork (copy-on-write), free and token eviction's
    compaction, applied to both pools in lockstep: every observable field equal after each one."""
    kvs, logs = pair(n_blocks, bs, prefix_cache)
    prompts = [STREAMS.stream(f"p{k % 3}", 200) for k in range(7)]
    prompts.append(np.concatenate([prompts[0][:100], STREAMS.stream("p-tail", 100)]))
    seqs: tuple[list, list] = ([], [])
    for op, k, n, r in ops:
        for kv, ss in zip(kvs, seqs):
            if not apply_op(kv, ss, prompts, op, k, n) and ss:  # evict: keep a random subset of one sequence
                s = ss[k % len(ss)]
                rng = np.random.default_rng(r)
                if s.num_kv:
                    kv.compact(s, np.flatnonzero(rng.random(s.num_kv) < rng.random()), int(rng.integers(0, 3)))
        assert [list(s.table) for s in seqs[0]] == [list(s.table) for s in seqs[1]]
        assert [(s.num_kv, s.num_registered) for s in seqs[0]] == [(s.num_kv, s.num_registered) for s in seqs[1]]
        assert kvs[0].copies == kvs[1].copies
        assert state(kvs[0]) == state(kvs[1])
        kvs[0].pool.recount()
    assert logs[0] == logs[1]
    for kv, ss in zip(kvs, seqs):
        for s in ss:
            kv.free(s)
    assert state(kvs[0]) == state(kvs[1])
    assert kvs[0].pool.recount() == kvs[1].pool.recount()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, bs=st.sampled_from([1, 4, 16]), n_blocks=st.integers(8, 64), budget=st.integers(1, 300),
       watermark=st.integers(0, 3))
def test_an_empty_tables_admission_floor_is_exact(ops, bs, n_blocks, budget, watermark):
    """On the compiled pool an empty table's admission floor is the very check allocate makes (its
    prefix hits matched, hits no one holds counted): the scheduler refuses at the floor exactly the
    admissions allocate would refuse, full-prompt or first chunk, among
    sequences sharing prefixes, forked, freed and evicting."""
    kv = PagedKV(n_blocks, bs)
    assert kv.fresh_floor
    prompts = [STREAMS.stream(f"p{k % 3}", 200) for k in range(7)]
    prompts.append(np.concatenate([prompts[0][:100], STREAMS.stream("p-tail", 100)]))
    seqs: list[SeqKV] = []
    for op, k, n, _ in ops:
        if op != "new":
            apply_op(kv, seqs, prompts, op if op != "evict" else "free", k, n)
            continue
        s = SeqKV(tokens=prompts[k])
        plen = min(len(prompts[k]), n * 5)
        for full in (True, False):
            floor, available = kv.admission_floor(s, plen, budget, full)
            hits = kv.lookup(s, plen)
            num_new = min(plen - kv.num_cached_tokens(s, hits), budget)
            ok = kv.allocate(s, num_new, hits, watermark, must_fit=plen if full else 0)
            assert ok == (floor <= available - watermark)
            if not ok:  # (allocate's shortfall: at least what was missing, at most the floor's)
                assert available < kv.last_shortfall <= floor + watermark
                continue
            kv.commit(s, num_new)
            seqs.append(s)
            break


def test_the_index_survives_deletes_that_wrap_the_table():
    """Keys crowded into a few home slots of a small table, deleted in every order: the backward-shift
    delete must keep each remaining key reachable (a tombstone-free table that lost one would miss
    a hit, and the match test after each delete sees it)."""
    bs, n = 1, 8  # a table of 16 slots
    rng = np.random.default_rng(0)
    for trial in range(200):
        p = ArrayBlockPool(n, bs)
        mask = len(p._hv) - 1
        home = rng.integers(0, mask + 1, size=3)  # every key's home is one of three slots (near the end too)
        keys = [int(rng.integers(0, 2**40)) * (mask + 1) + int(home[rng.integers(0, 3)]) for _ in range(n)]
        blocks: list[int] = []
        p.alloc_into(blocks, n)
        for b, k in zip(blocks, keys):  # each block a root: its own chain of one
            p.register_run([b], [k], 7, np.array([b], dtype=np.int32))
        p.release_all(blocks[::-1])
        live = dict(zip(keys, blocks))
        for _ in range(n):  # evict one at a time (LRU order: the reverse of release)
            got: list[int] = []
            p.alloc_into(got, 1)
            live = {k: b for k, b in live.items() if b != got[0]}
            assert p.index == live
            for k, b in live.items():
                assert p.match([k], np.array([b], dtype=np.int32), 1, 7) == [b]
            p.recount()


@pytest.mark.parametrize("cls", [ArrayBlockPool, BlockPool])
def test_out_of_blocks_is_refused_changing_nothing(cls):
    """Asking for more blocks than the pool can hand out raises, changing nothing, in both pools (the
    free blocks are not taken first); the compiled pool also refuses an incref of a free block (only the
    allocator hands those out) and calls whose arrays are too short for what they name."""
    p = cls(4, 4)
    t: list[int] = []
    p.alloc_into(t, 2)
    before = (list(p.refcnt), p.num_used, p.num_free, list(p._free))
    for n in (3, 100):
        with pytest.raises(IndexError):
            p.alloc_into(t, n)
        assert t == [0, 1] and (list(p.refcnt), p.num_used, p.num_free, list(p._free)) == before
    v = cls(10, 4, physical=2)  # 8 blocks counted free that were never materialised
    v.alloc_into(t, 1)
    with pytest.raises(RuntimeError, match="materialised"):
        v.alloc_into(t, 2)
    assert v.num_used == 1 and len(t) == 3
    if cls is ArrayBlockPool:
        with pytest.raises(KeyError):
            p.incref_many([3])
        toks = np.arange(8, dtype=np.int32)
        with pytest.raises(ValueError):  # one block, a short token row
            p.register_run([0], [5], 7, toks[:3])
        with pytest.raises(ValueError):  # two blocks, one block's tokens
            p.register_run([0, 1], [5, 6], 7, toks[:4])
        with pytest.raises(ValueError):  # a match past its tokens or its keys
            p.match([5, 6], toks[:4], 2, 7)
        with pytest.raises(ValueError):
            p.match([5], toks, 2, 7)


def test_no_compiled_call_reads_or_writes_past_an_array(tmp_path):
    """The lockstep, table and refusal tests again with numba's bounds checks on (numba checks none by
    default: a write past an array is a silent heap overwrite), compiled afresh into an empty cache."""
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                        "-k", "same_state or survives or refused"],
                       env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "4 passed" in r.stdout


def _replay(trace, tmp_path, name, compiled, **kw):
    PagedKV.compiled_pool = compiled
    try:
        cfg = ReplayConfig(**{"executor": "sim", "model": "llama-3-8b", "gpu": "h200", **kw})
        rp = Replay(str(trace), cfg, str(tmp_path / f"{name}-{compiled}"))
        s = rp.run()
        assert isinstance(rp.kv.pool, ArrayBlockPool if compiled else BlockPool)
    finally:
        PagedKV.compiled_pool = True
    d = tmp_path / f"{name}-{compiled}"
    s.pop("wall_s")
    return s, pd.read_parquet(d / "steps.parquet"), pd.read_parquet(d / "requests.parquet")


REPLAYS = {
    # name: (trace, settings); pools small enough that blocks are evicted and requests preempted
    "chat": (TRACES / "chat.jsonl", dict(num_blocks=1200, time_scale=0.05, max_model_len=8192)),
    "chat-no-cache": (TRACES / "chat.jsonl", dict(num_blocks=1200, time_scale=0.05, max_model_len=8192,
                                                  prefix_cache=False)),
    "best-of-n": (TRACES / "best_of_n.jsonl", dict(num_blocks=800, block_size=8)),
    "agent-h2o": (TRACES / "agent.jsonl", dict(num_blocks=900, eviction="h2o", limit=60)),
    "rag-write-back": (TRACES / "rag.jsonl", dict(num_blocks=700, cpu_kv_mem="2GiB", offload="write-back")),
    "chat-routed": (TRACES / "chat.jsonl", dict(num_blocks=800, replicas=2, router="kv-aware", limit=120,
                                                max_model_len=8192)),
    "mooncake": (REAL / "mooncake_conversation.jsonl", None),
}


@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_replays_are_row_for_row_those_of_blockpool(name, tmp_path):
    """The whole replay, both pools: every step and request row and every summary figure equal."""
    trace, kw = REPLAYS[name]
    if kw is None:  # the real Mooncake trace's first 600 requests on a pool that evicts
        from kvbench.trace.importers import convert
        conv = tmp_path / "mooncake.jsonl"
        convert("mooncake", str(trace), str(conv), limit=600)
        trace, kw = conv, dict(num_blocks=12000)
    a, b = (_replay(trace, tmp_path, name, c, **kw) for c in (True, False))
    assert a[0]["cache_evictions"] + a[0]["preemptions"] > 0  # the pool was short
    assert a[0] == b[0]
    pd.testing.assert_frame_equal(a[1], b[1])
    pd.testing.assert_frame_equal(a[2], b[2])
