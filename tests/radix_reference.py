"""A slow, plain re-implementation of SGLang 0.5.23's RadixCache (sglang/srt/mem_cache/radix_cache.py)
at page granularity, and the one-request-at-a-time protocol of benchmarks/sglang_reference/drive.py,
for tests to hold kvbench's radix mode to on random traces (tests/test_radix.py).

Written for clarity, not speed, and independent of kvbench.memory: nodes are objects holding their
pages; a match stamps every node it enters (the one it ends inside too) and splits that one; an
insert stamps its path, splits where it ends inside a node and adds a leaf for the rest; eviction
takes, again and again, the least recently stamped unlocked leaf over the whole tree (brute force)
until enough tokens are freed. Stamps come from a counter: each call takes one, and each node it
creates another (SGLang's TreeNode() reads the clock when it is built).
"""
from __future__ import annotations

import numpy as np

from kvbench.trace.keys import sequence_tokens
from kvbench.trace.tokens import TokenStreams


class Node:
    def __init__(self, pages: list[tuple], parent: Node | None, stamp: int):
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.lock = 0
        self.stamp = stamp


class RadixReference:
    def __init__(self, capacity_pages: int, page: int):
        self.page = page
        self.free = capacity_pages
        self.clock = 0
        self.root = Node([], None, 0)
        self.root.lock = 1
        self.evicted_tokens = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def pages(self, tokens: np.ndarray) -> list[tuple]:
        n = len(tokens) // self.page
        return [tuple(tokens[i * self.page:(i + 1) * self.page].tolist()) for i in range(n)]

    def _split(self, child: Node, k: int) -> Node:
        upper = Node(child.pages[:k], child.parent, self._tick())
        upper.lock = child.lock
        upper.parent.children[upper.pages[0]] = upper
        child.pages = child.pages[k:]
        child.parent = upper
        upper.children[child.pages[0]] = child
        return upper

    @staticmethod
    def _common(a: list[tuple], b: list[tuple]) -> int:
        k = 0
        while k < len(a) and k < len(b) and a[k] == b[k]:
            k += 1
        return k

    def match(self, pages: list[tuple]) -> tuple[int, Node]:
        """(pages matched, last node): RadixCache._match_prefix_helper."""
        t = self._tick()
        node, i = self.root, 0
        node.stamp = t
        while i < len(pages) and pages[i] in node.children:
            child = node.children[pages[i]]
            child.stamp = t
            k = self._common(child.pages, pages[i:])
            if k < len(child.pages):
                node = self._split(child, k)
                i += k
                break
            node, i = child, i + k
        return i, node

    def insert(self, pages: list[tuple]) -> int:
        """Pages of ``pages`` the tree held already: RadixCache._insert_helper."""
        t = self._tick()
        node, i = self.root, 0
        node.stamp = t
        while i < len(pages) and pages[i] in node.children:
            node = node.children[pages[i]]
            node.stamp = t
            k = self._common(node.pages, pages[i:])
            i += k
            if k < len(node.pages):
                node = self._split(node, k)
        if i < len(pages):
            leaf = Node(pages[i:], node, self._tick())
            node.children[pages[i]] = leaf
        return i

    def lock(self, node: Node, d: int) -> None:
        while node is not self.root:
            node.lock += d
            node = node.parent

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict(self, num_tokens: int) -> None:
        """RadixCache.evict: whole least recently stamped unlocked leaves until num_tokens freed."""
        done = 0
        while done < num_tokens:
            leaves = [n for n in self._nodes() if n is not self.root and not n.children and not n.lock]
            if not leaves:
                return
            x = min(leaves, key=lambda n: n.stamp)
            del x.parent.children[x.pages[0]]
            done += len(x.pages) * self.page
            self.free += len(x.pages)
        self.evicted_tokens += done

    def reserve(self, tokens: int) -> None:
        short = tokens - self.free * self.page
        if short > 0:
            self.evict(short)

    def checkpoint(self, pages: list[tuple], owned: int, lock: Node, split_at: int | None = None):
        """Insert, free the pages the tree held already past ``owned``, lock the inserted path."""
        held = self.insert(pages)
        if split_at is not None and 0 < split_at < len(pages):
            self.insert(pages[:split_at])
        self.free += max(0, held - owned)
        _, node = self.match(pages)
        self.lock(lock, -1)
        self.lock(node, 1)
        return node, len(pages)

    def run(self, requests, streams: TokenStreams, outputs: bool = False) -> list[int]:
        """Hit tokens per request, driven as drive.py drives SGLang (``outputs``: decode and insert
        the generated tokens too)."""
        page, hits = self.page, []
        for r in requests:
            prompt = streams.expand(r)
            L = len(prompt)
            m, node = self.match(self.pages(prompt[:L - 1]))
            self.lock(node, 1)
            extend = L - m * page
            self.reserve(extend)
            self.free -= -(-extend // page)
            node, owned = self.checkpoint(self.pages(prompt), m, node)
            end = L
            if outputs and r.output_len > 1:
                n_out = r.output_len - 1
                in_page = min((page - L % page) % page, n_out)
                new_pages = -(-(n_out - in_page) // page)
                self.reserve(new_pages * page)
                self.free -= new_pages
                seq = sequence_tokens(r, prompt, streams)
                node, owned = self.checkpoint(self.pages(seq), owned, node, split_at=L // page)
                end = len(seq)
            if end % page:  # the partial last page
                self.free += 1
            self.lock(node, -1)
            hits.append(m * page)
        return hits
