"""Hybrid KV: a model whose layers fall into several KV cache groups (kvbench.memory.groups) run as
vLLM's hybrid KV cache manager runs it. One shared block pool; per sequence one block table per group
(``GroupTables``), a null entry (``NULL``) where a windowed group freed a block that left the window;
per group a manager's rules (``Manager``: full attention, sliding window, chunked local), and a
coordinator that finds the longest prefix every group can serve.

The rules, each from vLLM 0.34 (``vllm/v1/core/``):
- keys: a group caches a block under the block's chained key salted with the group
  (``make_block_hash_with_group_id``), so each group hits only its own blocks;
- lookup (``HybridKVCacheCoordinator.find_longest_cache_hit``): groups of one spec are looked up
  together (a position hits only if every one of them caches it), full attention first, left to
  right; a sliding window then from the right, for the rightmost run of cdiv(W - 1, bs) cached
  blocks ending within the full hit (``SlidingWindowManager.find_longest_cache_hit``); chunked local
  from the start of the chunk holding the hit's end (``ChunkedLocalAttentionManager``); repeated
  until the hit stops shrinking;
- blocks a group no longer attends to are freed before each allocation
  (``remove_skipped_blocks``, ``get_num_skipped_tokens``), highest position first;
- admission (``allocate_slots`` with ``full_sequence_must_fit``): the sum over groups of the blocks
  each needs for the whole prompt, a windowed group counting at most
  ``max_admission_blocks_per_request`` (``get_num_blocks_to_allocate``); then the step's own check;
- caching at allocation (``cache_blocks``): full and chunked groups cache every full block; a sliding
  window, under the default ``prefix_cache_retention_interval`` of 0, only the cdiv(W - 1, bs) blocks
  ending at the prompt's last block boundary and at the shared-prefix junction the last lookup found
  (``reachable_block_mask``); a block left uncached is never cached later;
- free (``KVCacheCoordinator.free``): group by group in group order, each tail first.

A Mamba or linear-attention group (kind ``mamba``: one recurrent state per sequence, vLLM's MambaSpec
under ``MambaManager`` in "align" mode, what prefix caching turns on) follows the same pool with its own
rules (``vllm/v1/core/single_type_kv_cache_manager.py: MambaManager``):
- a block holds the state after the tokens up to its end (block j: (j + 1) x bs); a sequence holds the
  block of its running state, nulls before it, and across a step that crosses a block boundary also
  the block it is copied from (``allocate_new_blocks``: at most one new block a step, two with a
  prefill checkpoint; ``remove_skipped_blocks`` frees the older one at the next allocation);
- only a state that exists can be cached, and under the default retention interval of 0 only at the
  prompt's last block boundary below its last token and at the shared-prefix junction
  (``reachable_block_mask``): nothing while decoding;
- lookup from the right: the hit ends at the last block boundary, within the full-attention hit, whose
  state every Mamba group caches (``find_longest_cache_hit``); a state cached during this step cannot
  be hit before the next one (``cached_blocks_this_step``: the allocation is refused);
- the scheduler stops a prefill chunk where a state must be kept (``split``, vLLM's
  ``Scheduler._mamba_block_aligned_split``): at block boundaries, at the last boundary below the last
  token, at a junction.
Without prefix caching ("none" mode) a state group holds one block per sequence for its life, and
nothing is split.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbench.memory.block_pool import BlockPool
from kvbench.memory.contracts import Compaction, KVEvent, KVStats, SeqKV
from kvbench.memory.groups import KVGroup, KVLayout, cdiv
from kvbench.memory.states import NULL, GroupTables, StateGroups
from kvbench.trace.keys import lookup_blocks
from kvbench.trace.tokens import ROOT_KEY, block_keys

if TYPE_CHECKING:
    from kvbench.memory.tiers import TierMatch, Tiers

_MASK = (1 << 64) - 1
_SALT = 0x9E3779B97F4A7C15  # group g caches under key ^ ((g + 1) * _SALT); the first full group under the key


@dataclass(slots=True)
class HybridHit:
    """A lookup's hit: per group, its blocks by position (NULL left of a window's run), and the
    tokens every group serves."""

    blocks: list[list[int]]
    tokens: int
    longest: int = 0  # the longest hit any spec group found (vLLM: the junction when it exceeds ``tokens``)


@dataclass(frozen=True, slots=True)
class _SpecGroup:
    """Groups of one spec, looked up together (vLLM's SpecGroup)."""

    group: KVGroup  # the first of them (their spec)
    ids: tuple[int, ...]


@dataclass(slots=True)
class _Found:
    blocks: dict[int, list[int]] = field(default_factory=dict)  # group id -> blocks by position
    tokens: int = 0
    longest: int = 0


class HybridKV(StateGroups):
    """The paged layout of a model with several KV cache groups: a KVManager over one BlockPool (its
    recurrent-state groups' rules: kvbench.memory.states.StateGroups)."""

    layout = "paged"
    can_compact = False  # token eviction keeps one table; refused for hybrid models
    watermark_frac = 0.01
    keys_as_arrays = False

    def __init__(self, num_blocks: int, kv_layout: KVLayout, *, prefix_cache: bool = True,
                 cache_policy: str = "lru", max_batched_tokens: int = 8192, max_model_len: int = 1 << 30):
        """``max_batched_tokens`` and ``max_model_len`` size the windowed groups' admission caps (vLLM:
        max_in_flight_tokens of a synchronous scheduler is the step's token budget)."""
        bs = kv_layout.block_size
        self.kv_layout = kv_layout
        self.groups = kv_layout.groups
        self.block_size = bs
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.pool = BlockPool(num_blocks, bs, enable_cache=prefix_cache, policy=cache_policy,
                              duplicate_keys=cache_policy == "lru")
        self.caps = [g.admission_cap(bs, max_batched_tokens, max_model_len) for g in self.groups]
        self.max_batched_tokens = max_batched_tokens
        # (group, is it sliding, its window or chunk) of the groups that free what they no longer attend;
        # a recurrent state's groups (window 0) free all but their last state
        self._windowed = [(i, g.kind == "sliding", g.window) for i, g in enumerate(self.groups)
                          if g.kind in ("sliding", "chunked", "mamba")]
        self._states = [i for i, g in enumerate(self.groups) if g.kind == "mamba"]
        self._windows = [i for i, g in enumerate(self.groups) if g.kind in ("sliding", "chunked")]
        self.state_checkpoints = any(self.groups[i].spec.checkpoints for i in self._states)
        # the scheduler ends prefill chunks where a state must be kept (split): align mode only
        self.aligned_split = prefix_cache and bool(self._states)
        self._step_keys: set[int] = set()  # the state keys cached during this step (salted per group)
        self._ref = next((i for i, g in enumerate(self.groups) if g.kind != "mamba"), 0)  # a table by position
        self._token_groups = [i for i, g in enumerate(self.groups) if g.kind != "mamba"]  # KV per token
        first_full = next((i for i, g in enumerate(self.groups) if g.kind in ("full", "mla")), 0)
        self.salts = [0 if i == first_full else ((i + 1) * _SALT) & _MASK for i in range(len(self.groups))]
        self.roots = [ROOT_KEY ^ salt for salt in self.salts]
        specs: dict[Any, list[int]] = {}
        for i, g in enumerate(self.groups):
            specs.setdefault(g.spec, []).append(i)
        spec_groups = [_SpecGroup(self.groups[ids[0]], tuple(ids)) for ids in specs.values()]
        # full attention first (vLLM verify_and_split_kv_cache_groups), stable otherwise
        self.spec_groups = sorted(spec_groups, key=lambda sg: sg.group.kind not in ("full", "mla"))
        self.simple = len(self.spec_groups) == 2 and self.spec_groups[0].group.kind in ("full", "mla")
        self.copies: list[tuple[int, int]] = []
        self.cow_copies = 0
        self.partial_hit_tokens = 0
        self.last_shortfall = 0
        self.tiers: Tiers | None = None  # (refused: attach_tiers)
        self.last_loaded: TierMatch | None = None

    # -- what the scheduler reads ------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def cache_evictions(self) -> int:
        return self.pool.evictions

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.num_blocks

    def stats(self) -> KVStats:
        """Blocks of every group; tokens_live counts a token once per group that holds it."""
        p = self.pool
        return KVStats(p.num_used, p.num_cached, p.num_free, p.num_used * self.block_size, p.tokens_live)

    def admission_floor(self, s: SeqKV, num_tokens: int, budget: int, full: bool = True) -> tuple[int, int]:
        """No cheap bound: the lookup and the allocation decide (each group's need depends on its hit)."""
        return 0, self.pool.num_available

    def set_clock(self, now: float) -> None:
        self.pool.clock = now

    def enable_events(self) -> None:
        if self.prefix_cache:
            self.pool.events = []

    def take_events(self) -> list[KVEvent]:
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    # -- per-sequence state ------------------------------------------------------------------
    def _state(self, s: SeqKV) -> GroupTables:
        st = s.groups
        if st is None:
            n = len(self.groups)
            st = s.groups = GroupTables([[] for _ in range(n)], [None] * n, [None] * n)
        return st

    def _keys(self, s: SeqKV, g: int, n_blocks: int) -> list[int]:
        """Group ``g``'s keys of the sequence's first ``n_blocks`` full blocks (known tokens only)."""
        st = self._state(s)
        keys = st.keys[g]
        if keys is None or len(keys) < n_blocks:
            base = s.keys
            if base is None or len(base) < n_blocks:
                assert s.tokens is not None  # (keys are those of known tokens)
                have = 0 if base is None else len(base)
                total = len(s.tokens) // self.block_size
                more = block_keys(s.tokens[have * self.block_size:total * self.block_size], self.block_size,
                                  total - have, int(base[-1]) if have else ROOT_KEY)
                base = s.keys = (list(base) if base is not None else []) + list(more)
            salt = self.salts[g]
            keys = st.keys[g] = [int(k) ^ salt for k in base] if salt else [int(k) for k in base]
        return keys

    # -- lookup ------------------------------------------------------------------------------
    def _finder(self, s: SeqKV, ids: tuple[int, ...], n_max: int, strict: bool):
        """-> f(j): the blocks the groups ``ids`` cache for the sequence's block j (one each), or None
        unless every one does. A key is trusted when its block's parent key is the one before it; with
        ``strict`` the block's stored tokens are compared too (``_find`` confirms its result so)."""
        index, parent, rows = self.pool.index, self.pool.parent, self.pool.tokens
        keys = [self._keys(s, i, n_max) for i in ids]
        roots = [self.roots[i] for i in ids]
        tokens, bs = s.tokens, self.block_size
        assert tokens is not None and rows is not None

        def at(j: int) -> list[int] | None:
            got = []
            for k, root in zip(keys, roots):
                b = index.get(k[j])
                if b is None or parent[b] != (k[j - 1] if j else root):
                    return None
                if strict and not np.array_equal(rows[b], tokens[j * bs:(j + 1) * bs]):
                    return None
                got.append(b)
            return got
        return at

    def _find(self, s: SeqKV, sg: _SpecGroup, max_tokens: int) -> tuple[dict[int, list[int]], int]:
        """One spec group's hit within ``max_tokens``: (group id -> blocks by position, tokens). Found
        on keys, then confirmed against the blocks' tokens (a collision makes it look again, strictly)."""
        out, hit = self._find_with(s, sg, max_tokens, False)
        bs, rows, tokens = self.block_size, self.pool.tokens, s.tokens
        assert rows is not None and tokens is not None
        for blocks in out.values():
            pos = [j for j, b in enumerate(blocks) if b != NULL]
            if pos and not (rows[[blocks[j] for j in pos]] == tokens[:len(blocks) * bs].reshape(-1, bs)[pos]).all():
                return self._find_with(s, sg, max_tokens, True)
        return out, hit

    def _find_with(self, s: SeqKV, sg: _SpecGroup, max_tokens: int,
                   strict: bool) -> tuple[dict[int, list[int]], int]:
        bs, g = self.block_size, sg.group
        n_max = max_tokens // bs
        out: dict[int, list[int]] = {i: [] for i in sg.ids}
        if n_max <= 0:
            return out, 0
        at = self._finder(s, sg.ids, n_max, strict)
        if g.kind == "mamba":  # the last block boundary whose state every group caches (MambaManager)
            for j in range(n_max - 1, -1, -1):
                got = at(j)
                if got is not None:
                    for i, b in zip(sg.ids, got):
                        out[i] = [NULL] * j + [b]
                    return out, (j + 1) * bs
            return out, 0
        if g.kind == "sliding":
            need = cdiv(g.window - 1, bs)
            run = 0
            for j in range(n_max - 1, -1, -1):
                got = at(j)
                if got is None:
                    run = 0
                    continue
                run += 1
                if run == 1:
                    for i in sg.ids:
                        out[i] = [NULL] * (j + 1)
                for i, b in zip(sg.ids, got):
                    out[i][j] = b
                if run >= need:
                    for i in sg.ids:
                        del out[i][j + run:]
                    return out, (j + run) * bs
            # no run long enough: the cached run from block 0 (nothing lies before it)
            for i in sg.ids:
                del out[i][run:]
            return out, run * bs
        start = 0
        if g.kind == "chunked":
            start = (max_tokens // g.window * g.window) // bs
            for i in sg.ids:
                out[i] = [NULL] * start
        for j in range(start, n_max):
            got = at(j)
            if got is None:
                break
            for i, b in zip(sg.ids, got):
                out[i].append(b)
        return out, len(out[sg.ids[0]]) * bs

    def _lookup(self, s: SeqKV, num_tokens: int) -> _Found:
        """vLLM HybridKVCacheCoordinator.find_longest_cache_hit over at most ``num_tokens`` tokens."""
        found = _Found()
        hit = num_tokens
        full_hits: dict[int, int] = {}
        while True:
            curr = hit
            for k, sg in enumerate(self.spec_groups):
                if k in full_hits:  # full attention: a shorter prefix of a hit is a hit
                    curr = min(curr, full_hits[k])
                    continue
                blocks, curr = self._find(s, sg, curr)
                found.blocks.update(blocks)
                if sg.group.kind in ("full", "mla"):
                    full_hits[k] = curr
                found.longest = max(found.longest, curr)
            if curr >= hit:
                break
            hit = curr
            if self.simple:
                break
        bs = self.block_size
        for sg in self.spec_groups:  # full attention's blocks cut to the hit every group agrees on
            if sg.group.kind in ("full", "mla"):
                for i in sg.ids:
                    del found.blocks[i][cdiv(hit, bs):]
        found.tokens = hit
        return found

    def lookup(self, s: SeqKV, num_tokens: int) -> HybridHit:
        """The longest prefix of the sequence's first ``num_tokens`` every group serves, never the
        block holding the last of them; it also sets the shared-prefix junction the sliding groups
        cache at (vLLM: KVCacheManager.get_computed_blocks)."""
        st = self._state(s)
        empty = HybridHit([[] for _ in self.groups], 0)
        if not self.prefix_cache or s.tokens is None:
            st.boundary = 0
            return empty
        bs = self.block_size
        limit = min(lookup_blocks(num_tokens, bs), len(s.tokens) // bs) * bs
        if limit <= 0:
            st.boundary = 0
            return empty
        f = self._lookup(s, limit)
        st.boundary = f.longest if f.longest > f.tokens else 0
        return HybridHit([f.blocks[g] for g in range(len(self.groups))], f.tokens, f.longest)

    def num_cached_tokens(self, s: SeqKV, hits: Any) -> int:
        return hits.tokens if isinstance(hits, HybridHit) else 0

    def probe_cached_tokens(self, s: SeqKV, num_tokens: int) -> int:
        """The tokens a lookup would serve now, changing nothing (vLLM get_num_cached_tokens)."""
        if not self.prefix_cache or s.tokens is None:
            return 0
        limit = min(lookup_blocks(num_tokens, self.block_size), len(s.tokens) // self.block_size) * self.block_size
        return self._lookup(s, limit).tokens if limit > 0 else 0

    # -- allocation --------------------------------------------------------------------------
    def _to_allocate(self, s: SeqKV, g: int, st: GroupTables, num_tokens: int, hit: list[int], computed: int,
                     capped: bool) -> int:
        """Blocks group ``g`` takes to hold ``num_tokens`` (vLLM get_num_blocks_to_allocate): new ones,
        and hit blocks no sequence holds (taking them leaves fewer to evict)."""
        bs = self.block_size
        if self.groups[g].kind == "mamba":
            return self._state_to_allocate(s, g, st, num_tokens, hit, computed)
        required = cdiv(num_tokens, bs)
        cap = self.caps[g]
        if capped and cap is not None:
            required = min(required, cap)
        held = len(st.tables[g])
        if st.cached[g] is not None:  # a running sequence
            return max(required - held, 0)
        skipped = self.groups[g].skipped_tokens(computed) // bs
        new = max(required - max(skipped, len(hit) + held), 0)
        refcnt = self.pool.refcnt
        return new + sum(1 for b in hit[max(0, skipped - held):] if b != NULL and refcnt[b] == 0)

    def _drop_skipped(self, st: GroupTables, computed: int) -> None:
        """Free, group by group, the blocks no longer attended to (vLLM remove_skipped_blocks)."""
        bs = self.block_size
        if self._states and not self._windows:  # state groups only (beside full attention): one check for all
            states = self._state_skips(st, computed)
            if states is not None:
                for g in self._states:
                    self._drop_states(st, g, *states)
                self._states_dropped(st, states)
            return
        states, checked = None, False
        for g, sliding, w in self._windowed:  # (KVGroup.skipped_tokens, inline: every step runs it)
            if not w:  # a recurrent state's group
                if not checked:
                    states, checked = self._state_skips(st, computed), True
                if states is not None:
                    self._drop_states(st, g, *states)
                continue
            n = min((computed - w + 1 if sliding else computed // w * w) // bs, len(st.tables[g]))
            table = st.tables[g]
            if n <= 0 or table[n - 1] == NULL:  # nothing left the window since the last step
                continue
            freed = []
            for j in range(n - 1, -1, -1):
                if table[j] == NULL:
                    break
                freed.append(table[j])
                table[j] = NULL
            if freed:
                self.pool.release_all(freed)
        if states is not None:
            self._states_dropped(st, states)

    def allocate(self, s: SeqKV, num_new: int, hits: Any = (), watermark: int = 0,
                 must_fit: int = 0, forks: int = 0, external: int = 0,
                 load: bool = False) -> bool:
        """vLLM's allocate_slots over every group: the hit (a HybridHit, for an empty table) counts as
        computed, and so do ``external`` tokens after it (computed elsewhere: a KV connector's load;
        blocks a window already left get none, vLLM allocate_external_computed_blocks);
        ``must_fit``: the whole sequence must fit now (each windowed group capped); the groups'
        blocks no longer attended to are freed first; False when short (what was freed stays freed,
        as in vLLM)."""
        p, bs = self.pool, self.block_size
        st = self._state(s)
        if not (must_fit or external or st.shared) and hits == () and None not in st.cached:
            # a running sequence's step within the blocks it holds (decodes: all but one step a block)
            end = s.num_kv + num_new
            if -(-end // bs) <= len(st.tables[self._ref]):
                self._drop_skipped(st, s.num_kv)
                if self.prefix_cache and s.tokens is not None:
                    full = min(end, len(s.tokens)) // bs
                    for g, done in enumerate(st.cached):
                        if full > done:  # type: ignore[operator]  # (not None: running)
                            self._cache(s, st, g, end)
                return True
        hit = hits if isinstance(hits, HybridHit) else None
        hit_blocks = hit.blocks if hit is not None and hit.tokens else [[] for _ in self.groups]
        if load and self._states:
            raise ValueError("an async KV load is not modelled for a recurrent state's groups")
        if external and (s.num_kv or any(st.tables)):
            raise ValueError("external tokens are taken by an empty table only")
        if external and self._states:  # (vLLM allocates the loaded state's block too: not modelled)
            raise ValueError("external tokens are not modelled for a recurrent state's groups")
        local = s.num_kv + (hit.tokens if hit is not None else 0)
        computed = local + external
        self.last_loaded = None
        if must_fit:
            need = sum(self._to_allocate(s, g, st, must_fit, hit_blocks[g], computed, True)
                       for g in range(len(self.groups)))
            if need + watermark > p.num_available:
                self.last_shortfall = need + watermark
                return False
        end = computed + num_new
        self._drop_skipped(st, computed)
        need = sum(self._to_allocate(s, g, st, end, hit_blocks[g], computed, False) for g in range(len(self.groups)))
        if self._states:  # this allocation's checkpoint block (MambaManager._checkpoints)
            st.checkpoint = self._checkpoint_at(s, st, self._states[0], computed, end)
        shared_tails = []
        if num_new and s.num_kv % bs:  # a sample's first write into a tail its siblings share: copy it
            shared_tails = [g for g, t in enumerate(st.tables) if t and t[-1] != NULL and p.refcnt[t[-1]] > 1]
        if need + len(shared_tails) + watermark > p.num_available:
            self.last_shortfall = need + len(shared_tails) + watermark
            return False
        if hit is not None and hit.tokens:
            for g, blocks in enumerate(hit_blocks):  # every group's hits are taken before any new block
                skipped = self.groups[g].skipped_tokens(computed) // bs
                kept = blocks[skipped:]
                held = [b for b in kept if b != NULL]
                p.incref_many(held)
                p.touch(held)
                st.tables[g] = [NULL] * skipped + kept
                st.cached[g] = len(st.tables[g])
            s.num_kv = local
        if external:  # positions a window already left hold no block (vLLM: the null block)
            for g, table in enumerate(st.tables):
                skipped = self.groups[g].skipped_tokens(computed) // bs
                if len(table) < skipped:
                    table.extend([NULL] * (skipped - len(table)))
        for g in shared_tails:
            table = st.tables[g]
            src = table[-1]
            dst = p.alloc()
            p.add_fill(dst, p.fill[src])
            p.decref(src)
            table[-1] = dst
            self.copies.append((src, dst))
            self.cow_copies += 1
        kinds = self.groups
        for g, table in enumerate(st.tables):
            if kinds[g].kind == "mamba":
                if g == self._states[0]:
                    self._alloc_states(st, end)
                continue
            more = cdiv(end, bs) - len(table)
            if more > 0:
                p.alloc_into(table, more)
        if external:  # their KV is in place before the forward
            self.commit(s, external)
        if self.prefix_cache and s.tokens is not None and not load:  # (an async load: cached once it lands)
            for g in range(len(self.groups)):
                self._cache(s, st, g, end)
        return True

    def _cache(self, s: SeqKV, st: GroupTables, g: int, num_tokens: int) -> None:
        """Offer group ``g``'s full blocks of the first ``num_tokens`` tokens to the cache (vLLM
        cache_blocks): every one, or a sliding window's reachable runs only."""
        bs = self.block_size
        assert s.tokens is not None
        start = st.cached[g] or 0
        end = min(num_tokens, len(s.tokens)) // bs
        if start >= end:
            return
        grp, table = self.groups[g], st.tables[g]
        if grp.kind == "mamba":  # the states a later lookup can reach: the prompt's last boundary, the junction
            positions = [j for j in {(s.prompt_len - 1) // bs - 1, st.boundary // bs - 1 if st.boundary else -1}
                         if start <= j < end]
            positions.sort()
        elif grp.kind == "sliding":
            need = cdiv(grp.window - 1, bs)
            marks = np.zeros(end - start, dtype=bool)
            for b in (s.prompt_len - 1, *((st.boundary,) if st.boundary else ())):
                top = b // bs  # the window a lookup ending at this boundary needs
                lo, hi = max(start, top - need), min(end, top)
                if lo < hi:
                    marks[lo - start:hi - start] = True
            positions = [start + int(i) for i in np.flatnonzero(marks)]
        else:
            positions = list(range(start, end))
        st.cached[g] = end
        positions = [j for j in positions if table[j] != NULL]
        if not positions:
            return
        keys = self._keys(s, g, end)
        runs: list[list[int]] = []
        for j in positions:  # runs of consecutive positions, each registered under its parent's key
            if runs and runs[-1][-1] == j - 1:
                runs[-1].append(j)
            else:
                runs.append([j])
        for run in runs:
            a, b = run[0], run[-1] + 1
            self.pool.register_run(table[a:b], keys[a:b], keys[a - 1] if a else self.roots[g],
                                   s.tokens[a * bs:b * bs])
        if grp.kind == "mamba":
            self._step_keys.update(keys[j] for j in positions)

    def commit(self, s: SeqKV, n: int) -> None:
        self.commit_all((s,), (n,))

    def commit_all(self, seqs: Sequence[SeqKV], nums: Sequence[int]) -> None:
        """The step wrote KV for each sequence's next tokens, into every group's blocks."""
        p, bs = self.pool, self.block_size
        fill = p.fill
        live = 0
        for s, n in zip(seqs, nums):
            st = s.groups
            assert st is not None  # (allocated before it is committed)
            start, end = s.num_kv, s.num_kv + n
            tables = st.tables if not self._states else [st.tables[g] for g in self._token_groups]
            if n == 1:  # a decode: one position in every group
                j = start // bs
                for table in tables:
                    b = table[j]
                    if b != NULL:
                        fill[b] += 1
                        live += 1
                s.num_kv = end
                continue
            for table in tables:
                pos = start
                while pos < end:
                    j, off = divmod(pos, bs)
                    take = min(end - pos, bs - off)
                    b = table[j]
                    if b != NULL:
                        fill[b] += take
                        live += take
                    pos += take
            s.num_kv = end
        p.tokens_live += live

    def loaded(self, s: SeqKV) -> None:
        """An async load has landed: every group caches the loaded blocks as allocate_slots would
        have (vLLM _update_waiting_for_remote_kv: cache_blocks per group), and the prompt's last
        token is computed again, in every group that holds its position."""
        st = self._state(s)
        if self.prefix_cache and s.tokens is not None:
            for g in range(len(self.groups)):
                self._cache(s, st, g, s.num_kv)
        s.num_kv -= 1
        j = s.num_kv // self.block_size
        for table in st.tables:
            if j < len(table) and table[j] != NULL:
                self.pool.add_fill(table[j], -1)

    def trim(self, s: SeqKV) -> None:
        """The windows' blocks left behind by the last computed token are freed (vLLM: the connector's
        _connector_finished calls remove_skipped_blocks before it holds the rest)."""
        self._drop_skipped(self._state(s), s.num_kv)

    def group_blocks(self, s: SeqKV, start: int, end: int) -> list[int]:
        st = s.groups
        if st is None:
            return [0] * len(self.groups)
        return [sum(1 for b in table[start:end] if b != NULL) for table in st.tables]

    def free(self, s: SeqKV) -> None:
        """Drop the sequence's references group by group, each tail first (vLLM free)."""
        st = s.groups
        if st is not None:
            for table in st.tables:
                held = [b for b in reversed(table) if b != NULL]
                if held:
                    self.pool.release_all(held)
        s.groups = None
        s.table = []
        s.num_kv = 0
        s.num_registered = 0

    def fork(self, s: SeqKV, child: SeqKV) -> None:
        """The child shares every block of every group (parallel sampling)."""
        st = self._state(s)
        for table in st.tables:
            self.pool.incref_many([b for b in table if b != NULL])
        child.groups = GroupTables([list(t) for t in st.tables], list(st.cached), [None] * len(self.groups),
                                   st.boundary, shared=True)
        st.shared = True
        child.num_kv = s.num_kv

    def take_copies(self) -> list[tuple[int, int]]:
        c, self.copies = self.copies, []
        return c

    def take_tier_ops(self) -> tuple[list[tuple], list[tuple]]:
        return [], []

    def attach_tiers(self, tiers) -> None:
        raise ValueError("prefix-cache tiers are not modelled for a model with several KV cache groups")

    def compact(self, s: SeqKV, keep: np.ndarray, append: int = 0) -> Compaction | None:
        raise ValueError("token eviction is not modelled for a model with several KV cache groups")

    def slots_of(self, s: SeqKV, logical: np.ndarray) -> np.ndarray:
        raise ValueError("a model with several KV cache groups has a table per group, not one")

    def group_tables(self, s: SeqKV) -> list[list[int]]:
        """The sequence's block table of each group (NULL where freed): what a forward reads."""
        return self._state(s).tables


__all__ = ["NULL", "GroupTables", "HybridHit", "HybridKV"]
