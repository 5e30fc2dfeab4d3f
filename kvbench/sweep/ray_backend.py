"""Sweeps on a Ray cluster (``--backend ray``), with no filesystem shared with the driver.

The trace is put in Ray's object store once per sweep and every task reads it from there; a task
runs its configuration in a temporary directory on its node and returns the run's files as bytes,
which the driver writes into the sweep directory, or, when ``--out`` is a storage URI every node
reaches (s3://, gs://, ...), writes them there itself. A task lost with its node is run again (Ray's
``max_retries``); a configuration that fails every try is reported in sweep.json with its error and
the others go on. A task checks that its node runs the driver's kvbench version before anything else.
Tasks ask for one GPU each with the model executor, none with the sim, and ``--cpus-per-task`` CPUs.
"""
from __future__ import annotations

import os

from kvbench import __version__
from kvbench.provenance import code_fingerprint
from kvbench.sweep.tasks import Event, import_ray, run_shipped


def run_ray(trace: str, store, todo, *, address, cpus_per_task, max_retries, emit, finished,
            invocation=None) -> None:
    ray = import_ray()
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    with open(trace, "rb") as fh:
        trace_ref = ray.put(fh.read())  # once per sweep: tasks fetch it from the object store
    task = ray.remote(run_shipped)
    label = os.path.abspath(trace)
    dest = store.location if store.local is None else None
    refs = {}
    for c in todo:
        gpus = 1 if c.cfg.executor == "model" else 0
        ref = task.options(num_gpus=gpus, num_cpus=cpus_per_task, max_retries=max_retries,
                           retry_exceptions=False).remote(trace_ref, label, c.settings, c.name, __version__, dest,
                                                         code_fingerprint(), invocation)
        refs[ref] = c
        emit(Event("start", c.name))
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                c = refs[ref]
                try:
                    summary, files = ray.get(ref)
                except ray.exceptions.RayError as e:  # failed every try: report it, go on with the rest
                    finished(c, None, _reason(e))
                    continue
                if files is not None:
                    store.put_run(c.name, files)
                finished(c, summary, None)
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise


def _reason(e: Exception) -> str:
    cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
    lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__
