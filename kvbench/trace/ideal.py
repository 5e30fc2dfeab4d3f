"""The ideal prefix hit rate of a trace (spec §4): infinite cache, no concurrency, trace order.

Each request looks up the longest run of its prompt's whole blocks already seen (never the block that
holds the last prompt token, which must be computed to produce the first output token); then its
prompt, and where ``output`` names the answer the first output_len - 1 answer tokens too (the tokens
whose KV is computed during decode), are cached in whole blocks. Hit rate = hit tokens / prompt tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from kvbench.trace.format import Request
from kvbench.trace.tokens import TokenStreams, block_keys


@dataclass(frozen=True, slots=True)
class IdealHits:
    hit_tokens: int
    prompt_tokens: int
    distinct_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def lookup_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading whole blocks of a prompt may be served from cache (not the last token's)."""
    return (prompt_len - 1) // block_size


def cached_sequence(req: Request, prompt: np.ndarray, streams: TokenStreams) -> np.ndarray:
    """The tokens whose KV exists once the request finishes: prompt, plus a named answer's computed part."""
    if req.output is None or req.output_len <= 1:
        return prompt
    return np.concatenate([prompt, streams.output_tokens(req, req.output_len - 1)])


def ideal_hits(requests: Iterable[Request], block_size: int,
               streams: TokenStreams | None = None) -> IdealHits:
    """Count ideal prefix hits over requests in the given (trace) order."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    streams = streams or TokenStreams()
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        prompt = streams.expand(req)
        seq = cached_sequence(req, prompt, streams)
        keys = block_keys(seq, block_size)
        n_look = lookup_blocks(len(prompt), block_size)
        h = 0
        while h < n_look and keys[h] in seen:
            h += 1
        hit += h * block_size
        total += len(prompt)
        seen.update(keys)
    return IdealHits(hit, total, len(seen))


def ideal_hit_rate(requests: Iterable[Request], block_size: int,
                   streams: TokenStreams | None = None) -> float:
    return ideal_hits(requests, block_size, streams).hit_rate
