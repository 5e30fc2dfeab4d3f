"""The what-if's model of a trace (``BlockTrace``): every request's whole blocks as dense ids, how many
of them it may look up, the ceiling, belady's next uses, built once by ``prepare`` and shared by every
(budget, policy) point; and what a policy reads of it (``DenseView``).

prepare's costly part, hashing the trace into blocks (``HashedTrace``), depends on the trace and the
block size alone, so a trace file's is kept on disk (``read_hashed_cached``, kvbench.trace.cache's
rule) and a later question at that block size starts from it."""
from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvbench.memory.policy_base import CacheView
from kvbench.trace import cache
from kvbench.trace.format import Request
from kvbench.trace.ideal import dense_block_ids, ideal_hit_blocks, parent_block_ids
from kvbench.trace.keys import PrefixKeys, lookup_blocks
from kvbench.trace.pieces import Pieces
from kvbench.trace.tokens import TokenStreams

PREPARE_STREAM_TOKENS = 2**20  # the token streams' memo while prepare hashes the trace (4 MB)


@dataclass(slots=True)
class BlockTrace:
    """A trace reduced to what the what-if needs, built once and shared by every point.

    ``ids[starts[i]:starts[i+1]]``: request i's whole blocks as dense ids (0..distinct_blocks-1, in
    order of first appearance); ``lookups[i]``: how many leading ones it may hit; ``next_use``
    (aligned with ``ids``, only for belady): the next request that looks each block up;
    ``partial[i]``: its sequence ends inside a block (radix mode reserves that block too, as SGLang
    allocates the partial last page, and frees it at the end). ``arrival_s[i]``: its arrival, the
    time policies are told; ``parent[d]``: the id before block d in every request that holds it
    (-1 for a first block), since keys are chained.
    """

    block_size: int
    ids: np.ndarray  # int64 [total blocks]
    starts: np.ndarray  # int64 [requests + 1]
    lookups: np.ndarray  # int64 [requests]
    prompt_lens: np.ndarray  # int64 [requests]
    distinct_blocks: int
    window_start: int  # first request counted (after the warm-up)
    ceiling_hit_tokens: int  # infinite cache, same window
    next_use: np.ndarray | None = None  # int64 [total blocks]
    partial: np.ndarray | None = None  # bool [requests]
    arrival_s: np.ndarray | None = None  # float64 [requests]
    parent: np.ndarray | None = None  # int64 [distinct blocks]
    keys: np.ndarray | None = None  # uint64 [distinct blocks]: the block key behind each dense id
    sessions: list | None = None  # str | None per request: what the session router reads

    @property
    def requests(self) -> int:
        return len(self.lookups)

    @property
    def window_prompt_tokens(self) -> int:
        return int(self.prompt_lens[self.window_start:].sum())

    @property
    def ceiling(self) -> float:
        p = self.window_prompt_tokens
        return self.ceiling_hit_tokens / p if p else 0.0

    def future(self, budget_blocks: int) -> np.ndarray:
        """Belady's next uses at a budget: a request too large to run whole there looks up only its
        first ``budget_blocks`` blocks (else belady would keep blocks for lookups that never happen)."""
        if self.next_use is None:
            raise ValueError("belady needs the BlockTrace built with future=True")
        if not (self.lookups > budget_blocks).any():
            return self.next_use
        from kvbench.whatif.compiled import next_uses_dense

        return next_uses_dense(self.ids, self.starts, np.minimum(self.lookups, budget_blocks))


def window_start(requests: int, warmup: float) -> int:
    """Index of the first request after the warm-up fraction (the window keeps at least one)."""
    return min(int(warmup * requests), max(requests - 1, 0))


@dataclass(frozen=True, slots=True)
class HashedTrace:
    """A trace hashed into whole blocks at one block size: what ``prepare`` needs of it before any
    warm-up or policy (fields as BlockTrace's; ``hit_blocks[i]``: request i's blocks an infinite cache
    hits, IdealCounter's figures, from which a warm-up's ceiling is summed)."""

    block_size: int
    ids: np.ndarray  # int64 [total blocks]
    starts: np.ndarray  # int64 [requests + 1]
    lookups: np.ndarray  # int64 [requests]
    prompt_lens: np.ndarray  # int64 [requests]
    keys: np.ndarray  # uint64 [distinct blocks]
    hit_blocks: np.ndarray  # int64 [requests]
    partial: np.ndarray  # bool [requests]
    arrival_s: np.ndarray  # float64 [requests]
    parent: np.ndarray  # int64 [distinct blocks]
    sessions: list  # str | None per request

    @classmethod
    def of(cls, p: Pieces, block_size: int) -> HashedTrace:
        """Hash every request once and remap the keys to dense ids (in order of first appearance)."""
        flat, starts = PrefixKeys(block_size).keys_of_pieces(p.seeds, p.lengths, p.literal_at, p.memoise,
                                                             p.pieces_at, p.literals, seq_lens=p.seq_lens)
        lookups = np.minimum(lookup_blocks(p.prompt_lens, block_size), np.diff(starts))
        ids, keys = dense_block_ids(flat)
        del flat
        return cls(block_size, ids, starts, lookups, p.prompt_lens, keys, ideal_hit_blocks(ids, starts, lookups),
                   p.seq_lens % block_size != 0, p.arrival_s, parent_block_ids(ids, starts, len(keys)), p.sessions)

    def arrays(self) -> dict[str, np.ndarray]:
        """Its fields as named arrays: a cache entry's (``from_arrays`` reads them back)."""
        return ({name: getattr(self, name) for name in _HASHED_ARRAYS} | cache.session_arrays(self.sessions)
                | {"block_size": np.array(self.block_size)})

    @classmethod
    def from_arrays(cls, a: Mapping[str, np.ndarray]) -> HashedTrace:
        return cls(block_size=int(a["block_size"]), sessions=cache.sessions_of(a),
                   **{name: a[name] for name in _HASHED_ARRAYS})


_HASHED_ARRAYS = ("ids", "starts", "lookups", "prompt_lens", "keys", "hit_blocks", "partial", "arrival_s", "parent")
_HASHED: cache.Derived[HashedTrace] = cache.Derived("hashed", HashedTrace.arrays, HashedTrace.from_arrays)


def read_hashed_cached(path: str | os.PathLike, block_size: int, *, use_cache: bool = True) -> HashedTrace:
    """``HashedTrace.of(read_pieces(path), block_size)``, from the cache where an entry answers for the
    file (kvbench.trace.cache's rule), else hashed (from the file's cached Pieces, where they are) and
    cached."""
    def make() -> HashedTrace:
        return HashedTrace.of(cache.read_pieces_cached(path, use_cache=use_cache), block_size)

    return cache.cached(path, _HASHED, make, code=hashed_code(), key=f"block_size={block_size}",
                        use_cache=use_cache)


def hashed_code() -> str:
    """The code that makes a HashedTrace: kvbench/trace's sources (cache.trace_code) and this module's."""
    return f"{cache.trace_code()}+{_own_code()}"


@functools.cache
def _own_code() -> str:
    with open(__file__, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def prepare(requests: Sequence[Request] | Pieces | HashedTrace, block_size: int, warmup: float = 0.0, *,
            future: bool = True, streams: TokenStreams | None = None) -> BlockTrace:
    """Hash every request once, remap the keys to dense ids, count the ceiling; ``future``: also
    belady's next uses. ``requests``: a trace's requests, its Pieces (kvbench.trace.pieces.read_pieces
    reads them from a file, without a Request per line), or the trace hashed at ``block_size`` already
    (read_hashed_cached)."""
    if isinstance(requests, HashedTrace):
        if requests.block_size != block_size:
            raise ValueError(f"a trace hashed at block size {requests.block_size}, not {block_size}")
        h = requests
    else:
        # PrefixKeys hashes the whole trace in one compiled pass, memoising the keys of repeated
        # block-aligned segments, so the streams' own memo serves only literal segments: keep it small
        # streams one request uses are not memoised (p.memoise: PrefixKeys.count_once's rule)
        h = HashedTrace.of(requests if isinstance(requests, Pieces) else Pieces.from_requests(
            requests, streams or TokenStreams(max_cached_tokens=PREPARE_STREAM_TOKENS)), block_size)
    start = window_start(len(h.lookups), warmup)
    bt = BlockTrace(block_size, h.ids, h.starts, h.lookups, h.prompt_lens, len(h.keys), start,
                    int(h.hit_blocks[start:].sum()) * block_size, partial=h.partial, arrival_s=h.arrival_s,
                    parent=h.parent, keys=h.keys, sessions=h.sessions)
    if future:
        from kvbench.whatif.compiled import next_uses_dense

        bt.next_use = next_uses_dense(bt.ids, bt.starts, bt.lookups)
    return bt


class DenseView(CacheView):
    """What a policy reads in the what-if: a block is named by its prefix key's dense id, so its key
    is its id, and its parent is the id before it: the answers PoolView gives for a pool's physical
    blocks. A parent is always cached when its child is inserted (the request hit it, or inserts it
    first), and policies read parents only then."""

    def __init__(self, bt: BlockTrace):
        self._parent = bt.parent.tolist()
        self.block_size = bt.block_size

    def key_of(self, block: int) -> int:
        return block

    def parent_of(self, block: int) -> int:
        return self._parent[block]
