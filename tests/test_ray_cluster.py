"""Sweeps on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head and two worker nodes on
this machine) where no task may open a path of the driver's (an audit hook in every worker raises if
one does): the trace reaches the tasks through the object store, their runs come home, and the sweep
directory is the one a local sweep of the same grid writes; a task whose worker dies mid-run is run
again. Slow: a cluster takes tens of seconds to start on two cores."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from kvbench.cli.replay import REPLAY_OPTIONS  # noqa: E402
from kvbench.sweep import parse_grid, run_sweep  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACE = str(ROOT / "traces" / "chat.jsonl")
GRID = dict(executor="sim", model="llama-3-8b", layout="paged,slab", block_size="16,32", limit="12",
            max_model_len="8192", time_scale="0.05")
WALL = {"wall_s"}  # summary.json's one wall-clock figure (duration_s, busy_s... are the replay's own clock)
# config.json's fields that say how, where and when a run was asked for and ran, not what it computed:
# the Invocation's command line and host (kvbench.provenance.Invocation.record) and RunWriter's
# started_at/finished_at (provenance.now_iso). Everything else (settings, trace path and sha256,
# blocks, model, files' hashes, the user's metadata, the code and libraries) must agree.
NOT_COMPUTED = {"command_line", "host", "started_at", "finished_at"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=1)
    yield c, tmp
    ray.shutdown()
    c.shutdown()


def _connect(cluster, forbidden: list[str], hook: str):
    c, tmp = cluster
    ray.shutdown()
    env = {"KVBENCH_FORBIDDEN": os.pathsep.join(forbidden), "KVBENCH_CRASH_MARKER": str(tmp / "crashed"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0"}
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": env, "worker_process_setup_hook": f"ray_hooks.{hook}"})


def _same_run_dirs(a: Path, b: Path) -> None:
    runs = sorted(p.name for p in a.iterdir() if p.is_dir())
    assert runs == sorted(p.name for p in b.iterdir() if p.is_dir()) and runs
    for r in runs:
        assert sorted(os.listdir(a / r)) == sorted(os.listdir(b / r)), r
        for f in ("steps.parquet", "requests.parquet"):
            assert pd.read_parquet(a / r / f).equals(pd.read_parquet(b / r / f)), (r, f)
        sa, sb = (json.loads((d / r / "summary.json").read_text()) for d in (a, b))
        assert {k: v for k, v in sa.items() if k not in WALL} == {k: v for k, v in sb.items() if k not in WALL}
        ca, cb = (json.loads((d / r / "config.json").read_text()) for d in (a, b))
        assert NOT_COMPUTED <= ca.keys() and NOT_COMPUTED <= cb.keys(), r  # a renamed field is not skipped unseen
        assert {k: v for k, v in ca.items() if k not in NOT_COMPUTED} == \
            {k: v for k, v in cb.items() if k not in NOT_COMPUTED}, r
    ta, tb = (pd.read_parquet(d / "sweep.parquet").drop(columns=list(WALL)) for d in (a, b))
    assert ta.equals(tb)


def test_sweep_on_a_cluster_that_cannot_see_the_driver(cluster, tmp_path):
    grid = parse_grid(GRID, REPLAY_OPTIONS)
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_sweep(TRACE, grid, str(local))
    _connect(cluster, [str(remote), TRACE], "forbid_driver_paths")
    state = run_sweep(TRACE, grid, str(remote), backend="ray", max_retries=0)
    assert set(state.status.values()) == {"done"}, state.status
    _same_run_dirs(local, remote)
    # resume: everything came home complete, nothing runs again
    again = run_sweep(TRACE, grid, str(remote), backend="ray")
    assert set(again.status.values()) == {"skipped"}


def test_a_task_whose_worker_dies_is_run_again(cluster, tmp_path):
    grid = parse_grid({**GRID, "block_size": "16"}, REPLAY_OPTIONS)
    out = tmp_path / "sw"
    _connect(cluster, [str(out), TRACE], "forbid_and_crash_once")
    state = run_sweep(TRACE, grid, str(out), backend="ray", max_retries=2)
    assert (cluster[1] / "crashed").exists()  # a worker did die mid-run
    assert set(state.status.values()) == {"done"}, state.status
    assert len(pd.read_parquet(out / "sweep.parquet")) == len(state.configs)


def test_a_configuration_that_fails_every_try_is_reported_and_the_rest_go_on(cluster, tmp_path):
    # 600 MiB of KV holds a paged request of chat but no 8,192-token slab: the slab run fails
    grid = parse_grid({**GRID, "block_size": "16", "kv_mem": "600MiB"}, REPLAY_OPTIONS)
    out = tmp_path / "sw"
    _connect(cluster, [str(out), TRACE], "forbid_driver_paths")
    state = run_sweep(TRACE, grid, str(out), backend="ray", max_retries=1)
    assert state.status["slab"].startswith("failed") and "KV blocks" in state.status["slab"]
    assert {v for k, v in state.status.items() if k != "slab"} == {"done"}
    manifest = json.loads((out / "sweep.json").read_text())
    assert any(c["run"] == "slab" and c["status"].startswith("failed") for c in manifest["configurations"])
