"""The sweep runner (layer 7): every configuration of a grid (kvbench.sweep.grid) replayed into one
resumable directory.

A run whose summary.json says complete and whose config.json has the same settings is kept, anything
else is deleted and run again. ``sweep.parquet`` (one row per finished configuration: settings, then
every summary key) is rewritten after each run; ``sweep.json`` is the manifest of the grid.

Runs go to local worker processes (forkserver; each calls kvbench.engine.replay) or to Ray tasks.
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable


from kvbench import __version__
from kvbench.engine.config import ReplayConfig
from kvbench.errors import InputError, RunError
from kvbench.sweep.store import SweepStore
from kvbench.sweep.grid import Config, expand, not_applicable

SWEEP_PARQUET = "sweep.parquet"
SWEEP_JSON = "sweep.json"


# -- running -----------------------------------------------------------------------------------
def run_one(trace: str, settings: dict, run_dir: str) -> dict:
    """One configuration into ``run_dir`` (in this process or a local worker); its summary."""
    from kvbench.engine.replay import replay

    return replay(trace, ReplayConfig(**settings), run_dir)


def run_shipped(trace: bytes | str, trace_label: str, settings: dict, name: str, driver_version: str,
                dest: str | None = None) -> tuple[dict, dict[str, bytes] | None]:
    """One configuration run where the sweep directory may not be (a Ray task on another node, or a
    sweep whose --out is a storage URI): the trace comes as bytes (or a local path), the run goes to a
    temporary directory, and its files come back as bytes, or go straight to ``dest`` (a SweepStore
    location every node reaches). No path of the driver's is opened. -> (summary, files or None)."""
    from kvbench.engine.replay import replay

    if __version__ != driver_version:
        raise RunError(f"this worker runs kvbench {__version__} but the driver {driver_version}: install "
                       "the same kvbench on every node")
    with tempfile.TemporaryDirectory(prefix="kvbench-task-") as tmp:
        path = trace
        if isinstance(trace, bytes):
            path = os.path.join(tmp, "trace.jsonl")
            with open(path, "wb") as fh:
                fh.write(trace)
        run_dir = os.path.join(tmp, name)
        summary = replay(path, ReplayConfig(**settings), run_dir, trace_label=trace_label)
        files = {}
        for f in sorted(os.listdir(run_dir)):
            with open(os.path.join(run_dir, f), "rb") as fh:
                files[f] = fh.read()
    if dest is not None:
        SweepStore(dest).put_run(name, files)
        return summary, None
    return summary, files


def make_sweep_dir(out_dir: str) -> None:
    SweepStore(out_dir).makedirs()


def preflight(configs: list[Config], requests=None, trace_path: str = "") -> None:
    """What would make a configuration fail at once (an unknown model or GPU, an unreadable
    calibration, no CUDA device, a KV pool that holds no block or does not fit the GPUs) raises
    InputError before any run starts, once per distinct value. Given the trace's ``requests``, a
    request larger than every configuration's pool (where its size is known without building a
    model: --num-blocks, or the sim's) is refused too (a usage RunError); one too large for some
    configurations only is left to those runs, which fail and are reported while the others run."""
    from kvbench.engine.replay import check_trace_fits, pool_blocks
    from kvbench.executors import make_executor
    from kvbench.executors.presets import get_model

    checked: dict[tuple, RunError | None] = {}
    outcomes = []
    for c in configs:
        cfg = c.cfg
        key = (cfg.executor, cfg.model, cfg.gpu, cfg.calibration, cfg.kv_dtype, cfg.device, cfg.tp,
               cfg.kv_mem_bytes, cfg.num_blocks, cfg.block_size, cfg.layout, cfg.slab_reserve,
               cfg.max_model_len, cfg.limit)
        if key not in checked:
            checked[key] = None
            model = get_model(cfg.model)
            num_blocks = cfg.num_blocks
            if cfg.executor == "sim":
                # cheap: reads the GPU preset and the calibration file, sizes the pool
                num_blocks = pool_blocks(cfg, make_executor(cfg, model), model)
            else:  # the model executor: weights and pool must fit the device it would use
                from kvbench.engine.replay import check_model_memory
                check_model_memory(cfg, model)
            if requests is not None and num_blocks is not None:
                try:
                    check_trace_fits(requests, cfg, num_blocks, cfg.max_model_len or model.max_model_len,
                                     trace_path)
                except RunError as e:
                    checked[key] = e
        outcomes.append(checked[key])
    if outcomes and all(e is not None for e in outcomes):  # no configuration can run
        raise outcomes[0]


def finished_summary(store: SweepStore, name: str, settings: dict) -> dict | None:
    """The summary of a complete run of exactly these settings in the sweep's run ``name``, else None."""
    summary = store.read_json(name, "summary.json")
    config = store.read_json(name, "config.json")
    if not summary or not summary.get("complete") or not config:
        return None
    return summary if config.get("settings") == settings else None


@dataclass
class SweepState:
    """What the sweep knows so far; rewrites sweep.parquet and sweep.json as runs finish."""

    store: SweepStore
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
            # scalars only: a cluster run's per-replica figures stay in its summary.json
            row.update({k: v for k, v in s.items() if k not in row and not isinstance(v, (list, dict))})
            rows.append(row)
        buf = pa.BufferOutputStream()
        # every key of every row a column (from_pylist would take the first row's keys only: a
        # one-replica run has no cluster figures)
        names = list(dict.fromkeys(k for row in rows for k in row))
        pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in names} for row in rows]), buf)
        self.store.write_bytes(buf.getvalue().to_pybytes(), SWEEP_PARQUET)

    def write_manifest(self) -> None:
        self.store.write_json({
            "kvbench": __version__,
            "trace": os.path.abspath(self.trace),
            "grid": self.grid,
            "configurations": [{"run": c.name, "status": self.status.get(c.name, "pending"),
                                "settings": c.settings} for c in self.configs],
        }, SWEEP_JSON)


@dataclass
class Event:
    """Reported to the progress display: a configuration started, finished, was skipped or failed."""

    kind: str  # start | done | skip | fail
    name: str
    summary: dict | None = None
    error: str | None = None


def run_sweep(trace: str, grid: dict[str, list], out_dir: str, *, jobs: int = 1,
              backend: str = "local", ray_address: str | None = None,
              on_event: Callable[[Event], None] | None = None, cpus_per_task: float = 1,
              max_retries: int = 3) -> SweepState:
    """Run every configuration of ``grid`` not already finished in ``out_dir`` (a directory, or a
    storage URI: see kvbench.sweep.store)."""
    configs = expand(grid)
    if backend == "ray":
        import_ray()  # before anything is written: a missing extra is a usage error
    preflight(configs)
    store = SweepStore(out_dir)
    store.makedirs()
    state = SweepState(store, trace, grid, configs)
    emit = on_event or (lambda e: None)
    todo: list[Config] = []
    for c in configs:
        s = finished_summary(store, c.name, c.settings)
        if s is not None:
            state.summaries[c.name], state.status[c.name] = s, "skipped"
            emit(Event("skip", c.name, s))
            continue
        if store.exists(c.name):  # interrupted or different settings: start it again cleanly
            store.remove_run(c.name)
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

    if backend == "ray":
        from kvbench.sweep.ray_backend import run_ray

        run_ray(trace, store, todo, address=ray_address, cpus_per_task=cpus_per_task,
                max_retries=max_retries, emit=emit, finished=finished)
    elif store.local is None:  # a storage URI: each run in a temporary directory, then shipped
        for c in todo:
            emit(Event("start", c.name))
            try:
                summary, _ = run_shipped(trace, os.path.abspath(trace), c.settings, c.name, __version__,
                                         store.location)
            except Exception as e:  # one configuration failing must not stop the rest
                finished(c, None, str(e))
            else:
                finished(c, summary, None)
    else:
        _run_local(trace, store.local, todo, jobs, emit, finished)
    return state


def _run_local(trace, out_dir, todo, jobs, emit, finished) -> None:
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
