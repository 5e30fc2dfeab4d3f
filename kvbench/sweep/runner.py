"""The sweep runner (layer 7): every configuration of a grid (kvbench.sweep.grid) replayed into one
resumable directory.

A run whose summary.json says complete and whose config.json has the same settings is kept, anything
else is deleted and run again. ``sweep.parquet`` (one row per finished configuration: settings, then
every summary key) is rewritten after each run; ``sweep.json`` is the manifest of the grid.

Runs go to local worker processes (forkserver; each calls kvbench.engine.replay) or to Ray tasks.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Callable


from kvbench import __version__
from kvbench.engine.config import ReplayConfig
from kvbench.errors import InputError
from kvbench.engine.records import write_json
from kvbench.sweep.grid import Config, expand, not_applicable

SWEEP_PARQUET = "sweep.parquet"
SWEEP_JSON = "sweep.json"


# -- running -----------------------------------------------------------------------------------
def run_one(trace: str, settings: dict, run_dir: str) -> dict:
    """One configuration into ``run_dir`` (in a worker process or a Ray task); its summary."""
    from kvbench.engine.replay import replay

    return replay(trace, ReplayConfig(**settings), run_dir)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def finished_summary(run_dir: str, settings: dict) -> dict | None:
    """The summary of a complete run of exactly these settings in ``run_dir``, else None."""
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    config = _read_json(os.path.join(run_dir, "config.json"))
    if not summary or not summary.get("complete") or not config:
        return None
    return summary if config.get("settings") == settings else None


@dataclass
class SweepState:
    """What the sweep knows so far; rewrites sweep.parquet and sweep.json as runs finish."""

    out_dir: str
    trace: str
    grid: dict[str, list]
    configs: list[Config]
    summaries: dict[str, dict] = field(default_factory=dict)  # run name -> summary
    status: dict[str, str] = field(default_factory=dict)  # run name -> done|skipped|failed: ...

    def write(self) -> None:
        self.write_parquet()
        self.write_manifest()

    def write_parquet(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = []
        for c in self.configs:
            s = self.summaries.get(c.name)
            if s is None:
                continue
            unused = not_applicable(c.settings)
            row = {"run": c.name}
            row.update({k: (None if k in unused else v) for k, v in c.settings.items()})
            row.update({k: v for k, v in s.items() if k not in row})
            rows.append(row)
        path = os.path.join(self.out_dir, SWEEP_PARQUET)
        tmp = path + ".tmp"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)

    def write_manifest(self) -> None:
        write_json(os.path.join(self.out_dir, SWEEP_JSON), {
            "kvbench": __version__,
            "trace": os.path.abspath(self.trace),
            "grid": self.grid,
            "configurations": [{"run": c.name, "status": self.status.get(c.name, "pending"),
                                "settings": c.settings} for c in self.configs],
        })


@dataclass
class Event:
    """Reported to the progress display: a configuration started, finished, was skipped or failed."""

    kind: str  # start | done | skip | fail
    name: str
    summary: dict | None = None
    error: str | None = None


def run_sweep(trace: str, grid: dict[str, list], out_dir: str, *, jobs: int = 1,
              backend: str = "local", ray_address: str | None = None,
              on_event: Callable[[Event], None] | None = None) -> SweepState:
    """Run every configuration of ``grid`` not already finished in ``out_dir``."""
    configs = expand(grid)
    if backend == "ray":
        import_ray()  # before anything is written: a missing extra is a usage error
    os.makedirs(out_dir, exist_ok=True)
    state = SweepState(out_dir, trace, grid, configs)
    emit = on_event or (lambda e: None)
    todo: list[Config] = []
    for c in configs:
        run_dir = os.path.join(out_dir, c.name)
        s = finished_summary(run_dir, c.settings)
        if s is not None:
            state.summaries[c.name], state.status[c.name] = s, "skipped"
            emit(Event("skip", c.name, s))
            continue
        if os.path.exists(run_dir):  # interrupted or different settings: start it again cleanly
            shutil.rmtree(run_dir)
        todo.append(c)
    state.write()

    def finished(c: Config, summary: dict | None, error: str | None) -> None:
        if error is None:
            state.summaries[c.name], state.status[c.name] = summary, "done"
            emit(Event("done", c.name, summary))
        else:
            state.status[c.name] = f"failed: {error}"
            emit(Event("fail", c.name, error=error))
        state.write()

    runner = {"local": _run_local, "ray": _run_ray}[backend]
    runner(trace, out_dir, todo, jobs, ray_address, emit, finished)
    return state


def _run_local(trace, out_dir, todo, jobs, _address, emit, finished) -> None:
    if jobs <= 1:  # in this process: no start-up cost, and Ctrl-C reaches the engine directly
        for c in todo:
            emit(Event("start", c.name))
            try:
                s = run_one(trace, c.settings, os.path.join(out_dir, c.name))
            except Exception as e:  # one configuration failing must not stop the rest
                finished(c, None, str(e))
            else:
                finished(c, s, None)
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    # forkserver: workers do not inherit this process's threads or open parquet writers
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("forkserver"),
                                  initializer=_worker_init)
    try:
        futures = {}
        for c in todo:
            futures[pool.submit(_run_in_worker, trace, c.settings, os.path.join(out_dir, c.name))] = c
        started = set()
        pending = set(futures)
        while pending:
            # "start" is reported when a future leaves the queue, which the pool tells only as running()
            for f in pending:
                if f not in started and f.running():
                    started.add(f)
                    emit(Event("start", futures[f].name))
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for f in done:
                c = futures[f]
                if f not in started:
                    emit(Event("start", c.name))
                try:
                    finished(c, f.result(), None)
                except Exception as e:  # one configuration failing must not stop the rest
                    finished(c, None, str(e))
    except BaseException:
        # Ctrl-C (or a worker's crash): stop the workers, whose engines then close their runs as
        # incomplete; finished runs and sweep.parquet are already on disk.
        procs = list((getattr(pool, "_processes", None) or {}).values())  # shutdown forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        _interrupt_workers(procs)
        raise
    pool.shutdown()


# -- worker side of Ctrl-C: the run in progress closes as incomplete, queued ones never start ------
_STOPPING = False
_IN_RUN = False


def _worker_init() -> None:
    signal.signal(signal.SIGINT, _on_sigint)  # forkserver children start with SIGINT ignored


def _on_sigint(_signum, _frame) -> None:
    global _STOPPING
    _STOPPING = True
    if _IN_RUN:  # the engine's finally writes summary.json with complete=false
        raise KeyboardInterrupt


def _run_in_worker(trace: str, settings: dict, run_dir: str) -> dict:
    global _IN_RUN
    if _STOPPING:
        raise KeyboardInterrupt("the sweep was interrupted before this configuration started")
    _IN_RUN = True
    try:
        return run_one(trace, settings, run_dir)
    finally:
        _IN_RUN = False


def _interrupt_workers(procs) -> None:
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGINT)
        except (OSError, TypeError):
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()


def import_ray():
    try:
        import ray
    except ImportError:
        raise InputError("Ray is not installed: pip install 'kvbench[ray]'", field="--backend") from None
    return ray


def _run_ray(trace, out_dir, todo, _jobs, address, emit, finished) -> None:
    ray = import_ray()
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
             include_dashboard=False)
    remote = ray.remote(run_one)
    refs = {}
    trace_abs, out_abs = os.path.abspath(trace), os.path.abspath(out_dir)
    for c in todo:
        # one GPU per task for the real model; the cost model needs none
        gpus = 1 if c.cfg.executor == "model" else 0
        ref = remote.options(num_gpus=gpus, num_cpus=1).remote(
            trace_abs, c.settings, os.path.join(out_abs, c.name))
        refs[ref] = c
        emit(Event("start", c.name))
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                c = refs[ref]
                try:
                    finished(c, ray.get(ref), None)
                except ray.exceptions.RayTaskError as e:
                    cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
                    finished(c, None, str(cause).strip().splitlines()[-1])
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
