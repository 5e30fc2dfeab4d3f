"""A trace as flat arrays of pieces (``Pieces``): what the what-if needs of it, read from a trace file
without a Python object per request or segment (``read_pieces``), or made from requests
(``Pieces.from_requests``, the definition: the two are held equal by tests/test_pieces.py).

Pieces are kvbench.trace.ideal._flatten's: each request's cached sequence (its prompt, then a named
answer's computed part) as a run of named streams (a seed and a length), literal tokens (their place
in ``literals``) and unique streams; ``memoise`` marks the named streams another request names too
(PrefixKeys.count_once's rule).

``read_pieces`` takes the lines kvbench.trace.scan recognises (every line of the traces kvbench writes
and converts) in one compiled pass, and every other line through the full parser, in order: a bad line
gets the one-line ``file:line: field`` error load_trace gives it, and the first bad line is the one
reported. It holds the file and arrays some times its size (not more: a bad first request is refused
before the file is read, the read stops at the first line over the length limit, and a file of mostly
blank lines (no request, a row of arrays each) goes to the streaming reader).
"""
from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbench.errors import InputError
from kvbench.trace.format import (
    _BLANK,
    MAX_LINE_BYTES,
    MAX_T_S,
    TRACE,
    Request,
    check_unique_id,
    decode_line,
    foreign_format_error,
    load_trace,
    parse_request,
)
from kvbench.trace.keys import _flatten, once_streams
from kvbench.trace.tokens import TokenStreams, stable_hash


@dataclass(slots=True)
class Pieces:
    """Request r's pieces are ``pieces_at[r]:pieces_at[r+1]``: a stream (``seeds[p]``, its first
    ``lengths[p]`` tokens; ``literal_at[p]`` -1) or literal tokens (``literals[literal_at[p]:]
    [:lengths[p]]``), as compiled.trace_keys reads them."""

    seeds: np.ndarray  # uint64 [pieces]
    lengths: np.ndarray  # int64 [pieces]
    literal_at: np.ndarray  # int64 [pieces]
    memoise: np.ndarray  # bool [pieces]: a named stream another request names too
    pieces_at: np.ndarray  # int64 [requests + 1]
    literals: np.ndarray  # int32 [literal tokens]
    prompt_lens: np.ndarray  # int64 [requests]
    seq_lens: np.ndarray  # int64 [requests]: the prompt and a named answer's computed part
    arrival_s: np.ndarray  # float64 [requests]: t
    sessions: list  # str | None per request

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @classmethod
    def from_requests(cls, requests: Sequence[Request], streams: TokenStreams | None = None) -> Pieces:
        flat = _flatten(requests, streams or TokenStreams(), once_streams(requests))
        return cls(*flat[:8], np.fromiter((r.t for r in requests), dtype=np.float64, count=len(requests)),
                   [r.session for r in requests])


def read_pieces(path: str | os.PathLike, streams: TokenStreams | None = None) -> Pieces:
    """``Pieces.from_requests(load_trace(path), streams)``, and its errors, read straight from the file."""
    path = os.fspath(path)
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        regular = False
    if not regular:  # a pipe, a device, nothing there: the streaming reader, its bounds and its errors
        return Pieces.from_requests(load_trace(path), streams)
    from kvbench.trace import scan

    if 0 < getattr(sys, "get_int_max_str_digits", lambda: 0)() < scan.MAX_NUMBER_DIGITS:
        # Python set to refuse integers the scan reads (PYTHONINTMAXSTRDIGITS): json.loads's rule
        return Pieces.from_requests(load_trace(path), streams)
    try:
        with open(path, "rb") as fh:
            _first_request(fh, path)
            fh.seek(0)
            data = _read_to_long_line(fh)
    except OSError as e:
        raise InputError(f"cannot open {TRACE}: {e.strerror}", file=path) from None
    lines = scan_lines(data, most_bytes=16 * len(data) + 2**24)
    if lines is None:  # mostly blank lines, which cost load_trace nothing and the scan a row each
        return Pieces.from_requests(load_trace(path), streams)
    n_lines, req, ok, line_at, scanned = lines
    fast = np.flatnonzero(ok)
    t = np.array([float(data[a:b]) for a, b in req[fast][:, [scan.R_T_A, scan.R_T_B]].tolist()],
                 dtype=np.float64)  # as json.loads reads a number: float() of its text (of an int's too:
    ok[fast[t > MAX_T_S]] = False  # both round correctly); out of range: the full parser reports it
    arrival = np.zeros(n_lines, dtype=np.float64)
    arrival[fast] = t

    # every line in order, as iter_trace reads them: ids checked, the lines the scan left parsed in full
    seen: set[str] = set()
    order: list[int] = []  # the lines that are requests
    extra: list[Request] = []  # the requests of the lines the scan left, in order
    id_kind, id_a, id_b = (req[:, c].tolist() for c in (scan.R_ID_KIND, scan.R_ID_A, scan.R_ID_B))
    for line, read in enumerate(ok.tolist()):
        lineno = line + 1
        if read:
            rid = data[id_a[line]:id_b[line]].decode("ascii") if id_kind[line] != scan.ABSENT else str(lineno)
        else:
            obj = decode_line(data[line_at[line]:line_at[line + 1]], path, lineno, TRACE)
            if obj is _BLANK:
                continue
            r = parse_request(obj, {"file": path, "line": lineno}, len(order))
            rid = r.id
            extra.append(r)
            arrival[line] = r.t
        check_unique_id(rid, seen, {"file": path, "line": lineno})
        order.append(line)
    if not order:
        raise InputError("trace has no requests", file=path)
    return _assemble(data, req, np.array(order, dtype=np.int64), ok, arrival, extra, streams or TokenStreams(),
                     scanned)


def _first_request(fh, path: str) -> None:
    """Read up to the first request as iter_trace does, with its error where that line is bad (or a
    line before it) or there is none: a file given by mistake (a CSV, a model's weights) is refused at
    its first line, not read and scanned whole first."""
    lineno = 0
    try:
        while raw := fh.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            obj = decode_line(raw, path, lineno, TRACE)
            if obj is not _BLANK:
                parse_request(obj, {"file": path, "line": lineno}, 0)
                return
    except InputError as e:
        raise foreign_format_error(path) or e from None
    raise InputError("trace has no requests", file=path)


_CHUNK = 16 * 2**20  # bytes read at a time (at most MAX_LINE_BYTES: a long line spans chunks)


def _read_to_long_line(fh) -> bytearray:
    """The file's bytes, or, where a line is longer than MAX_LINE_BYTES, those up to its first
    MAX_LINE_BYTES + 1 bytes: load_trace reads no further (readline's bound) and stops there with that
    line's error, which the scan leaves to decode_line. A file with no line ends (a sparse terabyte)
    is not read whole."""
    data = bytearray()
    line_start = 0  # where the last line read so far begins
    while chunk := fh.read(_CHUNK):
        end = chunk.rfind(b"\n")
        if end >= 0:
            line_start = len(data) + end + 1
        data += chunk
        if len(data) - line_start > MAX_LINE_BYTES:
            del data[line_start + MAX_LINE_BYTES + 1:]
            break
    return data


def _bytes_view(data) -> np.ndarray:
    """data as a read-only uint8 array (read-only as a view of bytes is: the compiled functions'
    signatures, and their cached code, are those of bytes)."""
    view = np.frombuffer(data, dtype=np.uint8)
    view.flags.writeable = False
    return view


def scan_lines(data: bytes, most_bytes: int | None = None):
    """kvbench.trace.scan.scan over a file's bytes: (lines, req [lines, R_FIELDS], ok [lines]: the
    lines it read, line_at [lines + 1], its arrays: pieces, literal tokens and name occurrences); None
    if its arrays (and read_pieces's lists of a line's id) would take more than ``most_bytes``."""
    from kvbench.trace import scan

    buf = _bytes_view(data)
    n_lines, braces, seps = scan.bounds(buf)
    room = braces + n_lines  # a piece per segment, one more per answer
    # a line: req's row, ok, line_at, read_pieces's 4 lists; a unit of room: 8 arrays; a literal token
    if most_bytes is not None and (8 * scan.R_FIELDS + 41) * n_lines + 64 * room + 4 * seps > most_bytes:
        return None
    req = np.empty((n_lines, scan.R_FIELDS), dtype=np.int64)
    ok = np.zeros(n_lines, dtype=np.bool_)
    line_at = np.empty(n_lines + 1, dtype=np.int64)
    seeds, occ_seed = np.empty(room, dtype=np.uint64), np.empty(room, dtype=np.uint64)
    lengths, literal_at, occ, occ_req, occ_a, occ_b = (np.empty(room, dtype=np.int64) for _ in range(6))
    lits = np.empty(seps, dtype=np.int32)
    n_lines, n_pieces, n_lits, n_occ = scan.scan(buf, req, ok, line_at, seeds, lengths, literal_at, occ, lits,
                                                 occ_req, occ_a, occ_b, occ_seed, scan.MAX_NAME)
    return (n_lines, req[:n_lines], ok[:n_lines], line_at[:n_lines + 1],
            (seeds[:n_pieces], lengths[:n_pieces], literal_at[:n_pieces], occ[:n_pieces], lits[:n_lits],
             occ_req[:n_occ], occ_a[:n_occ], occ_b[:n_occ], occ_seed[:n_occ]))


def _assemble(data: bytes, req: np.ndarray, order: np.ndarray, ok: np.ndarray, arrival: np.ndarray,
              extra: list[Request], streams: TokenStreams, scanned: tuple) -> Pieces:
    """The Pieces of the requests on lines ``order``: the scan's pieces of the lines it read, _flatten's
    of the others (``extra``, in order), in order; names counted over both."""
    from kvbench.trace import scan

    seeds, lengths, literal_at, occ, lits, occ_req, occ_a, occ_b, occ_seed = scanned
    n, n_pieces, n_occ = len(order), len(seeds), len(occ_req)
    read = ok[order]
    f = req[order[read]]
    lo, hi = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)  # each request's pieces, below
    prompt_lens = np.empty(n, dtype=np.int64)
    lo[read], hi[read] = f[:, scan.R_PIECE_A], f[:, scan.R_PIECE_B]
    prompt_lens[read] = f[:, scan.R_PROMPT_LEN]
    sessions: list = [None] * n
    for r, (kind, a, b) in zip(np.flatnonzero(read).tolist(),
                               f[:, [scan.R_SESSION_KIND, scan.R_SESSION_A, scan.R_SESSION_B]].tolist()):
        if kind != scan.ABSENT:
            sessions[r] = data[a:b].decode("ascii")
    names = _bytes_view(data)
    if extra:  # after the scan's: their pieces, literal tokens, names (their bytes after the file's)
        x_seeds, x_lengths, x_literal_at, _, x_at, x_lits, x_prompt, *_ = _flatten(extra, streams, frozenset())
        x_occ = np.full(len(x_seeds), -1, dtype=np.int64)
        x_req, x_a, x_b, x_seed, x_bytes = [], [], [], [], []
        at = len(data)
        for j, (r, line) in enumerate(zip(np.flatnonzero(~read).tolist(), order[~read].tolist())):
            rq = extra[j]
            sessions[r] = rq.session
            own = [(k, seg.name) for k, seg in enumerate(rq.prompt) if seg.kind == "shared"]
            if rq.output is not None:
                own.append((len(rq.prompt) if x_at[j + 1] - x_at[j] > len(rq.prompt) else -1, rq.output))
            for k, name in own:
                if k >= 0:
                    x_occ[x_at[j] + k] = n_occ + len(x_req)
                b = name.encode("utf-8")
                x_req.append(line)
                x_a.append(at)
                x_b.append(at + len(b))
                x_seed.append(stable_hash(name))
                x_bytes.append(b)
                at += len(b)
        lo[~read], hi[~read] = n_pieces + x_at[:-1], n_pieces + x_at[1:]
        prompt_lens[~read] = x_prompt
        seeds, lengths = np.concatenate((seeds, x_seeds)), np.concatenate((lengths, x_lengths))
        literal_at = np.concatenate((literal_at, np.where(x_literal_at >= 0, x_literal_at + len(lits), -1)))
        lits = np.concatenate((lits, x_lits))
        occ = np.concatenate((occ, x_occ))
        occ_req = np.concatenate((occ_req, np.array(x_req, dtype=np.int64)))
        occ_a = np.concatenate((occ_a, np.array(x_a, dtype=np.int64)))
        occ_b = np.concatenate((occ_b, np.array(x_b, dtype=np.int64)))
        occ_seed = np.concatenate((occ_seed, np.array(x_seed, dtype=np.uint64)))
        names = np.concatenate((names, np.frombuffer(b"".join(x_bytes), dtype=np.uint8)))
    uses = scan.count_names(names, occ_req, occ_a, occ_b, occ_seed)
    take = _ranges(lo, hi)  # the pieces in request order
    occ, literal_at, lengths = occ[take], literal_at[take], lengths[take]
    memoise = (occ >= 0) & (uses[np.maximum(occ, 0)] >= 2) if len(uses) else np.zeros(len(take), dtype=np.bool_)
    literal = np.flatnonzero(literal_at >= 0)  # literal tokens in piece order, as _flatten lays them out
    lit_take = _ranges(literal_at[literal], literal_at[literal] + lengths[literal])
    literal_at[literal] = np.cumsum(lengths[literal]) - lengths[literal]
    pieces_at = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(hi - lo, out=pieces_at[1:])
    tokens_before = np.zeros(len(take) + 1, dtype=np.int64)  # a request's sequence: its pieces' tokens
    np.cumsum(lengths, out=tokens_before[1:])
    seq_lens = tokens_before[pieces_at[1:]] - tokens_before[pieces_at[:-1]]
    return Pieces(seeds[take], lengths, literal_at, memoise, pieces_at, np.ascontiguousarray(lits[lit_take]),
                  prompt_lens, seq_lens, arrival[order], sessions)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """lo[0]..hi[0]-1, then lo[1]..hi[1]-1, ... (int64)."""
    n = hi - lo
    ends = np.cumsum(n)
    return np.repeat(lo - (ends - n), n) + np.arange(int(ends[-1]) if len(n) else 0, dtype=np.int64)
