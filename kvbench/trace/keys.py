"""A request's tokens and block keys, as every layer builds them: which blocks a prompt may hit (the
lookup rule), the tokens a sequence computes (its prompt, then its answer), and the chained block keys
of a whole trace (PrefixKeys), built from flat arrays of pieces (FlatPieces) by one compiled pass.

The rule every cache shares: a lookup never covers the block that holds the prompt's last token (it
must be computed to produce the first output token); a named answer's first output_len - 1 tokens
are computed during decode and cached too, so a later request that re-sends the answer can hit them.
"""
from __future__ import annotations

import functools
from collections.abc import Container, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from kvbench.trace.format import Request
from kvbench.trace.tokens import (
    ROOT_KEY,
    TokenStreams,
    compiled,
    sample_stream,
    stable_hash,
    unique_stream,
)


class FlatPieces(NamedTuple):
    """Requests' cached sequences as flat arrays of pieces (compiled.trace_keys reads them): request r's
    pieces are ``pieces_at[r]:pieces_at[r+1]``, each a stream (``seeds[p]``, its first ``lengths[p]``
    tokens; ``literal_at[p]`` -1) or literal tokens (``literals[literal_at[p]:][:lengths[p]]``)."""

    seeds: np.ndarray  # uint64 [pieces]
    lengths: np.ndarray  # int64 [pieces]
    literal_at: np.ndarray  # int64 [pieces]
    memoise: np.ndarray  # bool [pieces]: a named stream another request names too
    pieces_at: np.ndarray  # int64 [requests + 1]
    literals: np.ndarray  # int32 [literal tokens]
    prompt_lens: np.ndarray  # int64 [requests]
    seq_lens: np.ndarray  # int64 [requests]: the prompt and a named answer's computed part
    shareable_at: np.ndarray  # int64 [requests]: prompt tokens before its first piece of its own; -1: none


class RequestKeys(NamedTuple):
    """One request's block keys (of its cached sequence), prompt length and pieces."""

    keys: np.ndarray  # uint64 [whole blocks of the cached sequence]
    prompt_len: int
    pieces: FlatPieces
    shareable: int | None  # PrefixKeys.shareable_blocks of the request


def lookup_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading whole blocks of a prompt may be served from cache (not the last token's)."""
    return (prompt_len - 1) // block_size


def cached_answer_len(req: Request) -> int:
    """How many tokens of the answer a later request may hit: a named answer's computed part (its
    first output_len - 1 tokens; the last is sampled, never fed back), 0 for an unnamed answer."""
    return req.output_len - 1 if req.output is not None and req.output_len > 1 else 0


def cached_sequence(req: Request, prompt: np.ndarray, streams: TokenStreams) -> np.ndarray:
    """The tokens a later request may hit once this one finishes: prompt, plus a named answer's
    computed part (the ideal hit rate's view: an unnamed answer is never re-sent)."""
    answer = cached_answer_len(req)
    return np.concatenate([prompt, streams.output_tokens(req, answer)]) if answer else prompt


def sequence_tokens(req: Request, prompt: np.ndarray, streams: TokenStreams, sample: int = 0) -> np.ndarray:
    """Every token whose KV sample ``sample`` of the request computes: the prompt and the first
    output_len - 1 generated tokens (the last one is sampled, never fed back). The engine hashes
    them all into the prefix cache, as vLLM does with sampled tokens."""
    if req.output_len <= 1:
        return prompt
    return np.concatenate([prompt, streams.output_tokens(req, req.output_len - 1, sample=sample)])


def sequence_tokens_of(req: Request, pieces: FlatPieces) -> np.ndarray:
    """``sequence_tokens(req, prompt, streams)`` (sample 0) from the request's pieces
    (PrefixKeys.with_pieces): its cached sequence, then, for an answer the trace does not name, the
    answer's own stream, filled by one compiled call."""
    n = int(pieces.seq_lens[0])
    extra = max(req.output_len - 1, 0) - cached_answer_len(req)  # the computed answer the pieces lack
    out = np.empty(n + extra, dtype=np.int32)
    c = compiled()
    c.fill_pieces(pieces.seeds, pieces.lengths, pieces.literal_at, pieces.literals, out)
    if extra:  # (TokenStreams.output_tokens of sample 0: the stream no prompt can name)
        c.fill_stream(out[n:], np.uint64(stable_hash(sample_stream(req.id, 0))), 0)
    return out


class PrefixKeys:
    """Block keys of requests' cached sequences at one block size (``block_keys`` of
    ``cached_sequence``, computed without expanding prompts), memoising the keys of block-aligned
    shared segments across requests.

    The memo: a named stream read from a block boundary has keys fixed by (parent key, stream,
    length), so a real trace's repeated segments (Mooncake's hash ids are prefix-chained: the same
    segment follows the same parent) are neither generated nor hashed again. Streams only one request
    uses (count_once), unique and literal segments are never stored. Bounded: at most
    ``memo_keys`` keys (8 bytes each) in at most ``memo_entries`` / 2 segments, in a table of
    ``memo_entries`` slots (32 bytes each), the whole memo flushed when either is full: 16 MB + 4 MB
    by default (Mooncake: 44,000 segments, 105,000 hits, no flush at block 512 or 16)."""

    def __init__(self, block_size: int, streams: TokenStreams | None = None, *,
                 memo_keys: int = 2**21, memo_entries: int = 2**17):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if memo_entries < 2 or memo_entries & (memo_entries - 1):
            raise ValueError("memo_entries must be a power of 2, >= 2")
        self.block_size = block_size
        self.streams = streams or TokenStreams()
        # shared streams only one request uses (count_once; or stream.OnceNames, which asks by name)
        self.once: Container[str] = frozenset()
        self._memo_key = np.zeros(2 * memo_entries, dtype=np.uint64)  # (parent, stream seed) per slot
        self._memo_len = np.full(memo_entries, -1, dtype=np.int64)  # segment length; -1: empty slot
        self._memo_at = np.zeros(memo_entries, dtype=np.int64)  # where its keys start in the pool
        self._memo_pool = np.zeros(memo_keys, dtype=np.uint64)
        self.memo_state = np.zeros(4, dtype=np.int64)  # entries, pool keys used, hits, flushes

    def __call__(self, req: Request) -> tuple[np.ndarray, int]:
        """(uint64 keys of every whole block of the cached sequence, prompt length)."""
        got = self.with_pieces(req)
        return got.keys, got.prompt_len

    def with_pieces(self, req: Request) -> RequestKeys:
        """``self(req)``, the request's pieces, from which ``sequence_tokens_of`` builds its tokens
        later without expanding a segment again, and ``shareable_blocks(req)``, read off the pieces."""
        flat = _flatten([req], self.streams, self.once)
        keys, _ = self.keys_of_pieces(*flat[:6], seq_lens=flat.seq_lens)
        at = int(flat.shareable_at[0])
        return RequestKeys(keys, int(flat.prompt_lens[0]), flat, at // self.block_size if at >= 0 else None)

    def many(self, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every request's keys at once: (uint64 keys, flattened; int64 [len+1] where request i's
        start; int64 prompt lengths). ``keys[starts[i]:starts[i+1]]`` is ``self(requests[i])[0]``."""
        flat = _flatten(requests, self.streams, self.once)
        return (*self.keys_of_pieces(*flat[:6], seq_lens=flat.seq_lens), flat.prompt_lens)

    def keys_of_pieces(self, seeds, lengths, literal_at, memoise, pieces_at, literals, *,
                       seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``many``'s (keys, starts) from requests already flattened into pieces (``_flatten``'s arrays,
        or kvbench.trace.pieces.Pieces's: ``memoise`` says which named streams other requests use)."""
        starts = np.zeros(len(pieces_at), dtype=np.int64)
        np.cumsum(seq_lens // self.block_size, out=starts[1:])
        keys = np.empty(int(starts[-1]), dtype=np.uint64)
        compiled().trace_keys(seeds, lengths, literal_at, memoise, pieces_at, literals, self.block_size,
                              np.uint64(ROOT_KEY), starts, keys, self._memo_key, self._memo_len,
                              self._memo_at, self._memo_pool, self.memo_state)
        return keys, starts

    def count_once(self, requests: Iterable[Request]) -> None:
        """Note the shared streams that only one of ``requests`` uses (in a prompt, or as the answer
        it names): like a unique segment, such a stream's blocks can never be hit by another request,
        so shareable_blocks stops before them and their keys are not memoised. On the Mooncake trace
        most 512-token hash ids are used once."""
        self.once = once_streams(requests)

    def shareable_blocks(self, req: Request) -> int | None:
        """How many leading blocks another request could share: the blocks before the first one holding
        a token of the request's own — a ``unique`` segment, or a shared stream no other request uses
        (count_once) — since every key after it is chained to it; None when there is none."""
        pos = 0
        once = self.once
        for i, seg in enumerate(req.prompt):
            if seg.length > 0 and (seg.kind == "unique" or (seg.kind == "shared" and seg.name in once)):
                return pos // self.block_size
            # a text segment's length is known once tokenized (Segment.length is 0)
            pos += len(self.streams.segment(seg, req.id, i)) if seg.kind == "text" else seg.length
        return None


def once_streams(requests: Iterable[Request]) -> frozenset[str]:
    """The shared streams only one of ``requests`` names (in a prompt, or as its answer)."""
    seen: set[str] = set()
    twice: set[str] = set()
    for r in requests:
        names = {seg.name for seg in r.prompt if seg.kind == "shared"}
        if r.output is not None:
            names.add(r.output)
        twice |= names & seen
        seen |= names
    return frozenset(seen - twice)


def cached_pieces(req: Request, streams: TokenStreams):
    """The cached sequence (as in cached_sequence) in pieces: ``(name, length)`` for a named stream,
    ``(None, tokens)`` for any other segment."""
    for i, seg in enumerate(req.prompt):
        if seg.kind == "shared":
            yield seg.name, seg.length
        else:
            yield None, streams.segment(seg, req.id, i)
    if answer := cached_answer_len(req):
        yield req.output, answer


_NO_TOKENS = np.zeros(0, dtype=np.int32)


def _flatten(requests: Sequence[Request], streams: TokenStreams, once: Container[str]) -> FlatPieces:
    """The requests' cached sequences as flat arrays of pieces for compiled.trace_keys (see there):
    a shared, unique or answer stream is (seed, length); literal tokens are (their place in
    ``literals``, length). ``memoise``: a named stream other requests use too. ``shareable_at``: as
    PrefixKeys.shareable_blocks counts, in tokens (one compiled call, compiled_ideal.keep_shared)."""
    seeds: list[int] = []
    lengths: list[int] = []
    literal_at: list[int] = []  # -1: a stream
    memoise: list[bool] = []
    pieces_at = [0]
    literals: list[np.ndarray] = []
    n_literal = 0
    prompt_lens: list[int] = []
    answers: list[int] = []
    # the loop runs once per segment of the trace (Mooncake: 288,500): local names, no calls per
    # shared segment but the name's hash (stable_hash: TokenStreams.stream's seed, one rule)
    add_seed, add_length = seeds.append, lengths.append
    add_at, add_memo = literal_at.append, memoise.append
    # stream.OnceNames is asked for every seed at once (its names' hash table, in the compiled call
    # after the loop, not one search a name): named pieces are marked True here
    by_seed = getattr(once, "names_table", None)
    for req in requests:
        prompt_len = 0
        for i, seg in enumerate(req.prompt):
            kind = seg.kind
            if kind == "shared":
                name = seg.name
                add_seed(stable_hash(name))
                add_length(seg.length)
                add_at(-1)
                add_memo(True if by_seed is not None else name not in once)
                prompt_len += seg.length
            elif kind == "unique":
                add_seed(stable_hash(unique_stream(req.id, i)))
                add_length(seg.length)
                add_at(-1)
                add_memo(False)
                prompt_len += seg.length
            else:
                toks = streams.segment(seg, req.id, i)
                add_seed(0)
                add_length(len(toks))
                add_at(n_literal)
                add_memo(False)
                literals.append(toks)
                n_literal += len(toks)
                prompt_len += len(toks)
        answer = cached_answer_len(req)
        if answer:
            add_seed(stable_hash(req.output))
            add_length(answer)
            add_at(-1)
            add_memo(True if by_seed is not None else req.output not in once)
        pieces_at.append(len(seeds))
        prompt_lens.append(prompt_len)
        answers.append(answer)
    prompt = np.array(prompt_lens, dtype=np.int64)
    seed_a, memo_a = np.array(seeds, dtype=np.uint64), np.array(memoise, dtype=np.bool_)
    length_a, at_a = np.array(lengths, dtype=np.int64), np.array(literal_at, dtype=np.int64)
    starts_a = np.array(pieces_at, dtype=np.int64)
    answer_a = np.array(answers, dtype=np.int64)
    shareable_at = np.empty(len(prompt_lens), dtype=np.int64)
    nk, nocc, _ = by_seed() if by_seed is not None else _NO_NAMES
    _ideal_core().keep_shared(seed_a, length_a, at_a, memo_a, starts_a, answer_a, nk, nocc, by_seed is not None,
                              shareable_at)
    return FlatPieces(seed_a, length_a, at_a, memo_a, starts_a,
                      np.ascontiguousarray(np.concatenate(literals) if literals else _NO_TOKENS, dtype=np.int32),
                      prompt, prompt + answer_a, shareable_at)


_NO_NAMES = (np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint8), np.zeros(1, dtype=np.int64))


@functools.cache
def _ideal_core():
    """kvbench.trace.compiled_ideal (the names' hash table's functions; ideal's counter), imported on
    first use (numba costs ~0.2 s to import), as kvbench.trace.tokens.compiled imports
    kvbench.trace.compiled."""
    from kvbench.trace import compiled_ideal
    return compiled_ideal
