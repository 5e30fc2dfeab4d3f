"""The block pool: fixed-size KV blocks, refcounts, the free list and the prefix-cache index.

A block is in exactly one of three states, and the counters follow every transition:
- free: empty, on ``_free`` (a stack; any empty block is as good as another);
- used: refcount > 0, held by one or more block tables;
- cached: refcount 0 but still indexed under its prefix key, held by the cache policy, which picks
  the victim when a block is needed and no free one is left.

With leaves-only eviction (``enable_leaf_eviction``, the radix mode's rule, as SGLang evicts only
leaves of its tree) a cached block that another cached block continues is *held*: refcount 0, not
evictable, until its last such child is evicted. Only a child registered by a sequence holding
that very parent block counts, so every user of a child holds its parent and every held block is
reachable by evicting leaves: held blocks count as available.

With node eviction (``enable_node_eviction``, the radix mode's default, SGLang's rule) the policy is
a kvbench.memory.radix.RadixNodes: blocks registered together form a node, a match ending inside a
node splits it (``split_after``), and eviction frees whole least recently used leaf nodes, the
blocks beyond the shortfall going to the free list.

Prefix keys are the chained block keys of kvbench.trace.tokens. A lookup trusts a key only after the
block's stored tokens and its parent's key match, so a hash collision can never return wrong KV.
All per-block state is in flat lists indexed by block id: no per-block Python objects, O(1) work per
block for alloc, incref, decref and register.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from kvbench.memory.policies import make_policy
from kvbench.memory.policy_base import NEVER, CachePolicy, PoolView

if TYPE_CHECKING:
    from collections.abc import Callable, MutableSequence, Sequence

    from kvbench.memory.radix import RadixNodes


class BlockPool:
    keys_as_arrays = False  # a sequence's keys are a list of ints (the index is a dict of them)

    def __init__(self, num_blocks: int, block_size: int, *, enable_cache: bool = True,
                 policy: str | CachePolicy = "lru", physical: int | None = None, duplicate_keys: bool = False):
        """``physical``: blocks to hold state for, when the caller knows the run can never use more
        than that many (a pool larger than the whole trace): the other ``num_blocks - physical``
        count as free but cost no memory. Ids are < physical. ``duplicate_keys``: a block computed
        under a key that another block caches is cached under it too (vLLM's BlockPool, hash mode)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        physical = num_blocks if physical is None else min(num_blocks, physical)
        self.physical = physical
        self._virtual_free = num_blocks - physical  # free blocks never materialised
        self.block_size = block_size
        self.enable_cache = enable_cache
        num_blocks = physical  # per-block state below
        self.policy = make_policy(policy, physical, self.num_blocks) if isinstance(policy, str) else policy
        self.policy.bind(PoolView(self))  # keys and parents, read at insert and evict
        self.refcnt = [0] * num_blocks
        self.fill = [0] * num_blocks  # tokens whose KV is written in the block
        self.key: list[int | None] = [None] * num_blocks
        self.parent: list[int] = [0] * num_blocks
        # Tokens of registered blocks, to confirm hits. Rows are written on register only.
        self.tokens = np.zeros((num_blocks, block_size), dtype=np.int32) if enable_cache else None
        # Prefix key -> the block a lookup finds. With duplicate_keys, as vLLM's BlockHashToBlockMap
        # (vllm/v1/core/block_pool.py: insert, pop, get_one_block), a block computed again under a
        # cached key (a prompt's last block, which no lookup covers; a prefix recomputed past a miss)
        # is cached under that key too: ``dups`` holds every block of such a key in the order they
        # were cached, the first is the one found, and when it is evicted the next takes the key
        # over. Without it (radix mode, and the policies that are kvbench's own) such a block stays
        # private and is freed at release.
        self.index: dict[int, int] = {}
        self.duplicate_keys = duplicate_keys and enable_cache
        self.dups: dict[int, dict[int, None]] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        # counters (spec §4), kept incrementally
        self.num_used = 0
        self.tokens_live = 0  # sum of fill over used blocks (a shared block counted once)
        self.evictions = 0  # cached blocks evicted (reclaimed for new content, or freed with their node)
        self.clock: float = 0  # logical time for policies (request index or step)
        # called with each cached block reclaimed (the radix tree forgets it)
        self.on_evict: Callable[[int], None] | None = None
        # KV events for a router's index (engine.routing.KVIndex), when a list: (True, keys stored) and
        # (False, keys evicted), in the order they happen; the engine drains it after each step.
        self.events: list | None = None
        # write-back tiers (kvbench.memory.tiers): called with (blocks, keys, parent keys) of the cached
        # blocks about to be evicted, before their keys are forgotten and the blocks reused
        self.spill = None
        # leaves-only eviction (None until enable_leaf_eviction)
        self.kids: list[int] | None = None  # cached children counted against a block
        self.kid_of: list[int] = []  # the block a child is counted against, or -1
        self.held: list[bool] = []
        self.num_held = 0
        self.nodes: RadixNodes | None = None  # node eviction: the RadixNodes policy (None until enable_node_eviction)

    def enable_leaf_eviction(self) -> None:
        n = self.physical
        self.kids, self.kid_of, self.held = [0] * n, [-1] * n, [False] * n

    def enable_node_eviction(self) -> None:
        """Evict whole LRU leaf nodes (SGLang's RadixCache.evict) instead of the policy's blocks."""
        from kvbench.memory.radix import RadixNodes

        self.policy = self.nodes = RadixNodes(self.physical, self.refcnt)

    def split_after(self, b: int) -> None:
        """Node eviction: a match ends at cached block ``b``: make it the tail of its node."""
        if self.nodes is not None:
            self.nodes.split_after(b)

    # -- state ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + self._virtual_free

    @property
    def num_cached(self) -> int:
        return len(self.policy) + self.num_held

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free plus cached ones (held ones after their leaves)."""
        return len(self._free) + self._virtual_free + len(self.policy) + self.num_held

    @property
    def slots_allocated(self) -> int:
        return self.num_used * self.block_size

    # -- transitions ------------------------------------------------------------------------
    def alloc(self) -> int:
        """Take a block for new content (refcount 1). Evicts a cached block when none is free."""
        got: list[int] = []
        self.alloc_into(got, 1)
        return got[0]

    def alloc_into(self, table: MutableSequence[int], n: int) -> None:
        """Append ``n`` newly allocated blocks to ``table`` (refcount 1 each): free blocks first, then
        cached ones the policy evicts. Raises IndexError, changing nothing, when fewer than ``n`` are
        available, and RuntimeError when the materialised blocks run out (``physical``)."""
        free = self._free
        if n > len(free) and self._virtual_free:
            raise RuntimeError(f"the pool's {self.physical:,} materialised blocks were all taken: the bound "
                               "given as `physical` was too small")
        if n > self.num_available:
            raise IndexError(f"no evictable block ({n:,} wanted, {self.num_available:,} free or cached)")
        take = min(n, len(free))
        if take:
            got = free[len(free) - take:]
            del free[len(free) - take:]
            got.reverse()
            refcnt = self.refcnt
            for b in got:
                refcnt[b] = 1
            table.extend(got)
            self.num_used += take
        need = n - take
        while need:  # evict cached blocks for the rest
            index, key, fill, refcnt, on_evict = self.index, self.key, self.fill, self.refcnt, self.on_evict
            k = need if self.kids is None else 1  # leaves-only: each victim may make its parent next
            victims = self.policy.pop_many(k)
            if self.events is not None:  # a key leaves the cache with its last block
                self.events.append((False, self._keys_leaving(victims)))
            if self.spill is not None:
                self.spill(victims, [key[b] for b in victims], [self.parent[b] for b in victims])
            if len(victims) > k:  # node eviction frees whole nodes: the rest of the last one is free
                for b in victims[k:]:
                    if on_evict is not None:
                        on_evict(b)
                    del index[key[b]]  # type: ignore[arg-type]  # a cached block has its key
                    key[b] = None
                    fill[b] = 0
                free.extend(victims[k:])
                self.evictions += len(victims) - k
                del victims[k:]
            if on_evict is None and self.kids is None:  # hash mode: the victims are only forgotten
                for b in victims:
                    self._unindex(b)
                    key[b] = None
                    fill[b] = 0
                    refcnt[b] = 1
                table.extend(victims)
            else:
                for b in victims:
                    if on_evict is not None:
                        on_evict(b)
                    if self.kids is not None:
                        self._leaf_gone(b)
                    del index[key[b]]  # type: ignore[arg-type]  # a cached block has its key
                    key[b] = None
                    fill[b] = 0
                    refcnt[b] = 1
                    table.append(b)
            self.evictions += k
            self.num_used += k
            need -= k

    def _keys_leaving(self, victims: list[int]) -> list[int]:
        """The keys that leave the cache when ``victims`` are evicted in this order: each with the
        last of its blocks."""
        key = cast("list[int]", self.key)  # victims are cached: every one has its key
        if not self.dups:
            return [key[b] for b in victims]
        left: dict[int, int] = {}
        out = []
        for b in victims:
            k = key[b]
            d = self.dups.get(k)
            n = left.get(k, 1 if d is None else len(d)) - 1
            left[k] = n
            if not n:
                out.append(k)
        return out

    def _unindex(self, b: int) -> None:
        """Forget cached block ``b`` under its key: the key's next block in caching order takes it
        over, or the key leaves the index (vLLM: BlockHashToBlockMap.pop)."""
        k: int = self.key[b]  # type: ignore[assignment]  # a cached block has its key
        d = self.dups.get(k) if self.dups else None
        if d is None:
            del self.index[k]
            return
        del d[b]
        self.index[k] = next(iter(d))
        if len(d) == 1:
            del self.dups[k]

    def _leaf_gone(self, b: int) -> None:
        """Leaves-only: evicted ``b`` no longer holds its parent back."""
        p = self.kid_of[b]
        if p < 0:
            return
        self.kid_of[b] = -1
        kids = self.kids
        assert kids is not None  # (leaves-only eviction's)
        kids[p] -= 1
        if not kids[p] and self.held[p]:
            self.held[p] = False
            self.num_held -= 1
            self.policy.unhold(p)

    def incref(self, b: int) -> None:
        """Take another reference to a block; a cached one becomes used again."""
        if self.refcnt[b] == 0:
            if self.kids is not None and self.held[b]:
                self.held[b] = False
                self.num_held -= 1
                self.policy.reuse_held(b)
            else:
                self.policy.reuse(b)
            self.num_used += 1
            self.tokens_live += self.fill[b]
        self.refcnt[b] += 1

    def incref_many(self, blocks) -> None:
        """``incref`` each block, in order."""
        for b in blocks:
            self.incref(b)

    def decref(self, b: int) -> None:
        """Drop a reference. At 0 the block becomes cached (if registered) or free."""
        self.release_all((b,))

    def release_all(self, blocks) -> None:
        """``decref`` every block of an iterable, in its order: the blocks whose refcount falls to 0
        become cached (registered: handed to the policy in this order) or free."""
        refcnt, fill, key, free = self.refcnt, self.fill, self.key, self._free
        cached: list[int] = []
        used = live = 0
        for b in blocks:
            r = refcnt[b] - 1
            refcnt[b] = r
            if r:
                continue
            used += 1
            live += fill[b]
            if key[b] is not None:
                cached.append(b)
            else:
                fill[b] = 0
                free.append(b)
        self.num_used -= used
        self.tokens_live -= live
        if self.kids is None:
            self.policy.release_many(cached)
            return
        kids, held, policy = self.kids, self.held, self.policy
        for b in cached:  # leaves-only: a cached block with a cached child is held, not evictable
            if kids[b]:
                held[b] = True
                self.num_held += 1
                policy.hold(b)
            else:
                policy.release(b)

    def add_fill(self, b: int, n: int) -> None:
        """``n`` more tokens of KV were written into used block ``b``."""
        self.fill[b] += n
        self.tokens_live += n

    def add_fill_many(self, blocks: list[int], n: int) -> None:
        """``add_fill(b, n)`` for each of these blocks."""
        fill = self.fill
        for b in blocks:
            fill[b] += n
        self.tokens_live += n * len(blocks)

    # -- prefix cache -----------------------------------------------------------------------
    def register(self, b: int, key: int, parent_key: int, tokens: np.ndarray,
                 next_use: int = NEVER, parent_block: int = -1, extend: bool = False) -> bool:
        """Index one computed block under ``key`` (``register_run`` of one; ``tokens``: its row of
        block_size ids). False when the key is already cached (another sequence computed the same
        block first): this block then stays private."""
        return len(self.register_run([b], [key], parent_key, tokens, None if next_use == NEVER else [next_use],
                                     parent_block, extend)) == 1

    def _count_kid(self, b: int, parent_block: int, parent_key: int) -> None:
        """Leaves-only: a new cached child holds its parent back when the sequence that registers
        it holds the cached parent itself (not a private copy of the same content)."""
        if parent_block >= 0 and self.key[parent_block] == parent_key:
            kids = self.kids
            assert kids is not None  # (leaves-only eviction's)
            kids[parent_block] += 1
            self.kid_of[b] = parent_block

    def register_run(self, blocks: Sequence[int], keys: list[int], parent_key: int, tokens: np.ndarray,
                     next_uses=None, parent_block: int = -1, extend: bool = False) -> list[int]:
        """Index consecutive computed blocks (``tokens`` holds exactly their ids, in order);
        ``keys[i]`` is ``blocks[i]``'s key, ``parent_key`` the key before the first and
        ``parent_block`` the sequence's block before the first (leaves-only and node eviction). A
        block whose key another block caches already is cached beside it (``duplicate_keys``) or
        stays private. Node eviction: the blocks join one node, which continues ``parent_block``'s
        with ``extend`` (RadixNodes.link). Returns the positions in ``blocks`` whose key is new to
        the cache."""
        if not self.enable_cache or not blocks:
            return []
        index, key_of, parent_of = self.index, self.key, self.parent
        if self.kids is None and self.nodes is None:  # hash mode: no tree to keep
            return self._register_flat(blocks, keys, parent_key, tokens, next_uses)
        rows = []
        again: list[int] = []  # rows whose key another block caches: this copy stays private
        kids, nodes = self.kids, self.nodes  # radix: parent links to keep
        links: list[tuple[int, int]] = []  # (block, counted parent) to link into nodes
        for i, b in enumerate(blocks):
            k = keys[i]
            if key_of[b] is None:
                if k in index:
                    if nodes is not None and not again and (parent_block < 0 or key_of[parent_block] == parent_key):
                        nodes.reinsert(index[k], parent_block)  # SGLang's insert walks the cached copy
                    again.append(i)
                    parent_key, parent_block = k, b
                    continue
                index[k] = b
                key_of[b] = k
                parent_of[b] = parent_key
                rows.append(i)
                if kids is not None:
                    self._count_kid(b, parent_block, parent_key)
                elif nodes is not None:  # counted parent: the sequence holds that very cached block
                    links.append((b, parent_block if parent_block >= 0 and key_of[parent_block] == parent_key
                                  else -1))
            parent_key = k
            parent_block = b
        if nodes is not None and links:
            nodes.link_run(links, extend)
        self._indexed(blocks, keys, tokens, next_uses, rows, again)
        return rows

    def _register_flat(self, blocks: Sequence[int], keys: list[int], parent_key: int, tokens: np.ndarray,
                       next_uses) -> list[int]:
        """``register_run`` without radix links: the same rule, one pass of comprehensions. Keys are
        chained, so no key repeats within a run. -> the positions whose key is new to the cache."""
        index, key_of, parent_of = self.index, self.key, self.parent
        parents = [parent_key, *keys[:-1]]
        fresh = [i for i, b in enumerate(blocks) if key_of[b] is None]
        again = [i for i in fresh if keys[i] in index]
        new = [i for i in fresh if keys[i] not in index] if again else fresh
        rows = fresh if self.duplicate_keys else new
        for i in new:
            b, k = blocks[i], keys[i]
            index[k] = b
            key_of[b] = k
            parent_of[b] = parents[i]
        if again and self.duplicate_keys:  # cached beside the block that holds the key
            dups = self.dups
            for i in again:
                b, k = blocks[i], keys[i]
                d = dups.get(k)
                if d is None:
                    d = dups[k] = {index[k]: None}
                d[b] = None
                key_of[b] = k
                parent_of[b] = parents[i]
        self._indexed(blocks, keys, tokens, next_uses, rows, [] if self.duplicate_keys else again, new)
        return new

    def _indexed(self, blocks, keys, tokens, next_uses, rows, again, new=None) -> None:
        """A registered run's rows now cached (the policy, the token rows; KV events for ``new``,
        the rows whose key is new to the cache), and the rows whose key another block caches and
        that stay private (the policy hears they were computed again)."""
        if again and next_uses is not None:
            self.policy.on_recompute_many([self.index[keys[i]] for i in again], self.clock,
                                          [int(next_uses[i]) for i in again])
        if not rows:
            return
        if self.events is not None and (rows if new is None else new):
            self.events.append((True, [keys[i] for i in (rows if new is None else new)]))
        self.policy.on_insert_many([blocks[i] for i in rows] if len(rows) < len(blocks) else blocks, self.clock,
                                   None if next_uses is None else [int(next_uses[i]) for i in rows])
        token_rows = self.tokens
        assert token_rows is not None  # (registering is the prefix cache's)
        t = tokens.reshape(-1, self.block_size)
        if len(rows) == len(blocks):
            token_rows[blocks] = t
        else:
            token_rows[[blocks[i] for i in rows]] = t[rows]

    def match(self, keys: list[int], tokens: np.ndarray, n_max: int, parent_key: int) -> list[int]:
        """The blocks caching the longest run of ``keys[:n_max]``, confirmed against tokens.

        ``tokens`` must hold at least ``n_max * block_size`` ids. Takes no references.
        """
        if not self.enable_cache or n_max <= 0:
            return []
        index, parent_of = self.index, self.parent
        hits: list[int] = []
        parent = parent_key
        for j in range(n_max):
            b = index.get(keys[j])
            if b is None or parent_of[b] != parent:
                break
            hits.append(b)
            parent = keys[j]
        if hits:
            bs = self.block_size
            n = len(hits)
            assert self.tokens is not None  # (enable_cache)
            same = (self.tokens[hits] == tokens[: n * bs].reshape(n, bs)).all(axis=1)
            if not same.all():
                hits = hits[: int(np.argmin(same))]
        return hits

    def touch(self, blocks: Sequence[int], next_uses=None) -> None:
        """Tell the policy these cached blocks were just used (hit)."""
        nus = None if next_uses is None else [int(nu) for nu in next_uses]
        self.policy.on_use_many(blocks, self.clock, nus)

    # -- checks -----------------------------------------------------------------------------
    def dup_chains(self) -> dict[int, list[int]]:
        """Keys cached by several blocks -> those blocks, the one found first (for tests)."""
        return {k: list(d) for k, d in self.dups.items()}

    def recount(self) -> dict:
        """Recompute the counters from scratch (for tests; O(num_blocks))."""
        used = [b for b in range(self.physical) if self.refcnt[b] > 0]
        cached = [b for b in range(self.physical) if self.refcnt[b] == 0 and self.key[b] is not None]
        out = {"num_used": len(used), "tokens_live": sum(self.fill[b] for b in used),
               "num_cached": len(cached), "num_free": self.num_blocks - len(used) - len(cached)}
        by_key: dict[int, list[int]] = {}  # every block of a key, the index finding the first cached
        for b in range(self.physical):
            k = self.key[b]
            if k is not None:
                by_key.setdefault(k, []).append(b)
        assert set(by_key) == set(self.index), "the index is not the keyed blocks"
        for k, blocks in by_key.items():
            order = list(self.dups[k]) if k in self.dups else [self.index[k]]
            assert sorted(blocks) == sorted(order) and self.index[k] == order[0], "a key's blocks drifted"
            assert len(order) == 1 or self.duplicate_keys, "a key cached twice"
        if self.kids is not None:  # leaves-only: children counted right, held = cached with a child
            kids = [0] * self.physical
            for b in range(self.physical):
                p = self.kid_of[b]
                if p >= 0:
                    kids[p] += 1
                    assert self.key[b] is not None and self.key[p] == self.parent[b], "a stale child edge"
            assert kids == self.kids, "child counts drifted"
            held = [b for b in cached if kids[b]]
            assert held == [b for b in range(self.physical) if self.held[b]], "held set drifted"
            assert len(held) == self.num_held and len(self.policy) == len(cached) - len(held)
            out["num_held"] = len(held)
        if self.nodes is not None:  # node eviction: the tree, its nodes and the LRU queue
            self.nodes.check([b for b in range(self.physical) if self.key[b] is not None])
        return out
