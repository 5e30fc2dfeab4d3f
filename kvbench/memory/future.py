"""The future that belady needs: for each request and each of its cacheable blocks, the index of
the next request (in trace order) that looks that block up.

One backward pass over the trace's chained block keys; the result is one small int64 array per
request (no dict of lists per key), so it fits for the whole Mooncake trace.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvbench.memory.policy_base import NEVER
from kvbench.trace.format import Request
from kvbench.trace.keys import PrefixKeys, lookup_blocks
from kvbench.trace.tokens import TokenStreams


def next_uses_from_keys(keys_per_request: Sequence[list[int]], lookups: Sequence[int]) -> list[np.ndarray]:
    """``keys_per_request[i]``: request i's block keys; ``lookups[i]``: how many leading ones it looks
    up. Returns, per request, the next request index using each of its blocks (NEVER if none)."""
    last: dict[int, int] = {}
    out: list[np.ndarray] = []  # last request first, reversed at the end
    for i in range(len(keys_per_request) - 1, -1, -1):
        ks = keys_per_request[i]
        get = last.get
        out.append(np.fromiter((get(k, NEVER) for k in ks), dtype=np.int64, count=len(ks)))
        for k in ks[: lookups[i]]:
            last[k] = i
    out.reverse()
    return out


def next_uses(requests: Sequence[Request], block_size: int,
              streams: TokenStreams | None = None) -> list[np.ndarray]:
    """Next-use arrays for requests in the order the engine will see them."""
    keys_of = PrefixKeys(block_size, streams)
    keys, looks = [], []
    for r in requests:
        k, prompt_len = keys_of(r)
        keys.append(k.tolist())
        looks.append(lookup_blocks(prompt_len, block_size))
    return next_uses_from_keys(keys, looks)
