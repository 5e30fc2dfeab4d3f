"""The kvbench trace format (spec §2): one JSON request per line, read and validated as a stream.

A request's prompt is a list of segments; token ids are produced lazily by ``kvbench.trace.tokens``.
Every validation failure raises InputError naming the file, the 1-based line and the field.

Rules this module defines where the spec leaves room:
- unknown top-level keys are ignored (forward compatibility), but a segment must have exactly one of
  the kinds ``tokens``, ``shared``, ``unique``, ``text``, and no keys beyond its kind's;
- a shared stream is unbounded: ``{"shared": X, "len": L}`` is the first L tokens of stream X, so a
  later, longer use of the same name extends an earlier one (they agree on the common prefix);
- ``id`` may be a string or an integer (kept as its decimal string); ids must be unique in a trace;
- requests need not be sorted by ``t``; the engine replays them in arrival order (stable).

Limits (checked before anything is allocated; each breach is an InputError naming file, line, field):
a line of at most MAX_LINE_BYTES; JSON nesting Python can decode; no NaN/Infinity; strings that are
valid Unicode (no lone surrogates) and at most MAX_NAME_CHARS for names; ``t`` at most MAX_T_S;
a request's prompt + output at most MAX_REQUEST_TOKENS tokens; ``n`` at most MAX_SAMPLES.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator, NamedTuple

from kvbench.errors import InputError

SEGMENT_KINDS = ("tokens", "shared", "unique", "text")
MAX_TOKEN_ID = 2**31 - 1
MAX_REQUEST_TOKENS = 2**24  # prompt + output of one request (16,777,216): past any model's context
MAX_SAMPLES = 1024  # n: parallel samples of one request
MAX_T_S = 1e10  # arrival time, seconds (317 years: an epoch time stamp fits)
MAX_NAME_CHARS = 4096  # ids, sessions, stream names
MAX_LINE_BYTES = 64 * 2**20  # one JSON line


def check_text(v: str, where: dict, fld: str, max_chars: int | None = MAX_NAME_CHARS) -> str:
    """A string usable everywhere it goes (UTF-8 files, parquet): no lone surrogates, bounded."""
    if max_chars is not None and len(v) > max_chars:
        raise InputError(f"longer than {max_chars} characters ({len(v)})", **where, field=fld)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"not valid Unicode (a lone surrogate at character {e.start + 1})",
                         **where, field=fld) from None
    return v


class Segment(NamedTuple):
    """One piece of a prompt. ``kind`` is one of SEGMENT_KINDS.

    tokens: ``tokens`` holds the ids; shared: ``name`` and ``length``; unique: ``length``;
    text: ``text`` (its length is known once tokenized, see kvbench.trace.tokens).

    A named tuple (immutable, hashable): a trace line makes one per segment (Mooncake: 24 a line), and
    it is built in a third of a frozen dataclass's time.
    """

    kind: str
    length: int = 0
    name: str | None = None
    tokens: tuple[int, ...] | None = None
    text: str | None = None

    def to_json(self) -> dict:
        if self.kind == "tokens":
            return {"tokens": list(self.tokens)}
        if self.kind == "shared":
            return {"shared": self.name, "len": self.length}
        if self.kind == "unique":
            return {"unique": self.length}
        return {"text": self.text}


@dataclass(slots=True)
class Request:
    """One trace request. ``index`` is its 0-based position in the file, ``line`` its 1-based line."""

    id: str
    t: float
    prompt: tuple[Segment, ...]
    output_len: int
    session: str | None = None
    n: int = 1
    output: str | None = None
    meta: dict | None = None
    index: int = 0
    line: int = 0
    prompt_len: int = field(default=-1)

    def to_json(self) -> dict:
        d: dict = {"id": self.id, "t": self.t}
        if self.session is not None:
            d["session"] = self.session
        d["output_len"] = self.output_len
        if self.n != 1:
            d["n"] = self.n
        if self.output is not None:
            d["output"] = self.output
        d["prompt"] = [s.to_json() for s in self.prompt]
        if self.meta:
            d["meta"] = self.meta
        return d


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _length(v, where: dict, fld: str, most: int = MAX_REQUEST_TOKENS) -> int:
    if not _is_int(v):
        raise InputError(f"must be an integer, got {_show(v)}", **where, field=fld)
    if v < 1:
        raise InputError(f"must be at least 1, got {v}", **where, field=fld)
    if v > most:
        raise InputError(f"must be at most {most:,}, got {_show(v)}", **where, field=fld)
    return v


def _show(v) -> str:
    """A short, printable rendering of a bad value (huge integers are not converted to text)."""
    if _is_int(v) and abs(v) >= 10**30:
        return f"an integer of about {v.bit_length() * 0.30103:.0f} digits"
    try:
        return json.dumps(v, ensure_ascii=True)[:40]
    except (ValueError, RecursionError):
        return type(v).__name__


def _common_segment(obj) -> Segment | None:
    """The common shapes ({"shared": name, "len": n}, {"unique": n}), accepted only as parse_segment's
    checks would accept them; None for anything else (parse_segment then decides)."""
    if type(obj) is dict:
        n = len(obj)
        if n == 2:
            name, length = obj.get("shared"), obj.get("len")
            if (type(name) is str and type(length) is int and 0 < len(name) <= MAX_NAME_CHARS and name.isascii()
                    and 1 <= length <= MAX_REQUEST_TOKENS):
                return Segment("shared", length, name)
        elif n == 1:
            length = obj.get("unique")
            if type(length) is int and 1 <= length <= MAX_REQUEST_TOKENS:
                return Segment("unique", length)
    return None


def parse_segment(obj, where: dict, k: int, text_len=None) -> Segment:
    """Validate one prompt segment. ``text_len(str) -> int`` measures text segments."""
    seg = _common_segment(obj)
    if seg is not None:
        return seg
    fld = f"prompt[{k}]"
    if not isinstance(obj, dict):
        raise InputError("a segment must be an object", **where, field=fld)
    kinds = [kk for kk in SEGMENT_KINDS if kk in obj]
    if len(kinds) != 1:
        extra = ", ".join(sorted(obj)) or "nothing"
        raise InputError(f"a segment needs exactly one of tokens/shared/unique/text, got {extra}",
                         **where, field=fld)
    kind = kinds[0]
    allowed = {"shared": {"shared", "len"}}.get(kind, {kind})
    unknown = set(obj) - allowed
    if unknown:
        raise InputError(f"unknown key {sorted(unknown)[0]!r} in a {kind} segment", **where, field=fld)
    if kind == "tokens":
        toks = obj["tokens"]
        if not isinstance(toks, list) or not toks:
            raise InputError("must be a non-empty list of token ids", **where, field=f"{fld}.tokens")
        for t in toks:
            if not _is_int(t) or t < 0 or t > MAX_TOKEN_ID:
                raise InputError(f"token ids are integers in [0, 2^31), got {_show(t)}",
                                 **where, field=f"{fld}.tokens")
        return Segment("tokens", len(toks), tokens=tuple(toks))
    if kind == "shared":
        name = obj["shared"]
        if not isinstance(name, str) or not name:
            raise InputError("must be a non-empty string", **where, field=f"{fld}.shared")
        check_text(name, where, f"{fld}.shared")
        if "len" not in obj:
            raise InputError("required field missing", **where, field=f"{fld}.len")
        return Segment("shared", _length(obj["len"], where, f"{fld}.len"), name=name)
    if kind == "unique":
        return Segment("unique", _length(obj["unique"], where, f"{fld}.unique"))
    text = obj["text"]
    if not isinstance(text, str) or not text:
        raise InputError("must be a non-empty string", **where, field=f"{fld}.text")
    check_text(text, where, f"{fld}.text", max_chars=None)
    n = text_len(text) if text_len is not None else len(text.encode("utf-8"))
    if n < 1:
        raise InputError("text tokenizes to no tokens", **where, field=f"{fld}.text")
    return Segment("text", n, text=text)


def parse_request(obj, where: dict, index: int, text_len=None) -> Request:
    """Validate one decoded JSON line into a Request."""
    if not isinstance(obj, dict):
        raise InputError("a request must be a JSON object", **where)
    for req in ("t", "prompt", "output_len"):
        if req not in obj:
            raise InputError("required field missing", **where, field=req)
    t = obj["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise InputError(f"must be a number, got {_show(t)}", **where, field="t")
    if t < 0:
        raise InputError(f"must be >= 0, got {_show(t)}", **where, field="t")
    if t > MAX_T_S:  # an int compares exactly; converting 10**400 to float would overflow
        raise InputError(f"must be at most {MAX_T_S:g} seconds, got {_show(t)}", **where, field="t")
    output_len = _length(obj["output_len"], where, "output_len")
    prompt = obj["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise InputError("must be a non-empty list of segments", **where, field="prompt")
    common = _common_segment
    segs = tuple([common(s) or parse_segment(s, where, k, text_len) for k, s in enumerate(prompt)])
    plen = sum(s.length for s in segs)
    if plen + output_len > MAX_REQUEST_TOKENS:
        raise InputError(f"prompt ({plen:,} tokens) + output_len ({output_len:,}) is more than "
                         f"{MAX_REQUEST_TOKENS:,} tokens", **where, field="prompt")
    rid = obj.get("id", where.get("line"))
    if _is_int(rid):
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        raise InputError("must be a non-empty string", **where, field="id")
    check_text(rid, where, "id")
    session = obj.get("session")
    if session is not None and not isinstance(session, str):
        if _is_int(session):
            session = str(session)
        else:
            raise InputError("must be a string", **where, field="session")
    if session is not None:
        check_text(session, where, "session")
    n = obj.get("n", 1)
    n = _length(n, where, "n", MAX_SAMPLES)
    output = obj.get("output")
    if output is not None and (not isinstance(output, str) or not output):
        raise InputError("must be a non-empty string", **where, field="output")
    if output is not None:
        check_text(output, where, "output")
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise InputError("must be an object", **where, field="meta")
    if meta is not None:
        try:  # carried into results: it must encode
            json.dumps(meta, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError, ValueError):
            raise InputError("must encode as UTF-8 JSON (no lone surrogates, bounded nesting)",
                             **where, field="meta") from None
    return Request(id=rid, t=float(t), prompt=segs, output_len=output_len, session=session, n=n,
                   output=output, meta=meta, index=index, line=where.get("line", 0), prompt_len=plen)


def json_lines(path: str | os.PathLike, what: str = "trace") -> Iterator[tuple[int, object]]:
    """Stream ``(1-based line, decoded JSON)`` from a JSON-lines file, skipping blank lines.

    ``what`` names the expected format in errors ("not UTF-8 text", malformed JSON), so an importer
    fed the wrong file says what it expected.
    """
    path = os.fspath(path)
    try:
        # Binary lines, decoded one at a time: a text-mode reader decodes ahead in chunks and would
        # blame a bad byte on the wrong line.
        fh: IO[bytes] = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot open {what}: {e.strerror}", file=path) from None
    with fh:
        lineno = 0
        while True:
            # bounded reads: a file with no line ends (/dev/zero) must not fill the memory
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            obj = decode_line(raw, path, lineno, what)
            if obj is not _BLANK:
                yield lineno, obj


_BLANK = object()  # decode_line's answer for a blank line


def decode_line(raw: bytes, path: str, lineno: int, what: str = "trace"):
    """The decoded JSON of one line (``raw`` as readline returns it), or _BLANK for a blank line."""
    if len(raw) > MAX_LINE_BYTES:
        raise InputError(f"line longer than {MAX_LINE_BYTES // 2**20} MiB (expected {what})",
                         file=path, line=lineno)
    try:
        s = raw.decode("utf-8").strip().lstrip("\ufeff")
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start + 1} of the line; expected {what})",
                         file=path, line=lineno) from None
    if not s:
        return _BLANK
    try:
        return _DECODER.decode(s)
    except json.JSONDecodeError as e:
        raise InputError(f"malformed JSON ({e.msg} at column {e.colno}; expected {what})",
                         file=path, line=lineno) from None
    except RecursionError:
        raise InputError(f"JSON nested too deeply (expected {what})", file=path, line=lineno) from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise InputError(f"unusable JSON ({str(e).split(';')[0]}; expected {what})",
                         file=path, line=lineno) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)  # one decoder: json.loads with an argument makes one a line


TRACE = "a kvbench JSONL trace"  # what json_lines's errors say a trace file should be


def iter_trace(path: str | os.PathLike, text_len=None) -> Iterator[Request]:
    """Stream the requests of a JSONL trace, validating each; blank lines are skipped. A file in a
    format kvbench imports (Mooncake, Azure, BurstGPT, ShareGPT) is refused at its first line with
    the command that converts it."""
    path = os.fspath(path)
    seen: set[str] = set()
    index = 0
    try:
        for lineno, obj in json_lines(path, TRACE):
            where = {"file": path, "line": lineno}
            r = parse_request(obj, where, index, text_len)
            check_unique_id(r.id, seen, where)
            index += 1
            yield r
    except InputError as e:
        raise (foreign_format_error(path) or e) if index == 0 else e from None
    if index == 0:
        raise InputError("trace has no requests", file=path)


# (importer name, what it is, a test of the file's first non-blank line and its first 64 KiB): files
# people hand to replay by mistake, recognised so the error can name the conversion
_FOREIGN = (
    ("mooncake", "a Mooncake trace", lambda first, head: first.startswith("{") and all(
        f'"{k}"' in first for k in ("timestamp", "input_length", "output_length", "hash_ids"))),
    ("azure", "an Azure LLM inference CSV", lambda first, head: first.replace(" ", "").startswith(
        "TIMESTAMP,ContextTokens,GeneratedTokens")),
    ("burstgpt", "a BurstGPT CSV", lambda first, head: first.startswith("Timestamp,") and "Request tokens" in first),
    ("sharegpt", "a ShareGPT JSON file", lambda first, head: first.startswith("[") and '"conversations"' in head),
)


def foreign_format(path: str) -> tuple[str, str] | None:
    """(importer, description) when ``path`` starts like a trace format kvbench imports, else None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16).decode("utf-8", "replace").lstrip("\ufeff")
    except OSError:
        return None
    first = next((ln.strip() for ln in head.splitlines() if ln.strip()), "")
    return next(((name, what) for name, what, test in _FOREIGN if first and test(first, head)), None)


def foreign_format_error(path: str) -> InputError | None:
    """The one-line refusal of a file in an imported format, naming its conversion; None otherwise."""
    found = foreign_format(path)
    if found is None:
        return None
    name, what = found
    return InputError(f"this is {what}, not a kvbench trace: convert it first with "
                      f"kvbench trace convert --from {name} {path} -o out.jsonl", file=path, line=1)


def check_unique_id(rid: str, seen: set[str], where: dict) -> None:
    """Ids are unique in a trace: ``rid`` is added to the ids ``seen`` before it, or refused."""
    if rid in seen:
        raise InputError(f"duplicate request id {rid!r}", **where, field="id")
    seen.add(rid)


def load_trace(path: str | os.PathLike, text_len=None, limit: int | None = None) -> list[Request]:
    """Read a whole trace (validated), optionally only its first ``limit`` requests."""
    out = []
    for r in iter_trace(path, text_len):
        if limit is not None and len(out) >= limit:
            break
        out.append(r)
    return out


def write_trace(requests: Iterable[Request], path: str | os.PathLike) -> int:
    """Write requests as JSONL (atomically: a temporary file renamed into place). Returns the count."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    n = 0
    try:
        fh = open(tmp, "w", encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write trace: {e.strerror}", file=path) from None
    try:
        with fh:
            for r in requests:
                fh.write(json.dumps(r.to_json(), separators=(",", ":")))
                fh.write("\n")
                n += 1
    except BaseException:
        # A failing source (bad input half-way through a conversion) leaves no partial file behind.
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return n
