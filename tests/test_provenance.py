"""Results you can trust: a sweep reuses a finished run only when everything that decides its output
is equal (the trace's content, the settings, the files the settings name, the code), refuses an --out
that holds another trace's or another grid's results, and every run and sweep records how it was made
(command line, times, host, version, commit, tags). CSV beside the parquet for spreadsheets."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from kvbench import provenance
from kvbench.cli import main
from kvbench.sweep.runner import reuse_verdict
from kvbench.sweep.store import SweepStore

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "traces" / "chat.jsonl"
FAST = ["--limit", "12", "--kv-mem", "4GiB"]


def _head(src: Path, dst: Path, n: int) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[:n]))
    return dst


def _sweep(capsys, *args) -> tuple[int, str, str]:
    try:
        main(["sweep", *map(str, args)])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_changed_trace_at_the_same_path_is_never_shown_as_the_old_ones(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trace = _head(CHAT, tmp_path / "chat.jsonl", 30)
    code, _, _ = _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", "sw")
    assert code == 0
    # the same path rewritten with other requests: the old --out is refused, naming both traces
    _head(CHAT, trace, 20)
    code, _, err = _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", "sw")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds a sweep of another trace" in err and str(trace) in err and "name another --out" in err
    assert (tmp_path / "sw" / "paged-bs16" / "summary.json").exists()  # never deleted
    # without --out, each content gets its own folder: the new trace's runs are its own
    code, _, err = _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--limit", "30")
    assert code == 0 and "reused from" not in err
    _head(CHAT, trace, 25)
    code, _, err = _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--limit", "30")
    assert code == 0 and "reused from" not in err
    dirs = sorted(p for p in (tmp_path / "runs").iterdir())
    assert len(dirs) == 2
    counts = sorted(pd.read_parquet(d / "sweep.parquet")["requests"].iloc[0] for d in dirs)
    assert counts == [20, 25]


def test_two_traces_of_one_name_get_their_own_results(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = _head(CHAT, tmp_path / "a" / "chat.jsonl", 30)
    b = _head(CHAT, tmp_path / "b" / "chat.jsonl", 10)
    for trace in (a, b):
        code, _, err = _sweep(capsys, trace, "--block-size", "16,32", "--kv-mem", "4GiB", "--json")
        assert code == 0 and "reused from" not in err
    sweeps = sorted((tmp_path / "runs").iterdir())
    assert sorted(pd.read_parquet(d / "sweep.parquet")["requests"].iloc[0] for d in sweeps) == [10, 30]


def test_reuse_says_where_from_and_when(tmp_path, capsys):
    trace = _head(CHAT, tmp_path / "chat.jsonl", 12)
    out = tmp_path / "sw"
    assert _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", out)[0] == 0
    finished = {n: json.loads((out / n / "config.json").read_text())["finished_at"] for n in ("paged-bs16", "paged-bs32")}
    code, _, err = _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", out)
    assert code == 0
    for name, when in finished.items():
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", when)
        assert f"kvbench sweep: {name}: reused from {out / name}, finished {when}" in err.splitlines()


def test_a_run_is_reused_only_when_trace_settings_files_and_code_agree(tmp_path, capsys, monkeypatch):
    trace = _head(CHAT, tmp_path / "chat.jsonl", 12)
    out = tmp_path / "sw"
    assert _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", out)[0] == 0
    store = SweepStore(str(out))
    config = json.loads((out / "paged-bs16" / "config.json").read_text())
    settings, sha = config["settings"], config["trace"]["sha256"]
    assert reuse_verdict(store, "paged-bs16", settings, sha)[0] is not None
    # another trace's content (mutation: compare the settings only -> this is reused)
    assert reuse_verdict(store, "paged-bs16", settings, "0" * 64) == (None, "it replayed another trace")
    # other settings
    summary, why = reuse_verdict(store, "paged-bs16", {**settings, "block_size": 32}, sha)
    assert summary is None and why.startswith("its settings changed (block_size: 16 -> 32")
    # other code: reruns with a note that says so
    monkeypatch.setattr("kvbench.sweep.runner.code_fingerprint", lambda: "another-code")
    summary, why = reuse_verdict(store, "paged-bs16", settings, sha)
    assert summary is None and "made by other kvbench code" in why
    code, _, err = _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", out)
    assert code == 0 and "kvbench sweep: paged-bs16: runs again: it was made by other kvbench code" in err
    assert "reused from" not in err


def test_a_changed_file_that_a_setting_names_reruns(tmp_path, capsys):
    trace = _head(CHAT, tmp_path / "chat.jsonl", 12)
    policy = tmp_path / "policy.json"
    main(["trace", "fit-policy", str(CHAT), "--warmup", "0.5", "-o", str(policy)])
    capsys.readouterr()
    out = tmp_path / "sw"
    grid = ["--cache-policy", f"lru,learned:{policy}", *FAST, "--out", out]
    assert _sweep(capsys, trace, *grid)[0] == 0
    code, _, err = _sweep(capsys, trace, *grid)
    assert code == 0 and err.count("reused from") == 2
    data = json.loads(policy.read_text())
    policy.write_text(json.dumps(data, indent=2))  # the same model, other bytes: a changed file
    code, _, err = _sweep(capsys, trace, *grid)
    assert code == 0 and err.count("reused from") == 1
    assert "runs again: the file its --cache-policy names changed" in err


def test_an_out_with_another_grid_is_refused_and_kept(tmp_path, capsys):
    trace = _head(CHAT, tmp_path / "chat.jsonl", 12)
    out = tmp_path / "sw"
    assert _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", out)[0] == 0
    code, _, err = _sweep(capsys, trace, "--block-size", "16,64", *FAST, "--out", out)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--out {out}: holds a sweep of another grid (--block-size 16,32" in err
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["grid"]["block_size"] == [16, 32]  # not overwritten
    assert (out / "paged-bs32" / "summary.json").exists()


def test_runs_and_sweeps_record_how_they_were_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["kvbench", "replay", "x"])
    trace = _head(CHAT, tmp_path / "chat.jsonl", 8)
    main(["replay", str(trace), "--limit", "8", "--out", str(tmp_path / "r"), "--metadata", "team=serving",
          "--metadata", "note=a b=c"])
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["command_line"] == "kvbench replay x"
    assert config["metadata"] == {"team": "serving", "note": "a b=c"}
    assert config["host"] and config["started_at"] <= config["finished_at"]
    env = config["environment"]
    assert env["code"] == provenance.code_fingerprint() and env["kvbench"]
    if (REPO / ".git").exists():  # this checkout is kvbench's own: its commit, and whether it is dirty
        assert re.fullmatch(r"[0-9a-f]{40}", env["git_commit"]) and isinstance(env["git_dirty"], bool)
    capsys.readouterr()
    _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", tmp_path / "sw", "--metadata", "run=7")
    manifest = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert manifest["metadata"] == {"run": "7"} and manifest["trace_sha256"] == provenance.file_sha256(trace)
    assert manifest["started_at"] <= manifest["finished_at"] and manifest["code"] == provenance.code_fingerprint()
    with pytest.raises(SystemExit) as e:
        main(["replay", str(trace), "--metadata", "novalue"])
    assert e.value.code == 2
    assert "--metadata" in capsys.readouterr().err


def test_git_commit_only_for_kvbenchs_own_checkout(tmp_path):
    def repo(name: str, project: str | None) -> Path:
        top = tmp_path / name
        (top / "kvbench").mkdir(parents=True)
        (top / "kvbench" / "__init__.py").write_text("")
        if project:
            (top / "pyproject.toml").write_text(f'[project]\nname = "{project}"\n')
        for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
            subprocess.run(["git", *cmd], cwd=top, check=True, capture_output=True)
        return top

    own = repo("own", "kvbench")
    info = provenance.git_info_of(str(own / "kvbench"))
    assert re.fullmatch(r"[0-9a-f]{40}", info["git_commit"]) and info["git_dirty"] is False
    (own / "kvbench" / "__init__.py").write_text("x = 1\n")
    assert provenance.git_info_of(str(own / "kvbench"))["git_dirty"] is True
    other = repo("other", "someone-elses-app")  # kvbench vendored into another project's repository
    assert provenance.git_info_of(str(other / "kvbench")) == {"git_commit": None, "git_dirty": None}
    assert provenance.git_info_of(str(tmp_path)) == {"git_commit": None, "git_dirty": None}  # no repository


def test_csv_export_matches_the_parquet(tmp_path, capsys):
    trace = _head(CHAT, tmp_path / "chat.jsonl", 8)
    main(["replay", str(trace), "--out", str(tmp_path / "r"), "--csv"])
    for name in ("requests", "steps"):
        csv = pd.read_csv(tmp_path / "r" / f"{name}.csv")
        pq = pd.read_parquet(tmp_path / "r" / f"{name}.parquet")
        assert list(csv.columns) == list(pq.columns) and len(csv) == len(pq) > 0
        assert csv["t_s" if name == "steps" else "ttft_ms"].round(9).equals(
            pq["t_s" if name == "steps" else "ttft_ms"].round(9))
    summary = pd.read_csv(tmp_path / "r" / "summary.csv")
    assert summary["requests"].iloc[0] == 8
    capsys.readouterr()
    _sweep(capsys, trace, "--block-size", "16,32", *FAST, "--out", tmp_path / "sw")
    main(["export", str(tmp_path / "sw"), "--out", str(tmp_path / "csv")])
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "csv" / "sweep.csv")]
    assert list(pd.read_csv(written[0])["run"]) == ["paged-bs16", "paged-bs32"]
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path)])
    assert e.value.code == 2


def test_the_code_fingerprint_follows_the_sources(tmp_path, monkeypatch):
    fp = provenance.code_fingerprint()
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    copy = tmp_path / "kvbench"
    shutil.copytree(REPO / "kvbench", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(provenance, "_package_dirs", lambda: [str(copy)])
    provenance.code_fingerprint.cache_clear()
    try:
        same = provenance.code_fingerprint()
        provenance.code_fingerprint.cache_clear()
        assert provenance.code_fingerprint() == same  # a function of the files alone
        (copy / "executors" / "sim.py").write_text((copy / "executors" / "sim.py").read_text() + "\n# x\n")
        provenance.code_fingerprint.cache_clear()
        changed = provenance.code_fingerprint()
    finally:
        provenance.code_fingerprint.cache_clear()
    assert same != changed
