"""What kvbench computed from a trace file, kept on disk so that the next question about the same file
starts in milliseconds: results made of arrays (``cached``: its parsed Pieces, ``read_pieces_cached``;
kvbench.whatif.blocktrace's trace hashed at a block size) and a command's answer to one question
(``TraceAnswer``, e.g. ``kvbench trace whatif``'s table for one set of flags).

Where: under ``$XDG_CACHE_HOME/kvbench/`` (default ``~/.cache/kvbench/``): a folder per kind of result
made of arrays (``pieces/``, ``hashed/``), one ``.npz`` per trace file and key (a block size) named by
the sha256 of the two (a rewritten trace replaces its own entries), the result's arrays (sessions as
UTF-8 text and offsets) and a JSON header, in numpy's own format (``np.load`` reads it with pickle
refused); ``answers/``, one ``.json`` per (file, question, code).
Nothing is cached for a pipe or a device, with ``KVBENCH_NO_CACHE=1`` (``--no-cache``), or for a trace
whose integers Python is set to refuse (PYTHONINTMAXSTRDIGITS: read_pieces's errors depend on it). A
cache directory that cannot be written is skipped without a word; an entry that cannot be read is a
miss.

When an entry answers for the file (the rule). An entry of arrays names in its header its format, the
code that made it (Pieces: the sha256 of kvbench/trace's sources, ``trace_code``: they are that
package's work), its key, and the file as it was read: size, mtime in ns, inode, device, and its sha256.
  - size, mtime, inode and device all equal: the entry is used; the file is not opened;
  - the same size, but another mtime, inode or device (touched, copied over, checked out again): the
    file is hashed, and the entry used (its header brought up to date) only if the sha256 is the same;
  - anything else, or other code: the file is read again, and the entry replaced.
A process hashes a file once while its stat stays (one question checks and stores several entries of
it), where the hash may be trusted as an entry is (below); a racy file's hash is taken every time.
An answer's name is the sha256 of its question, the file's size, mtime, inode and device, and all of
kvbench's code (kvbench.provenance.code_fingerprint): any change to any of them is another name.
Trusting the stat assumes a change of content changes the mtime, which fails where the file is written
again within the filesystem's timestamp granularity of the read that was cached. So a file read less
than ``RACY_NS`` after its mtime is not cached (git's "racily clean" entries), nor one whose stat
changed while it was read.

Bounds: the least recently used entries (an entry's mtime, touched when it is used) are removed when
one is written, past ``MAX_PIECES`` entries or ``MAX_PIECES_BYTES`` bytes in a folder of arrays, and
past ``MAX_ANSWERS`` answers.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

import numpy as np

from kvbench.trace.pieces import Pieces, read_pieces

FORMAT = 2  # the layout of an entry; another value is a miss
MAX_PIECES = 16
MAX_PIECES_BYTES = 2 * 2**30
MAX_ANSWERS = 256
MAX_ANSWERS_BYTES = 256 * 2**20
RACY_NS = 2 * 10**9  # a file read sooner than this after its mtime is not cached (FAT's 2 s granularity)
STALE_TMP_S = 3600  # a half-written entry older than this was left by a process that died
_ARRAYS = ("seeds", "lengths", "literal_at", "memoise", "pieces_at", "literals", "prompt_lens", "seq_lens",
           "arrival_s")
_TRACE_DIR = os.path.dirname(os.path.abspath(__file__))


def cache_home() -> str:
    """$XDG_CACHE_HOME/kvbench, or ~/.cache/kvbench."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvbench")


def cache_enabled() -> bool:
    """False where KVBENCH_NO_CACHE is set to anything but "" or "0"."""
    return os.environ.get("KVBENCH_NO_CACHE", "") in ("", "0")


_trace_code: list[str] = []


def trace_code() -> str:
    """sha256 (16 hex digits) of kvbench/trace's Python sources: what makes a trace's Pieces."""
    if not _trace_code:
        h = hashlib.sha256()
        for name in sorted(os.listdir(_TRACE_DIR)):
            if name.endswith(".py"):
                with open(os.path.join(_TRACE_DIR, name), "rb") as fh:
                    h.update(name.encode() + b"\0" + fh.read() + b"\0")
        _trace_code.append(h.hexdigest()[:16])
    return _trace_code[0]


@dataclass(frozen=True, slots=True)
class FileState:
    """A file as os.stat sees it: what the rule's first case compares."""

    size: int
    mtime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileState:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _cacheable(path: str, use_cache: bool) -> FileState | None:
    """The file's state where its results may be cached (a regular file, the cache on), else None."""
    if not (use_cache and cache_enabled()) or _int_digits_lowered():
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileState.of(st) if stat.S_ISREG(st.st_mode) else None


def _int_digits_lowered() -> bool:
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    return 0 < limit < sys.int_info.default_max_str_digits


def _settled(path: str, state: FileState, read_ns: int) -> bool:
    """Whether what was read from ``path`` (at ``state``, from time ``read_ns``) may be cached: the file
    is unchanged since, and its mtime was older than RACY_NS when it was read."""
    try:
        return read_ns - state.mtime_ns >= RACY_NS and FileState.of(os.stat(path)) == state
    except OSError:
        return False


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


_digests: dict[tuple[str, FileState], str] = {}  # the sha256 of files this process hashed, settled


def _sha256_at(path: str, state: FileState) -> str:
    """The file's sha256 while it is at ``state``: hashed once per process (one question checks and
    stores several entries of a file) where the hash may be trusted as an entry would be (the file
    settled, the module's rule), else every time."""
    key = (os.path.abspath(path), state)
    if key not in _digests:
        hashed_ns = time.time_ns()
        digest = file_sha256(path)
        if not _settled(path, state, hashed_ns):
            return digest
        _digests[key] = digest
    return _digests[key]


# ------------------------------------------------------------------------------------------ arrays

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Derived(Generic[T]):
    """A kind of result computed from a trace file and kept as arrays: ``folder`` (under the cache
    home) holds its entries; ``save`` gives a result's arrays (names of letters, digits and _; not
    "header"), ``load`` the result again from an entry's (a mapping of those names to arrays, each
    of the dtype and layout saved, writeable: numba compiles a function per layout). ``digest``, where
    the making reads the whole file and hashes it as it goes: the sha256 a result holds (None if it
    holds none), so the file is not hashed again to store it."""

    folder: str
    save: Callable[[T], dict[str, np.ndarray]]
    load: Callable[[Mapping[str, np.ndarray]], T]
    digest: Callable[[T], str | None] | None = None


def cached(path: str | os.PathLike, kind: Derived[T], make: Callable[[], T], *, code: str, key: str = "",
           use_cache: bool = True, home: str | None = None) -> T:
    """``make()``, a result of ``kind`` for the file at ``path`` and ``key``, made by ``code``: from the
    cache where an entry answers for the file (the module's rule), else made and then cached. Its
    errors, never cached."""
    path = os.fspath(path)
    state = _cacheable(path, use_cache)
    if state is None:
        return make()
    trace = os.path.abspath(path)
    entry = os.path.join(home or cache_home(), kind.folder, _name(json.dumps([trace, key])) + ".npz")
    got = _load(entry, kind, path, state, {"format": FORMAT, "code": code, "trace": trace, "key": key})
    if got is not None:
        return got
    read_ns = time.time_ns()
    value = make()
    try:  # (a stat that changed while it was made fails _settled below, whoever hashed the file)
        digest = (kind.digest(value) if kind.digest is not None else None) or _sha256_at(path, state)
    except OSError:
        return value
    if _settled(path, state, read_ns):
        _store(entry, kind.save(value), {"format": FORMAT, "code": code, "trace": trace, "key": key,
                                         **asdict(state), "sha256": digest})
    return value


def _name(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load(entry: str, kind: Derived[T], path: str, state: FileState, wanted: dict) -> T | None:
    """The entry's result where it answers for the file at ``state`` and its header has the ``wanted``
    values, else None."""
    try:
        with np.load(entry, allow_pickle=False) as npz:
            head = json.loads(npz["header"].tobytes())
            if any(head[k] != v for k, v in wanted.items()) or head["size"] != state.size:
                return None
            same = FileState(head["size"], head["mtime_ns"], head["ino"], head["dev"]) == state
            hashed_ns = time.time_ns()
            if not same and _sha256_at(path, state) != head["sha256"]:
                return None
            value = kind.load(npz)
    except Exception:  # no entry, or one half-written, foreign or of another numpy: make it again
        return None
    if not same and _settled(path, state, hashed_ns):  # the content checked: this stat answers from now on
        _store(entry, kind.save(value), {**head, **asdict(state)})
    else:
        _touch(entry)
    return value


def _store(entry: str, arrays: dict[str, np.ndarray], header: dict) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))
    if buf.tell() <= MAX_PIECES_BYTES:
        _write(entry, buf.getbuffer(), MAX_PIECES, MAX_PIECES_BYTES)


def session_arrays(sessions: list) -> dict[str, np.ndarray]:
    """A session (str or None) per request as arrays: ``session_of[r]`` indexes the distinct names (-1:
    none), name i is ``session_text[session_at[i]:session_at[i + 1]]`` in UTF-8."""
    index: dict[str, int] = {}
    of = np.fromiter((-1 if s is None else index.setdefault(s, len(index)) for s in sessions), dtype=np.int64,
                     count=len(sessions))
    encoded = [s.encode("utf-8") for s in index]
    at = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=at[1:])
    return {"session_text": np.frombuffer(b"".join(encoded), dtype=np.uint8), "session_at": at, "session_of": of}


def sessions_of(arrays: Mapping[str, np.ndarray]) -> list:
    """``session_arrays``'s sessions again."""
    text, at = arrays["session_text"].tobytes(), arrays["session_at"].tolist()
    names = [text[a:b].decode("utf-8") for a, b in zip(at, at[1:])]
    return [None if i < 0 else names[i] for i in arrays["session_of"].tolist()]


# ------------------------------------------------------------------------------------------ pieces

def _pieces_arrays(p: Pieces) -> dict[str, np.ndarray]:
    return {name: getattr(p, name) for name in _ARRAYS} | session_arrays(p.sessions)


def _pieces(a: Mapping[str, np.ndarray]) -> Pieces:
    return Pieces(*(a[name] for name in _ARRAYS), sessions_of(a))


PIECES: Derived[Pieces] = Derived("pieces", _pieces_arrays, _pieces)


def read_pieces_cached(path: str | os.PathLike, *, use_cache: bool = True, home: str | None = None) -> Pieces:
    """``read_pieces(path)``, from the cache where an entry answers for the file (the module's rule),
    else read and then cached. Byte for byte the Pieces read_pieces gives; its errors, never cached."""
    return cached(path, PIECES, lambda: read_pieces(os.fspath(path)), code=trace_code(), use_cache=use_cache,
                  home=home)


# ----------------------------------------------------------------------------------------- answers

class TraceAnswer:
    """A command's answer to one question about a trace file, kept as a JSON object: ``get`` before
    computing it (None: compute), ``put`` after. ``question``: every setting the answer depends on,
    as JSON values (a file a setting names goes in by its content's sha256)."""

    def __init__(self, path: str | os.PathLike, question: dict, *, use_cache: bool = True,
                 home: str | None = None):
        from kvbench.provenance import code_fingerprint

        self._path = os.fspath(path)
        self._read_ns = time.time_ns()
        self._state = _cacheable(self._path, use_cache)
        self._entry = None
        if self._state is not None:
            key = json.dumps({"format": FORMAT, "code": code_fingerprint(), "trace": os.path.abspath(self._path),
                              "file": asdict(self._state), "question": question}, sort_keys=True)
            self._entry = os.path.join(home or cache_home(), "answers", _name(key) + ".json")

    def get(self) -> dict | None:
        if self._entry is None:
            return None
        try:
            with open(self._entry, encoding="utf-8") as fh:
                answer = json.load(fh)
        except (OSError, ValueError):
            return None
        _touch(self._entry)
        return answer

    def put(self, answer: dict) -> None:
        """Keep ``answer`` (if the file did not change while it was computed, and is not racy)."""
        from kvbench.jsonio import dumps

        if self._entry is not None and _settled(self._path, self._state, self._read_ns):
            _write(self._entry, dumps(answer).encode(), MAX_ANSWERS, MAX_ANSWERS_BYTES)


# ------------------------------------------------------------------------------------ the folders

def _write(entry: str, data, max_entries: int, max_bytes: int) -> None:
    """Write an entry whole, then rename it into place; then keep its folder in bounds. Any OSError
    (a read-only or full disk, a file where the folder should be): nothing is cached."""
    where = os.path.dirname(entry)
    try:
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, entry)
        except BaseException:
            os.unlink(tmp)
            raise
        evict(where, max_entries, max_bytes, keep=entry)
    except OSError:
        pass


def _touch(entry: str) -> None:
    try:
        os.utime(entry)
    except OSError:
        pass


def evict(where: str, max_entries: int, max_bytes: int, keep: str | None = None) -> None:
    """Remove the least recently used entries of a folder until at most ``max_entries`` and
    ``max_bytes`` remain (``keep`` stays), and half-written ones older than STALE_TMP_S."""
    entries = []
    now = time.time()
    with os.scandir(where) as it:
        for e in it:
            try:
                st = e.stat()
            except OSError:
                continue
            if e.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TMP_S:
                    _remove(e.path)
            else:
                entries.append((e.path != keep, -st.st_mtime, st.st_size, e.path))
    entries.sort()  # the kept one first, then the most recently used
    kept = total = 0
    for evictable, _, size, path in entries:
        if evictable and (kept >= max_entries or total + size > max_bytes):
            _remove(path)
        else:
            kept, total = kept + 1, total + size


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
