"""Importers of public trace formats into kvbench traces (spec §2), for ``kvbench trace convert``.

- Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``): hash id h is
  ``{"shared": "mooncake/<h>", "len": 512}``, the last one cut to input_length - 512*(k-1); id = the
  line number. Rows with output_length 0 are skipped and counted (the engine cannot generate 0
  tokens, and stretching them to 1 would invent decode work the service never did).
- Azure LLM inference CSV, 2023 layout (``TIMESTAMP,ContextTokens,GeneratedTokens``): one ``unique``
  segment; t relative to the first row. Rows with 0 context or 0 generated tokens are skipped.
- BurstGPT CSV, columns found by header name (the 6-column ``Timestamp,Model,Request tokens,Response
  tokens,Total tokens,Log Type`` and the 8-column release with ``Session ID`` and ``Elapsed time``):
  one ``unique`` segment; t relative to the first row; failed requests (0 response tokens) skipped.
- ShareGPT JSON (a list of ``{"id", "conversations": [{"from", "value"}, ...]}``): each answered
  turn is a request; message i of conversation c is the stream ``sharegpt/<c>/<i>``, so turn k re-sends
  turns 1..k-1 as shared segments and names its answer by ``output`` for the next turn to hit.
  Lengths come from a local Hugging Face tokenizer or, without one, ceil(characters / 4).
  Arrivals: conversations start as a Poisson (or gamma) process at a mean request rate; turns follow
  each other after exponential think times (workloads.sampling.session_times_s).

Every importer streams its input (ShareGPT excepted: a JSON array is parsed whole), validates as it
goes, raises InputError naming file, line and field, and counts what it skips in an ImportReport.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator

import numpy as np

from kvbench.errors import InputError
from kvbench.trace.format import (
    MAX_REQUEST_TOKENS,
    MAX_T_S,
    Request,
    Segment,
    json_lines,
    parse_request,
    write_trace,
)

MOONCAKE_BLOCK_TOKENS = 512
CHARS_PER_TOKEN = 4  # the usual rule of thumb for English with a BPE tokenizer
FORMATS = ("mooncake", "azure", "burstgpt", "sharegpt")


@dataclass
class ImportReport:
    """What a conversion did: requests written, rows skipped by reason, notes for the user."""

    written: int = 0
    skipped: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def summary(self, fmt: str, out: str) -> str:
        skipped = sum(self.skipped.values())
        why = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())
        tail = f"; skipped {skipped} ({why})" if skipped else "; skipped 0"
        return f"converted {fmt}: wrote {self.written} requests to {out}{tail}"


def _count(v, where: dict, fld: str, what: str) -> int:
    """A whole number of tokens in [0, MAX_REQUEST_TOKENS] from JSON or CSV (CSV gives strings;
    '906.0' is accepted)."""
    if isinstance(v, str):
        try:
            v = float(v) if any(c in v for c in ".eEnN") else int(v)
        except ValueError:
            raise InputError(f"expected a whole number, got {v[:40]!r} (is this {what}?)",
                             **where, field=fld) from None
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"expected a whole number, got {str(v)[:40]} (is this {what}?)",
                         **where, field=fld)
    if not 0 <= v <= MAX_REQUEST_TOKENS:
        raise InputError(f"must be in [0, {MAX_REQUEST_TOKENS:,}] tokens, got {v if v.bit_length() < 64 else 'a huge number'}",
                         **where, field=fld)
    return v


def _seconds(v: float, where: dict, fld: str) -> float:
    """A time stamp in seconds, finite and within the trace format's range."""
    if not (math.isfinite(v) and 0 <= v <= MAX_T_S):
        raise InputError(f"must be a time in [0, {MAX_T_S:g}] seconds, got {v}", **where, field=fld)
    return v


def _lengths_request(rid: str, t: float, prompt_len: int, output_len: int, report: ImportReport,
                     session: str | None = None, meta: dict | None = None) -> Request | None:
    """A request known only by its lengths (Azure, BurstGPT), or None when it must be skipped."""
    if output_len == 0:
        report.skipped["with 0 output tokens (failed)"] += 1
        return None
    if prompt_len == 0:
        report.skipped["with an empty prompt"] += 1
        return None
    return Request(id=rid, t=t, prompt=(Segment("unique", prompt_len),), output_len=output_len,
                   session=session, meta=meta, prompt_len=prompt_len)


# ---------------------------------------------------------------------------------------- Mooncake

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def read_mooncake(path: str, report: ImportReport) -> Iterator[Request]:
    what = "a Mooncake JSONL trace"
    for lineno, row in json_lines(path, what):
        where = {"file": path, "line": lineno}
        if not isinstance(row, dict):
            raise InputError(f"a row must be a JSON object ({what})", **where)
        for f in MOONCAKE_FIELDS:
            if f not in row:
                raise InputError(f"required field missing (is this {what}?)", **where, field=f)
        ts_ms = row["timestamp"]
        if isinstance(ts_ms, bool) or not isinstance(ts_ms, (int, float)):
            raise InputError(f"must be a number of milliseconds, got {str(ts_ms)[:40]}", **where,
                             field="timestamp")
        t = _seconds(ts_ms / 1000.0 if ts_ms <= 1e18 else math.inf, where, "timestamp")
        input_len = _count(row["input_length"], where, "input_length", what)
        output_len = _count(row["output_length"], where, "output_length", what)
        if input_len == 0:
            report.skipped["with an empty prompt"] += 1
            continue
        hash_ids = row["hash_ids"]
        if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise InputError("must be a list of integers", **where, field="hash_ids")
        k = len(hash_ids)
        if not MOONCAKE_BLOCK_TOKENS * (k - 1) < input_len <= MOONCAKE_BLOCK_TOKENS * k:
            raise InputError(f"{k} hash ids do not cover input_length {input_len} in "
                             f"{MOONCAKE_BLOCK_TOKENS}-token blocks", **where, field="hash_ids")
        if output_len == 0:
            report.skipped["with 0 output tokens"] += 1
            continue
        last = input_len - MOONCAKE_BLOCK_TOKENS * (k - 1)
        segs = tuple(Segment("shared", MOONCAKE_BLOCK_TOKENS if i < k - 1 else last,
                             name=f"mooncake/{h}") for i, h in enumerate(hash_ids))
        yield Request(id=str(lineno), t=round(t, 6), prompt=segs, output_len=output_len,
                      prompt_len=input_len, line=lineno)


# ------------------------------------------------------------------------------------ CSV formats

_TIME_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(\.\d+)?\s*(Z|[+-]\d{2}:?\d{2})?$")


def _timestamp_s(text: str, where: dict, fld: str, what: str) -> float:
    """Seconds from a number or an ISO date-time with any number of fraction digits (Azure has 7)."""
    text = text.strip()
    try:
        return _seconds(float(text), where, fld)
    except ValueError:
        pass
    m = _TIME_RE.match(text)
    if m is None:
        raise InputError(f"expected a time stamp, got {text[:40]!r} (is this {what}?)", **where,
                         field=fld)
    date, clock, frac, tz = m.groups()
    tz = "+00:00" if tz in (None, "Z") else tz
    try:
        dt = datetime.fromisoformat(f"{date}T{clock}{tz}")
    except ValueError:
        raise InputError(f"not a valid date-time: {text[:40]!r}", **where, field=fld) from None
    return _seconds((dt - datetime(1970, 1, 1, tzinfo=timezone.utc)).total_seconds() + float(frac or 0),
                    where, fld)


def _csv_rows(path: str, required: tuple[str, ...], what: str) -> Iterator[tuple[int, dict]]:
    """``(line, {lower-cased header: value})`` for each CSV row; checks the header has ``required``
    (matched without regard to case or surrounding spaces)."""
    try:
        fh = open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise InputError(f"cannot open {what}: {e.strerror}", file=path) from None
    with fh:
        reader = csv.reader(fh)
        try:
            header = [h.strip().lower() for h in next(reader, [])]
            missing = [c for c in required if c.lower() not in header]
            if missing:
                found = ", ".join(header)[:80] or "nothing"
                raise InputError(f"not {what}: the header has no column {missing[0]!r} "
                                 f"(found: {found})", file=path, line=1, field=missing[0])
            for row in reader:
                if not row or all(not c.strip() for c in row):
                    continue
                lineno = reader.line_num
                if len(row) != len(header):
                    raise InputError(f"{len(row)} columns where the header has {len(header)}",
                                     file=path, line=lineno)
                yield lineno, dict(zip(header, row))
        except UnicodeDecodeError:
            raise InputError(f"not UTF-8 text (expected {what})", file=path,
                             line=reader.line_num + 1) from None
        except csv.Error as e:
            raise InputError(f"malformed CSV ({e}; expected {what})", file=path,
                             line=reader.line_num) from None


def _relative_t(ts: float, first: list, where: dict, fld: str) -> float:
    if not first:
        first.append(ts)
    t = round(ts - first[0], 6)  # microseconds: no float noise in the written trace
    if t < 0:
        raise InputError("earlier than the first row's time stamp", **where, field=fld)
    return _seconds(t, where, fld)


def _read_lengths_csv(path: str, report: ImportReport, what: str, columns: tuple[str, str, str],
                      extra=None) -> Iterator[Request]:
    """Rows of (time stamp, prompt tokens, output tokens) columns -> one ``unique``-prompt request each;
    ``extra(row)`` gives more Request fields (session, meta)."""
    ts_col, in_col, out_col = columns
    first: list[float] = []
    for lineno, row in _csv_rows(path, columns, what):
        where = {"file": path, "line": lineno}
        t = _relative_t(_timestamp_s(row[ts_col.lower()], where, ts_col, what), first, where, ts_col)
        req = _lengths_request(str(lineno), t, _count(row[in_col.lower()], where, in_col, what),
                               _count(row[out_col.lower()], where, out_col, what), report,
                               **(extra(row) if extra else {}))
        if req is not None:
            req.line = lineno
        if req is not None:
            yield req


def read_azure(path: str, report: ImportReport) -> Iterator[Request]:
    return _read_lengths_csv(path, report, "an Azure LLM inference CSV (TIMESTAMP,ContextTokens,GeneratedTokens)",
                             ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))


def _burstgpt_extra(row: dict) -> dict:
    meta = {k: row[c] for k, c in (("model", "model"), ("log_type", "log type")) if row.get(c)}
    return {"session": row.get("session id") or None, "meta": meta or None}


def read_burstgpt(path: str, report: ImportReport) -> Iterator[Request]:
    return _read_lengths_csv(path, report, "a BurstGPT CSV (Timestamp, Request tokens, Response tokens, ...)",
                             ("Timestamp", "Request tokens", "Response tokens"), _burstgpt_extra)


# ------------------------------------------------------------------------------------ ShareGPT

USER_ROLES = {"human", "user"}
ANSWER_ROLES = {"gpt", "chatgpt", "assistant", "bard", "bing", "model"}


def token_counter(tokenizer_path: str | None, report: ImportReport) -> Callable[[str], int]:
    """Token count of a text: a local Hugging Face tokenizer, or ceil(characters / 4) without one."""
    if tokenizer_path is None:
        report.notes.append(f"no --tokenizer: token counts estimated as ceil(characters / "
                            f"{CHARS_PER_TOKEN}), about right for English with a BPE tokenizer")
        return lambda text: math.ceil(len(text) / CHARS_PER_TOKEN)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except Exception as e:  # transformers raises many kinds; all mean "no usable tokenizer here"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot load a tokenizer: {msg[:160]}", file=tokenizer_path) from None
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def _load_json(path: str, what: str):
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise InputError(f"cannot open {what}: {e.strerror}", file=path) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InputError(f"not UTF-8 text (expected {what})", file=path, line=line) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"malformed JSON ({e.msg} at column {e.colno}; expected {what})",
                         file=path, line=e.lineno) from None
    except RecursionError:
        raise InputError(f"nested too deeply to be {what}", file=path) from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise InputError(f"unusable JSON ({str(e).split(':')[0]}; expected {what})", file=path) from None


def _sharegpt_turns(path: str, what: str, count_tokens, report: ImportReport):
    """Per conversation: (key, [(message index, role, tokens)]) with roles 'user'/'answer'/'system'."""
    data = _load_json(path, what)
    if not isinstance(data, list):
        raise InputError(f"the top level must be a list of conversations ({what})", file=path)
    keys_seen: set[str] = set()
    for ci, conv in enumerate(data):
        fld = f"[{ci}]"
        if not isinstance(conv, dict) or not isinstance(conv.get("conversations"), list):
            raise InputError(f"expected an object with a 'conversations' list ({what})", file=path,
                             field=f"{fld}.conversations")
        key = str(conv.get("id", ci))
        if key in keys_seen:  # ShareGPT dumps repeat ids; names must not collide
            key = f"{key}~{ci}"
        keys_seen.add(key)
        msgs = []
        for mi, m in enumerate(conv["conversations"]):
            mf = f"{fld}.conversations[{mi}]"
            if not isinstance(m, dict) or not isinstance(m.get("value"), str):
                raise InputError("expected an object with a string 'value'", file=path,
                                 field=f"{mf}.value")
            who = str(m.get("from", "")).lower()
            role = ("user" if who in USER_ROLES else "answer" if who in ANSWER_ROLES
                    else "system" if who == "system" else None)
            if role is None:
                raise InputError(f"unknown speaker {m.get('from')!r} (expected human or gpt)",
                                 file=path, field=f"{mf}.from")
            msgs.append((mi, role, count_tokens(m["value"])))
        yield key, msgs


def read_sharegpt(path: str, report: ImportReport, *, tokenizer: str | None = None,
                  rate: float = 1.0, think_s: float = 30.0, seed: int = 0,
                  arrival: str = "poisson", burstiness: float = 1.0) -> Iterator[Request]:
    from kvbench.workloads.sampling import (
        session_times_s,  # layer 1 shares the arrival model
    )

    what = "a ShareGPT JSON file (a list of {id, conversations: [{from, value}]})"
    count_tokens = token_counter(tokenizer, report)
    sessions: list[tuple[str, list[Request]]] = []
    for key, msgs in _sharegpt_turns(path, what, count_tokens, report):
        turns: list[Request] = []
        history: list[Segment] = []
        for i, (mi, role, n_tok) in enumerate(msgs):
            name = f"sharegpt/{key}/{mi}"
            if role == "answer" and i > 0 and msgs[i - 1][1] == "user" and history:
                if n_tok == 0:
                    report.skipped["turns with an empty answer"] += 1
                else:
                    turns.append(Request(id=f"{key}-t{len(turns) + 1}", t=0.0, prompt=tuple(history),
                                         output_len=n_tok, session=key, output=name,
                                         prompt_len=sum(s.length for s in history)))
            if n_tok > 0:
                history.append(Segment("shared", n_tok, name=name))
        if turns:
            sessions.append((key, turns))
        else:
            report.skipped["conversations with no answered turn"] += 1
    if not sessions:
        raise InputError(f"no conversation has an answered turn ({report.summary('sharegpt', '-')})", file=path)
    rng = np.random.default_rng(seed)
    times = session_times_s(rng, [len(t) for _, t in sessions], rate, think_s, arrival, burstiness)
    out = []
    for (_, turns), ts in zip(sessions, times):
        for req, t in zip(turns, ts):
            req.t = round(float(t), 6)
            out.append(req)
    # Written in arrival order, so trace order (used by the ideal hit rate) matches replay order.
    out.sort(key=lambda r: r.t)
    yield from out


# ------------------------------------------------------------------------------------ entry point

def _valid(requests: Iterator[Request], in_path: str) -> Iterator[Request]:
    """Every request as the trace reader will read it back: a row the format cannot hold (too long,
    a name that is not valid Unicode) stops the conversion naming its source line, so a converted
    trace is always one that kvbench accepts."""
    for i, r in enumerate(requests):
        where = {"file": in_path, "line": r.line} if r.line else {"file": in_path}
        parse_request(r.to_json(), where, i)
        yield r


READERS: dict[str, Callable[..., Iterator[Request]]] = {
    "mooncake": read_mooncake, "azure": read_azure, "burstgpt": read_burstgpt,
    "sharegpt": read_sharegpt,
}


def convert(fmt: str, in_path: str | os.PathLike, out_path: str | os.PathLike,
            limit: int | None = None, **options) -> ImportReport:
    """Convert ``in_path`` (format ``fmt``) to a kvbench trace at ``out_path``; the first ``limit``
    requests only if given. ``options`` go to the reader (ShareGPT's tokenizer and arrival model)."""
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    report = ImportReport()
    requests = READERS[fmt](in_path, report, **options)
    if limit is not None:
        requests = itertools.islice(requests, limit)
    report.written = write_trace(_valid(requests, in_path), out_path)
    if report.written == 0:
        os.unlink(out_path)
        raise InputError(f"no requests to write ({report.summary(fmt, out_path)})", file=in_path)
    return report
