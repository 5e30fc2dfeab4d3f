"""Radix prefix matching (``--prefix-mode radix``, SGLang's idea at block granularity plus a partial
tail): matches a prompt's cached prefix to any token length, not only whole blocks.

The tree is the block-key chain itself: a cached block is a node whose parent is the block before it
(its ``parent`` key in the pool), so whole-block matching walks the same chain as hash mode. What
radix adds is the last, partial step: among the cached children of the last matched node, the one
whose tokens share the longest common prefix with the prompt's next tokens. Its first k tokens are
served from cache by copying the block into a fresh one (a copy-on-write copy the executor performs
before the step's forward); the unmatched rest of that block is recomputed into the copy. Finished
sequences also leave their partial tail block in the tree (full-block hash mode cannot hold it), which
is what lets the next turn of a conversation hit the answer's last tokens.

Children are indexed by (parent key, first token), so a partial match looks at a handful of blocks.
Eviction stays with the pool's cache policy: a node evicted before its children leaves them
unreachable until they are evicted in turn (they can no longer be hit); SGLang evicts leaves only.
"""
from __future__ import annotations

import numpy as np

# xor-ed into a partial block's key so it can never equal a whole block's chained key
PARTIAL_SALT = 0x7061727469616C00  # "partial"


class RadixChildren:
    """(parent key, first token) -> cached blocks, for the partial step of a radix match."""

    def __init__(self):
        self._kids: dict[tuple[int, int], set[int]] = {}
        self._slot: dict[int, tuple[int, int]] = {}  # block -> its (parent key, first token)

    def add(self, block: int, parent_key: int, first_token: int) -> None:
        k = (parent_key, int(first_token))
        self._kids.setdefault(k, set()).add(block)
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
