"""The ideal prefix hit rate of a trace (spec §4): infinite cache, no concurrency, trace order.

Each request looks up the longest run of its prompt's whole blocks already seen (never the block that
holds the last prompt token, which must be computed to produce the first output token); then its
prompt, and where ``output`` names the answer the first output_len - 1 answer tokens too (the tokens
whose KV is computed during decode), are cached in whole blocks. Hit rate = hit tokens / prompt tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from kvbench.trace.format import Request
from kvbench.trace.tokens import ROOT_KEY, TokenStreams, block_keys


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
    """The tokens a later request may hit once this one finishes: prompt, plus a named answer's
    computed part (the ideal hit rate's view: an unnamed answer is never re-sent)."""
    if req.output is None or req.output_len <= 1:
        return prompt
    return np.concatenate([prompt, streams.output_tokens(req, req.output_len - 1)])


def sequence_tokens(req: Request, prompt: np.ndarray, streams: TokenStreams, sample: int = 0) -> np.ndarray:
    """Every token whose KV sample ``sample`` of the request computes: the prompt and the first
    output_len - 1 generated tokens (the last one is sampled, never fed back). The engine hashes
    them all into the prefix cache, as vLLM does with sampled tokens."""
    if req.output_len <= 1:
        return prompt
    return np.concatenate([prompt, streams.output_tokens(req, req.output_len - 1, sample=sample)])


class PrefixKeys:
    """Block keys of requests' cached sequences at one block size, memoising the keys of
    block-aligned shared segments across requests (see ``_sequence_keys``)."""

    def __init__(self, block_size: int, streams: TokenStreams | None = None):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.streams = streams or TokenStreams()
        self._memo: dict[tuple[int, str, int], np.ndarray] = {}

    def __call__(self, req: Request) -> tuple[np.ndarray, int]:
        """(uint64 keys of every whole block of the cached sequence, prompt length)."""
        return _sequence_keys(req, self.block_size, self.streams, self._memo)


class IdealCounter:
    """The infinite cache of the ideal hit rate, fed one request at a time in trace order."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seen: set[int] = set()
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def add(self, keys: np.ndarray, prompt_len: int) -> int:
        """Look a request up, then cache it; returns its hit tokens."""
        m = _seen_prefix(keys, self.seen)
        h = min(m, lookup_blocks(prompt_len, self.block_size)) * self.block_size
        self.hit_tokens += h
        self.prompt_tokens += prompt_len
        # keys[:m] are in the set already (see _seen_prefix), so only the rest can be new.
        self.seen.update(keys[m:].tolist())
        return h

    def result(self) -> IdealHits:
        return IdealHits(self.hit_tokens, self.prompt_tokens, len(self.seen))


def ideal_hits(requests: Iterable[Request], block_size: int,
               streams: TokenStreams | None = None, *,
               on_request: Callable[[Request, int], None] | None = None) -> IdealHits:
    """Count ideal prefix hits over requests in the given (trace) order.

    ``on_request(req, hit_tokens)`` is called once per request, for callers that break the rate down
    (by turn, by session).
    """
    keys_of = PrefixKeys(block_size, streams)
    counter = IdealCounter(block_size)
    for req in requests:
        h = counter.add(*keys_of(req))
        if on_request is not None:
            on_request(req, h)
    return counter.result()


def _seen_prefix(keys: np.ndarray, seen: set[int]) -> int:
    """Length of the longest prefix of ``keys`` already in ``seen``, by binary search.

    Valid because ``seen`` is prefix-closed: a chained key covers every block before it, and every
    sequence caches all its leading whole blocks, so if key i was seen then keys 0..i were too.
    """
    lo, hi = 0, len(keys)
    if hi == 0 or int(keys[0]) not in seen:
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(keys[mid - 1]) in seen:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _pieces(req: Request, streams: TokenStreams):
    """The cached sequence (as in cached_sequence) in pieces: ``(name, length)`` for a named stream,
    ``(None, tokens)`` for any other segment."""
    for i, seg in enumerate(req.prompt):
        if seg.kind == "shared":
            yield seg.name, seg.length
        else:
            yield None, streams.segment(seg, req.id, i)
    if req.output is not None and req.output_len > 1:
        yield req.output, req.output_len - 1


_NO_TOKENS = np.zeros(0, dtype=np.int32)


def _sequence_keys(req: Request, block_size: int, streams: TokenStreams,
                   memo: dict) -> tuple[np.ndarray, int]:
    """Block keys of a request's cached sequence (identical to ``block_keys(cached_sequence(...))``)
    and its prompt length in tokens.

    A named stream that starts on a block boundary has keys fixed by (parent key, name, length), so
    they are memoised: on a trace like Mooncake's, whose prompts are chains of shared 512-token
    segments, each block is hashed once however many requests repeat it.
    """
    parts: list[np.ndarray] = []
    parent = ROOT_KEY
    carry = _NO_TOKENS  # tokens of a partial block waiting for the next piece
    seq_len = 0
    for name, what in _pieces(req, streams):
        if name is not None and carry.size == 0:
            length = what
            n_full = length // block_size
            ks = memo.get((parent, name, length))
            if ks is None:
                toks = streams.stream(name, n_full * block_size) if n_full else _NO_TOKENS
                ks = np.array(block_keys(toks, block_size, n_full, parent), dtype=np.uint64)
                memo[(parent, name, length)] = ks
            rest = length - n_full * block_size
            carry = streams.stream(name, rest, start=n_full * block_size) if rest else _NO_TOKENS
        else:
            toks = streams.stream(name, what) if name is not None else what
            length = len(toks)
            if carry.size:
                toks = np.concatenate([carry, toks])
            n_full = len(toks) // block_size
            ks = np.array(block_keys(toks, block_size, n_full, parent), dtype=np.uint64)
            carry = toks[n_full * block_size:]
        seq_len += length
        if ks.size:
            parts.append(ks)
            parent = int(ks[-1])
    answer = req.output_len - 1 if req.output is not None and req.output_len > 1 else 0
    keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
    return keys, seq_len - answer


def ideal_hit_rate(requests: Iterable[Request], block_size: int,
                   streams: TokenStreams | None = None) -> float:
    return ideal_hits(requests, block_size, streams).hit_rate
