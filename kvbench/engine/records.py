"""What a run writes (spec §3): config.json, summary.json, requests.parquet, steps.parquet.

Rows are buffered and written as parquet row groups as the run goes, so a long run holds little in
memory; ``close`` (also reached on Ctrl-C or a crash, from the engine's ``finally``) closes the
parquet footers and writes summary.json with ``complete`` true or false, leaving a readable run.
"""
from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench import __version__
from kvbench.errors import InputError
from kvbench.jsonio import dumps
from kvbench.provenance import code_fingerprint, git_info, now_iso

REQUEST_SCHEMA = pa.schema([
    ("id", pa.string()), ("session", pa.string()), ("replica", pa.int64()), ("arrival_s", pa.float64()),
    ("first_token_s", pa.float64()), ("finish_s", pa.float64()), ("prompt_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("output_tokens", pa.int64()), ("n", pa.int64()),
    ("ttft_ms", pa.float64()), ("tpot_ms", pa.float64()), ("e2e_ms", pa.float64()),
    ("queue_ms", pa.float64()), ("preemptions", pa.int64()), ("recomputed_tokens", pa.int64()),
    ("evicted_tokens", pa.int64()), ("recalled_tokens", pa.int64()), ("loaded_tokens", pa.int64()),
    ("rejected", pa.string()), ("itl_ms_max", pa.float64()),
])
STEP_SCHEMA = pa.schema([
    ("step", pa.int64()), ("replica", pa.int64()), ("t_s", pa.float64()), ("dur_ms", pa.float64()),
    ("prefill_tokens", pa.int64()), ("decode_seqs", pa.int64()), ("running", pa.int64()),
    ("waiting", pa.int64()), ("blocks_total", pa.int64()), ("blocks_used", pa.int64()),
    ("blocks_cached", pa.int64()), ("blocks_free", pa.int64()), ("slots_allocated", pa.int64()),
    ("tokens_live", pa.int64()), ("internal_frag", pa.float64()), ("kv_util", pa.float64()),
    ("hit_tokens_cum", pa.int64()), ("query_tokens_cum", pa.int64()),
    ("cpu_hit_tokens_cum", pa.int64()), ("disk_hit_tokens_cum", pa.int64()), ("bytes_loaded", pa.int64()),
    ("bytes_stored", pa.int64()), ("load_ms", pa.float64()),
])
# a disaggregated run's requests (engine/disagg.py): where each went and the parts of its TTFT, which sum to it
TRANSFER_SCHEMA = pa.schema([
    ("id", pa.string()), ("prefill", pa.int64()), ("decode", pa.int64()),
    ("prefill_wait_ms", pa.float64()), ("prefill_ms", pa.float64()), ("hop_ms", pa.float64()),
    ("admit_ms", pa.float64()), ("transfer_ms", pa.float64()), ("first_step_ms", pa.float64()),
    ("ttft_ms", pa.float64()), ("blocks", pa.int64()), ("bytes", pa.int64()),
    ("prefill_cached_tokens", pa.int64()), ("decode_cached_tokens", pa.int64()),
])
# a live run's tokens as the client received them: one row per streamed chunk (the gaps are step times)
TOKEN_SCHEMA = pa.schema([("id", pa.string()), ("sample", pa.int64()), ("t_s", pa.float64()),
                          ("tokens", pa.int64())])
PCTS = (("mean", None), ("p50", 50), ("p90", 90), ("p99", 99))


@contextmanager
def interrupt_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) held back for the block and raised after it: a row group is written and its
    buffer cleared together, so an interrupted run's rows are in the file once, neither lost nor
    twice. Only the main thread can hold it; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is None:  # a handler not installed from Python: leave it be
        yield
        return
    caught: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if caught:
        if callable(old):
            old(signal.SIGINT, None)
        elif old == signal.SIG_DFL:
            raise KeyboardInterrupt


_NUMERIC = {pa.int64(): ("i", np.int64), pa.float64(): ("if", np.float64)}  # numpy kinds each takes as it is


def _column(values: Sequence, type_: pa.DataType) -> pa.Array:
    """Python values (None: null) as an Arrow array of ``type_``, as pa.array makes it: int64,
    float64 (a NaN stays a value) and strings are built from their buffers, since pa.array asks
    pandas about its input and importing pandas costs a run ~0.2 s; other types, and values numpy
    does not read as the type's (pa.array then converts them or says why not), by pa.array. (A bool
    among an int64 column's ints is read as 0 or 1 here, where pa.array refuses it.)"""
    n = len(values)
    numeric = _NUMERIC.get(type_)
    if numeric is not None:
        kinds, dtype = numeric
        data = np.array(values)
        if data.ndim == 1 and data.dtype.kind in kinds:  # no nulls, no odd values: numpy read them all
            return pa.Array.from_buffers(type_, n, [None, pa.py_buffer(data.astype(dtype, copy=False))], null_count=0)
    nulls = values.count(None)
    validity = None
    if nulls:
        valid = np.fromiter((v is not None for v in values), dtype=np.bool_, count=n)
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    if numeric is not None and nulls:
        data = np.array([0 if v is None else v for v in values])
        if data.ndim == 1 and data.dtype.kind in numeric[0]:
            return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(data.astype(numeric[1], copy=False))],
                                         null_count=nulls)
    elif type_ == pa.string() and all(type(v) is str for v in values if v is not None):
        encoded = [b"" if v is None else v.encode() for v in values]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        if offsets[-1] < 2**31:  # (pa.string's offsets are int32)
            return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(offsets.astype(np.int32)),
                                                    pa.py_buffer(b"".join(encoded))], null_count=nulls)
    return pa.array(list(values), type=type_)


def column_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """An int64, float64 or bool (no nulls) column as numpy, as ``to_numpy(zero_copy_only=False)``
    gives it (a null: NaN, an int64 column with nulls then float64), read from the column's buffers:
    Arrow's to_numpy imports pandas (~0.2 s a run)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts, nulls = [], False
    for a in chunks:
        n, off = len(a), a.offset
        validity, data = a.buffers()[:2]
        v: np.ndarray
        if a.type == pa.bool_():
            v = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=off + n, bitorder="little")[off:].astype(np.bool_)
        elif a.type in _NUMERIC:
            v = np.frombuffer(data, dtype=_NUMERIC[a.type][1], count=off + n)[off:]
        else:
            raise TypeError(f"column_numpy reads int64, float64 and bool columns, not {a.type}")
        if a.null_count:
            if a.type == pa.bool_():
                raise TypeError("column_numpy reads a bool column without nulls")
            ok = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), count=off + n, bitorder="little")[off:]
            v = np.where(ok.astype(np.bool_), v, np.nan)
            nulls = True
        parts.append(v)
    if not parts:
        return np.zeros(0, dtype=np.bool_ if column.type == pa.bool_() else _NUMERIC[column.type][1])
    out = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
    return out.astype(np.float64) if nulls and out.dtype != np.float64 else out


class Table:
    """Rows buffered as tuples, flushed to a parquet file in row groups (a row is appended whole, so
    one that Ctrl-C cuts short is never half written)."""

    def __init__(self, path: str, schema: pa.Schema, flush_rows: int):
        self.schema = schema
        self.buffer: list[tuple] = []
        # dictionary pages for the strings only: a numeric column's values rarely repeat (times, counts),
        # and trying to encode it so cost a step row group of 8,192 rows 25 of its 29 ms, for a
        # larger file (tests/test_records.py: the same values read back)
        self.writer: pq.ParquetWriter | None = pq.ParquetWriter(
            path, schema, compression="zstd", use_dictionary=[f.name for f in schema if f.type == pa.string()])
        self.flush_rows = flush_rows
        self.path = path

    def add(self, row: tuple) -> None:
        buffer = self.buffer
        buffer.append(row)
        if len(buffer) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        buffer = self.buffer
        if buffer:
            names = self.schema.names
            widths = {len(row) for row in buffer}
            if widths != {len(names)}:
                raise ValueError(f"rows of {sorted(widths)} values for the {len(names)} columns of {self.path}")
            assert self.writer is not None  # (rows are added before close)
            columns = [_column(values, field.type) for values, field in zip(zip(*buffer), self.schema)]
            with interrupt_held():
                self.writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))
                self.buffer = []

    def close(self) -> None:
        """Write the rows left and the file's footer; the writer (which holds every row group's
        metadata until it is dropped) is let go."""
        if self.writer is None:
            return
        self.flush()
        self.writer.close()
        self.writer = None


def environment(device_name: str | None = None) -> dict:
    """Versions, the code's fingerprint and device, for config.json (git only for kvbench's own
    checkout: kvbench.provenance.git_info)."""
    env = {"kvbench": __version__, **git_info(), "code": code_fingerprint(), "python": sys.version.split()[0],
           "platform": platform.platform(), "device_name": device_name}
    for dist in ("torch", "triton", "transformers", "numpy", "pandas", "pyarrow"):
        try:  # from the installed metadata: importing transformers and triton costs a second per run
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    return env


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(dumps(obj, indent=2))
        fh.write("\n")
    os.replace(tmp, path)


RUN_FILES = ("summary.json", "config.json", "requests.parquet", "steps.parquet", "metrics.parquet", "tokens.parquet")


def holds_run(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("summary.json", "config.json"))


def claim_run_dir(run_dir: str, *, force: bool = False, unique: bool = False) -> str:
    """Create a run directory (and its parents) for a new run and return its path.

    No run is ever written over another: a directory that holds a run is refused unless ``force``
    (its run files are then removed); with ``unique`` (a default name) a taken name gets a suffix
    (-2, -3, ...) instead, so two replays started in the same second write two directories. A path
    that cannot be created is an InputError naming --out."""
    base, k = run_dir, 1
    parent = os.path.dirname(os.path.abspath(run_dir))
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:
        raise InputError("a parent of it is a file, not a directory", file=run_dir, field="--out") from None
    except OSError as e:
        raise InputError(f"cannot create its parent directory ({e.strerror or e})", file=run_dir,
                         field="--out") from None
    while True:
        try:
            os.mkdir(run_dir)  # atomic: of two processes asking for one name, one gets it
            return run_dir
        except FileExistsError:
            if unique:
                k += 1
                run_dir = f"{base}-{k}"
                continue
            if not os.path.isdir(run_dir):
                raise InputError("exists and is not a directory", file=run_dir, field="--out") from None
            if holds_run(run_dir):
                if not force:
                    raise InputError("holds a run already: name another --out, or add --force to replace it",
                                     file=run_dir, field="--out") from None
                for f in RUN_FILES:
                    if os.path.exists(os.path.join(run_dir, f)):
                        os.remove(os.path.join(run_dir, f))
            return run_dir
        except OSError as e:
            raise InputError(f"cannot create the run directory ({e.strerror or e})", file=run_dir,
                             field="--out") from None


class RunWriter:
    """Opens a claimed run directory: summary.json says incomplete until ``close`` (also reached on
    Ctrl-C or a crash) writes the real one."""

    def __init__(self, run_dir: str, config: dict, transfers: bool = False):
        """``transfers``: also write transfers.parquet (a disaggregated run's, TRANSFER_SCHEMA)."""
        self.dir = run_dir
        self.config = {**config, "started_at": now_iso(), "finished_at": None}
        try:
            write_json(os.path.join(run_dir, "summary.json"), {"complete": False})
            write_json(os.path.join(run_dir, "config.json"), self.config)
            self.requests = Table(os.path.join(run_dir, "requests.parquet"), REQUEST_SCHEMA, 1024)
            self.steps = Table(os.path.join(run_dir, "steps.parquet"), STEP_SCHEMA, 8192)
            self.transfers = (Table(os.path.join(run_dir, "transfers.parquet"), TRANSFER_SCHEMA, 1024)
                              if transfers else None)
        except OSError as e:
            raise InputError(f"cannot write the run ({e.strerror or e})", file=run_dir, field="--out") from None
        self.requests_path = os.path.join(run_dir, "requests.parquet")
        self.tables_closed = False
        self.closed = False

    def close_tables(self) -> None:
        """Close the parquet files (their rows readable from now on); ``close`` does it if not done."""
        if not self.tables_closed:
            self.tables_closed = True
            try:
                self.requests.close()
            finally:
                self.steps.close()
                if self.transfers is not None:
                    self.transfers.close()

    def close(self, summary: dict) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.close_tables()
        finally:
            self.config["finished_at"] = now_iso()
            write_json(os.path.join(self.dir, "config.json"), self.config)
            write_json(os.path.join(self.dir, "summary.json"), summary)


def weighted_percentile(values: np.ndarray, counts: np.ndarray, q: float) -> float:
    """np.percentile(np.repeat(values, counts), q) (linear interpolation) without the repeat."""
    order = np.argsort(values, kind="stable")
    v, c = values[order], np.cumsum(counts[order])
    pos = q / 100.0 * (c[-1] - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    a, b = v[np.searchsorted(c, lo, side="right")], v[np.searchsorted(c, hi, side="right")]
    return float(a + (b - a) * (pos - lo))


def itl_summary(gaps: dict[float, int] | list[dict[float, int]]) -> dict:
    """``itl_ms_{mean,p50,p90,p99}`` over every gap between two tokens of one sample, pooled over the
    requests (vllm bench serve's ITL); ``gaps`` maps gap seconds to how often it occurred."""
    merged: dict[float, int] = {}
    for g in (gaps if isinstance(gaps, list) else [gaps]):
        for k, n in g.items():
            merged[k] = merged.get(k, 0) + n
    if not merged:
        return {f"itl_ms_{name}": None for name, _ in PCTS}
    v = np.fromiter(merged.keys(), dtype=np.float64, count=len(merged)) * 1e3
    c = np.fromiter(merged.values(), dtype=np.int64, count=len(merged))
    by_gap = np.argsort(v, kind="stable")  # the sums in one order whatever order the gaps were seen in
    v, c = v[by_gap], c[by_gap]
    out = {"itl_ms_mean": float((v * c).sum() / c.sum())}
    for name, q in PCTS[1:]:
        out[f"itl_ms_{name}"] = weighted_percentile(v, c, q)
    return out


SLO_KEYS = ("ttft", "tpot", "e2e", "itl")  # --slo names; itl is a request's longest gap


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=200,tpot=50' (milliseconds) -> {'ttft': 200.0, 'tpot': 50.0}; ValueError naming the
    part that is not NAME=MS with NAME one of ttft, tpot, e2e, itl."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or name not in SLO_KEYS or not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"expected NAME=MILLISECONDS with NAME one of {', '.join(SLO_KEYS)}, got {part!r}")
        out[name] = ms
    return out


def goodput(latencies: dict[str, np.ndarray], slo: dict[str, float], duration_s: float) -> dict:
    """Requests meeting every SLO (vllm bench serve's --goodput): their share and their rate.
    ``latencies``: per completed request, in ms, 'ttft', 'tpot', 'e2e' and 'itl' (its longest gap);
    a request without a figure (one output token: no TPOT) meets that SLO."""
    if not slo:
        return {"slo_attainment": None, "goodput_req_per_s": None}
    n = len(latencies["ttft"])
    ok = np.ones(n, dtype=bool)
    for name, ms in slo.items():
        ok &= ~(np.asarray(latencies[name]) > ms)  # NaN (no figure) passes
    good = int(ok.sum())
    return {"slo_attainment": good / n if n else None,
            "goodput_req_per_s": good / duration_s if duration_s > 0 else None}


def distribution(prefix: str, values) -> dict:
    """mean/p50/p90/p99 of finite values, as ``{prefix}_{stat}`` keys (None when there are none)."""
    a = np.asarray(values, dtype=np.float64)
    a = a[np.isfinite(a)]
    if not len(a):
        return {f"{prefix}_{name}": None for name, _ in PCTS}
    qs = [q for _, q in PCTS if q is not None]
    at = dict(zip(qs, np.percentile(a, qs).tolist()))  # one partition for every percentile
    return {f"{prefix}_{name}": float(a.mean()) if q is None else at[q] for name, q in PCTS}

