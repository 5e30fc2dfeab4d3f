"""A trace read as a stream: what a replay keeps of a request it has not issued is a few numbers, and
the request itself is read from the file when it is issued.

``TraceIndex`` makes one pass over the file (every line validated as ``iter_trace`` does: the same
one-line errors with file, line and field) and keeps, per request, where its line starts, its time and
its lengths (``TraceIndex``: ~48 bytes a request), and of the names its prompt and answer use only
those that more than one request uses, each with the last request that uses it (``SharedNames``).
``TraceIndex.request(pos)`` reads the request at arrival position ``pos`` again (one seek); a trace not
sorted by ``t`` is replayed in arrival order all the same (a stable sort of the times, ties in file
order), reading out of file order.

``ListTrace`` is the same interface over requests already in memory (tests, selfcheck, a caller's
list), so a replay has one code path.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import BinaryIO

import numpy as np
import xxhash

from kvbench.errors import InputError
from kvbench.trace.cache import Derived, cached, trace_code
from kvbench.trace.format import (
    _BLANK,
    TRACE,
    Request,
    decode_line,
    foreign_format_error,
    parse_request,
)
from kvbench.trace.tokens import stable_hash

MAX_LINE_READ = 64 * 2**20 + 1  # format.MAX_LINE_BYTES + 1: decode_line refuses a longer line
NEVER_EXPIRES = np.iinfo(np.int64).max
SMALL_SET = 1 << 16  # names: a Python set (~80 bytes a name) up to this many, sorted arrays beyond


class SharedNames:
    """The stream names (prompt ``shared`` segments, and ``output`` answers) that more than one
    request uses, each with the trace index of the last request that uses it: a name outside it
    is used once, so its blocks can never be hit by another request (PrefixKeys.shareable_blocks), and
    a kept block whose last piece's name is past its last use can never be hit again
    (IdealCounter's expiry). Held as sorted uint64 seeds (stable_hash of the name) and int64 last
    uses, and a set of the seeds while they are few."""

    def __init__(self, seeds: np.ndarray, last_use: np.ndarray):
        order = np.argsort(seeds, kind="stable")
        self.seeds = np.ascontiguousarray(seeds[order], dtype=np.uint64)
        self.last_use = np.ascontiguousarray(last_use[order], dtype=np.int64)
        self._set = set(self.seeds.tolist()) if len(self.seeds) <= SMALL_SET else None
        self._table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.seeds)

    def table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (seed, last use) pairs as an open-addressing table (uint64 seeds, uint8 occupancy,
        int64 last uses; kvbench.trace.compiled_ideal.index_names), built on first use: what
        ideal.block_expiry looks a request's pieces up in, one compiled call a request."""
        if self._table is None:
            from kvbench.trace.compiled_ideal import index_names

            size = 1
            while size < 2 * len(self.seeds):
                size *= 2
            table = np.zeros(size, dtype=np.uint64), np.zeros(size, dtype=np.uint8), np.zeros(size, dtype=np.int64)
            index_names(self.seeds, self.last_use, *table)
            self._table = table
        return self._table

    def shared(self, name: str) -> bool:
        seed = stable_hash(name)
        if self._set is not None:
            return seed in self._set
        i = int(np.searchsorted(self.seeds, np.uint64(seed)))
        return i < len(self.seeds) and int(self.seeds[i]) == seed

    def last_uses(self, seeds: np.ndarray) -> np.ndarray:
        """int64 per seed: the last request that uses it; -1 for a seed used once (or not a name)."""
        if not len(self.seeds):
            return np.full(len(seeds), -1, dtype=np.int64)
        i = np.minimum(np.searchsorted(self.seeds, seeds), len(self.seeds) - 1)
        return np.where(self.seeds[i] == seeds, self.last_use[i], -1)

    @property
    def once(self) -> OnceNames:
        """The complement, as PrefixKeys.once reads it (``name in once``)."""
        return OnceNames(self)

    @classmethod
    def of(cls, requests: Iterable[Request]) -> SharedNames:
        """From requests in memory, in trace order: the k-th is user k."""
        counter = NameCounter()
        for k, r in enumerate(requests):
            counter.add(r, k)
        return counter.result()


class OnceNames:
    """``name in once``: the name is not in the SharedNames (used by one request only)."""

    def __init__(self, shared: SharedNames):
        self.shared = shared

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and not self.shared.shared(name)

    def names_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shared names' hash table (SharedNames.table): a seed it lacks is a name used once, which
        kvbench.trace.keys._flatten asks of a request's every seed in one compiled call."""
        return self.shared.table()


class NameCounter:
    """Counts, over requests fed in trace order, how many requests use each name and which is the
    last. Each use is 12 bytes (the name's seed, the request's rank) buffered in arrays; past
    ``spill`` uses they go to 16 temporary files by the seed's top bits, and each file is counted on
    its own at the end, so the memory is a sixteenth of the trace's name uses (a million Mooncake
    requests name ~24 M streams)."""

    CHUNK = 1 << 16
    PARTS = 16

    def __init__(self, spill: int = 1 << 22):
        self._seeds: list[np.ndarray] = []
        self._users: list[np.ndarray] = []
        self._held = 0
        self._buf_s: array = array("Q")
        self._buf_u: array = array("q")
        self._spill = spill
        self._dir: tempfile.TemporaryDirectory | None = None

    def add(self, r: Request, user: int) -> None:
        """Request ``r``, the ``user``-th in trace order, uses its names."""
        names = {seg.name for seg in r.prompt if seg.kind == "shared"}
        if r.output is not None:
            names.add(r.output)
        for name in names:
            self._buf_s.append(stable_hash(name))
            self._buf_u.append(user)
        if len(self._buf_s) >= self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._buf_s:
            self._seeds.append(np.frombuffer(self._buf_s, dtype=np.uint64).copy())
            self._users.append(np.frombuffer(self._buf_u, dtype=np.int64).copy())
            self._held += len(self._buf_s)
            self._buf_s, self._buf_u = array("Q"), array("q")
        if self._held >= self._spill:
            self._to_files()

    def _to_files(self) -> None:
        if not self._seeds:
            return
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvbench-names-")
        seeds, users = np.concatenate(self._seeds), np.concatenate(self._users)
        self._seeds, self._users, self._held = [], [], 0
        part = (seeds >> np.uint64(60)).astype(np.int64)
        for p in range(self.PARTS):
            sel = part == p
            with open(os.path.join(self._dir.name, f"{p}.seeds"), "ab") as fh:
                fh.write(seeds[sel].tobytes())
            with open(os.path.join(self._dir.name, f"{p}.users"), "ab") as fh:
                fh.write(users[sel].tobytes())

    def result(self) -> SharedNames:
        self._flush()
        if self._dir is None:
            parts = [(np.concatenate(self._seeds), np.concatenate(self._users))] if self._seeds else []
        else:
            self._to_files()
            parts = ((np.fromfile(os.path.join(self._dir.name, f"{p}.seeds"), dtype=np.uint64),
                      np.fromfile(os.path.join(self._dir.name, f"{p}.users"), dtype=np.int64))
                     for p in range(self.PARTS))
        self._seeds, self._users = [], []
        found = [_shared(seeds, users) for seeds, users in parts]
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        if not found:
            return SharedNames(np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64))
        return SharedNames(np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found]))


def _shared(seeds: np.ndarray, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the seeds more than one request uses, the last of them) from uses given in trace order."""
    order = np.argsort(seeds, kind="stable")  # ties keep trace order: a seed's last use is its run's end
    seeds = seeds[order]
    first = np.ones(len(seeds), dtype=bool)
    first[1:] = seeds[1:] != seeds[:-1]
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], len(seeds))
    multi = (ends - starts) > 1  # a request counts a name once (a set per request)
    return seeds[starts[multi]], users[order[ends[multi] - 1]]


class TraceIndex:
    """A trace file, indexed by one validating pass (module docstring). Positions are arrival order:
    ``t[pos]``, ``request(pos)``; ``trace_index[pos]`` is the request's place in the file.
    ``sha256``: the file's, hashed in the same pass (None when ``limit`` stopped it before the end).

    The index is kept in the trace cache (kvbench.trace.cache.read_index_cached: keyed by the file's
    stat, its content hash inside), so a sweep's configurations, and any later run of the same file,
    read it back instead of parsing the trace again."""

    def __init__(self, path: str | os.PathLike, limit: int | None = None, *, use_cache: bool = True):
        self.path = os.fspath(path)
        self._fh: BinaryIO | None = None
        arrays = cached(self.path, INDEX, lambda: _scan(self.path, limit), code=trace_code(),
                              key=f"limit={limit}", use_cache=use_cache)
        self.sha256 = bytes(arrays["sha256"]).decode() or None
        self.file_offsets, self.file_lines = arrays["file_offsets"], arrays["file_lines"]
        self.order = arrays["order"]  # arrival position -> trace index
        self.trace_index = self.order
        self.t = arrays["times"][self.order]
        self.prompt_len = arrays["prompt_len"][self.order]
        self.output_len = arrays["output_len"][self.order]
        self.n = arrays["n"][self.order]
        self.sorted = bool((self.order == np.arange(len(self.order))).all())
        self.names = SharedNames(arrays["name_seeds"], arrays["name_last_use"])

    def __len__(self) -> int:
        return len(self.t)

    def _read(self, index: int) -> Request:
        """The request at trace index ``index`` (its place in the file)."""
        if self._fh is None:
            self._fh = open(self.path, "rb")  # noqa: SIM115 (kept open across reads; close())
        return _read_at(self._fh, self.path, int(self.file_offsets[index]), int(self.file_lines[index]), index)

    def request(self, pos: int) -> Request:
        """The request at arrival position ``pos``, read from the file."""
        return self._read(int(self.order[pos]))

    def positioned(self) -> Iterator[tuple[int, Request]]:
        """(arrival position, request) in trace order."""
        at = np.empty(len(self.order), dtype=np.int64)
        at[self.order] = np.arange(len(self.order))
        for i in range(len(self.order)):
            yield int(at[i]), self._read(i)

    def in_trace_order(self) -> Iterator[Request]:
        for i in range(len(self.order)):
            yield self._read(i)

    def in_arrival_order(self) -> Iterator[Request]:
        for pos in range(len(self.order)):
            yield self.request(pos)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _scan(path: str, limit: int | None) -> dict[str, np.ndarray]:
    """TraceIndex's pass over the file (ids checked unique): its arrays in file order, ``order`` the
    arrival order, and ``sha256`` the file's hex digest as bytes (empty if ``limit`` stopped early)."""
    offsets, lines, times = array("q"), array("q"), array("d")
    plens, olens, ns = array("q"), array("q"), array("q")
    id_hashes = array("Q")
    counter = NameCounter()
    digest = hashlib.sha256()
    index = 0
    at_end = False
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed by the with below, after the error test)
    except OSError as e:
        raise InputError(f"cannot open {TRACE}: {e.strerror}", file=path) from None
    try:
        with fh:
            pos, lineno = 0, 0
            while True:
                if limit is not None and index >= limit:
                    at_end = not fh.read(1)  # (a line cut at the limit: the hash is the whole file's or none)
                    break
                raw = fh.readline(MAX_LINE_READ)
                if not raw:
                    at_end = True
                    break
                digest.update(raw)
                lineno += 1
                at, pos = pos, pos + len(raw)
                obj = decode_line(raw, path, lineno, TRACE)
                if obj is _BLANK:
                    continue
                r = parse_request(obj, {"file": path, "line": lineno}, index)
                offsets.append(at)
                lines.append(lineno)
                times.append(r.t)
                plens.append(r.prompt_len)
                olens.append(r.output_len)
                ns.append(r.n)
                id_hashes.append(xxhash.xxh64_intdigest(r.id.encode("utf-8")))
                counter.add(r, index)
                index += 1
    except InputError as e:
        raise (foreign_format_error(path) or e) if index == 0 else e from None
    if index == 0:
        raise InputError("trace has no requests", file=path)
    times_a = np.frombuffer(times, dtype=np.float64).copy()
    names = counter.result()

    def ints(a: array) -> np.ndarray:
        return np.frombuffer(a, dtype=np.int64).copy()
    arrays = {"file_offsets": ints(offsets), "file_lines": ints(lines), "times": times_a,
              "order": np.argsort(times_a, kind="stable"), "prompt_len": ints(plens), "output_len": ints(olens),
              "n": ints(ns), "name_seeds": names.seeds, "name_last_use": names.last_use}
    _check_ids(path, np.frombuffer(id_hashes, dtype=np.uint64), arrays["file_offsets"], arrays["file_lines"])
    arrays["sha256"] = np.frombuffer(digest.hexdigest().encode() if at_end else b"", dtype=np.uint8)
    return arrays


def _index_of(entry: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.asarray(entry[name]) for name in INDEX_ARRAYS}


INDEX_ARRAYS = ("file_offsets", "file_lines", "times", "order", "prompt_len", "output_len", "n", "name_seeds",
                "name_last_use", "sha256")
# TraceIndex's arrays in the trace cache (kvbench.trace.cache: keyed by the file's stat and the limit)
INDEX: Derived[dict[str, np.ndarray]] = Derived("index", dict, _index_of,
                                                digest=lambda arrays: bytes(arrays["sha256"]).decode() or None)


def _read_at(fh: BinaryIO, path: str, offset: int, line: int, index: int) -> Request:
    """The request on line ``line`` of the file, which starts at byte ``offset`` (the ``index``-th)."""
    fh.seek(offset)
    obj = decode_line(fh.readline(MAX_LINE_READ), path, line, TRACE)
    return parse_request(obj, {"file": path, "line": line}, index)


def _check_ids(path: str, hashes: np.ndarray, offsets: np.ndarray, lines: np.ndarray) -> None:
    """Ids are unique (format.check_unique_id): a hash seen twice is read again, and the later line
    of a true duplicate named."""
    order = np.argsort(hashes, kind="stable")
    h = hashes[order]
    same = np.flatnonzero(h[1:] == h[:-1])
    if not len(same):
        return
    with open(path, "rb") as fh:
        def read(i: int) -> Request:
            return _read_at(fh, path, int(offsets[i]), int(lines[i]), i)
        later = []
        for k in same:
            a, b = sorted((int(order[k]), int(order[k + 1])))
            if read(a).id == read(b).id:
                later.append(b)
        if later:
            b = min(later)
            raise InputError(f"duplicate request id {read(b).id!r}", file=path, line=int(lines[b]), field="id")


def trace_sha256(path: str | os.PathLike) -> str:
    """The trace file's sha256, from its index (read back from the trace cache, or made by the
    validating pass, which hashes as it reads): a bad trace is refused here, with its one-line error."""
    index = TraceIndex(path)
    assert index.sha256 is not None  # (no limit: the pass reads the whole file)
    return index.sha256


class ListTrace:
    """TraceIndex's interface over requests in memory (trace order: each one's ``index``)."""

    def __init__(self, requests: Sequence[Request]):
        self.path = "<requests>"
        self.sha256: str | None = None  # (no file)
        self.requests = sorted(requests, key=lambda r: r.t)  # arrival order (stable: ties keep trace order)
        self.t = np.array([r.t for r in self.requests], dtype=np.float64)
        self.trace_index = np.array([r.index for r in self.requests], dtype=np.int64)
        self.prompt_len = np.array([r.prompt_len for r in self.requests], dtype=np.int64)
        self.output_len = np.array([r.output_len for r in self.requests], dtype=np.int64)
        self.n = np.array([r.n for r in self.requests], dtype=np.int64)
        self.sorted = bool((np.diff(self.trace_index) > 0).all())
        self.names = SharedNames.of(self.in_trace_order())

    def __len__(self) -> int:
        return len(self.requests)

    def request(self, pos: int) -> Request:
        return self.requests[pos]

    def positioned(self) -> Iterator[tuple[int, Request]]:
        """(arrival position, request) in trace order (by ``index``, ties in arrival order)."""
        reqs = self.requests
        return ((p, reqs[p]) for p in sorted(range(len(reqs)), key=lambda p: reqs[p].index))

    def in_trace_order(self) -> Iterator[Request]:
        return (r for _, r in self.positioned())

    def in_arrival_order(self) -> Iterator[Request]:
        return iter(self.requests)

    def close(self) -> None:
        pass

