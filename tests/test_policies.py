"""Cache policies against their definition: random call sequences (hypothesis) drive each policy and
a reference that evaluates the rule in policies.py's docstring by brute force (the minimum over every
evictable block of its priority at release, ties to the earliest release), and the two must name the
same victims in the same order, through the one-block calls and the batch calls alike."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.memory.policies import NEVER, CACHE_POLICIES, make_policy


class Reference:
    """The eviction rule, evaluated by brute force: no structure to get wrong."""

    def __init__(self, name: str):
        self.name = name
        self.tick = self.seq = 0
        self.inserted, self.count, self.last, self.next = {}, {}, {}, {}
        self.evictable: dict[int, tuple] = {}  # block -> (priority at release, release seq)

    def priority(self, b: int) -> tuple:
        if self.name == "lru":
            return ()
        if self.name == "fifo":
            return (self.inserted[b],)
        if self.name == "lfu":
            return (self.count[b], self.last[b])
        return (-self.next[b],)  # belady: the furthest next use first

    def insert(self, b: int, next_use: int) -> None:
        self.tick += 1
        self.inserted[b] = self.last[b] = self.tick
        self.count[b] = 1
        self.next[b] = next_use

    def use(self, b: int, next_use: int) -> None:
        self.tick += 1
        self.last[b] = self.tick
        self.count[b] += 1
        self.next[b] = next_use

    def recompute(self, b: int, next_use: int) -> None:
        if self.name == "belady":
            self.next[b] = next_use
            if b in self.evictable:  # queued again under its new next use
                self.reuse(b)
                self.release(b)

    def release(self, b: int) -> None:
        self.seq += 1
        self.evictable[b] = (self.priority(b), self.seq)

    def reuse(self, b: int) -> None:
        del self.evictable[b]

    def pop(self) -> int:
        b = min(self.evictable, key=self.evictable.__getitem__)
        del self.evictable[b]
        return b


KINDS = ["insert", "use", "release", "reuse", "pop", "recompute"]
next_use = st.one_of(st.integers(0, 6), st.just(NEVER))  # few values: belady ties often
calls = st.lists(st.tuples(st.sampled_from(KINDS), st.booleans(),
                           st.lists(st.integers(0, 1000), max_size=8),
                           st.lists(next_use, min_size=8, max_size=8)),
                 max_size=120)


def drive(name: str, num_blocks: int, script) -> None:
    """Apply ``script`` to the policy and the reference, keeping to the protocol the block pool
    keeps (insert and use blocks in use, release blocks in use, reuse evictable ones), and compare
    every victim and every length."""
    pol, ref = make_policy(name, num_blocks), Reference(name)
    state = ["out"] * num_blocks  # out | used | evictable (the block pool's view)
    for kind, batched, picks, nus in script:
        want = {"insert": ("out",), "use": ("used",), "release": ("used",), "reuse": ("evictable",),
                "recompute": ("used", "evictable"), "pop": ()}[kind]
        cands = [b for b in range(num_blocks) if state[b] in want]
        blocks = list(dict.fromkeys(cands[p % len(cands)] for p in picks)) if cands else []
        nus = nus[:len(blocks)]
        if kind == "pop":
            n = min(len(picks), len(pol))
            victims = pol.pop_many(n) if batched else [pol.pop() for _ in range(n)]
            assert victims == [ref.pop() for _ in range(n)]
            for b in victims:
                state[b] = "out"
        elif kind in ("insert", "use"):
            for b, nu in zip(blocks, nus):
                (ref.insert if kind == "insert" else ref.use)(b, nu)
                state[b] = "used"
            if batched:
                (pol.on_insert_many if kind == "insert" else pol.on_use_many)(blocks, 0, nus)
            else:
                for b, nu in zip(blocks, nus):
                    (pol.on_insert if kind == "insert" else pol.on_use)(b, 0, nu)
        elif kind == "recompute":
            for b, nu in zip(blocks, nus):
                ref.recompute(b, nu)
            pol.on_recompute_many(blocks, 0, nus)
        else:  # release, reuse
            for b in blocks:
                getattr(ref, kind)(b)
                state[b] = "evictable" if kind == "release" else "used"
            if batched:
                getattr(pol, kind + "_many")(blocks)
            else:
                for b in blocks:
                    getattr(pol, kind)(b)
        assert len(pol) == len(ref.evictable) == state.count("evictable")
    assert pol.pop_many(len(pol)) == [ref.pop() for _ in range(len(ref.evictable))]  # the rest, in order


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CACHE_POLICIES)), num_blocks=st.integers(1, 24), script=calls)
def test_policies_evict_as_the_rule_says(name, num_blocks, script):
    drive(name, num_blocks, script)


@pytest.mark.parametrize("name", sorted(CACHE_POLICIES))
def test_policies_long_random_run(name):
    """Thousands of calls over a few hundred blocks with next uses spread wide: the bucket queues'
    clean-ups (emptied buckets, stale late entries) happen and change no decision."""
    rng = random.Random(7)
    script = [(rng.choice(KINDS), rng.random() < 0.5, [rng.randrange(1000) for _ in range(rng.randrange(12))],
               [rng.choice([NEVER, rng.randrange(20000)]) for _ in range(12)]) for _ in range(12000)]
    drive(name, 300, script)


def test_pop_with_nothing_evictable_raises():
    """BlockPool.alloc relies on it: a victim that does not exist is an error, never a block."""
    for name in CACHE_POLICIES:
        pol = make_policy(name, 4)
        pol.on_insert_many([0, 1], 0)
        pol.release_many([0])
        assert pol.pop() == 0
        with pytest.raises(IndexError):
            pol.pop()


def test_lfu_block_parked_then_used_is_not_skipped():
    """A block in use at the front of the smallest bucket is parked by pop; used again, it lands in
    a bucket below the one pop stopped at, and must still be found there."""
    def call(kind, *blocks):
        return kind, True, list(blocks), [NEVER] * 8

    script = [call("insert", 0, 1, 2), call("use", 1), call("use", 1), call("use", 2), call("use", 2),
              call("release", 1, 2),  # uses: 0 one, 1 and 2 three each
              call("pop", 0),  # parks 0 (in use, bucket 1) and evicts 1: pop stops at bucket 3
              call("use", 0), call("release", 0),  # 0: two uses
              call("pop", 0)]  # 0, not 2
    drive("lfu", 3, script)
