"""Cache policies against their definition: random call sequences (hypothesis) drive each policy and
a reference that evaluates its rule by brute force, and the two must name the same victims in the same
order, through the one-block calls and the batch calls alike. The policies keyed by one number (lru,
fifo, lfu, lru2, prefix, belady; learned's logit at the pop) take the minimum over every evictable
block, ties to the earliest release; ARC and S3-FIFO are restated on plain lists from their class
docstrings. The script's blocks carry keys (ghosts get hit) and parents (depth, continuations)
as a block pool gives them. Boundary cases of ARC and S3-FIFO the random runs rarely reach are
written out."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.memory.learned import LearnedModel, LearnedPolicy
from kvbench.memory.policies import CACHE_POLICIES, make_policy
from kvbench.memory.policy_base import NEVER, CacheView

LEARNED = LearnedModel(window_s=60.0, block_size=1, mean=[0.3, 0.2, 0.9, 0.1, 0.5, 0.4, 3.0],
                       scale=[0.9, 0.7, 1.1, 0.6, 1.3, 0.8, 2.5], coef=[0.37, 1.21, -0.43, 0.88, 0.52, -0.61, -0.79],
                       intercept=0.11)


class Reference:
    """The eviction rule, evaluated by brute force: no structure to get wrong. Blocks wait in
    ``evictable`` with the seq that made them evictable (ties: the smallest goes first) and, for the
    policies keyed at release, their priority then; learned's logit is evaluated at the pop."""

    def __init__(self, name: str):
        self.name = name
        self.tick = self.seq = 0
        self.inserted, self.count, self.last, self.next = {}, {}, {}, {}
        self.ended: dict[int, list[int]] = {}  # lru2: seqs that ended the block's uses since insert
        self.depth, self.run, self.kids, self.t_ins, self.t_last, self.t_prev = {}, {}, {}, {}, {}, {}
        self.evictable: dict[int, tuple] = {}  # block -> (priority at release, seq)
        self.now = 0.0

    def priority(self, b: int) -> tuple:
        if self.name == "lru":
            return ()
        if self.name == "fifo":
            return (self.inserted[b],)
        if self.name == "lfu":
            return (self.count[b], self.last[b])
        if self.name == "lru2":
            return (self.ended[b][-2] if len(self.ended[b]) > 1 else 0,)
        if self.name == "prefix":
            return (-self.depth[b],)
        if self.name == "learned":
            return ()  # at the pop
        return (-self.next[b],)  # belady: the furthest next use first

    def logit(self, b: int) -> float:
        """LEARNED's logit of P(reuse) for block b now, feature by feature as the docstring says."""
        log = math.log1p
        x = [log(self.depth[b]), log(self.count[b] - 1), log(self.run[b]), log(self.kids[b]),
             log(self.t_last[b] - self.t_ins[b]), log(self.t_last[b] - self.t_prev[b]), self.now - self.t_last[b]]
        m = LEARNED
        return m.intercept + sum(c * (v - mu) / s for c, v, mu, s in zip(m.coef, x, m.mean, m.scale))

    def insert_many(self, blocks, next_uses, parents) -> None:
        for b, nu, p in zip(blocks, next_uses, parents):
            self.tick += 1
            self.inserted[b] = self.last[b] = self.tick
            self.count[b] = 1
            self.next[b] = nu
            self.ended[b] = []
            self.depth[b] = self.depth[p] + 1 if p >= 0 else 0
            self.kids[b] = 0
            self.t_ins[b] = self.t_last[b] = self.t_prev[b] = self.now
            if p >= 0:
                self.kids[p] += 1
                if self.name == "learned" and p in self.evictable:  # a new continuation: queued anew
                    self.reuse(p)
                    self.release(p)
        for b in blocks:
            self.run[b] = max(self.depth[c] for c in blocks) + 1

    def use(self, b: int, next_use: int) -> None:
        self.tick += 1
        self.last[b] = self.tick
        self.count[b] += 1
        self.next[b] = next_use
        self.t_prev[b], self.t_last[b] = self.t_last[b], self.now

    def recompute(self, b: int, next_use: int) -> None:
        if self.name == "belady":
            self.next[b] = next_use
            if b in self.evictable:  # queued again under its new next use
                self.reuse(b)
                self.release(b)

    def release(self, b: int) -> None:
        self.seq += 1
        self.ended[b].append(self.seq)
        self.evictable[b] = (self.priority(b), self.seq)

    def reuse(self, b: int) -> None:
        del self.evictable[b]

    def pop(self) -> int:
        if self.name == "learned":
            b = min(self.evictable, key=lambda b: (self.logit(b), self.evictable[b][1]))
        else:
            b = min(self.evictable, key=self.evictable.__getitem__)
        del self.evictable[b]
        return b


class ARCReference:
    """ARC as policies.ARCPolicy's docstring states it, on plain lists: T1, T2 (cached blocks), B1,
    B2 (keys, oldest first), p; the victim is the named list's evictable block released first."""

    def __init__(self, capacity: int):
        self.c = capacity
        self.p = 0.0
        self.T = {1: [], 2: []}
        self.B = {1: [], 2: []}
        self.key: dict[int, int] = {}
        self.evictable: dict[int, int] = {}  # block -> release seq
        self.seq = 0

    def insert_many(self, blocks, keys) -> None:
        for b, k in zip(blocks, keys):
            self.key[b] = k
            B1, B2 = self.B[1], self.B[2]
            if k in B1:
                self.p = min(self.c, self.p + max(len(B2) / len(B1), 1))
                B1.remove(k)
                self.T[2].append(b)
            elif k in B2:
                self.p = max(0.0, self.p - max(len(B1) / len(B2), 1))
                B2.remove(k)
                self.T[2].append(b)
            else:
                self.T[1].append(b)
                while len(self.T[1]) + len(B1) > self.c and B1:
                    B1.pop(0)
                while len(self.T[1]) + len(self.T[2]) + len(B1) + len(B2) > 2 * self.c and B2:
                    B2.pop(0)

    def use(self, b: int) -> None:
        if b in self.T[1]:
            self.T[1].remove(b)
            self.T[2].append(b)

    def release(self, b: int) -> None:
        self.seq += 1
        self.evictable[b] = self.seq

    def reuse(self, b: int) -> None:
        del self.evictable[b]

    def pop(self) -> int:
        ev = {w: [b for b in self.T[w] if b in self.evictable] for w in (1, 2)}
        w = 1 if ev[1] and (len(self.T[1]) > self.p or not ev[2]) else 2
        b = min(ev[w], key=self.evictable.__getitem__)
        self.T[w].remove(b)
        del self.evictable[b]
        self.B[w].append(self.key[b])
        return b


class S3FIFOReference:
    """S3-FIFO as policies.S3FIFOPolicy's docstring states it, on plain lists."""

    def __init__(self, capacity: int):
        self.small_max = max(1, int(capacity * 0.1))
        self.main_max = capacity - self.small_max
        self.ghost_max = max(1, int(capacity * 0.9))
        self.Q = {1: [], 2: []}  # S, M: oldest first
        self.size = {1: 0, 2: 0}
        self.where: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.key: dict[int, int] = {}
        self.aside: set[int] = set()
        self.G: list[int] = []
        self.evictable: set[int] = set()

    def insert_many(self, blocks, keys) -> None:
        for b, k in zip(blocks, keys):
            self.key[b] = k
            w = 2 if k in self.G else 1
            if w == 2:
                self.G.remove(k)
            self.where[b], self.count[b] = w, 0
            self.size[w] += 1
            self.Q[w].append(b)

    def use(self, b: int) -> None:
        self.count[b] = min(self.count[b] + 1, 3)

    def release(self, b: int) -> None:
        self.evictable.add(b)
        if b in self.aside:
            self.aside.remove(b)
            self.Q[self.where[b]].append(b)

    def reuse(self, b: int) -> None:
        self.evictable.remove(b)

    def _take(self, w: int) -> int:
        q = self.Q[w]
        while q:
            b = q.pop(0)
            if self.count[b] and w == 1:
                self.count[b] = 0
                self.where[b] = 2
                self.size[1] -= 1
                self.size[2] += 1
                self.Q[2].append(b)
            elif self.count[b]:
                self.count[b] -= 1
                q.append(b)
            elif b in self.evictable:
                if w == 1:
                    self.G = [k for k in self.G if k != self.key[b]] + [self.key[b]]
                    self.G = self.G[-self.ghost_max:]
                self.evictable.remove(b)
                self.size[w] -= 1
                return b
            else:
                self.aside.add(b)
        return -1

    def pop(self) -> int:
        order = (2, 1, 2) if self.size[2] > self.main_max or not self.size[1] else (1, 2, 1)
        for w in order:
            b = self._take(w)
            if b >= 0:
                return b
        raise AssertionError("no victim")


def make_reference(name: str, capacity: int):
    return {"arc": ARCReference, "s3fifo": S3FIFOReference}.get(name, lambda c: Reference(name))(capacity)


class ScriptView(CacheView):
    """Keys and parents as a block pool holds them: a block's key is set at insert, its parent is
    the block caching its parent key (if any)."""

    block_size = 1

    def __init__(self):
        self.key: dict[int, int] = {}
        self.parent_key: dict[int, int] = {}

    def key_of(self, block: int):
        return self.key.get(block)

    def parent_of(self, block: int) -> int:
        pk = self.parent_key.get(block, -1)
        return next((b for b, k in self.key.items() if k == pk), -1)


KINDS = ["insert", "use", "release", "reuse", "pop", "recompute"]
next_use = st.one_of(st.integers(0, 6), st.just(NEVER))  # few values: belady ties often
calls = st.lists(st.tuples(st.sampled_from(KINDS), st.booleans(),
                           st.lists(st.integers(0, 1000), max_size=8),
                           st.lists(next_use, min_size=8, max_size=8)),
                 max_size=120)


def build(name: str, num_blocks: int):
    if name == "learned":
        return LearnedPolicy(num_blocks, None, LEARNED)
    return make_policy(name, num_blocks)


def drive(name: str, num_blocks: int, script) -> None:
    """Apply ``script`` to the policy and the reference, keeping to the protocol the block pool
    keeps (insert and use blocks in use, release blocks in use, reuse evictable ones; a new block's
    key is no cached block's, its parent a cached block's or none), and compare every victim and
    every length. Time moves on by one second a call."""
    pol, ref = build(name, num_blocks), make_reference(name, num_blocks)
    view = ScriptView()
    pol.bind(view)
    state = ["out"] * num_blocks  # out | used | evictable (the block pool's view)
    for step, (kind, batched, picks, nus) in enumerate(script):
        now = float(step)
        if isinstance(ref, Reference):
            ref.now = now
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
                del view.key[b]
        elif kind == "insert":
            keys, parents = [], []
            for b, p in zip(blocks, picks):  # keys from a small space: ghosts get hit
                k = p % (2 * num_blocks + 3)
                while k in view.key.values():
                    k = (k + 1) % (2 * num_blocks + 3)
                holders = sorted(view.key)  # cached before it, in the call or earlier
                parent = holders[p % len(holders)] if holders and p % 3 else -1
                view.key[b] = k
                view.parent_key[b] = view.key[parent] if parent >= 0 else -1
                keys.append(k)
                parents.append(parent)
                state[b] = "used"
            # batched: one call; else a call per block (learned's prompt feature is the call's chain)
            for part in ([range(len(blocks))] if batched else [[i] for i in range(len(blocks))]):
                bs = [blocks[i] for i in part]
                if isinstance(ref, Reference):
                    ref.insert_many(bs, [nus[i] for i in part], [parents[i] for i in part])
                else:
                    ref.insert_many(bs, [keys[i] for i in part])
                pol.on_insert_many(bs, now, [nus[i] for i in part])
        elif kind == "use":
            for b, nu in zip(blocks, nus):
                ref.use(b, nu) if isinstance(ref, Reference) else ref.use(b)
            if batched:
                pol.on_use_many(blocks, now, nus)
            else:
                for b, nu in zip(blocks, nus):
                    pol.on_use(b, now, nu)
        elif kind == "recompute":
            if isinstance(ref, Reference):
                for b, nu in zip(blocks, nus):
                    ref.recompute(b, nu)
            pol.on_recompute_many(blocks, now, nus)
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
    rest = len(pol)
    assert pol.pop_many(rest) == [ref.pop() for _ in range(rest)]  # the rest, in order


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


class KeyView(CacheView):
    """Block -> key, set by the test (no parents)."""

    def __init__(self):
        self.key: dict[int, int] = {}

    def key_of(self, block: int):
        return self.key.get(block)


def _insert(pol, view, block: int, key: str) -> None:
    view.key[block] = key
    pol.on_insert_many([block], 0)
    pol.release_many([block])


def test_arc_replaces_from_t1_only_above_its_target():
    """Two ghost hits in B1 raise p to 2 = |T1|: the tie goes to T2 (the paper's case needs the new
    key, which the pool does not know when it evicts)."""
    view = KeyView()
    pol = make_policy("arc", 4)
    pol.bind(view)
    for b, k in enumerate("abcd"):
        _insert(pol, view, b, k)
    assert pol.pop() == 0  # T1 = {0..3}, p = 0: T1's oldest; key a to B1
    _insert(pol, view, 0, "a")  # ghost hit: p = 1, block 0 in T2
    assert pol.p == 1
    assert pol.pop() == 1  # |T1| = 3 > 1; key b to B1
    _insert(pol, view, 1, "b")  # p = 2
    assert pol.pop() == 0  # |T1| = 2 = p: from T2, its oldest


def test_arc_keeps_t1_and_b1_within_the_cache():
    """|T1| + |B1| <= c: a new key pushes B1's oldest ghost out, so that key is new again."""
    view = KeyView()
    pol = make_policy("arc", 2)
    pol.bind(view)
    _insert(pol, view, 0, "a")
    _insert(pol, view, 1, "b")
    assert pol.pop() == 0  # a to B1
    _insert(pol, view, 0, "c")  # |T1| + |B1| = 3 > 2: a leaves B1
    assert pol.pop() == 1  # b to B1
    _insert(pol, view, 1, "a")  # not a ghost hit: T1, p stays 0
    assert pol.p == 0
    assert pol.pop() == 0


def test_s3fifo_evicts_from_small_until_main_is_over_its_share():
    """c = 10: S holds 1, M 9. Nine keys come back from the ghost into M; with |M| = 9 (not over)
    the next victim is S's block, not M's oldest."""
    view = KeyView()
    pol = make_policy("s3fifo", 10)
    pol.bind(view)
    for b in range(9):
        _insert(pol, view, b, f"k{b}")
        assert pol.pop() == b  # S's only block: its key to the ghost
        _insert(pol, view, b, f"k{b}")  # ghost hit: into M
    _insert(pol, view, 9, "new")
    assert pol.pop() == 9
