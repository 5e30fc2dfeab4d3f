"""Radix prefix caching (``--prefix-mode radix``, SGLang's RadixCache): partial matching inside a
block (RadixChildren) and node-granular eviction (RadixNodes).

Partial matching. The tree is the block-key chain itself: a cached block is a node whose parent is
the block before it (its ``parent`` key in the pool), so whole-block matching walks the same chain as
hash mode. What radix adds is the last, partial step: among the cached children of the last matched
node, the one whose tokens share the longest common prefix with the prompt's next tokens. Its first k
tokens are served from cache by copying the block into a fresh one (a copy-on-write copy the executor
performs before the step's forward); the unmatched rest of that block is recomputed into the copy.
Finished sequences also leave their partial tail block in the tree (full-block hash mode cannot hold
it), which is what lets the next turn of a conversation hit the answer's last tokens. Children are
indexed by (parent key, first token), so a partial match looks at a handful of blocks.

Eviction (``--radix-eviction``): ``node`` (RadixNodes, the default) evicts as SGLang 0.5.23's
``RadixCache.evict`` does: whole leaf nodes, least recently used first, until the shortfall is met;
``block`` keeps the pool's block-granular leaves-only eviction under any ``--cache-policy``
(kvbench.memory.block_pool).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvbench.memory.policy_base import CachePolicy

# xor-ed into a partial block's key so it can never equal a whole block's chained key
PARTIAL_SALT = 0x7061727469616C00  # "partial"


class RadixChildren:
    """(parent key, first token) -> cached blocks, for the partial step of a radix match."""

    def __init__(self) -> None:
        self._kids: dict[tuple[int, int], set[int]] = {}
        self._slot: dict[int, tuple[int, int]] = {}  # block -> its (parent key, first token)

    def add(self, block: int, parent_key: int, first_token: int) -> None:
        k = (parent_key, int(first_token))
        kids = self._kids.get(k)
        if kids is None:
            self._kids[k] = {block}
        else:
            kids.add(block)
        self._slot[block] = k

    def remove(self, block: int) -> None:
        k = self._slot.pop(block, None)
        if k is not None:
            kids = self._kids[k]
            kids.discard(block)
            if not kids:
                del self._kids[k]

    def best(self, parent_key: int, want: np.ndarray, tokens: np.ndarray, fill: list[int],
             exclude: set[int] | None = None) -> tuple[int, int]:
        """(block, k): the cached child of ``parent_key`` whose first k tokens equal ``want[:k]``
        with k largest (k >= 1), or (-1, 0). ``tokens``/``fill``: the pool's token rows and fills."""
        if not len(want):
            return -1, 0
        cands = self._kids.get((parent_key, int(want[0])))
        if not cands:
            return -1, 0
        best_b, best_k = -1, 0
        for b in cands:
            if exclude and b in exclude:
                continue
            n = min(fill[b], len(want))
            diff = np.flatnonzero(tokens[b, :n] != want[:n])
            k = int(diff[0]) if len(diff) else n
            if k > best_k:
                best_b, best_k = b, k
        return best_b, best_k

    def __len__(self) -> int:
        return len(self._slot)


class RadixNodes(CachePolicy):
    """SGLang's node-granular eviction (``RadixCache.evict``, radix_cache.py) over block ids, as a
    cache policy whose ``pop_many`` frees whole nodes.

    A node is a run of blocks that one sequence added to the tree at once (``link``): its unshared
    tail beyond its prefix hit, as SGLang's ``_insert_helper`` adds a new node for the key left after
    matching. A node is split where a later request's match ends inside it (``split_after``, SGLang's
    ``_split_node``). Only leaf nodes whose blocks are all unused are evictable; the victim is the
    least recently used leaf, all its blocks go at once (SGLang frees ``x.value``, usually more than
    the shortfall), and its parent becomes a leaf candidate.

    Recency. SGLang stamps ``last_access_time`` on every node of a request's path when it matches and
    when it inserts (at each prefill chunk and at finish), and the request holds its path locked in
    between, so among unused nodes the order is that of their last release: the queue holds the
    heads of unused nodes in release order (a sequence releases tail first, so a child node comes
    before its parent). One exception, kept: SGLang's match also stamps the node it ends inside, so
    the part of a split node below the match (``split_after``) is moved to the queue's end.

    Invariant (what makes node state O(1)): every holder of a block holds the whole node, since
    block tables are prefix-closed and a match that ends inside a node splits it. So a node is
    unused exactly when its head's refcount is 0, and a node and its parent can be told apart by
    ``is_head`` alone. Per block: ``up`` (the counted parent block: the block before it, when its
    sequence held that very block at registration; else -1, a root of its own), ``down`` (the next
    block of the same node, -1 at the tail), ``is_head``; per head ``tail_of``, per tail ``head_of``
    and ``kids`` (child nodes hanging off it). Each call costs O(1) per block it links, releases,
    reuses or evicts; ``split_after`` walks the upper part of the node (blocks the caller holds).

    ``refcnt``: the owner's refcounts (the pool's list, read only). ``name`` is lru: this policy
    orders by recency only, as SGLang's default ``--radix-eviction-policy lru``.
    """

    name = "lru"

    def __init__(self, num_blocks: int, refcnt):
        super().__init__(num_blocks)
        n = num_blocks
        self.refcnt = refcnt
        self.up = [-1] * n
        self.down = [-1] * n
        self.is_head = [False] * n
        self.tail_of = [-1] * n  # head -> tail of its node
        self.head_of = [-1] * n  # tail -> head of its node
        self.kids = [0] * n  # tail -> child nodes
        self._q: OrderedDict[int, None] = OrderedDict()  # heads of unused nodes, by release
        self._n = 0  # cached blocks (unused, indexed): all of them reachable by evicting leaves

    # -- the tree -------------------------------------------------------------------------------
    def link(self, b: int, parent: int, extend: bool = False) -> None:
        """Block ``b`` (just indexed, in use) continues ``parent`` (-1: a root). With ``extend`` it
        joins the parent's node when that node may grow: ``parent`` is its tail, with no child, held
        by this sequence alone (a sequence's decode steps and its partial tail add to the node it
        is building); else it starts a node, a child of ``parent``'s."""
        self.up[b] = parent
        if parent >= 0:
            if (extend and self.down[parent] < 0 and not self.kids[parent]
                    and self.refcnt[parent] == 1):
                h = self.head_of[parent]
                self.head_of[parent] = -1
                self.down[parent] = b
                self.is_head[b] = False
                self.tail_of[h] = b
                self.head_of[b] = h
                return
            if self.down[parent] >= 0:  # cannot happen while holders hold whole nodes; kept safe
                self.split_after(parent)
            self.kids[parent] += 1
        self.is_head[b] = True
        self.tail_of[b] = b
        self.head_of[b] = b

    def link_run(self, links: list[tuple[int, int]], extend: bool) -> None:
        """``link`` each (block, parent) in order, the first with ``extend``: a block whose parent is
        the block linked just before continues its node."""
        up, down, is_head, head_of = self.up, self.down, self.is_head, self.head_of
        prev = h = -1
        for b, p in links:
            if p >= 0 and p == prev:  # the node goes on; its tail is set where it ends
                up[b] = p
                down[p] = b
                is_head[b] = False
            else:
                if prev >= 0:
                    self.tail_of[h], head_of[prev] = prev, h
                self.link(b, p, extend)
                extend = True
                h = head_of[b]
                head_of[b] = -1
            prev = b
        self.tail_of[h], head_of[prev] = prev, h

    def split_after(self, x: int) -> None:
        """Make ``x`` the tail of its node (SGLang's ``_split_node`` where a match ends at ``x``).
        The part below, if any, becomes a child node; unused, it goes to the queue's end (SGLang's
        match stamps the node it ends inside)."""
        c = self.down[x]
        if c < 0:
            return
        h = x
        is_head, up = self.is_head, self.up
        while not is_head[h]:
            h = up[h]
        t = self.tail_of[h]
        self.down[x] = -1
        is_head[c] = True
        self.tail_of[h], self.head_of[x] = x, h
        self.tail_of[c], self.head_of[t] = t, c
        self.kids[x] = 1
        if self.refcnt[c] == 0:
            self._q[c] = None
            if h in self._q:  # a parent goes after its children
                self._q.move_to_end(h)

    def reinsert(self, c: int, parent: int) -> None:
        """A sequence computed cached block ``c`` again, after its own ``parent`` block (-1: as its
        first block); it was past its lookup: the block of its last prompt token. SGLang's insert
        walks into ``c``: it splits ``c``'s node after ``c`` and stamps it."""
        if self.up[c] != parent:
            return
        if not self.is_head[c]:
            self.split_after(parent)
        self.split_after(c)
        if c in self._q:
            self._q.move_to_end(c)

    # -- the policy ---------------------------------------------------------------------------
    def release_many(self, blocks) -> None:
        q, is_head = self._q, self.is_head
        n = 0
        for b in blocks:
            n += 1
            if is_head[b]:
                q[b] = None
        self._n += n

    def release(self, block: int) -> None:
        self.release_many((block,))

    def reuse_many(self, blocks) -> None:
        q, is_head = self._q, self.is_head
        n = 0
        for b in blocks:
            n += 1
            if is_head[b]:
                q.pop(b, None)
        self._n -= n

    def reuse(self, block: int) -> None:
        self.reuse_many((block,))

    def pop_many(self, n: int) -> list[int]:
        """Evict least recently used leaf nodes until at least ``n`` blocks are freed; returns every
        freed block (SGLang's ``evict(num_tokens)`` stops once ``num_evicted >= num_tokens``)."""
        q, kids, tail_of, down, up = self._q, self.kids, self.tail_of, self.down, self.up
        victims: list[int] = []
        while len(victims) < n:
            h = next((h for h in q if not kids[tail_of[h]]), -1)  # the front one, but for a safeguard
            if h < 0:
                raise IndexError(f"pop {n}: no evictable node left ({len(victims)} blocks freed)")
            del q[h]
            b = h
            while b >= 0:
                victims.append(b)
                nxt = down[b]
                down[b] = -1
                b = nxt
            p = up[h]
            if p >= 0:
                kids[p] -= 1
            t = tail_of[h]
            tail_of[h] = self.head_of[t] = -1
            self.is_head[h] = False
        self._n -= len(victims)
        for b in victims:
            up[b] = -1
        return victims

    def __len__(self) -> int:
        return self._n

    # -- checks -------------------------------------------------------------------------------
    def check(self, indexed: list[int]) -> None:
        """Recompute the tree from scratch and compare (tests; O(blocks)). ``indexed``: the blocks
        the pool indexes."""
        refcnt, up, down, is_head = self.refcnt, self.up, self.down, self.is_head
        ix = set(indexed)
        kids: dict[int, int] = {}
        for b in range(self.num_blocks):
            if b not in ix:
                assert up[b] == -1 and down[b] == -1 and not is_head[b], f"forgotten block {b} keeps tree state"
                continue
            if up[b] >= 0:
                assert up[b] in ix, f"block {b}'s parent {up[b]} is not cached"
                if is_head[b]:
                    kids[up[b]] = kids.get(up[b], 0) + 1
                else:
                    assert down[up[b]] == b, f"block {b} is inside a node but not its parent's next"
            else:
                assert is_head[b], f"root block {b} does not start a node"
            if down[b] >= 0:
                assert up[down[b]] == b and not is_head[down[b]]
        heads = [b for b in ix if is_head[b]]
        unused_heads = set()
        for h in heads:
            b, blocks = h, []
            while b >= 0:
                blocks.append(b)
                b = down[b]
            t = blocks[-1]
            assert self.tail_of[h] == t and self.head_of[t] == h, f"node {h}..{t}: head/tail drifted"
            used = {refcnt[b] > 0 for b in blocks}
            assert len(used) == 1, f"node {h}..{t} is partly held: {[refcnt[b] for b in blocks]}"
            if not used.pop():
                unused_heads.add(h)
        for b in ix:
            assert self.kids[b] == kids.get(b, 0), f"block {b}: {self.kids[b]} child nodes, {kids.get(b, 0)} counted"
            if down[b] >= 0:
                assert not self.kids[b], f"block {b} inside a node has a child node"
        assert set(self._q) == unused_heads, "queue != heads of unused nodes"
        assert self._n == sum(1 for b in ix if refcnt[b] == 0), "cached block count drifted"
        pos = {h: i for i, h in enumerate(self._q)}
        for h in self._q:  # a parent after its children: the front is always a leaf
            p = up[h]
            while p >= 0 and not is_head[p]:
                p = up[p]
            if p >= 0 and p in pos:
                assert pos[p] > pos[h], f"node {p} is queued before its child node {h}"
