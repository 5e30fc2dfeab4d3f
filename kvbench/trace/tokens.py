"""Segment expansion to token ids, and the chained block keys that prefix caching is built on.

Token streams are deterministic across runs, processes and machines: a stream named X is cut in
chunks of STREAM_CHUNK tokens, chunk k drawn from numpy's PCG64 seeded with (xxh64(X), k). Chunking
makes every stream prefix-consistent (its first L tokens never depend on how far it was read) and lets
streams be generated lazily. Generated chunks are memoised in a bounded LRU, so a 100-million-token
trace never sits in memory as Python ints; prompts are int32 numpy arrays.

Block keys (vLLM's scheme): key_i = xxh3_64(token bytes of block i, seed=key_{i-1}), seeded with
ROOT_KEY for block 0, so a block's key covers every token before it. Both the ideal hit rate here and
the prefix cache in kvbench.memory use ``block_keys``; the cache confirms hits against stored tokens.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from kvbench.trace.format import Request, Segment

# Token ids drawn for shared/unique streams lie in [TOKEN_LO, TOKEN_HI): below every real vocabulary
# size we use, and above the ids tokenizers reserve for special tokens.
TOKEN_LO, TOKEN_HI = 16, 32000
STREAM_CHUNK = 1024
ROOT_KEY = 0x6B7662656E6368  # "kvbench": the parent key of a sequence's first block
_UNIQUE_PREFIX = "\x00unique/"


def stable_hash(name: str) -> int:
    """A 64-bit hash of a string that is the same in every process (unlike ``hash``)."""
    return xxhash.xxh64_intdigest(name.encode("utf-8"))


class TokenStreams:
    """Lazily generated, memoised, deterministic token streams by name.

    ``max_cached_tokens`` bounds the memo (least recently used chunks are dropped and regenerated
    on demand, identically).
    """

    def __init__(self, max_cached_tokens: int = 64 * 2**20, tokenizer=None):
        self._chunks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._budget = max(STREAM_CHUNK, max_cached_tokens) // STREAM_CHUNK
        self.tokenizer = tokenizer

    def _chunk(self, seed: int, k: int) -> np.ndarray:
        key = (seed, k)
        arr = self._chunks.get(key)
        if arr is not None:
            self._chunks.move_to_end(key)
            return arr
        # The same seed words as PCG64([lo, hi, k]) (a list of ints is split into uint32 words), given
        # as an array: it skips numpy's per-element coercion, a fifth of the cost of a chunk.
        words = np.array([seed & 0xFFFFFFFF, seed >> 32, k], dtype=np.uint32)
        rng = np.random.Generator(np.random.PCG64(words))
        arr = rng.integers(TOKEN_LO, TOKEN_HI, size=STREAM_CHUNK, dtype=np.int32)
        self._chunks[key] = arr
        if len(self._chunks) > self._budget:
            self._chunks.popitem(last=False)
        return arr

    def stream(self, name: str, length: int, start: int = 0) -> np.ndarray:
        """Tokens [start, start+length) of the stream called ``name`` (int32)."""
        seed = stable_hash(name)
        end = start + length
        k0, k1 = start // STREAM_CHUNK, (end - 1) // STREAM_CHUNK
        if k0 == k1:
            off = start - k0 * STREAM_CHUNK
            return self._chunk(seed, k0)[off:off + length]
        parts = [self._chunk(seed, k) for k in range(k0, k1 + 1)]
        full = np.concatenate(parts)
        off = start - k0 * STREAM_CHUNK
        return full[off:off + length]

    def segment(self, seg: Segment, request_key: str, position: int) -> np.ndarray:
        """The token ids of one segment of a request (``position`` = the segment's index)."""
        if seg.kind == "shared":
            return self.stream(seg.name, seg.length)
        if seg.kind == "unique":
            return self.stream(f"{_UNIQUE_PREFIX}{request_key}/{position}", seg.length)
        if seg.kind == "tokens":
            return np.asarray(seg.tokens, dtype=np.int32)
        return np.asarray(encode_text(seg.text, self.tokenizer), dtype=np.int32)

    def expand(self, req: Request) -> np.ndarray:
        """The request's whole prompt as an int32 array (a fresh array; the caller may keep it)."""
        key = req.id
        parts = [self.segment(s, key, i) for i, s in enumerate(req.prompt)]
        if len(parts) == 1:
            return parts[0].copy()
        return np.concatenate(parts)

    def output_tokens(self, req: Request, length: int, start: int = 0) -> np.ndarray:
        """The named answer stream's tokens [start, start+length), for requests with ``output``."""
        return self.stream(req.output, length, start)


def encode_text(text: str, tokenizer=None) -> list[int]:
    """Tokenize a ``text`` segment: with a Hugging Face tokenizer when one is given, else bytes.

    The byte fallback (UTF-8 byte b -> id 3 + b) keeps traces with text usable offline; it counts
    about 4x more tokens than a BPE tokenizer would for English.
    """
    if tokenizer is not None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return [3 + b for b in text.encode("utf-8")]


def text_length(tokenizer=None):
    """A ``text -> token count`` function for the trace reader."""
    return lambda text: len(encode_text(text, tokenizer))


def block_keys(tokens: np.ndarray, block_size: int, n_blocks: int | None = None,
               parent: int = ROOT_KEY) -> list[int]:
    """Chained keys of the first ``n_blocks`` full blocks of ``tokens`` (all full blocks if None)."""
    if n_blocks is None:
        n_blocks = len(tokens) // block_size
    if n_blocks <= 0:
        return []
    buf = np.ascontiguousarray(tokens[: n_blocks * block_size], dtype=np.int32).tobytes()
    step = block_size * 4
    h = xxhash.xxh3_64_intdigest
    keys = [0] * n_blocks
    key = parent
    for i in range(n_blocks):
        key = h(buf[i * step:(i + 1) * step], key)
        keys[i] = key
    return keys
