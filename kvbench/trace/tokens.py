"""Segment expansion to token ids, and the chained block keys that prefix caching is built on.

Token streams are deterministic across runs, processes and machines: token i of the stream named X
is a counter-based hash of (xxh64(X), i) (splitmix64's finaliser, vectorised in numpy) mapped into
[TOKEN_LO, TOKEN_HI). Being a function of the position, a stream is prefix-consistent by construction
(its first L tokens never depend on how far it was read), any range can be produced without the ones
before it, and there is no generator to seed per stream. Stream prefixes read from position 0 are
memoised in a bounded LRU, so a 100-million-token trace never sits in memory as Python ints; prompts
are int32 numpy arrays.

Block keys (vLLM's scheme): key_i = xxh3_64(token bytes of block i, seed=key_{i-1}), seeded with
ROOT_KEY for block 0, so a block's key covers every token before it. Both the ideal hit rate here and
the prefix cache in kvbench.memory use ``block_keys``; the cache confirms hits against stored tokens.

Streams and keys are computed by kvbench.trace.compiled (numba), loaded on first use (``compiled()``):
a Python loop of xxhash calls cost ~0.3 us a block, and numpy's expression ~9 us a segment. A call
for a few blocks (a decode step's) still takes the xxhash library, as numba's call costs more.
"""
from __future__ import annotations

import functools
from collections import OrderedDict

import numpy as np
import xxhash

from kvbench.trace.format import Request, Segment

# Token ids drawn for shared/unique streams lie in [TOKEN_LO, TOKEN_HI): below every real vocabulary
# size we use, and above the ids tokenizers reserve for special tokens.
TOKEN_LO, TOKEN_HI = 16, 32000
ROOT_KEY = 0x6B7662656E6368  # "kvbench": the parent key of a sequence's first block
_UNIQUE_PREFIX = "\x00unique/"
_SAMPLE_PREFIX = "\x00sample/"  # the generated tokens of a sample whose answer the trace does not name
FEW_BLOCKS = 12  # block_keys hashes up to this many blocks in Python, more in one compiled call


def stable_hash(name: str) -> int:
    """A 64-bit hash of a string that is the same in every process (unlike ``hash``)."""
    return xxhash.xxh64_intdigest(name.encode("utf-8"))


@functools.cache  # (an import statement a call costs ~0.35 us; the hot paths ask per request)
def compiled():
    """kvbench.trace.compiled, imported on first use (numba costs ~0.2 s and ~60 MB to import)."""
    from kvbench.trace import compiled as module
    return module


def stream_tokens(seed: int, start: int, length: int) -> np.ndarray:
    """Tokens [start, start+length) of the stream whose name hashes to ``seed`` (int32): token i is
    splitmix64's finaliser of (i + 1) * 0x9E3779B97F4A7C15 + seed (mod 2**64), mod (TOKEN_HI - TOKEN_LO),
    plus TOKEN_LO."""
    out = np.empty(max(length, 0), dtype=np.int32)
    compiled().fill_stream(out, np.uint64(seed), start)
    return out


def unique_stream(request_key: str, position: int) -> str:
    """The name of the stream a ``unique`` segment reads (no trace can name it)."""
    return f"{_UNIQUE_PREFIX}{request_key}/{position}"


def sample_stream(request_key: str, sample: int) -> str:
    """The name of the stream a sample generates when the trace names no answer for it (no trace can
    name it either)."""
    return f"{_SAMPLE_PREFIX}{request_key}/{sample}"


class TokenStreams:
    """Lazily generated, memoised, deterministic token streams by name.

    ``max_cached_tokens`` bounds the memo of stream prefixes (the least recently used are dropped
    and regenerated on demand, identically).
    """

    def __init__(self, max_cached_tokens: int = 16 * 2**20, tokenizer=None):
        self._prefixes: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self._budget = max_cached_tokens
        self.tokenizer = tokenizer

    def stream(self, name: str, length: int, start: int = 0) -> np.ndarray:
        """Tokens [start, start+length) of the stream called ``name`` (int32)."""
        if start:  # e.g. one answer token at a time: computed directly, not memoised
            return stream_tokens(stable_hash(name), start, length)
        memo = self._prefixes
        arr = memo.get(name)
        if arr is not None and len(arr) >= length:
            memo.move_to_end(name)
            return arr[:length]
        have = 0 if arr is None else len(arr)
        new = stream_tokens(stable_hash(name), 0, max(length, 2 * have))
        memo[name] = new
        memo.move_to_end(name)
        self._cached_tokens += len(new) - have
        while self._cached_tokens > self._budget and len(memo) > 1:
            _, old = memo.popitem(last=False)
            self._cached_tokens -= len(old)
        return new[:length]

    def segment(self, seg: Segment, request_key: str, position: int) -> np.ndarray:
        """The token ids of one segment of a request (``position`` = the segment's index)."""
        if seg.kind == "shared":
            return self.stream(seg.name, seg.length)
        if seg.kind == "unique":
            return self.stream(unique_stream(request_key, position), seg.length)
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

    def output_tokens(self, req: Request, length: int, start: int = 0, sample: int = 0) -> np.ndarray:
        """Tokens [start, start+length) that sample ``sample`` of a request generates (int32).

        Sample 0 of a request whose ``output`` names its answer emits that stream (a later prompt may
        re-send it). Every other sample emits a stream of its own, named from the request id and the
        sample index, which no prompt can name: its blocks are hit only by the sample itself, after
        a preemption (as vLLM hashes sampled tokens too). Parallel samples share their first token,
        sample 0's (they are forked after it is sampled)."""
        if length <= 0:
            return np.zeros(0, dtype=np.int32)
        if sample and start == 0:
            first = self.output_tokens(req, 1, 0, 0)
            return np.concatenate([first, self.output_tokens(req, length - 1, 1, sample)])
        if sample == 0 and req.output is not None:
            return self.stream(req.output, length, start)
        # one-off streams: computed directly, never memoised (they would crowd out shared prefixes)
        return stream_tokens(stable_hash(sample_stream(req.id, sample)), start, length)


def encode_text(text: str, tokenizer=None) -> list[int]:
    """Tokenize a ``text`` segment: with a Hugging Face tokenizer when one is given, else bytes.

    The byte fallback (UTF-8 byte b -> id 3 + b) keeps traces with text usable offline; it counts
    about 4x more tokens than a BPE tokenizer would for English.
    """
    if tokenizer is not None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return [3 + b for b in text.encode("utf-8")]


def block_keys(tokens: np.ndarray, block_size: int, n_blocks: int | None = None,
               parent: int = ROOT_KEY, as_array: bool = False):
    """Chained keys of the first ``n_blocks`` full blocks of ``tokens`` (all full blocks if None): a
    list of ints, or (``as_array``) a uint64 array."""
    if n_blocks is None:
        n_blocks = len(tokens) // block_size
    if n_blocks <= 0:
        return np.zeros(0, dtype=np.uint64) if as_array else []
    toks = np.ascontiguousarray(tokens[: n_blocks * block_size], dtype=np.int32)
    if len(toks) < n_blocks * block_size:
        raise ValueError(f"{n_blocks} blocks of {block_size} need {n_blocks * block_size} tokens, not {len(toks)}")
    if n_blocks > FEW_BLOCKS:
        keys_of = compiled().block_keys_of(toks, n_blocks, block_size, np.uint64(parent))
        return keys_of if as_array else keys_of.tolist()
    # a decode step's block or a few: the xxhash library's own xxh3 (numba's call costs ~3 us more)
    buf, step, h = toks.tobytes(), block_size * 4, xxhash.xxh3_64_intdigest
    keys = [0] * n_blocks
    key = parent
    for i in range(n_blocks):
        key = keys[i] = h(buf[i * step:(i + 1) * step], key)
    return np.array(keys, dtype=np.uint64) if as_array else keys
