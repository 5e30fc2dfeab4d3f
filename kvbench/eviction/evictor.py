"""Layer 3, token eviction: which tokens of a sequence keep their KV when it outgrows its budget.

One mechanism (``Evictor``) serves every policy of ``EVICTION_POLICIES`` (``--eviction``: streaming, h2o,
infinigen); a policy only says how many kept tokens are the most recent, whether attention is scored and
whether evicted tokens go to a CPU pool and may be recalled. The scheduler calls ``after_step``,
``release`` and ``fill_batch``. Budgets, scores, the paged mechanics, InfiniGen's speculation and the
counters: docs/architecture.md, "Layer 3, eviction".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvbench.errors import InputError
from kvbench.eviction import synth
from kvbench.eviction.cpu_pool import CpuPool
from kvbench.memory.contracts import KVManager

MIN_RECENT = 16  # tokens every budget leaves for the recent window besides the sinks
RECALL_ALPHA = 2.0  # recall a pooled token weighing this many times the mean kept token
RECALL_SHARE = 0.25  # most of the budget recalled in one step
CPU_POOL_FACTOR = 4  # CPU pool capacity = this many times the GPU pool's tokens


@dataclass(frozen=True)
class Policy:
    name: str
    recent_share: float  # of the non-sink budget, the most recent tokens; the rest by score
    scored: bool  # accumulates attention scores
    offload: bool  # evicted tokens go to the CPU pool and may be recalled


EVICTION_POLICIES = {
    "streaming": Policy("streaming", 1.0, False, False),
    "h2o": Policy("h2o", 0.5, True, False),
    "infinigen": Policy("infinigen", 0.5, True, True),
}


def budget_tokens(kv_budget: float, seq_len: int, floor: int) -> int:
    """A sequence's KV budget in tokens: kv_budget tokens, or that share of seq_len when < 1."""
    b = int(kv_budget) if kv_budget >= 1 else math.ceil(kv_budget * seq_len)
    return max(b, floor)


def select(pos: np.ndarray, score: np.ndarray, keep_n: int, sinks: int, recent_share: float) -> np.ndarray:
    """Slots to keep: positions < sinks, then the most recent ceil(recent_share x rest), then the
    highest scores. pos: int64 [n], score: float64 [n] -> sorted int64 [<= keep_n]."""
    n = len(pos)
    if keep_n >= n:
        return np.arange(n)
    keep = pos < sinks
    rest = keep_n - int(keep.sum())
    if rest > 0:
        cand = np.flatnonzero(~keep)
        n_recent = min(len(cand), math.ceil(rest * recent_share))
        if n_recent:
            recent = cand[np.argpartition(-pos[cand], n_recent - 1)[:n_recent]]
            keep[recent] = True
        n_heavy = rest - n_recent
        if n_heavy > 0:
            cand = np.flatnonzero(~keep)
            heavy = cand[np.argpartition(-score[cand], n_heavy - 1)[:n_heavy]]
            keep[heavy] = True
    return np.flatnonzero(keep)


class SeqState:
    """A sequence's eviction state, slot-aligned: the position and the accumulated score of each slot."""

    __slots__ = ("pos", "score", "n", "key", "reread_p", "ahead")

    def __init__(self, num_kv: int, key: int, reread_p: float):
        cap = max(64, 2 * num_kv)
        self.pos = np.zeros(cap, dtype=np.int64)
        self.pos[:num_kv] = np.arange(num_kv)
        self.score = np.zeros(cap)
        self.n = num_kv
        self.key = key
        self.reread_p = reread_p
        # sim: (t, raw weights of slots [0, n) for the query at t), computed ahead
        self.ahead: tuple[int, np.ndarray] | None = None

    def sync(self, num_kv: int, computed: int) -> None:
        """Slots [n, num_kv) were written since: the latest tokens, positions up to computed - 1."""
        add = num_kv - self.n
        if add <= 0:
            return
        if num_kv > len(self.pos):
            cap = 2 * num_kv
            self.pos = np.resize(self.pos, cap)
            self.score = np.resize(self.score, cap)
        self.pos[self.n:num_kv] = np.arange(computed - add, computed)
        self.score[self.n:num_kv] = 0.0
        self.n = num_kv

    def replace(self, pos: np.ndarray, score: np.ndarray) -> None:
        n = len(pos)
        if n > len(self.pos):
            self.pos, self.score = np.zeros(2 * n, dtype=np.int64), np.zeros(2 * n)
        self.pos[:n], self.score[:n] = pos, score
        self.n = n
        self.ahead = None

    def raw_weights(self, t: int) -> np.ndarray:
        """Synthetic weights of slots [0, n) for the query at t, reusing what speculation computed
        for the same query before the latest slot was written."""
        a = self.ahead
        if a is not None and a[0] == t and len(a[1]) <= self.n:
            have = a[1]
            return np.concatenate([have, synth.raw_weights(self.key, self.pos[len(have):self.n], t, self.reread_p)])
        return synth.raw_weights(self.key, self.pos[:self.n], t, self.reread_p)


class NoEviction:
    """``--eviction none``: every hook does nothing."""

    name = "none"
    mass_sum = 0.0  # no attention mass measured
    mass_n = 0

    def after_step(self, seqs, result, step: int) -> None:
        pass

    def release(self, s) -> None:
        pass

    def fill_batch(self, batch) -> None:
        pass

    def summary(self) -> dict:
        return {"evicted_tokens": 0, "recalled_tokens": 0, "attention_mass_kept": None,
                "offloaded_tokens": 0, "pcie_bytes": 0}


class Evictor:
    """Applies a Policy to the running sequences after each step, through the paged KV's ``compact``."""

    def __init__(self, policy: Policy, kv, *, kv_budget: float, sink_tokens: int, seed: int,
                 kv_bytes_per_token: int, cpu_pool_tokens: int | None = None, cpu_pool_rule: str = "counter",
                 speculate=None):
        self.policy = policy
        self.name = policy.name
        self.kv = kv
        self.kv_budget = kv_budget
        self.sinks = sink_tokens
        self.floor = sink_tokens + MIN_RECENT
        self.seed = seed
        self.bytes_per_token = kv_bytes_per_token
        cap = cpu_pool_tokens if cpu_pool_tokens is not None else CPU_POOL_FACTOR * kv.capacity_tokens
        self.cpu = CpuPool(cap, cpu_pool_rule) if policy.offload else None
        # the model executor's look-ahead scorer (ModelExecutor.speculate); None: synthetic attention
        self.speculate = speculate
        # queued for the next batch
        self._offload: list = []
        self._recall: list = []
        self._src: list[np.ndarray] = []
        self._dst: list[np.ndarray] = []
        self._release: list[int] = []
        self._dropped: list = []  # (seq_id, positions) the CPU pool dropped for capacity
        self._pcie_pending = 0
        # totals
        self.evicted = self.recalled = self.offloaded = self.pcie_bytes = 0
        self.moved_slots = self.compactions = self.short_of_blocks = 0
        self.mass_sum = 0.0
        self.mass_n = 0
        self.peak_seq_tokens = 0
        self.excess_max = -(1 << 62)

    # -- hooks the scheduler calls -------------------------------------------------------------
    def release(self, s) -> None:
        """The sequence freed its KV (finished or preempted): forget its state and host copies."""
        if s.ev is not None or (self.cpu is not None and self.cpu.get(s.seq_id) is not None):
            s.ev = None
            self._release.append(s.seq_id)
            if self.cpu is not None:
                self.cpu.release(s.seq_id)

    def fill_batch(self, batch) -> None:
        """Hand the queued moves, offloads, recalls and releases to the next batch."""
        if self._src:
            batch.slot_moves = (np.concatenate(self._src), np.concatenate(self._dst))
            self._src, self._dst = [], []
        batch.offload, batch.recall, batch.host_release = self._offload, self._recall, self._release
        batch.pool_dropped = self._dropped
        batch.offload_is_transfer = self.policy.offload
        batch.pcie_bytes = self._pcie_pending
        self._offload, self._recall, self._release, self._dropped, self._pcie_pending = [], [], [], [], 0

    def after_step(self, seqs, result, step: int) -> None:
        """Score, recall and evict for every sequence whose next step is a decode."""
        if result.mass_kept:
            self.mass_sum += sum(result.mass_kept.values())
            self.mass_n += len(result.mass_kept)
        due = [s for s in seqs if s.num_kv + s.dropped == s.num_tokens - 1 and s.num_out > 0]
        ahead = None  # mid-prefill sequences wait: eviction starts once the prompt is computed
        if self.cpu is not None and self.speculate is not None:
            ahead = self.speculate([(s.seq_id, s.last_token, s.num_kv + s.dropped, o.pos) for s in due
                                    if (o := self.cpu.get(s.seq_id)) is not None and len(o)])
        for s in due:
            self._one(s, s.num_kv + s.dropped, result, ahead, step)
        if self.cpu is not None:
            self._dropped.extend(self.cpu.enforce_capacity().items())

    # -- one sequence ----------------------------------------------------------------------
    def _one(self, s, computed: int, result, ahead, step: int) -> None:
        st = s.ev
        if st is None:
            if s.dropped:
                raise RuntimeError("a compacted sequence lost its eviction state")
            req = s.rs.req
            st = s.ev = SeqState(s.num_kv, synth.sequence_key(self.seed, req.index),
                                 synth.reread_chance((req.meta or {}).get("workload")))
        else:
            st.sync(s.num_kv, computed)
        n = st.n
        t = computed - 1  # the query of the step that just ran
        if self.policy.scored:
            if result.attention is not None:
                w = result.attention.get(s.seq_id)
                if w is not None:
                    st.score[:len(w)] += w
            else:
                raw = st.raw_weights(t)
                st.score[:n] += raw / raw.sum()
        budget = budget_tokens(self.kv_budget, s.num_tokens, self.floor)
        cand = self._recall_candidates(s, st, computed, ahead, step) if self.cpu is not None else None
        n_cand = 0 if cand is None else len(cand)
        if n >= budget:
            target = max(self.floor - 1, budget - self.kv.block_size)
        elif n_cand:
            target = min(budget - 1, n + n_cand)
        else:
            self._note_size(n, budget)
            return
        n_recall = min(n_cand, max(0, target - self.floor), int(RECALL_SHARE * budget))
        keep_n = target - n_recall
        if keep_n >= n and not n_recall:
            self._note_size(n, budget)
            return
        keep = select(st.pos[:n], st.score[:n], keep_n, self.sinks, self.policy.recent_share)
        gone = np.ones(n, dtype=bool)
        gone[keep] = False
        gone_idx = np.flatnonzero(gone)
        gone_phys = self.kv.slots_of(s, gone_idx)
        comp = self.kv.compact(s, keep, n_recall)
        if comp is None:
            self.short_of_blocks += 1
            self._note_size(n, budget)
            return
        old_pos, old_score = st.pos[:n].copy(), st.score[:n].copy()
        new_n = len(keep) + n_recall
        new_pos, new_score = np.empty(new_n, dtype=np.int64), np.empty(new_n)
        stay = np.zeros(n, dtype=bool)
        stay[keep] = True
        stay[comp.src] = False
        in_place = np.flatnonzero(stay)
        new_pos[in_place], new_score[in_place] = old_pos[in_place], old_score[in_place]
        new_pos[comp.dst], new_score[comp.dst] = old_pos[comp.src], old_score[comp.src]
        gone_pos = old_pos[gone_idx]
        if n_recall:
            assert self.cpu is not None and cand is not None  # (recalls are the CPU pool's candidates)
            o = self.cpu.get(s.seq_id)
            assert o is not None
            pick = cand[:n_recall]
            new_pos[comp.append], new_score[comp.append] = o.pos[pick], o.score[pick]
            self._recall.append((s.seq_id, o.pos[pick].copy(), comp.append_phys))
            mask = np.zeros(len(o), dtype=bool)
            mask[pick] = True
            self.cpu.remove(s.seq_id, mask)
            self.recalled += n_recall
            s.rs.recalled_tokens += n_recall
            self._pcie_pending += n_recall * self.bytes_per_token
        st.replace(new_pos, new_score)
        if len(gone_idx):
            self._offload.append((s.seq_id, gone_pos, gone_phys))
            self.evicted += len(gone_idx)
            s.rs.evicted_tokens += len(gone_idx)
            if self.cpu is not None:
                self.cpu.add(s.seq_id, gone_pos, old_score[gone_idx], step)
                self.offloaded += len(gone_idx)
                self._pcie_pending += len(gone_idx) * self.bytes_per_token
        if len(comp.src):
            self._src.append(comp.src_phys)
            self._dst.append(comp.dst_phys)
            self.moved_slots += len(comp.src)
        self.compactions += 1
        self.pcie_bytes += (n_recall + (len(gone_idx) if self.cpu is not None else 0)) * self.bytes_per_token
        self._note_size(new_n, budget)

    def _recall_candidates(self, s, st: SeqState, t_next: int, ahead, step: int) -> np.ndarray | None:
        """Indices into the sequence's pooled tokens worth recalling for the decode at position
        t_next, best first. ahead: the model executor's speculation (seq_id -> host positions,
        weights), or None for the synthetic attention."""
        assert self.cpu is not None  # (recalls are the CPU pool's)
        o = self.cpu.get(s.seq_id)
        if o is None or not len(o):
            return None
        if ahead is not None:
            w = ahead.get(s.seq_id)  # one weight per pooled token, in the pool's order
            if w is None:
                return None
        else:
            raw = st.raw_weights(t_next)
            st.ahead = (t_next, raw)  # the next step's scoring needs these again
            w = synth.raw_weights(st.key, o.pos, t_next, st.reread_p) / raw.sum()
        o.score += w
        hot = np.flatnonzero(w > RECALL_ALPHA / max(1, st.n))
        if not len(hot):
            return None
        o.hits[hot] += 1
        o.last[hot] = step
        return hot[np.argsort(-w[hot], kind="stable")]

    def _note_size(self, n: int, budget: int) -> None:
        """Slots the sequence will hold after its next decode writes, against its budget."""
        if n + 1 > self.peak_seq_tokens:
            self.peak_seq_tokens = n + 1
        if n + 1 - budget > self.excess_max:
            self.excess_max = n + 1 - budget

    def summary(self) -> dict:
        return {"evicted_tokens": self.evicted, "recalled_tokens": self.recalled,
                "attention_mass_kept": self.mass_sum / self.mass_n if self.mass_n else None,
                "offloaded_tokens": self.offloaded, "pcie_bytes": self.pcie_bytes,
                "cpu_pool_dropped_tokens": self.cpu.dropped if self.cpu is not None else 0,
                "eviction_compactions": self.compactions, "eviction_moved_slots": self.moved_slots,
                "eviction_short_of_blocks": self.short_of_blocks,
                "peak_seq_tokens": self.peak_seq_tokens,
                "budget_excess_max_tokens": self.excess_max if self.compactions or self.peak_seq_tokens else None}


def make_evictor(name: str, kv: KVManager, *, kv_budget: float, sink_tokens: int, seed: int,
                 kv_bytes_per_token: int, **kw) -> Evictor | NoEviction:
    """The evictor for ``--eviction NAME``. A layout that cannot shrink a sequence (``can_compact``
    false: a slab's reservation, where eviction would free nothing) is refused, not silently spared."""
    if name == "none":
        return NoEviction()
    if not kv.can_compact:
        raise InputError(f"token eviction ({name}) frees slots by packing a sequence's kept tokens, which the "
                         f"{kv.layout} layout cannot do: use --layout paged, or --eviction none", field="--eviction")
    try:
        policy = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction {name!r} (choose from none, {', '.join(EVICTION_POLICIES)})") from None
    return Evictor(policy, kv, kv_budget=kv_budget, sink_tokens=sink_tokens, seed=seed,
                   kv_bytes_per_token=kv_bytes_per_token, **kw)
