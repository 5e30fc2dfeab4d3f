"""What runs one configuration of a sweep, wherever it runs: in this process, a local worker process,
or a Ray task on another node (``run_shipped``: the trace as bytes, the run's files back as bytes);
the progress events the runner reports; importing Ray."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from kvbench import __version__
from kvbench.engine.config import ReplayConfig
from kvbench.errors import InputError, RunError
from kvbench.provenance import Invocation, code_fingerprint
from kvbench.sweep.store import SweepStore


def run_one(trace: str, settings: dict, run_dir: str, invocation: Invocation | None = None) -> dict:
    """One configuration into ``run_dir`` (in this process or a local worker); its summary."""
    from kvbench.engine.runs import replay

    return replay(trace, ReplayConfig(**settings), run_dir, invocation=invocation)


def run_shipped(trace: bytes | str, trace_label: str, settings: dict, name: str, driver_version: str,
                dest: str | None = None, driver_code: str | None = None,
                invocation: Invocation | None = None) -> tuple[dict, dict[str, bytes] | None]:
    """One configuration run where the sweep directory may not be (a Ray task on another node, or a
    sweep whose --out is a storage URI): the trace comes as bytes (or a local path), the run goes to a
    temporary directory, and its files come back as bytes, or go straight to ``dest`` (a SweepStore
    location every node reaches). No path of the driver's is opened. -> (summary, files or None)."""
    from kvbench.engine.runs import replay

    if __version__ != driver_version or (driver_code is not None and code_fingerprint() != driver_code):
        mine, theirs = (__version__, driver_version) if __version__ != driver_version else \
            (f"code {code_fingerprint()}", f"code {driver_code}")
        raise RunError(f"this worker runs kvbench {mine} but the driver {theirs}: install "
                       "the same kvbench on every node")
    with tempfile.TemporaryDirectory(prefix="kvbench-task-") as tmp:
        path = trace
        if isinstance(trace, bytes):
            path = os.path.join(tmp, "trace.jsonl")
            with open(path, "wb") as fh:
                fh.write(trace)
        run_dir = os.path.join(tmp, name)
        summary = replay(path, ReplayConfig(**settings), run_dir, trace_label=trace_label, invocation=invocation)
        files = {}
        for f in sorted(os.listdir(run_dir)):
            with open(os.path.join(run_dir, f), "rb") as fh:
                files[f] = fh.read()
    if dest is not None:
        SweepStore(dest).put_run(name, files)
        return summary, None
    return summary, files


@dataclass
class Event:
    """Reported to the progress display: a configuration started, finished, was skipped or failed."""

    kind: str  # start | done | skip | fail | note
    name: str
    summary: dict | None = None
    error: str | None = None
    message: str | None = None  # skip: where the run was reused from; note: why it runs again


def import_ray():
    try:
        import ray
    except ImportError:
        raise InputError("Ray is not installed: pip install 'kvbench[ray]'", field="--backend") from None
    return ray
