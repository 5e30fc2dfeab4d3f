"""The sweep runner (layer 7): every configuration of a grid (kvbench.sweep.grid) replayed into one
resumable directory.

A finished run is reused only when everything that decides its output is equal (reuse_verdict): the
trace's content, the settings, the files the settings name and the code. A run that differs only in
settings, files or code is run again with a note; a directory that holds another trace's or another
grid's sweep is refused (check_sweep_dir), so no input's results are ever deleted for another's.
``sweep.parquet`` (one row per finished configuration: settings, then every summary key) is rewritten
after each run; ``sweep.json`` is the manifest of the grid and of how the sweep was made.

Runs go to local worker processes (forkserver; each calls kvbench.engine.replay) or to Ray tasks.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

from kvbench import __version__
from kvbench.errors import InputError, RunError
from kvbench.provenance import (
    Invocation,
    code_fingerprint,
    file_sha256,
    git_info,
    now_iso,
    setting_files,
)
from kvbench.sweep.grid import Config, expand, not_applicable
from kvbench.sweep.store import SweepStore
from kvbench.sweep.tasks import Event, import_ray, run_one, run_shipped
from kvbench.trace.stream import trace_sha256

SWEEP_PARQUET = "sweep.parquet"
SWEEP_JSON = "sweep.json"


# -- running -----------------------------------------------------------------------------------
def make_sweep_dir(out_dir: str) -> None:
    SweepStore(out_dir).makedirs()


def preflight(configs: list[Config], requests=None, trace_path: str = "") -> None:
    """What would make a configuration fail at once (an unknown model or GPU, an unreadable
    calibration, no CUDA device, a KV pool that holds no block or does not fit the GPUs) raises
    InputError before any run starts, once per distinct value. Given the trace's ``requests``, a
    request larger than every configuration's pool (where its size is known without building a
    model: --num-blocks, or the sim's) is refused too (a usage RunError); one too large for some
    configurations only is left to those runs, which fail and are reported while the others run."""
    from kvbench.engine.setup import check_trace_fits, kv_layout_of, pool_blocks
    from kvbench.executors import make_executor
    from kvbench.executors.presets import get_model

    checked: dict[tuple, RunError | None] = {}
    outcomes = []
    for c in configs:
        cfg = c.cfg
        key = (cfg.executor, cfg.model, cfg.gpu, cfg.calibration, cfg.kv_dtype, cfg.device, cfg.tp,
               cfg.kv_mem_bytes, cfg.num_blocks, cfg.block_size, cfg.layout, cfg.slab_reserve,
               cfg.max_model_len, cfg.limit, cfg.max_num_seqs, cfg.disable_hybrid_kv_cache_manager,
               cfg.max_batched_tokens)
        if key not in checked:
            checked[key] = None
            model = get_model(cfg.model)
            num_blocks = cfg.num_blocks
            layout = None
            if cfg.executor == "sim":
                # cheap: reads the GPU preset and the calibration file, sizes the pool
                executor = make_executor(cfg, model)
                layout = kv_layout_of(cfg, executor)
                num_blocks = pool_blocks(cfg, executor, kv_layout=layout)
            else:  # the model executor: weights and pool must fit the device it would use
                from kvbench.engine.setup import check_model_memory
                check_model_memory(cfg, model)
            if requests is not None and num_blocks is not None:
                try:
                    check_trace_fits(requests, cfg, num_blocks, cfg.max_model_len or model.max_model_len,
                                     trace_path, layout)
                except RunError as e:
                    checked[key] = e
        outcomes.append(checked[key])
    if outcomes and all(e is not None for e in outcomes):  # no configuration can run
        raise outcomes[0]


def _changed(old: dict, new: dict) -> list[str]:
    """'name: old -> new' for every key whose value differs."""
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in keys if old.get(k) != new.get(k)]


def reuse_verdict(store: SweepStore, name: str, settings: dict, trace_sha: str | None
                  ) -> tuple[dict | None, str | None]:
    """Whether the sweep's run ``name`` can stand for a run of ``settings`` on the trace whose content
    hash is ``trace_sha``: (its summary, None) when it is complete and everything that decides its
    output is equal -- the trace's content, the settings, the content of every file a setting names
    and the code --, else (None, why it runs again) (why is None where there is no finished run)."""
    summary = store.read_json(name, "summary.json")
    config = store.read_json(name, "config.json")
    if not summary or not config:
        return None, None
    if not summary.get("complete"):
        return None, "it was interrupted"
    trace = config.get("trace") if isinstance(config.get("trace"), dict) else {}
    if trace.get("sha256") != trace_sha:
        return None, "it replayed another trace"
    if config.get("settings") != settings:
        old = config.get("settings") if isinstance(config.get("settings"), dict) else {}
        return None, "its settings changed (" + "; ".join(_changed(old, settings)[:3]) + ")"
    files = setting_files(settings)
    if (config.get("files") or {}) != files:
        changed = [k for k in files if (config.get("files") or {}).get(k) != files[k]]
        return None, f"the file its --{(changed or ['?'])[0].replace('_', '-')} names changed"
    env = config.get("environment") if isinstance(config.get("environment"), dict) else {}
    if env.get("code") != code_fingerprint() or env.get("kvbench") != __version__:
        return None, (f"it was made by other kvbench code ({env.get('kvbench')} {env.get('code')}; "
                      f"this is {__version__} {code_fingerprint()})")
    return summary, None


def finished_at(store: SweepStore, name: str) -> str | None:
    """When the sweep's run ``name`` finished, as its config.json records it."""
    config = store.read_json(name, "config.json") or {}
    return config.get("finished_at")


def _grid_key(grid: dict) -> str:
    import json

    return json.dumps(grid, sort_keys=True, default=str)


def check_sweep_dir(store: SweepStore, trace: str, trace_sha: str | None, grid: dict[str, list]) -> None:
    """Refuse a sweep directory that holds the results of another trace or another grid (one line,
    exit 2): they would be hidden from the report or deleted to make room for this sweep's."""
    manifest = store.read_json(SWEEP_JSON)
    if manifest is None:
        return
    where = store.location
    old_sha = manifest.get("trace_sha256")
    if old_sha is None:  # written before sweeps recorded the trace's hash: its runs know it
        for c in manifest.get("configurations") or []:
            cfg = store.read_json(str(c.get("run")), "config.json") if isinstance(c, dict) else None
            old_sha = ((cfg or {}).get("trace") or {}).get("sha256")
            if old_sha:
                break
    if old_sha is not None and old_sha != trace_sha:
        raise InputError(f"holds a sweep of another trace ({manifest.get('trace')}, sha256 {str(old_sha)[:12]}; "
                         f"this one is {trace}, sha256 {str(trace_sha)[:12]}): name another --out",
                         file=where, field="--out")
    if "grid" in manifest and _grid_key(manifest["grid"]) != _grid_key(grid):
        old = ", ".join(f"--{k.replace('_', '-')} {','.join(map(str, v))}" for k, v in manifest["grid"].items())
        raise InputError(f"holds a sweep of another grid ({old or 'no options'}): name another --out",
                         file=where, field="--out")


@dataclass
class SweepState:
    """What the sweep knows so far; rewrites sweep.parquet and sweep.json as runs finish."""

    store: SweepStore
    trace: str
    grid: dict[str, list]
    configs: list[Config]
    trace_sha: str | None = None
    invocation: Invocation = field(default_factory=Invocation)
    started_at: str = field(default_factory=now_iso)
    finished_at: str | None = None
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
            **git_info(),
            "code": code_fingerprint(),
            "trace": os.path.abspath(self.trace),
            "trace_sha256": self.trace_sha,
            "grid": self.grid,
            **self.invocation.record(),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "configurations": [{"run": c.name, "status": self.status.get(c.name, "pending"),
                                "settings": c.settings} for c in self.configs],
        }, SWEEP_JSON)


def run_sweep(trace: str, grid: dict[str, list], out_dir: str, *, jobs: int = 1,
              backend: str = "local", ray_address: str | None = None,
              on_event: Callable[[Event], None] | None = None, cpus_per_task: float = 1,
              max_retries: int = 3, invocation: Invocation | None = None) -> SweepState:
    """Run every configuration of ``grid`` not already finished in ``out_dir`` (a directory, or a
    storage URI: see kvbench.sweep.store)."""
    configs = expand(grid)
    if backend == "ray":
        import_ray()  # before anything is written: a missing extra is a usage error
    preflight(configs)
    # one validating pass over the trace, hashing it as it reads, kept in the trace cache: a bad trace
    # is refused before any run, and every configuration's run without --limit reads the index back
    # (a grid whose every run reads only the first --limit requests validates no more than they do)
    trace_sha = (trace_sha256(trace) if any(c.cfg.limit is None for c in configs)
                 else file_sha256(trace))
    store = SweepStore(out_dir)
    check_sweep_dir(store, os.path.abspath(trace), trace_sha, grid)
    store.makedirs()
    invocation = invocation or Invocation()
    state = SweepState(store, trace, grid, configs, trace_sha, invocation)
    emit = on_event or (lambda e: None)
    todo: list[Config] = []
    for c in configs:
        s, why = reuse_verdict(store, c.name, c.settings, trace_sha)
        if s is not None:
            state.summaries[c.name], state.status[c.name] = s, "skipped"
            emit(Event("skip", c.name, s, message=f"reused from {store.path(c.name)}, finished "
                                                 f"{finished_at(store, c.name) or 'at an unrecorded time'}"))
            continue
        if why is not None:
            emit(Event("note", c.name, message=f"runs again: {why}"))
        if store.exists(c.name):  # interrupted, or this input under other settings or code
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
                max_retries=max_retries, emit=emit, finished=finished, invocation=invocation)
    elif store.local is None:  # a storage URI: each run in a temporary directory, then shipped
        for c in todo:
            emit(Event("start", c.name))
            try:
                summary, _ = run_shipped(trace, os.path.abspath(trace), c.settings, c.name, __version__,
                                         store.location, invocation=invocation)
            except Exception as e:  # one configuration failing must not stop the rest
                finished(c, None, str(e))
            else:
                finished(c, summary, None)
    else:
        _run_local(trace, store.local, todo, jobs, emit, finished, invocation)
    state.finished_at = now_iso()
    state.write_manifest()
    return state


def _run_local(trace, out_dir, todo, jobs, emit, finished, invocation) -> None:
    if jobs <= 1:  # in this process: no start-up cost, and Ctrl-C reaches the engine directly
        for c in todo:
            emit(Event("start", c.name))
            try:
                s = run_one(trace, c.settings, os.path.join(out_dir, c.name), invocation)
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
            futures[pool.submit(_run_in_worker, trace, c.settings, os.path.join(out_dir, c.name), invocation)] = c
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


def _run_in_worker(trace: str, settings: dict, run_dir: str, invocation: Invocation) -> dict:
    global _IN_RUN
    if _STOPPING:
        raise KeyboardInterrupt("the sweep was interrupted before this configuration started")
    _IN_RUN = True
    try:
        return run_one(trace, settings, run_dir, invocation)
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


