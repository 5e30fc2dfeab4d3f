"""What a run writes (spec §3): config.json, summary.json, requests.parquet, steps.parquet.

Rows are buffered and written as parquet row groups as the run goes, so a long run holds little in
memory; ``close`` (also reached on Ctrl-C or a crash, from the engine's ``finally``) closes the
parquet footers and writes summary.json with ``complete`` true or false, leaving a readable run.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench import __version__

REQUEST_SCHEMA = pa.schema([
    ("id", pa.string()), ("session", pa.string()), ("arrival_s", pa.float64()),
    ("first_token_s", pa.float64()), ("finish_s", pa.float64()), ("prompt_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("output_tokens", pa.int64()), ("n", pa.int64()),
    ("ttft_ms", pa.float64()), ("tpot_ms", pa.float64()), ("e2e_ms", pa.float64()),
    ("queue_ms", pa.float64()), ("preemptions", pa.int64()), ("recomputed_tokens", pa.int64()),
    ("evicted_tokens", pa.int64()), ("recalled_tokens", pa.int64()), ("rejected", pa.string()),
])
STEP_SCHEMA = pa.schema([
    ("step", pa.int64()), ("t_s", pa.float64()), ("dur_ms", pa.float64()),
    ("prefill_tokens", pa.int64()), ("decode_seqs", pa.int64()), ("running", pa.int64()),
    ("waiting", pa.int64()), ("blocks_total", pa.int64()), ("blocks_used", pa.int64()),
    ("blocks_cached", pa.int64()), ("blocks_free", pa.int64()), ("slots_allocated", pa.int64()),
    ("tokens_live", pa.int64()), ("internal_frag", pa.float64()), ("kv_util", pa.float64()),
    ("hit_tokens_cum", pa.int64()), ("query_tokens_cum", pa.int64()),
])
PCTS = (("mean", None), ("p50", 50), ("p90", 90), ("p99", 99))


class _Table:
    """Column buffers flushed to a parquet file in row groups."""

    def __init__(self, path: str, schema: pa.Schema, flush_rows: int):
        self.schema = schema
        self.cols: dict[str, list] = {n: [] for n in schema.names}
        self.writer = pq.ParquetWriter(path, schema, compression="zstd")
        self.flush_rows = flush_rows
        self.rows = 0

    def add(self, row: tuple) -> None:
        for col, v in zip(self.cols.values(), row):
            col.append(v)
        self.rows += 1
        if self.rows >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.writer.write_table(pa.table(self.cols, schema=self.schema))
            for col in self.cols.values():
                col.clear()
            self.rows = 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device_name: str | None = None) -> dict:
    """Versions and device, for config.json."""
    env = {"kvbench": __version__, "git_commit": _git_commit(), "python": sys.version.split()[0],
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
        json.dump(obj, fh, indent=2, sort_keys=False, default=_jsonable)
        fh.write("\n")
    os.replace(tmp, path)


def _jsonable(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    return str(v)


class RunWriter:
    def __init__(self, run_dir: str, config: dict):
        self.dir = run_dir
        if os.path.isdir(run_dir):
            write_json(os.path.join(run_dir, "summary.json"), {"complete": False})
        else:
            # A new run directory appears whole, already marked incomplete: built under a temporary
            # name and renamed, so an interrupt can never leave a directory without summary.json.
            parent = os.path.dirname(os.path.abspath(run_dir))
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".kvbench-run-", dir=parent)
            try:
                write_json(os.path.join(tmp, "summary.json"), {"complete": False})
                os.rename(tmp, run_dir)
            except BaseException:  # Ctrl-C included: leave nothing half-made behind
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        write_json(os.path.join(run_dir, "config.json"), config)
        self.requests = _Table(os.path.join(run_dir, "requests.parquet"), REQUEST_SCHEMA, 1024)
        self.steps = _Table(os.path.join(run_dir, "steps.parquet"), STEP_SCHEMA, 8192)
        self.closed = False

    def close(self, summary: dict) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.requests.close()
            self.steps.close()
        finally:
            write_json(os.path.join(self.dir, "summary.json"), summary)


def distribution(prefix: str, values) -> dict:
    """mean/p50/p90/p99 of finite values, as ``{prefix}_{stat}`` keys (NaN when there are none)."""
    a = np.asarray(values, dtype=np.float64)
    a = a[np.isfinite(a)]
    out = {}
    for name, q in PCTS:
        if not len(a):
            out[f"{prefix}_{name}"] = float("nan")
        else:
            out[f"{prefix}_{name}"] = float(a.mean() if q is None else np.percentile(a, q))
    return out

