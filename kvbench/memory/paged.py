"""Paged KV: per-sequence block tables over a BlockPool, with prefix hits, fork and copy-on-write.

The scheduler drives one ``SeqKV`` per running sequence through four calls:
``lookup`` (cached prefix blocks, no references taken) -> ``allocate`` (take the hits, then blocks
for the tokens about to be computed, and register in the prefix cache every block those tokens
fill; False when memory is short) -> ``commit`` (the step wrote KV for n more tokens: fill
counters) -> ``free``. Blocks are registered when allocated, before their KV is written, as vLLM v1
does (``KVCacheManager.allocate_slots`` -> ``cache_blocks``): a request scheduled later in the same
step hits them, and the executor writes every token's KV before any attention reads it.
``fork`` shares every block of a sequence by refcount (parallel sampling); the first append into a
shared partial tail copies it (copy-on-write), and the (src, dst) copy is queued in ``copies`` for the
executor to perform before the step's forward.

Token eviction (kvbench.eviction.evictor) shrinks a sequence with ``compact``: the kept tokens are packed into
slots [0, n) so whole blocks are freed. Once compacted, slot i no longer holds logical position i:
``num_kv`` counts slots (what memory holds) and ``dropped`` the computed tokens no longer in a slot,
so ``num_kv + dropped`` is what the sequence has computed. A block shared with another sequence or
indexed by the prefix cache is never written: when compaction would change one, its kept tokens
are copied out into a private block and the sequence drops its reference (token-level copy-on-write);
a compacted sequence registers nothing more in the prefix cache, since its slots are no longer a
prefix of its tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvbench.memory.array_pool import ArrayBlockPool
from kvbench.memory.block_pool import BlockPool
from kvbench.memory.contracts import BlockPoolAPI, Compaction, KVEvent, KVStats, SeqKV
from kvbench.memory.policy_base import NEVER
from kvbench.memory.radix import PARTIAL_SALT, RadixChildren
from kvbench.trace.keys import lookup_blocks
from kvbench.trace.tokens import ROOT_KEY, block_keys

if TYPE_CHECKING:
    from kvbench.memory.tiers import TierMatch, Tiers

RADIX_EVICTIONS = ("node", "block")  # --radix-eviction


class PagedKV:
    """The paged layout: a KVManager (kvbench.memory.contracts) over a block pool."""

    layout = "paged"
    can_compact = True  # token eviction packs kept tokens and frees whole blocks
    watermark_frac = 0.01  # keep this share of blocks free at admission, for running sequences to grow
    compiled_pool = True  # ArrayBlockPool where it serves (tests set False to replay on BlockPool)

    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = True,
                 cache_policy: str = "lru", prefix_mode: str = "hash", radix_eviction: str = "node",
                 radix_partial: bool = True, physical: int | None = None, compiled: bool | None = None):
        """``radix_eviction`` (radix mode): ``node`` evicts whole LRU leaf nodes, as SGLang does;
        ``block`` evicts leaf blocks by ``cache_policy``. ``radix_partial`` (radix mode): also
        serve a prefix that ends inside a cached block (a copy) and keep finished partial tails;
        without it radix mode matches whole blocks only, as SGLang with page size = block size.
        ``physical``: see BlockPool. ``compiled``: hash mode (or no prefix cache) under lru runs on
        ArrayBlockPool, the compiled twin of BlockPool; False keeps BlockPool (the reference); None:
        ``compiled_pool``'s choice."""
        if prefix_mode not in ("hash", "radix"):
            raise ValueError(f"unknown prefix mode {prefix_mode!r} (choose from hash, radix)")
        if radix_eviction not in RADIX_EVICTIONS:
            raise ValueError(f"unknown radix eviction {radix_eviction!r} (choose from {', '.join(RADIX_EVICTIONS)})")
        radix = prefix_cache and prefix_mode == "radix"
        if radix and radix_eviction == "node" and cache_policy != "lru":
            raise ValueError(f"node eviction orders nodes by recency (SGLang's lru); cache policy "
                             f"{cache_policy!r} needs block eviction")
        self.pool: BlockPoolAPI
        self.tree: BlockPool | None = None  # radix mode: the pool itself, as the BlockPool that keeps the tree
        if (self.compiled_pool if compiled is None else compiled) and not radix and cache_policy == "lru":
            self.pool = ArrayBlockPool(num_blocks, block_size, enable_cache=prefix_cache, physical=physical)
        else:
            # hash mode under lru is vLLM's BlockPool: a key recomputed while cached is cached twice
            self.pool = pool = BlockPool(num_blocks, block_size, enable_cache=prefix_cache, policy=cache_policy,
                                         physical=physical, duplicate_keys=not radix and cache_policy == "lru")
            if radix:
                self.tree = pool
        # a sequence's table, given at its first allocation: the compiled pool's reads in place (int32)
        self.new_table = self.pool.new_table if isinstance(self.pool, ArrayBlockPool) else list
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.radix_partial = radix and radix_partial
        self.radix = RadixChildren() if self.radix_partial else None  # children by first token
        if self.tree is not None:  # radix
            if self.radix is not None:
                self.tree.on_evict = self.radix.remove
            if radix_eviction == "node":  # SGLang evicts whole leaf nodes of its tree
                self.tree.enable_node_eviction()
            else:  # ... leaf blocks only
                self.tree.enable_leaf_eviction()
        self._pinned: list[int] = []  # sources of pending partial-hit copies, held until handed over
        self.partial_hit_tokens = 0  # radix: tokens served by copying a partly matching block
        self.copies: list[tuple[int, int]] = []  # copy-on-write copies not yet handed to an executor
        self.cow_copies = 0
        self.last_shortfall = 0  # after a failed allocate: the blocks it would have needed free (at least)
        self.tiers: Tiers | None = None  # the tiers behind the pool (attach_tiers)
        self.last_loaded: TierMatch | None = None  # after a successful allocate: the TierMatch it loaded, or None
        # admission_floor exact for an empty table: the compiled pool's hash cache, nothing behind it
        self.fresh_floor = isinstance(self.pool, ArrayBlockPool) and prefix_cache and self.radix is None

    def attach_tiers(self, tiers: Tiers) -> None:
        """Put a chain of tiers (kvbench.memory.tiers.Tiers) behind the pool: lookups continue into
        it, computed blocks are stored write-through, or evicted ones write-back. Hash mode only."""
        if not self.prefix_cache or self.tree is not None:
            raise ValueError("prefix-cache tiers need the hash prefix cache (--prefix-mode hash)")
        if self.pool.num_used or self.pool.num_cached:
            raise ValueError("attach tiers to an empty pool")  # sequences' keys change type with them
        self.tiers = tiers
        self.fresh_floor = False  # (a lookup continues into the tiers)
        if not tiers.write_through and tiers.own:
            self.pool.spill = tiers.evicted

    # -- what the scheduler reads ------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def admission_floor(self, s: SeqKV, num_tokens: int, budget: int, full: bool = True) -> tuple[int, int]:
        """(a lower bound on the blocks admitting ``s`` takes, the blocks available): a cheap test that
        spares the prefix lookup and allocation while memory is plainly short, the bound assuming every
        block the lookup may serve is hit.
        ``full``: the whole sequence must fit (full-prompt admission), else its first chunk.

        On the compiled pool (hash mode, no tiers) an empty table's floor is exact: its prefix hits
        matched, the blocks ``allocate`` would check for (one compiled call: a queue's head is retried
        every step while memory is short — Mooncake: ~55,000 refusals, one lookup and allocate each)."""
        bs = self.block_size
        if self.fresh_floor and s.tokens is not None and not s.table and not s.num_kv:
            n_max = min(lookup_blocks(num_tokens, bs), len(s.tokens) // bs)
            pool = self.pool
            assert isinstance(pool, ArrayBlockPool)  # (fresh_floor's)
            return (pool.fresh_need(self._keys(s, n_max), s.tokens, n_max, ROOT_KEY, num_tokens, budget, full),
                    pool.num_available)
        most_hit = lookup_blocks(num_tokens, bs) * bs if self.prefix_cache else 0
        tokens = num_tokens - most_hit if full else min(budget, num_tokens - most_hit)
        return -(-tokens // bs), self.pool.num_available

    def stats(self) -> KVStats:
        p = self.pool
        return KVStats(p.num_used, p.num_cached, p.num_free, p.num_used * self.block_size, p.tokens_live)

    @property
    def cache_evictions(self) -> int:
        return self.pool.evictions

    aligned_split = False  # no recurrent state: a chunk is never cut (KVManager.split)

    def split(self, s: SeqKV, computed: int, num_new: int) -> int:
        return num_new

    def new_step(self) -> None:
        pass

    def set_clock(self, now: float) -> None:
        self.pool.clock = now
        if self.tiers is not None:
            self.tiers.clock = now

    def enable_events(self) -> None:
        if self.prefix_cache:
            self.pool.events = []

    def take_events(self) -> list[KVEvent]:
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    # -- prefix cache ------------------------------------------------------------------------
    @property
    def keys_as_arrays(self) -> bool:
        """A sequence's keys are a uint64 array (the compiled pool's), not a list of ints (BlockPool's
        dict, and the tiers', take ints)."""
        return self.pool.keys_as_arrays and self.tiers is None

    def _keys(self, s: SeqKV, n_blocks: int):
        """The chained keys of the sequence's first ``n_blocks`` full blocks (``n_blocks`` <=
        len(tokens) // block_size), computed on first need: a sequence arrives with its prompt's keys
        and extends them over its generated tokens as it decodes. A list of ints, or a uint64 array
        (``keys_as_arrays``)."""
        keys = s.keys
        if keys is None:
            keys = s.keys = np.zeros(0, dtype=np.uint64) if self.keys_as_arrays else []
        have = len(keys)
        if have < n_blocks:
            bs, tokens = self.block_size, s.tokens
            assert tokens is not None  # (keys are those of known tokens)
            total = len(tokens) // bs  # every block of known tokens at once: one call per sequence
            as_array = not isinstance(keys, list)
            more = block_keys(tokens[have * bs:total * bs], bs, total - have, int(keys[-1]) if have else ROOT_KEY,
                              as_array)
            if as_array:
                keys = s.keys = np.concatenate([keys, more]) if have else more
            else:
                keys.extend(more)
        return keys

    def lookup(self, s: SeqKV, num_tokens: int) -> list[int]:
        """Blocks caching the longest prefix of the sequence's first ``num_tokens`` tokens, never
        the block holding the last of them (its KV must be computed to sample the next token)."""
        s.partial_block, s.partial_len = -1, 0
        s.tier_match = None
        if not self.prefix_cache or s.tokens is None:
            return []
        bs = self.block_size
        n_max = min(lookup_blocks(num_tokens, bs), len(s.tokens) // bs)
        hits = self.pool.match(self._keys(s, n_max), s.tokens, n_max, ROOT_KEY) if n_max > 0 else []
        if self.radix is not None:  # radix: extend the match into the next block, token by token
            pos = len(hits) * bs
            want = s.tokens[pos:min(pos + bs, num_tokens - 1, len(s.tokens))]
            parent = s.keys[len(hits) - 1] if hits else ROOT_KEY
            rows = self.pool.tokens
            assert rows is not None  # (the prefix cache's)
            s.partial_block, s.partial_len = self.radix.best(parent, want, rows, self.pool.fill)
        elif self.tiers and len(hits) < n_max:  # the continuation, in the tiers behind the pool
            s.tier_match = self.tiers.match(s.keys, len(hits), n_max, s.keys[len(hits) - 1] if hits else ROOT_KEY,
                                            bs, num_tokens)
        return hits

    def probe_cached_tokens(self, s: SeqKV, num_tokens: int) -> int:
        """Tokens of the sequence's first ``num_tokens`` the pool caches in whole blocks, changing
        nothing (vLLM: KVCacheManager.get_num_cached_tokens, the last token's block never counted)."""
        if not self.prefix_cache or s.tokens is None:
            return 0
        bs = self.block_size
        n_max = min(lookup_blocks(num_tokens, bs), len(s.tokens) // bs)
        return len(self.pool.match(self._keys(s, n_max), s.tokens, n_max, ROOT_KEY)) * bs if n_max > 0 else 0

    @property
    def usage(self) -> float:
        """Blocks held by sequences / the pool's blocks (vLLM: BlockPool.get_usage)."""
        return self.pool.num_used / self.num_blocks

    def num_cached_tokens(self, s: SeqKV, hits: list[int]) -> int:
        """Tokens the last ``lookup`` serves from cache: whole blocks (the pool's, then the tiers'),
        plus a radix partial block."""
        m = s.tier_match
        return (len(hits) + (len(m) if m else 0)) * self.block_size + s.partial_len

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, s: SeqKV, num_new: int, hits: Sequence[int] = (), watermark: int = 0,
                 must_fit: int = 0, forks: int = 0, external: int = 0,
                 load: bool = False) -> bool:
        """Make the table cover ``num_kv + len(hits)*block_size + num_new`` tokens and register in the
        prefix cache the blocks those tokens fill.

        ``hits`` (from ``lookup``, only for an empty table) are taken first and count as computed; so
        do the blocks the lookup found in the tiers, loaded into fresh blocks after them.
        ``must_fit``: tokens the whole sequence needs, all of which must fit now (vLLM's
        ``full_sequence_must_fit`` admission gate) though only ``num_new`` are allocated. Returns
        False, changing nothing, when fewer than ``watermark`` blocks would remain. ``forks``: samples
        the sequence will fork; they share its blocks, so they need none now. ``external`` (an empty
        table only): tokens after the hits whose KV was computed elsewhere (a KV connector's load, vLLM
        ``allocate_slots``' num_external_computed_tokens): their blocks are taken, hold KV at once and
        are registered like computed ones -- unless ``load`` (an async load: vLLM's
        delay_cache_blocks), when they are registered by ``loaded``, once the KV has arrived.
        """
        p, bs = self.pool, self.block_size
        table = s.table
        if table and not hits and not must_fit:  # fast path (every decode step): room in an unshared tail
            total = s.num_kv + num_new
            if total <= len(table) * bs and (s.num_kv % bs == 0 or num_new == 0 or p.refcnt[table[-1]] == 1):
                if total // bs > s.num_registered:
                    self._register_upto(s, total, num_new == 1)
                return True
            if num_new == 1 and s.num_kv == len(table) * bs and p.num_available > watermark:
                p.alloc_into(table, 1)  # a decode into a new block (the rest below, with nothing to add)
                if total // bs > s.num_registered:  # (a block of one token is full at once)
                    self._register_upto(s, total, True)
                return True
        elif not table and not s.num_kv and -(-(num_new + external) // bs) + watermark > p.num_available:
            # an admission short whatever its hits (the head of the queue, retried every step while
            # memory is short): a fresh table needs at least the new tokens' blocks, the hits' apart
            self.last_loaded = None
            self.last_shortfall = -(-(num_new + external) // bs) + watermark
            return False
        if external and (table or s.num_kv):
            raise ValueError("external tokens are taken by an empty table only")
        n_hit = len(hits)
        fresh = not table and s.num_kv == 0
        part = s.partial_len if fresh else 0  # radix: tokens copied from a partly matching block
        m = s.tier_match if fresh else None
        n_load = len(m) if m else 0  # blocks loaded from the tiers
        self.last_loaded = None
        have = len(s.table) + n_hit
        total = s.num_kv + (n_hit + n_load) * bs + part + external + num_new
        need = max(0, -(-total // bs) - have)
        tail_shared = (num_new > 0 and s.num_kv % bs != 0 and n_hit == 0
                       and p.refcnt[s.table[-1]] > 1)
        # cached hits with no holder leave the evictable set when taken
        revived = list(map(p.refcnt.__getitem__, hits)).count(0) if n_hit else 0
        if part and p.refcnt[s.partial_block] == 0:
            revived += 1
        extra = need + tail_shared + revived
        # the whole sequence must fit: every block it will hold beyond the hits (and the partial copy)
        check = max(extra, max(0, -(-must_fit // bs) - have) + tail_shared + revived) if must_fit else extra
        if check > p.num_available - watermark:
            self.last_shortfall = check + watermark
            return False
        if fresh:
            s.table = self.new_table()
        if n_hit:
            assert not s.table and s.num_kv == 0, "hits are only taken by an empty table"
            p.incref_many(hits)
            nodes = self.tree.nodes if self.tree is not None else None
            if nodes is not None:  # node eviction: the match ends here, and leaves a node
                down = nodes.down  # wherever the next hit is not the node's next block (a run
                for a, b in zip(hits, hits[1:]):  # registered after a private copy hangs apart)
                    if down[a] >= 0 and down[a] != b:
                        nodes.split_after(a)
                nodes.split_after(hits[-1])
            p.touch(hits, None if s.next_use is None else s.next_use[:n_hit])
            s.table.extend(hits)
            s.num_kv = n_hit * bs
            s.num_registered = n_hit
        if tail_shared:
            src = s.table[-1]
            dst = p.alloc()
            p.add_fill(dst, p.fill[src])
            p.decref(src)
            s.table[-1] = dst
            self.copies.append((src, dst))
            self.cow_copies += 1
        if n_load:  # the tier slots read are pinned before any eviction this allocation makes
            assert m is not None and self.tiers is not None  # (the lookup's hits in the tiers)
            self.tiers.pin(m, None if s.next_use is None else s.next_use[n_hit:n_hit + n_load])
        if part:  # pin the source until the copy is handed to the executor (take_copies)
            assert self.tree is not None  # (a partial hit is radix mode's)
            self.tree.incref(s.partial_block)
            self.tree.split_after(s.partial_block)  # node eviction: held alone, its node is itself
            self._pinned.append(s.partial_block)
        if need:
            p.alloc_into(s.table, need)
        if part:
            dst = s.table[n_hit]
            p.add_fill(dst, part)
            self.copies.append((s.partial_block, dst))
            self.partial_hit_tokens += part
            s.num_kv += part
            s.partial_block, s.partial_len = -1, 0
        if n_load:  # loaded blocks hold their KV before the forward: computed, registered, not re-stored
            loaded = s.table[n_hit:n_hit + n_load]
            for b in loaded:
                p.add_fill(b, bs)
            assert m is not None and self.tiers is not None
            self.tiers.loads(m, loaded)
            s.num_kv += n_load * bs
            self._register(s, n_hit + n_load, through=False)
            self.last_loaded = m
        if external:  # their KV is in place before the forward: computed, registered below
            self.commit(s, external)
        if m is not None:
            assert self.tiers is not None
            self.tiers.declined_tokens += m.declined * bs
        s.tier_match = None
        end = s.num_kv + num_new
        if end // bs > s.num_registered and not load:
            self._register_upto(s, end, num_new == 1 and not fresh)
        return True

    def loaded(self, s: SeqKV) -> None:
        """The async load of ``s``'s prompt has ended: its blocks are cached (vLLM
        _update_waiting_for_remote_kv: cache_blocks up to the computed tokens), and its last token is
        computed again by its next step, which samples from it (num_computed_tokens - 1)."""
        self._register_upto(s, s.num_kv)
        s.num_kv -= 1
        self.pool.add_fill(s.table[s.num_kv // self.block_size], -1)

    def trim(self, s: SeqKV) -> None:
        """(One full-attention table: every block stays attended.)"""

    def group_blocks(self, s: SeqKV, start: int, end: int) -> list[int]:
        return [max(0, min(end, len(s.table)) - start)]

    def commit(self, s: SeqKV, n: int) -> None:
        """The step wrote KV for the next ``n`` tokens of the sequence (its blocks were registered
        when allocated)."""
        self.commit_all((s,), (n,))

    def commit_all(self, seqs, nums) -> None:
        """``commit`` each (sequence, tokens) of a step: one call a step, not one a sequence (the
        hot path)."""
        p, bs = self.pool, self.block_size
        fill = p.fill
        live = 0  # tokens written here (the pool counts those of whole blocks it fills)
        for s, n in zip(seqs, nums):
            start = s.num_kv
            if n == 1:  # decode
                fill[s.table[start // bs]] += 1
                live += 1
            else:  # a prefill chunk: the rest of a partial block, whole blocks, a partial one
                table, end = s.table, start + n
                j, off = divmod(start, bs)
                if off:
                    take = min(n, bs - off)
                    fill[table[j]] += take
                    start += take
                    j += 1
                whole = (end - start) // bs
                if whole:
                    p.add_fill_many(table[j:j + whole], bs)
                if end - start > whole * bs:
                    fill[table[j + whole]] += end - start - whole * bs
                live += n - whole * bs
            s.num_kv += n
        p.tokens_live += live

    def _register_upto(self, s: SeqKV, end: int, decode: bool = False) -> None:
        """Register the full blocks of the sequence's first ``end`` tokens not registered yet, where
        their tokens are known: vLLM's ``cache_blocks(request, num_computed + num_new)``.

        Node eviction groups the blocks into radix nodes as SGLang inserts them: a prefill chunk's
        blocks form a node (SGLang inserts the prompt at each chunk's end), and the blocks a
        sequence's decode steps (``decode``: one token) register form one node, grown block by block
        (SGLang inserts the output at finish, split from the prompt's pages)."""
        if not self.prefix_cache or s.tokens is None or s.compacted:
            return
        full = min(end, len(s.tokens)) // self.block_size
        if full > s.num_registered:
            self._register(s, full, decode)

    def _register(self, s: SeqKV, full: int, decode: bool = False, through: bool = True) -> None:
        """Register blocks [num_registered, full); ``through``: they are computed (not loaded from a
        tier), so write-through tiers store the ones the pool indexes."""
        bs, a, tokens = self.block_size, s.num_registered, s.tokens
        assert tokens is not None  # (blocks are registered under their tokens' keys)
        keys = self._keys(s, full)
        nu = None
        if s.next_use is not None:  # blocks past the ones a later request looks up are never used
            nu = s.next_use[a:full]
            if len(nu) < full - a:
                nu = np.concatenate([nu, np.full(full - a - len(nu), NEVER, dtype=np.int64)])
        parent = s.table[a - 1] if a else -1
        extend = False
        if self.tree is not None and self.tree.nodes is not None:  # decode steps grow the node they began
            extend = decode and parent >= 0 and parent == s.open_block
            s.open_block = s.table[full - 1] if decode else -1
        fresh = self.pool.register_run(s.table[a:full], keys[a:full], keys[a - 1] if a else ROOT_KEY,
                                       tokens[a * bs:full * bs], nu, parent, extend)
        s.num_registered = full
        tiers = self.tiers
        if tiers is not None and through and tiers.stores:
            table = s.table
            new = [a + i for i in fresh]  # keys new to the pool: a copy of a cached block is stored once
            if new:
                tiers.stored([table[j] for j in new], [keys[j] for j in new],
                             [keys[j - 1] if j else ROOT_KEY for j in new],
                             None if nu is None else [nu[j - a] for j in new])
        if self.radix is not None:
            key_of, table, add = self.pool.key, s.table, self.radix.add
            firsts = tokens[a * bs:full * bs:bs].tolist()
            for j in range(a, full):
                b = table[j]
                if key_of[b] == keys[j]:
                    add(b, keys[j - 1] if j else ROOT_KEY, firsts[j - a])

    def _register_partial_tail(self, s: SeqKV) -> None:
        """Radix: leave a finished or preempted sequence's partial last block in the tree, when its
        tokens are known (prompt or named answer) and nobody else holds it."""
        bs, p, radix, tokens = self.block_size, self.tree, self.radix, s.tokens
        assert p is not None and radix is not None and tokens is not None  # (radix_partial, the tokens known)
        j, f = divmod(s.num_kv, bs)
        if not f or j >= len(s.table) or j * bs + f > len(tokens):
            return
        b = s.table[j]
        if p.refcnt[b] != 1 or p.key[b] is not None:
            return
        parent = self._keys(s, j)[j - 1] if j else ROOT_KEY
        toks = tokens[j * bs:j * bs + f]
        row = np.zeros(bs, dtype=np.int32)
        row[:f] = toks
        key = xxhash.xxh3_64_intdigest(toks.tobytes(), parent) ^ PARTIAL_SALT
        if p.register(b, key, parent, row, parent_block=s.table[j - 1] if j else -1, extend=True):
            radix.add(b, parent, toks[0])

    def free(self, s: SeqKV) -> None:
        """Drop the sequence's references, tail first so its last blocks are evicted first."""
        self._check_unpinned()
        if self.radix_partial and s.tokens is not None and not s.compacted:
            self._register_partial_tail(s)
        self.pool.release_all(s.table[::-1])
        s.table = []
        s.num_kv = 0
        s.num_registered = 0
        s.open_block = -1
        s.dropped = 0
        s.compacted = False

    def _check_unpinned(self) -> None:
        """A pinned partial-hit source is referenced without its parent; dropping references before
        ``take_copies`` could leave that parent held but unreachable (leaves-only eviction)."""
        if self._pinned and self.tree is not None:  # (radix mode: leaves-only or node eviction)
            raise RuntimeError("take_copies() must follow a partial-hit allocation before free or compact")

    def fork(self, s: SeqKV, child: SeqKV) -> None:
        """Make ``child`` (an empty SeqKV) share every block, full and partial, of ``s``: sharing takes
        no new block."""
        self.pool.incref_many(s.table)
        child.table = s.table[:]
        child.open_block = -1  # a sample's own decode blocks start a node of its own
        child.num_kv = s.num_kv
        child.num_registered = s.num_registered
        child.dropped = s.dropped
        child.compacted = s.compacted

    # -- token eviction ----------------------------------------------------------------------
    def slots_of(self, s: SeqKV, logical: np.ndarray) -> np.ndarray:
        """Pool slots of the sequence's logical slots. int64 [n] -> int64 [n]."""
        bs = self.block_size
        tbl = np.asarray(s.table, dtype=np.int64)
        return tbl[logical // bs] * bs + logical % bs

    def _frozen(self, b: int) -> bool:
        """A block this sequence may not write: shared, or indexed by the prefix cache."""
        return self.pool.refcnt[b] > 1 or self.pool.key[b] is not None

    def compact(self, s: SeqKV, keep: np.ndarray, append: int = 0) -> Compaction | None:
        """Keep the sequence's slots ``keep`` (logical, sorted, unique) and reserve ``append`` more:
        afterwards it holds n = len(keep) + append slots, [0, n), in ceil(n / block_size) blocks.

        Kept tokens stay where they are when their block stays; the others (in blocks past the new
        end, or in frozen blocks that would change) fill the holes, so a step moves about as many
        slots as it evicts. A frozen block stays only if it keeps all its tokens and nothing is
        written into it; otherwise a new private block replaces it. Returns None, changing nothing,
        when those new blocks are not available.
        """
        self._check_unpinned()
        p, bs, tree = self.pool, self.block_size, self.tree
        # radix mode: per block, its counted parent (leaves-only: kid_of; node eviction: up), or -1
        counted = (None if tree is None else tree.kid_of if tree.kids is not None else
                   tree.nodes.up if tree.nodes is not None else None)
        old_n = s.num_kv
        keep = np.asarray(keep, dtype=np.int64)
        n = len(keep) + append
        nb = -(-n // bs)
        kept = np.zeros(old_n, dtype=bool)
        kept[keep] = True
        table = s.table
        stay = np.ones(nb, dtype=bool)
        fill = p.fill
        for k in range(nb):
            if k >= len(table):
                stay[k] = False
            elif self._frozen(table[k]):
                lo, f = k * bs, fill[table[k]]
                stay[k] = (lo + f <= n and (f == bs or lo + f == n) and bool(kept[lo:lo + f].all()))
                par = counted[table[k]] if counted is not None else -1
                if stay[k] and par >= 0 and not (k and stay[k - 1] and table[k - 1] == par):
                    stay[k] = False  # leaves-only: a cached block is never held without its parent
        n_new = int(nb - stay.sum())
        if n_new > p.num_available:
            return None
        # kept slots that stay in place: inside [0, n) and in a staying block
        m = min(old_n, n)
        in_place = np.zeros(old_n, dtype=bool)
        in_place[:m] = kept[:m] & stay[np.arange(m) // bs]
        src = np.flatnonzero(kept & ~in_place)
        occupied = np.zeros(n, dtype=bool)
        occupied[:m] = in_place[:m]
        holes = np.flatnonzero(~occupied)  # len = len(src) + append
        dst, app = holes[:len(src)], holes[len(src):]
        src_phys = self.slots_of(s, src)
        # the new table: staying blocks, new blocks where not; release the rest (tail first)
        new_table = [table[k] if stay[k] else p.alloc() for k in range(nb)]
        kept_blocks = set(new_table)
        released = [b for b in table if b not in kept_blocks]
        for k, b in enumerate(new_table):
            want = min(bs, n - k * bs)
            if fill[b] != want:  # a private block (frozen ones stay only when unchanged)
                p.tokens_live += want - fill[b]
                fill[b] = want
        s.table = new_table
        if tree is not None and tree.nodes is not None:  # a kept block whose node continues into released
            for b in released:  # ones: split there
                up = tree.nodes.up[b]
                if up >= 0 and up in kept_blocks and p.key[b] is not None:
                    tree.split_after(up)
        p.release_all(released[::-1])
        s.dropped += old_n - n
        s.num_kv = n
        s.num_registered = min(s.num_registered, int(np.argmin(stay)) if not stay.all() else nb)
        s.compacted = True
        return Compaction(src, dst, app, src_phys, self.slots_of(s, dst), self.slots_of(s, app))

    def take_tier_ops(self) -> tuple[list[tuple], list[tuple]]:
        """The tiers' (pre, post) transfers for this step's executor (kvbench.memory.tiers)."""
        return self.tiers.take_ops() if self.tiers is not None else ([], [])

    def take_copies(self) -> list[tuple[int, int]]:
        """Copies for the executor to perform before the next forward; unpins their sources."""
        c, self.copies = self.copies, []
        if self._pinned:
            self.pool.release_all(self._pinned)
            self._pinned = []
        return c
