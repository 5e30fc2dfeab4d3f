"""The attention mass kept (spec §4), measured on the model executor: for a decoding sequence under
token eviction, the share of the full-cache attention weight that falls on the tokens kept.

The kept tokens' share comes from the decode's own log-sum-exp; the evicted tokens' weight is scored on
the host against their KV copies (kvbench.eviction.host_kv). That host pass costs O(evicted tokens) per
sequence, so a step measures at most MASS_SAMPLE decoding sequences, in turn. A measurement, not the
policy's work: it is not part of the step's time.
"""
from __future__ import annotations

import torch

from kvbench.eviction.host_kv import HostKV

# Most decoding sequences per step whose attention mass kept is measured (in turn when more decode).
MASS_SAMPLE = 16


class MassMeter:
    def __init__(self, host: HostKV, scale: float):
        self.host = host
        self.scale = scale
        self._turn = 0  # where the next step's sample of decodes starts

    def rows(self, n: int, device) -> torch.Tensor:
        """Decode rows whose mass this step measures: all, or MASS_SAMPLE of them in turn."""
        if n <= MASS_SAMPLE:
            return torch.arange(n, device=device)
        self._turn = (self._turn + MASS_SAMPLE) % n
        return (torch.arange(MASS_SAMPLE, device=device) + self._turn) % n

    def measure(self, decode_records, seq_ids: list[int]) -> dict[int, float]:
        """``decode_records``: per layer, (q [D, Hq, Dh], lse [D, Hq]) of the step's decodes, in
        ``seq_ids`` order. -> seq_id -> mass kept, for the sampled rows."""
        rows = self.rows(len(seq_ids), decode_records[0][0].device)
        q = torch.stack([r[0][rows] for r in decode_records]).cpu()  # [L, M, Hq, Dh]
        lse = torch.stack([r[1][rows] for r in decode_records]).cpu()  # [L, M, Hq]
        return self.host.mass_kept([seq_ids[i] for i in rows.tolist()], q, lse, self.scale)
