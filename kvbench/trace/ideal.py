"""The ideal prefix hit rate of a trace (spec §4): infinite cache, no concurrency, trace order.

Each request looks up the longest run of its prompt's whole blocks already seen (never the block that
holds the last prompt token, which must be computed to produce the first output token); then its
prompt, and where ``output`` names the answer the first output_len - 1 answer tokens too (the tokens
whose KV is computed during decode), are cached in whole blocks. Hit rate = hit tokens / prompt tokens.

Radix runs use a token-granular ideal (``radix_ideal_hits``, ``RadixIdealCounter``): the same, but a
request hits the longest common prefix, to the token, of its prompt (never its last token) with any
sequence cached before it, as a radix tree of tokens would. It is the block ideal plus, where the
whole blocks stop, the most tokens of the next block that some earlier sequence continued with.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvbench.trace.format import Request
from kvbench.trace.keys import (
    _NO_NAMES,
    _NO_TOKENS,
    PrefixKeys,
    _ideal_core,
    cached_answer_len,
    cached_pieces,
    lookup_blocks,
)
from kvbench.trace.tokens import ROOT_KEY, TokenStreams, compiled


@dataclass(frozen=True, slots=True)
class IdealHits:
    hit_tokens: int
    prompt_tokens: int
    distinct_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class IdealCounter:
    """The infinite cache of the ideal hit rate, fed one request at a time in trace order.

    It keeps the keys a later request could hit. Keys from a request's first block holding a token of
    its own (``unique`` segment; ``shareable`` in ``add``) on can never hit: they are counted, not
    kept, so the memory grows with the shared content of a trace, not with its length (a trace of 10^6
    requests with unique prompts would otherwise hold ~10^8 keys). Fed ``expires`` (block_expiry), it
    also lets go of a key once no later request can hit it -- the last request naming the piece its
    block ends in has been counted -- so the memory is the shared content still to be used: a day of
    conversations holds its open conversations' keys, not the day's.

    The keys live in compiled arrays (kvbench.trace.compiled_ideal: a hash table of uint64 keys, and
    the keys still to let go as lists under a heap of their expiries), one compiled call per request;
    ``seen`` is a read-only view of them (``len``, ``in``, iteration)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.kept_blocks = 0  # distinct blocks ever kept (some since let go)
        self.private_blocks = 0  # distinct blocks never kept (they cannot hit)
        self.hit_tokens = 0
        self.prompt_tokens = 0
        cc = _ideal_core()
        self._tk = np.zeros(_TABLE, dtype=np.uint64)  # the kept keys: an open-addressing table
        self._occ = np.zeros(_TABLE, dtype=np.uint8)  # 1 where a slot holds a key
        self._nkey = np.zeros(_NODES, dtype=np.uint64)  # the keys to let go, as lists of nodes
        self._nnext = np.arange(1, _NODES + 1, dtype=np.int64)
        self._nnext[-1] = -1
        self._heap = np.zeros((2, _HEAP), dtype=np.int64)  # (expiry, a list's first node), a min-heap
        self._c = np.zeros(4, dtype=np.int64)  # compiled_ideal's counters
        self._c[cc.NFREE] = _NODES

    @property
    def seen(self) -> KeptKeys:
        """The keys kept now (a view)."""
        return KeptKeys(self)

    def add(self, keys: np.ndarray, prompt_len: int, shareable: int | None = None,
            expires: np.ndarray | None = None, at: int = 0) -> int:
        """Look a request up, then cache it; returns its hit tokens. ``shareable``: how many leading
        blocks another request could share (PrefixKeys.shareable_blocks); None: all. ``expires``: per
        block, the trace position of the last request that can hit it; ``at``: this request's (keys
        whose last user came before it are let go first)."""
        n = len(keys)
        end = n if shareable is None or shareable >= n else shareable
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        expiring = expires is not None
        exp = np.ascontiguousarray(expires, dtype=np.int64) if expiring else _NO_EXPIRY
        if expiring and len(exp) < end:
            raise ValueError(f"expires has {len(exp)} blocks, fewer than the {end} kept")
        while True:
            # keys[:m] are kept already (see _seen_prefix); keys[m:end] are kept now, new counts
            m, new = _ideal_core().add(self._tk, self._occ, self._nkey, self._nnext, self._heap, self._c,
                                  keys, exp, end, at, expiring)
            if m >= 0:
                break
            self._grow(new, expiring)
        h = min(m, lookup_blocks(prompt_len, self.block_size)) * self.block_size
        self.hit_tokens += h
        self.prompt_tokens += prompt_len
        if end < n:
            self.private_blocks += n - max(m, end)
        self.kept_blocks += new
        return h

    def _grow(self, room: int, expiring: bool) -> None:
        """Make room for ``room`` more keys: the table at most half full, and, when they are to be let
        go (``expiring``), a list node and a heap entry for each. (Nothing shrinks once let go, as a
        Python set does not.)"""
        cc, c = _ideal_core(), self._c
        size = len(self._occ)
        while 2 * (int(c[cc.N]) + room) > size:
            size *= 2
        if size > len(self._occ):
            tk, occ = np.zeros(size, dtype=np.uint64), np.zeros(size, dtype=np.uint8)
            cc.rehash(self._tk, self._occ, tk, occ)
            self._tk, self._occ = tk, occ
        nodes = len(self._nkey)
        if not expiring:
            return
        if int(c[cc.NFREE]) < room:
            grown = max(2 * nodes, nodes + room)
            nkey, nnext = np.zeros(grown, dtype=np.uint64), np.arange(1, grown + 1, dtype=np.int64)
            nkey[:nodes], nnext[:nodes] = self._nkey, self._nnext
            nnext[-1] = c[cc.FREE]  # the new nodes go before the free ones
            c[cc.FREE] = nodes
            c[cc.NFREE] += grown - nodes
            self._nkey, self._nnext = nkey, nnext
        entries = self._heap.shape[1]
        if int(c[cc.HEAP]) + room > entries:
            heap = np.zeros((2, max(2 * entries, int(c[cc.HEAP]) + room)), dtype=np.int64)
            heap[:, :entries] = self._heap
            self._heap = heap

    def result(self) -> IdealHits:
        return IdealHits(self.hit_tokens, self.prompt_tokens, self.kept_blocks + self.private_blocks)


class KeptKeys:
    """IdealCounter's kept keys, read-only: ``len``, ``key in``, and iteration (as ints)."""

    def __init__(self, counter: IdealCounter):
        self._counter = counter

    def __len__(self) -> int:
        c = self._counter
        return int(c._c[_ideal_core().N])

    def __contains__(self, key: object) -> bool:
        c = self._counter
        if not isinstance(key, (int, np.integer)) or not 0 <= int(key) < 2**64:
            return False
        return bool(_ideal_core().contains(c._tk, c._occ, np.uint64(key)))

    def __iter__(self) -> Iterator[int]:
        c = self._counter
        return iter(c._tk[c._occ != 0].tolist())


_TABLE, _NODES, _HEAP = 1024, 1024, 256  # IdealCounter's first sizes (grown as needed)
_NO_EXPIRY = np.zeros(0, dtype=np.int64)
_NO_LAST_USE = np.zeros(0, dtype=np.int64)


NEVER = np.iinfo(np.int64).max  # a block_expiry that never comes: literal tokens may recur anywhere


def block_expiry(pieces, n_blocks: int, block_size: int, names) -> np.ndarray:
    """int64 [n_blocks]: per whole block of a request's cached sequence (PrefixKeys.with_pieces's
    ``pieces``), the trace position of the last request that can hit it: that of the last request
    naming the piece its last token lies in (``names``: kvbench.trace.stream.SharedNames), since a
    later prompt can only reproduce the block's chained key with that piece's tokens; NEVER for
    literal tokens, -1 for a piece no other request names. One compiled call: SharedNames' seeds are
    looked up in its hash table (SharedNames.table); a ``names`` without one is asked ``last_uses``
    of the pieces' seeds."""
    seeds = np.ascontiguousarray(pieces.seeds, dtype=np.uint64)
    table = getattr(names, "table", None)
    if table is None:
        nk, nocc, nv = _NO_NAMES
        per_piece = np.ascontiguousarray(names.last_uses(seeds), dtype=np.int64)  # (empty: no pieces)
    else:
        (nk, nocc, nv), per_piece = table(), _NO_LAST_USE
    return _ideal_core().block_expiry(np.ascontiguousarray(pieces.lengths, dtype=np.int64),
                                np.ascontiguousarray(pieces.literal_at, dtype=np.int64), seeds, nk, nocc, nv,
                                per_piece, int(n_blocks), int(block_size))


def dense_block_ids(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 ids, uint64 distinct keys): each key's index among the distinct keys, numbered in order
    of first appearance (as pandas.factorize numbers them)."""
    return compiled().dense_ids(np.ascontiguousarray(keys, dtype=np.uint64))


def parent_block_ids(ids: np.ndarray, starts: np.ndarray, n_distinct: int) -> np.ndarray:
    """int64 [n_distinct]: the dense id of the block before each block in the requests that hold it
    (-1 for a first block); one id, since a chained key covers its parent's. Request i's blocks are
    ``ids[starts[i]:starts[i+1]]``."""
    return compiled().parent_ids(ids, starts, n_distinct)


def ideal_hit_blocks(ids: np.ndarray, starts: np.ndarray, lookups: np.ndarray) -> np.ndarray:
    """The whole blocks each request hits in IdealCounter (the same figures), from dense ids numbered
    by first appearance (dense_block_ids): a block was seen before request i iff its id is below the
    number of distinct blocks of requests 0..i-1, so no set of keys is kept. Request i's blocks are
    ``ids[starts[i]:starts[i+1]]``; it may hit its first ``lookups[i]`` (<= its blocks)."""
    return compiled().ideal_hit_blocks(ids, starts, lookups)


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
        h = counter.add(*keys_of(req), keys_of.shareable_blocks(req))
        if on_request is not None:
            on_request(req, h)
    return counter.result()


def _seen_prefix(keys: np.ndarray, seen: set[int]) -> int:
    """Length of the longest prefix of ``keys`` already in ``seen``, by binary search.

    Valid because ``seen`` is prefix-closed: a chained key covers every block before it, and every
    sequence caches all its leading whole blocks, so if key i was seen then keys 0..i were too. Keys
    let go (IdealCounter's expiry) keep it so for every request still to come: a request that shares
    key i names every piece of blocks 0..i, so none of their keys has expired yet.
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


def ideal_hit_rate(requests: Iterable[Request], block_size: int,
                   streams: TokenStreams | None = None) -> float:
    return ideal_hits(requests, block_size, streams).hit_rate


# ------------------------------------------------------------------------- token granularity

def radix_ideal_hits(requests: Sequence[Request], block_size: int,
                     streams: TokenStreams | None = None, *,
                     on_request: Callable[[Request, int], None] | None = None) -> IdealHits:
    """The token-granular ideal (radix runs) over requests in the given (trace) order.

    Whole blocks first, as ``ideal_hits``; then, where request i's whole blocks stop after key K
    (a block of its prompt that no earlier sequence had there), its next tokens are compared with
    every continuation of K cached before it: the block that followed K in an earlier sequence, or
    that sequence's partial last block. The longest common prefix, capped at the last prompt token,
    is added. A token trie of the whole trace would not fit in memory (Mooncake: 145 M prompt
    tokens), so this takes two passes and keeps tokens only for the continuations of keys where some
    request's whole blocks stop (at most one key per request):

    1. block hits, as ``IdealCounter``, noting each request's stop key K and its room left;
    2. in trace order, each request first takes its extension from the continuations of its K
       recorded so far, then records its own continuations of every stop key on its path.

    The continuations are the tokens the engine caches there: the cached sequence (prompt and a
    named answer), and at the prompt's end the first tokens every sample generates (the engine keeps
    them in the block after the prompt, so a later prompt may match them by chance). Blocks wholly
    of sampled tokens are left out: a prompt reaches them only with a whole block equal by chance.
    ``on_request(req, hit_tokens)`` is called once per request, in order.
    """
    streams = streams or TokenStreams()
    bs = block_size
    keys_of = PrefixKeys(bs, streams)
    seen: set[int] = set()
    all_keys: list[np.ndarray] = []
    stops: list[tuple[int, int, int]] = []  # (whole blocks hit, stop key, tokens left before the last)
    prompt_total = 0
    for req in requests:  # pass 1: whole blocks
        keys, prompt_len = keys_of(req)
        m = _seen_prefix(keys, seen)
        hit = min(m, lookup_blocks(prompt_len, bs))
        seen.update(keys[m:].tolist())
        all_keys.append(keys)
        stops.append((hit, int(keys[hit - 1]) if hit else ROOT_KEY, min(prompt_len - 1 - hit * bs, bs - 1)))
        prompt_total += prompt_len
    stop_keys = {k for _, k, room in stops if room > 0}
    wanted = np.fromiter(stop_keys, dtype=np.uint64, count=len(stop_keys))
    conts: dict[tuple[int, int], list[np.ndarray]] = {}  # (stop key, first token) -> continuations
    known: set[tuple[int, bytes]] = set()
    hit_total = 0
    for i, req in enumerate(requests):  # pass 2: extensions, then this request's continuations
        hit, key, room = stops[i]
        ext = 0
        if room > 0:
            want = _cached_tokens(req, streams, hit * bs, hit * bs + room)
            for row in conts.get((key, int(want[0])), ()):
                n = min(len(row), room)
                diff = np.flatnonzero(row[:n] != want[:n])
                ext = max(ext, int(diff[0]) if len(diff) else n)
        h = hit * bs + ext
        hit_total += h
        if on_request is not None:
            on_request(req, h)
        if not len(wanted):
            continue
        keys = all_keys[i]
        at = (np.flatnonzero(np.isin(keys, wanted)) + 1).tolist()  # blocks whose parent is a stop key
        if ROOT_KEY in stop_keys:
            at.insert(0, 0)
        if not at:
            continue
        parents = [int(keys[p - 1]) if p else ROOT_KEY for p in at]
        length = req.prompt_len + cached_answer_len(req)
        for p, parent in zip(at, parents):
            if p * bs < length:
                _remember(conts, known, parent, _cached_tokens(req, streams, p * bs, min(length, (p + 1) * bs)))
        # the block after the prompt, as each sample computes it
        end = req.prompt_len // bs
        if end in at and req.output_len > 1:
            parent = parents[at.index(end)]
            head = _cached_tokens(req, streams, end * bs, req.prompt_len)
            for sample in range(req.n):
                if sample == 0 and req.output is not None:
                    continue  # the cached sequence's own block, remembered above
                gen = streams.output_tokens(req, min(req.output_len - 1, bs - len(head)), sample=sample)
                _remember(conts, known, parent, np.concatenate([head, gen]))
    return IdealHits(hit_total, prompt_total, len(seen))


def _remember(conts: dict, known: set, parent: int, row: np.ndarray) -> None:
    if len(row) and (parent, row.tobytes()) not in known:
        known.add((parent, row.tobytes()))
        conts.setdefault((parent, int(row[0])), []).append(row)


def _cached_tokens(req: Request, streams: TokenStreams, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the request's cached sequence, without expanding the rest."""
    out = []
    pos = 0
    for name, what in cached_pieces(req, streams):
        length = what if name is not None else len(what)
        lo, hi = max(start, pos), min(stop, pos + length)
        if lo < hi:
            out.append(streams.stream(name, hi - lo, start=lo - pos) if name is not None
                       else what[lo - pos:hi - pos])
        pos += length
        if pos >= stop:
            break
    return out[0] if len(out) == 1 else np.concatenate(out) if out else _NO_TOKENS


class RadixIdealCounter:
    """``IdealCounter``'s interface for radix runs: fed the requests a run admits, one at a time in
    trace order (``add``), it gives the token-granular ideal of those fed so far (``result``), so an
    interrupted run's ideal covers what it admitted. ``requests``: every request the run may admit,
    in trace order; ``radix_ideal_hits`` runs over them once, here (it needs the whole trace)."""

    def __init__(self, block_size: int, requests: Sequence[Request], streams: TokenStreams | None = None):
        self.block_size = block_size
        self._hits: list[tuple[int, int]] = []  # (hit tokens, prompt tokens) per request, in order
        done = radix_ideal_hits(requests, block_size, streams,
                                on_request=lambda r, h: self._hits.append((h, r.prompt_len)))
        self._distinct = done.distinct_blocks
        self.count = self.hit_tokens = self.prompt_tokens = 0

    def add(self, keys: np.ndarray, prompt_len: int, shareable: int | None = None,
            expires: np.ndarray | None = None, at: int = 0) -> int:
        """The next request was admitted (its block keys are not needed); returns its hit tokens."""
        h, n = self._hits[self.count]
        if n != prompt_len:
            raise ValueError("RadixIdealCounter fed out of order")
        self.count += 1
        self.hit_tokens += h
        self.prompt_tokens += n
        return h

    def result(self) -> IdealHits:
        """The distinct whole blocks are the whole trace's (not only of the requests fed so far)."""
        return IdealHits(self.hit_tokens, self.prompt_tokens, self._distinct)
