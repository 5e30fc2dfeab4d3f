"""``kvbench sweep``: the grid collapses to distinct configurations, an interrupted sweep resumes
without redoing finished runs, sweep.parquet has one row per configuration, bad grids exit 2."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kvbench.cli import main
from kvbench.cli.replay import REPLAY_OPTIONS
from kvbench.sweep import default_sweep_dir, expand, parse_grid, run_sweep

REPO = Path(__file__).resolve().parents[1]
TRACE = str(REPO / "traces" / "chat.jsonl")
# memory binds (slab: 3 sequences of 8192 slots in 4 GiB) and arrivals are 10x the trace's rate
GRID = ["--executor", "sim", "--model", "llama-3-8b", "--block-size", "8,16,32,64",
        "--layout", "paged,slab", "--prefix-cache", "on,off", "--max-model-len", "8192",
        "--kv-mem", "4GiB", "--time-scale", "0.1"]
NAMES = {f"paged-bs{bs}-pc_{pc}" for bs in (8, 16, 32, 64) for pc in ("on", "off")} | {"slab"}


def _grid(**raw):
    return parse_grid(raw, REPLAY_OPTIONS)


def test_a_layout_comparison_gets_paged_without_prefix_cache():
    from kvbench.sweep import add_comparisons, compares

    grid, notes = add_comparisons(_grid(layout="paged,slab"))
    assert grid["prefix_cache"] == [True, False] and notes
    rows = {c.name: compares(c.settings, grid) for c in expand(grid)}
    assert rows == {"paged-pc_on": "layout + prefix cache", "paged-pc_off": "layout", "slab": "baseline"}
    assert add_comparisons(_grid(layout="paged,slab", prefix_cache="off"))[1] == []
    assert add_comparisons(_grid(layout="paged"))[1] == []


def test_slab_and_unused_settings_collapse():
    configs = expand(_grid(layout="paged,slab", block_size="8,16,32,64", prefix_cache="on,off"))
    assert {c.name for c in configs} == NAMES
    slab = next(c for c in configs if c.name == "slab").cfg
    assert (slab.layout, slab.block_size, slab.prefix_cache) == ("slab", 16, False)  # no prefix cache
    # eviction none has no budget: 1 + 2 configurations, not 4
    names = [c.name for c in expand(_grid(eviction="none,h2o", kv_budget="0.1,0.3"))]
    assert names == ["paged-none", "paged-h2o-kvb0.1", "paged-h2o-kvb0.3"]
    # prefix cache off has no cache policy
    assert len(expand(_grid(prefix_cache="on,off", cache_policy="lru,fifo,belady"))) == 4


def test_grid_values_are_typed_and_names_stable():
    g = _grid(prefix_cache="on, off,on", kv_budget="0.2,64", model="/models/my llama")
    assert g == {"prefix_cache": [True, False], "kv_budget": [0.2, 64.0], "model": ["/models/my llama"]}
    names = [c.name for c in expand(_grid(model="/a/x y,/b/x y"))]
    assert len(set(names)) == 2 and all(n.startswith("paged-m_x_y_") for n in names)  # lossy: hashed
    assert default_sweep_dir(TRACE, g) == default_sweep_dir(TRACE, _grid(
        prefix_cache="on,off", kv_budget="0.2,64", model="/models/my llama"))


@pytest.mark.parametrize("args, field", [
    (["--block-size", "8,x"], "--block-size"),
    (["--layout", "paged,slob"], "--layout"),
    (["--prefix-cache", "on,maybe"], "--prefix-cache"),
    (["--kv-mem", "4GiB,lots"], "--kv-mem"),
    (["--block-size", "8,,16"], "--block-size"),
])
def test_bad_grid_exits_2_with_one_line(args, field, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["sweep", TRACE, *args, "--out", str(tmp_path / "sw")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "sw").exists()


def test_ray_backend_without_ray_is_a_one_line_usage_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(SystemExit) as e:
        main(["sweep", TRACE, "--backend", "ray", "--out", str(tmp_path / "sw")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "pip install 'kvbench[ray]'" in err[0], err
    assert not (tmp_path / "sw").exists()


def test_a_failing_configuration_does_not_stop_the_rest(capsys, tmp_path):
    out = tmp_path / "sw"
    # 600 MiB of KV holds a paged chat request but not one slab of 8192 slots (1 GiB)
    with pytest.raises(SystemExit) as e:
        main(["sweep", TRACE, "--executor", "sim", "--model", "llama-3-8b", "--layout", "paged,slab",
              "--kv-mem", "600MiB", "--max-model-len", "8192", "--limit", "5", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and "1 of 3 configurations failed (slab)" in err[-1]
    assert list(pd.read_parquet(out / "sweep.parquet")["run"]) == ["paged-pc_on", "paged-pc_off"]
    status = {c["run"]: c["status"] for c in _manifest(out)["configurations"]}
    assert status["paged-pc_off"] == "done" and "KV blocks" in status["slab"]


def _manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / "sweep.json").read_text())
    except (OSError, ValueError):
        return None


def _done(out: Path) -> list[str]:
    m = _manifest(out) or {"configurations": []}
    return [c["run"] for c in m["configurations"] if c["status"] == "done"]


def _mtimes(run_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}


@pytest.fixture(scope="module")
def long_chat(tmp_path_factory) -> str:
    """1,000 chat requests: runs long enough (~1 s each) that Ctrl-C lands midway through a sweep
    even on a busy machine, not after its grid."""
    path = tmp_path_factory.mktemp("long") / "chat1000.jsonl"
    subprocess.run([sys.executable, "-m", "kvbench", "trace", "gen", "chat", "--requests", "1000", "--seed", "1",
                    "-o", str(path)], check=True, capture_output=True, cwd=REPO)
    return str(path)


@pytest.mark.parametrize("jobs", ["1", "2"])  # in process, and worker processes
def test_interrupted_sweep_resumes_without_redoing_finished_runs(tmp_path, jobs, long_chat):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "kvbench", "sweep", long_chat, *GRID, "--out", str(out)]
    # SIGINT as a terminal delivers it, even when the test runner was started in the background
    # (a non-interactive shell's background job, and all it starts, ignores SIGINT)
    proc = subprocess.Popen(cmd + ["-j", jobs], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while len(_done(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # Ctrl-C, midway
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "resume" in err.strip().splitlines()[-1]
    recorded = _done(out)
    assert 2 <= len(recorded) < 9
    rows = pd.read_parquet(out / "sweep.parquet")
    # what resuming goes by: a run directory whose summary says complete. A run may complete just
    # as Ctrl-C arrives, before the sweep records it; every other started one is marked incomplete,
    # or has no summary yet when Ctrl-C landed while it was being set up.
    finished = [d.name for d in sorted(out.iterdir()) if d.is_dir() and not d.name.startswith(".")
                and (d / "summary.json").exists() and json.loads((d / "summary.json").read_text())["complete"]]
    assert set(recorded) <= set(finished) and len(finished) < 9
    # sweep.parquet is rewritten as runs finish, before the manifest: it holds every recorded run
    # (and one more when Ctrl-C falls between the two writes), never an unfinished one
    assert set(recorded) <= set(rows["run"]) <= set(finished)
    finished = recorded + [n for n in finished if n not in recorded]

    # one finished run made to look interrupted: it must be redone, the others left alone
    redo = finished[-1]
    summary = json.loads((out / redo / "summary.json").read_text())
    (out / redo / "summary.json").write_text(json.dumps({**summary, "complete": False}))
    kept = {n: _mtimes(out / n) for n in finished[:-1]}

    r = subprocess.run(cmd + ["-j", "2", "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["skipped"] == len(finished) - 1 and report["failed"] == []
    assert report["ran"] == 9 - len(finished) + 1
    for name, mtimes in kept.items():
        assert _mtimes(out / name) == mtimes, f"{name} was redone"
    assert json.loads((out / redo / "summary.json").read_text())["complete"] is True

    rows = pd.read_parquet(out / "sweep.parquet")
    assert len(rows) == 9 and set(rows["run"]) == NAMES
    assert rows["complete"].all()
    slab = rows[rows["run"] == "slab"].iloc[0]
    assert pd.isna(slab["block_size"]) and slab["layout"] == "slab"
    # settings as columns, then every summary.json key
    summary_keys = json.loads((out / "slab" / "summary.json").read_text()).keys()
    assert set(summary_keys) <= set(rows.columns)
    assert list(rows.columns[:3]) == ["run", "layout", "block_size"]
    # what the layouts are expected to show, so a sweep that ran the wrong thing fails
    paged16 = rows[rows["run"] == "paged-bs16-pc_on"].iloc[0]
    assert slab["internal_frag"] > 0.5 > 0.05 > paged16["internal_frag"]
    assert paged16["mean_running"] > 2 * slab["mean_running"]
    manifest = _manifest(out)
    assert {c["status"] for c in manifest["configurations"]} <= {"done", "skipped"}
    assert manifest["grid"]["block_size"] == [8, 16, 32, 64]


@pytest.mark.slow
def test_ray_backend_runs_the_grid(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    r = subprocess.run([sys.executable, "-m", "kvbench", "sweep", TRACE, "--executor", "sim",
                        "--model", "llama-3-8b", "--layout", "paged,slab", "--block-size", "16,32",
                        "--limit", "20", "--max-model-len", "8192", "--backend", "ray", "--out", str(out),
                        "--json"], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["ran"] == 5  # slab, and paged with and without prefix cache at each size
    assert sorted(pd.read_parquet(out / "sweep.parquet")["run"]) == [
        "paged-bs16-pc_off", "paged-bs16-pc_on", "paged-bs32-pc_off", "paged-bs32-pc_on", "slab"]


def test_a_sweep_to_a_storage_uri_equals_one_to_a_directory(tmp_path):
    """--out as a pyarrow filesystem URI (file:// here; s3://, gs://... alike): each run is computed in
    a temporary directory and its files shipped, so the sweep directory is the same as a local one's."""
    grid = _grid(executor="sim", model="llama-3-8b", layout="paged,slab", prefix_cache="on,off", limit="6",
                 max_model_len="8192")
    run_sweep(TRACE, grid, str(tmp_path / "local"))
    run_sweep(TRACE, grid, f"file://{tmp_path / 'uri'}")
    for run in ("paged-pc_on", "paged-pc_off", "slab"):
        for f in ("steps.parquet", "requests.parquet"):
            assert pd.read_parquet(tmp_path / "local" / run / f).equals(pd.read_parquet(tmp_path / "uri" / run / f))
        a, b = ({k: v for k, v in json.loads((tmp_path / d / run / "config.json").read_text()).items()
                 if k not in ("started_at", "finished_at")} for d in ("local", "uri"))
        assert a == b  # the trace is recorded by the driver's path, not the temporary copy's
    again = run_sweep(TRACE, grid, f"file://{tmp_path / 'uri'}")
    assert set(again.status.values()) == {"skipped"}


def test_a_worker_with_another_kvbench_version_refuses_to_run(tmp_path):
    from kvbench.errors import RunError
    from kvbench.sweep.tasks import run_shipped

    settings = expand(_grid(executor="sim", limit="2"))[0].settings
    with pytest.raises(RunError, match="install the same kvbench"):
        run_shipped(TRACE, TRACE, settings, "x", "0.0.0-other")


def test_a_sweep_reads_no_more_of_the_trace_than_its_runs_do(tmp_path, capsys):
    """A bad line past every configuration's --limit is not the sweep's to refuse (replay --limit
    runs over it too); one within reach is refused before any run, with its line."""
    lines = (REPO / "traces" / "chat.jsonl").read_text().splitlines()[:50]
    trace = tmp_path / "tail.jsonl"
    trace.write_text("\n".join(lines + ["{not json"]) + "\n")
    state = run_sweep(str(trace), {"limit": [20], "block_size": [8, 16]}, str(tmp_path / "cut"))
    assert len(state.summaries) == 2 and set(state.status.values()) == {"done"}
    with pytest.raises(SystemExit) as e:
        main(["sweep", str(trace), "--block-size", "8,16", "--out", str(tmp_path / "all")])
    assert e.value.code == 2 and "tail.jsonl:51" in capsys.readouterr().err


def test_an_slo_of_several_targets_is_one_value_of_the_grid():
    """--slo ttft=500,tpot=50 is one SLO of two targets, not two SLOs; a repeated target starts the next."""
    from kvbench.cli.replay import REPLAY_OPTIONS
    from kvbench.sweep.grid import parse_grid

    def slos(text):
        return parse_grid({"slo": text}, REPLAY_OPTIONS)["slo"]
    assert len(slos("ttft=500,tpot=50")) == 1
    assert len(slos("ttft=500,tpot=50,ttft=1000,tpot=100")) == 2
    assert len(slos("ttft=500,ttft=1000")) == 2
