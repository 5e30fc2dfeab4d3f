"""InfiniGen's CPU pool, as bookkeeping: which evicted tokens of which sequence sit in host memory and
can be recalled, with a capacity in tokens shared by all sequences and a rule that picks what to drop
when it is full (the tensors themselves are the model executor's; the sim has none).

Rules (``CPU_POOL_RULES``): ``counter`` drops the tokens recalled (or scored above the recall
threshold) least often, oldest first among equals, as InfiniGen's counter-based pool does; ``lru``
drops those whose last such use is oldest; ``fifo`` those offloaded first. When the pool overflows it
drops down to CPU_POOL_LOW of its capacity at once, so the O(pool) victim search runs rarely.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CPU_POOL_RULES = ("counter", "lru", "fifo")
CPU_POOL_LOW = 0.9


@dataclass(slots=True)
class Offloaded:
    """One sequence's tokens in the pool, parallel arrays in no particular order."""

    pos: np.ndarray  # int64 [n] token positions
    score: np.ndarray  # float64 [n] accumulated attention (H2O's score, kept while offloaded)
    hits: np.ndarray  # int64 [n] times scored above the recall threshold
    last: np.ndarray  # int64 [n] step of the last such time (or of offloading)
    born: np.ndarray  # int64 [n] step offloaded

    @classmethod
    def empty(cls) -> "Offloaded":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, np.zeros(0), z, z, z)

    def __len__(self) -> int:
        return len(self.pos)

    def keep_only(self, mask: np.ndarray) -> None:
        self.pos, self.score, self.hits = self.pos[mask], self.score[mask], self.hits[mask]
        self.last, self.born = self.last[mask], self.born[mask]


class CpuPool:
    def __init__(self, capacity_tokens: int, rule: str = "counter"):
        if rule not in CPU_POOL_RULES:
            raise ValueError(f"unknown CPU pool rule {rule!r} (choose from {', '.join(CPU_POOL_RULES)})")
        self.capacity = capacity_tokens
        self.rule = rule
        self.seqs: dict[int, Offloaded] = {}
        self.size = 0
        self.dropped = 0  # tokens dropped for capacity (gone for good, like H2O's)

    def get(self, seq_id: int) -> Offloaded | None:
        return self.seqs.get(seq_id)

    def add(self, seq_id: int, pos: np.ndarray, score: np.ndarray, step: int) -> None:
        o = self.seqs.get(seq_id)
        if o is None:
            o = self.seqs[seq_id] = Offloaded.empty()
        n = len(pos)
        now = np.full(n, step, dtype=np.int64)
        o.pos = np.concatenate([o.pos, pos])
        o.score = np.concatenate([o.score, score])
        o.hits = np.concatenate([o.hits, np.zeros(n, dtype=np.int64)])
        o.last = np.concatenate([o.last, now])
        o.born = np.concatenate([o.born, now])
        self.size += n

    def remove(self, seq_id: int, mask: np.ndarray) -> None:
        """Take the entries where ``mask`` is set out of the pool (recalled)."""
        o = self.seqs[seq_id]
        self.size -= int(mask.sum())
        o.keep_only(~mask)

    def release(self, seq_id: int) -> None:
        o = self.seqs.pop(seq_id, None)
        if o is not None:
            self.size -= len(o)

    def enforce_capacity(self) -> dict[int, np.ndarray]:
        """Drop entries by the rule until the pool is within capacity; returns the positions dropped,
        per sequence (empty when nothing was)."""
        if self.size <= self.capacity:
            return {}
        ids = list(self.seqs)
        owner = np.concatenate([np.full(len(self.seqs[i]), k) for k, i in enumerate(ids)])
        idx = np.concatenate([np.arange(len(self.seqs[i])) for i in ids])
        born = np.concatenate([self.seqs[i].born for i in ids])
        if self.rule == "fifo":
            order = np.argsort(born, kind="stable")
        elif self.rule == "lru":
            order = np.lexsort((born, np.concatenate([self.seqs[i].last for i in ids])))
        else:
            order = np.lexsort((born, np.concatenate([self.seqs[i].hits for i in ids])))
        n_drop = self.size - int(self.capacity * CPU_POOL_LOW)
        victims = order[:n_drop]
        gone = {}
        for k, sid in enumerate(ids):
            v = idx[victims[owner[victims] == k]]
            if len(v):
                gone[sid] = self.seqs[sid].pos[v]
                mask = np.ones(len(self.seqs[sid]), dtype=bool)
                mask[v] = False
                self.seqs[sid].keep_only(mask)
        self.size -= n_drop
        self.dropped += n_drop
        return gone
