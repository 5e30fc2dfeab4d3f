"""Worker-process hooks for the Ray cluster tests (tests/test_ray_cluster.py), set through Ray's
``worker_process_setup_hook``: they make a task fail if it opens a path of the driver's, and kill one
worker mid-run, as a lost node would."""
from __future__ import annotations

import os
import sys


def forbid_driver_paths() -> None:
    """Any open of a path under KVBENCH_FORBIDDEN (os.pathsep-separated) raises: a task must get the
    trace from the object store and give its run back, never touch the driver's files."""
    forbidden = [p for p in os.environ.get("KVBENCH_FORBIDDEN", "").split(os.pathsep) if p]

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if any(path == f or path.startswith(f + os.sep) for f in forbidden):
                raise PermissionError(f"a task opened the driver's path {path}")
    sys.addaudithook(hook)


def forbid_and_crash_once() -> None:
    """forbid_driver_paths, and the first worker to start a replay dies in it, once per cluster (a
    marker file says it happened): the task is lost mid-run, as it would be with its node."""
    forbid_driver_paths()
    from kvbench.engine import replay as engine

    run = engine.Replay.run

    def run_or_die(self, *args, **kw):
        try:
            fd = os.open(os.environ["KVBENCH_CRASH_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return run(self, *args, **kw)
        os.close(fd)
        os._exit(1)
    engine.Replay.run = run_or_die
