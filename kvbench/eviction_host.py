"""Host-memory copies of evicted KV for the model executor: InfiniGen's CPU pool tensors, and the
shadow of every evicted token that measuring the attention mass kept needs.

Per sequence: the positions of its host-held tokens (sorted) and their K/V for every layer, on the
CPU. ``offload`` gathers pool slots to the host, ``recall`` writes host rows back into pool slots
(and forgets them: the token is on the device again), ``release`` drops a finished sequence.
``score`` compares decode queries with the host keys — this step's, for the attention mass kept, or
the coming step's, for InfiniGen's speculation over the pooled tokens only: exact q.k in float32
(see kvbench.eviction on why not InfiniGen's partial weights), normalised by a decode's log-sum-exp
over the kept tokens, so a token's weight is relative to the kept tokens' total of 1.
"""
from __future__ import annotations

import numpy as np
import torch


class HostKV:
    def __init__(self):
        self.pos: dict[int, np.ndarray] = {}  # seq_id -> int64 [n], sorted
        self.kv: dict[int, torch.Tensor] = {}  # seq_id -> [2L, n, Hkv, D] on the CPU

    def __len__(self) -> int:
        return sum(len(p) for p in self.pos.values())

    @staticmethod
    def _flat(pool: torch.Tensor) -> torch.Tensor:
        """[2L, NB, BS, Hkv, D] -> [2L, NB*BS, Hkv, D], a view: slot-indexed."""
        return pool.view(pool.shape[0], -1, *pool.shape[3:])

    def offload(self, pool: torch.Tensor, items) -> int:
        """items: (seq_id, positions int64 [n], pool slots int64 [n]). Returns bytes copied."""
        flat, nbytes = self._flat(pool), 0
        for sid, pos, slots in items:
            rows = flat[:, torch.as_tensor(slots, device=pool.device)].to("cpu")  # [2L, n, Hkv, D]
            nbytes += rows.numel() * rows.element_size()
            if sid in self.pos:
                pos = np.concatenate([self.pos[sid], pos])
                rows = torch.cat([self.kv[sid], rows], dim=1)
            order = np.argsort(pos, kind="stable")
            self.pos[sid] = pos[order]
            self.kv[sid] = rows[:, torch.from_numpy(order)]
        return nbytes

    def recall(self, pool: torch.Tensor, items) -> int:
        """items: (seq_id, positions, pool slots): write those host tokens back. Returns bytes copied."""
        flat, nbytes = self._flat(pool), 0
        for sid, pos, slots in items:
            have = self.pos[sid]
            rows = np.searchsorted(have, pos)
            if not np.array_equal(have[np.minimum(rows, len(have) - 1)], pos):
                raise RuntimeError(f"sequence {sid}: recalled tokens are not on the host")
            kv = self.kv[sid][:, torch.from_numpy(rows)]
            flat[:, torch.as_tensor(slots, device=pool.device)] = kv.to(pool.device, pool.dtype)
            nbytes += kv.numel() * kv.element_size()
            keep = np.ones(len(have), dtype=bool)
            keep[rows] = False
            self.pos[sid] = have[keep]
            self.kv[sid] = self.kv[sid][:, torch.from_numpy(keep)]
        return nbytes

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.pos.pop(sid, None)
            self.kv.pop(sid, None)

    def score(self, seq_ids: list[int], q: torch.Tensor, lse: torch.Tensor, scale: float,
              only: list[np.ndarray] | None = None):
        """Host tokens against decode queries.

        q: [L, S, Hq, D], lse: f32 [L, S, Hq] (over the kept tokens), row i of S = seq_ids[i].
        Without ``only``: -> (None, mass_kept: seq_id -> share of the full-cache weight on kept
        tokens, for every seq). With ``only`` (per row, host positions to score, e.g. the CPU
        pool's): -> (seq_id -> float64 weight of each of those positions, mean over layers and
        heads, relative to the kept tokens' total of 1; None for mass).
        """
        scores, mass = ({}, None) if only is not None else (None, {})
        for i, sid in enumerate(seq_ids):
            pos = self.pos.get(sid)
            if pos is None or not len(pos):
                if mass is not None:
                    mass[sid] = 1.0
                continue
            k = self.kv[sid][0::2]  # [L, n, Hkv, D]
            if only is not None:
                k = k[:, torch.from_numpy(np.searchsorted(pos, only[i]))]
            k = k.float()
            n_layers, n, hkv, d = k.shape
            qi = q[:, i].float().view(n_layers, hkv, -1, d)  # [L, Hkv, G, D]
            logits = torch.einsum("lhgd,lnhd->lhgn", qi, k) * scale
            p = torch.exp(logits - lse[:, i].view(n_layers, hkv, -1, 1))  # [L, Hkv, G, n]
            if only is not None:
                scores[sid] = p.mean((0, 1, 2)).double().numpy()
            else:
                evicted = p.sum(-1)  # [L, Hkv, G]: evicted weight against the kept total of 1
                mass[sid] = float((1.0 / (1.0 + evicted)).mean())
        return scores, mass
