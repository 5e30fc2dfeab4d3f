"""Host-memory copies of evicted KV for the model executor: InfiniGen's CPU pool tensors, and the
shadow of every evicted token that measuring the attention mass kept needs.

Per sequence: the positions of its host-held tokens (sorted) and their K/V for every layer, on the
CPU. ``offload`` gathers pool slots to the host, ``recall`` writes host rows back into pool slots
(and forgets them: the token is on the device again), ``release`` drops a finished sequence.
``mass_kept`` compares this step's decode queries with the host keys (exact q.k in float32, on the
host: a measurement, not timed), normalised by the decode's log-sum-exp over the kept tokens.

InfiniGen's speculation (``speculate``) runs on the device, as InfiniGen's does: when a transfer
offloads tokens it also keeps their *partial keys* on the device — for every layer and KV head the
PARTIAL_DIMS share of key dims (whole rotary pairs) with the largest mean magnitude, chosen from
the first tokens offloaded (InfiniGen picks its channels offline, after skewing the weights so that
few carry the dot product); they leave the device when their token leaves the CPU pool — and the coming decode's query, restricted to the same dims, is scored against them
and normalised by its partial scores over the kept tokens and itself. Half the dims: on this
project's random models a quarter loses the position structure of the local heads (chat then
recalled 1,219 of 5,036 offloaded tokens instead of 9 of 3,847 on the eviction tests' chat trace);
PARTIAL_DIMS = 1 scores exactly. The partial keys' device memory is InfiniGen's cost too; the KV
pool's figures do not count it.
"""
from __future__ import annotations

import math

import numpy as np
import torch

PARTIAL_DIMS = 0.5  # share of each KV head's key dims kept on the device for speculation


class HostKV:
    def __init__(self, partial_dims: float = PARTIAL_DIMS):
        self.pos: dict[int, np.ndarray] = {}  # seq_id -> int64 [n], sorted
        self.kv: dict[int, torch.Tensor] = {}  # seq_id -> [2L, n, Hkv, D] on the CPU
        self.partial_dims = partial_dims
        self.dims: torch.Tensor | None = None  # int64 [L, Hkv, r] on the device: the partial key dims
        self.dim_mask: torch.Tensor | None = None  # bool [L, Hkv, D]: the same dims as a mask
        # the CPU pool's tokens (a subset of the host rows): positions sorted, partial keys on the device
        self.pk_pos: dict[int, np.ndarray] = {}
        self.pk: dict[int, torch.Tensor] = {}  # seq_id -> [L, n, Hkv, r]

    @staticmethod
    def _flat(pool: torch.Tensor) -> torch.Tensor:
        """[2L, NB, BS, Hkv, D] -> [2L, NB*BS, Hkv, D], a view: slot-indexed."""
        return pool.view(pool.shape[0], -1, *pool.shape[3:])

    def offload(self, pool: torch.Tensor, items, keep_partial: bool = False) -> int:
        """items: (seq_id, positions int64 [n], pool slots int64 [n]). Returns bytes copied.
        keep_partial: also keep the tokens' partial keys on the device (InfiniGen's transfers)."""
        flat, nbytes = self._flat(pool), 0
        for sid, pos, slots in items:
            dev_rows = flat[:, torch.as_tensor(slots, device=pool.device)]  # [2L, n, Hkv, D]
            rows = dev_rows.to("cpu")
            nbytes += rows.numel() * rows.element_size()
            if keep_partial:
                self._add_partial(sid, pos, self._partial(dev_rows[0::2]))
            if sid in self.pos:
                pos = np.concatenate([self.pos[sid], pos])
                rows = torch.cat([self.kv[sid], rows], dim=1)
            order = np.argsort(pos, kind="stable")
            self.pos[sid] = pos[order]
            self.kv[sid] = rows[:, torch.from_numpy(order)]
        return nbytes

    def _add_partial(self, sid: int, pos: np.ndarray, part: torch.Tensor) -> None:
        if sid in self.pk_pos:
            pos = np.concatenate([self.pk_pos[sid], pos])
            part = torch.cat([self.pk[sid], part], dim=1)
        order = np.argsort(pos, kind="stable")
        self.pk_pos[sid] = pos[order]
        self.pk[sid] = part[:, torch.from_numpy(order).to(part.device)]

    def drop_partial(self, items) -> None:
        """items: (seq_id, positions): tokens that left the CPU pool (recalled, or dropped for good)."""
        for sid, pos in items:
            have = self.pk_pos.get(sid)
            if have is None:
                continue
            keep = ~np.isin(have, pos)
            self.pk_pos[sid] = have[keep]
            self.pk[sid] = self.pk[sid][:, torch.from_numpy(keep).to(self.pk[sid].device)]

    def _partial(self, k: torch.Tensor) -> torch.Tensor:
        """k: [L, n, Hkv, D] on the device -> its partial keys [L, n, Hkv, r] (choosing the dims once:
        whole rotary pairs (i, i + D/2), those of largest mean squared length, so that a partial
        score does not depend on the tokens' absolute positions)."""
        if self.dims is None:
            half = k.shape[3] // 2
            pairs = max(1, min(half, math.ceil(self.partial_dims * half)))
            energy = k.float().pow(2).mean(1)  # [L, Hkv, D]
            top = (energy[..., :half] + energy[..., half:]).topk(pairs, dim=-1).indices  # [L, Hkv, pairs]
            self.dims = torch.cat([top, top + half], dim=-1)  # [L, Hkv, r]
            self.dim_mask = torch.zeros(k.shape[0], k.shape[2], k.shape[3], dtype=torch.bool, device=k.device)
            self.dim_mask.scatter_(2, self.dims, True)  # [L, Hkv, D]
        return torch.gather(k, 3, self.dims[:, None].expand(-1, k.shape[1], -1, -1))

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
            self.drop_partial([(sid, pos)])
        return nbytes

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.pos.pop(sid, None)
            self.kv.pop(sid, None)
            self.pk_pos.pop(sid, None)
            self.pk.pop(sid, None)

    def mass_kept(self, seq_ids: list[int], q: torch.Tensor, lse: torch.Tensor, scale: float) -> dict[int, float]:
        """q: [L, S, Hq, D], lse: f32 [L, S, Hq] (over the kept tokens), row i of S = seq_ids[i], on the
        CPU -> seq_id -> share of the full-cache attention weight that falls on the kept tokens."""
        mass = {}
        for i, sid in enumerate(seq_ids):
            pos = self.pos.get(sid)
            if pos is None or not len(pos):
                mass[sid] = 1.0
                continue
            k = self.kv[sid][0::2]  # [L, n, Hkv, D]
            evicted = _weights(q[:, i].view(k.shape[0], k.shape[2], -1, k.shape[3]), k, lse[:, i], scale).sum(-1)
            mass[sid] = float((1.0 / (1.0 + evicted)).mean())  # evicted weight against the kept total of 1
        return mass

    def speculate(self, seq_ids: list[int], q: torch.Tensor, lse: torch.Tensor, scale: float,
                  only: list[np.ndarray]) -> dict[int, np.ndarray]:
        """Partial-key scores of the host positions ``only[i]`` (each held with partial keys) for the
        queries q: [L, S, Hq, D] and their kept tokens' lse f32 [L, S, Hq], on the device -> seq_id ->
        float64 weight of each position, mean over layers and heads, relative to the kept total of 1."""
        scores = {}
        for i, sid in enumerate(seq_ids):
            pk = self.pk.get(sid)
            if pk is None:
                continue
            assert self.dims is not None  # (chosen with the first partial keys)
            rows = torch.from_numpy(np.searchsorted(self.pk_pos[sid], only[i])).to(pk.device)
            kp = pk[:, rows]  # [L, n, Hkv, r]
            qi = q[:, i].view(kp.shape[0], kp.shape[2], -1, q.shape[-1])  # [L, Hkv, G, D]
            qp = torch.gather(qi, 3, self.dims[:, :, None, :].expand(-1, -1, qi.shape[2], -1))
            scores[sid] = _weights(qp, kp, lse[:, i], scale).mean((0, 1, 2)).double().cpu().numpy()
        return scores


def _weights(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention weights of keys that the softmax left out, relative to its total (lse).
    q: [L, Hkv, G, D], k: [L, n, Hkv, D], lse: [L, Hkv * G] -> float32 [L, Hkv, G, n]."""
    logits = torch.einsum("lhgd,lnhd->lhgn", q.float(), k.float()) * scale
    return torch.exp(logits - lse.float().view(*q.shape[:3], 1))
