"""Every example in README.md runs, at small scale, and shows something: README's own commands (its
bash blocks, `for` loops expanded) are run on the shipped traces with a --limit in a scratch folder,
and every sweep and every report of several runs must hold configurations that differ (an example
whose rows all agree teaches nothing). The sim's commands run here in about a minute; those on the
converted Mooncake trace are marked slow. A real forward (--executor model), a calibration, Ray, GPU and live-server
commands are left to their own tests."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pandas as pd
import pytest

from kvbench.cli import main
from kvbench.report.words import performs_alike

REPO = Path(__file__).resolve().parents[1]
LIMIT = "30"
SKIP = ("--executor model", "--backend", "calibrate", "selfcheck", "--calibration", "pip ", "fit-policy",
        "learned:", "--endpoint", "--like-server", "runs/live")  # a live server: tests/test_live.py
RUNS = ("replay", "sweep", "report")


def readme_commands() -> list[list[str]]:
    """Each kvbench command in README's bash blocks as argv (continuations joined, comments dropped,
    `for X in A B; do ... done` expanded, `a && b` split)."""
    text = (REPO / "README.md").read_text()
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines()]
    commands, i = [], 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"for (\w+) in ([^;]+); do$", line)
        if m:
            body = []
            i += 1
            while lines[i] != "done":
                body.append(lines[i])
                i += 1
            for value in m.group(2).split():
                commands += [b.replace(f"${m.group(1)}", value) for b in body]
        else:
            commands += [part.strip() for part in line.split("&&")]
        i += 1
    out = []
    for c in commands:
        if c.startswith("kvbench ") and not any(s in c for s in SKIP):
            out.append(shlex.split(c)[1:])
    return out


def _small(argv: list[str]) -> list[str]:
    """A README command at small scale: --limit on runs, one process."""
    argv = list(argv)
    if "-j" in argv:
        k = argv.index("-j")
        del argv[k:k + 2]
    if argv[0] in ("replay", "sweep") and "--limit" not in argv:
        argv += ["--limit", LIMIT]
    if argv[:3] == ["trace", "gen", "chat"] and "--requests" in argv:
        argv[argv.index("--requests") + 1] = LIMIT
    return argv


def _summaries(path: Path) -> list[dict]:
    """Each configuration's settings and figures (a sweep's rows, or a run's config and summary)."""
    if (path / "sweep.parquet").exists():
        return pd.read_parquet(path / "sweep.parquet").to_dict("records")
    return [{**json.loads((path / "config.json").read_text())["settings"],
             **json.loads((path / "summary.json").read_text())}]


def _run_examples(tmp_path: Path, monkeypatch, capsys, wanted, small=_small) -> int:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces").symlink_to(REPO / "traces")
    shared = REPO.parent / "shared"
    if shared.exists() and not (tmp_path.parent / "shared").exists():  # README's ../shared/traces/real
        (tmp_path.parent / "shared").symlink_to(shared)
    ran = 0
    for argv in readme_commands():
        if not wanted(argv):
            continue
        argv = small(argv)
        missing = [a for a in argv if a.endswith(".jsonl") and not Path(a).exists() and argv[argv.index(a) - 1] != "-o"]
        assert not missing, f"README runs {' '.join(argv)} on {missing}, which no earlier example makes"
        try:
            main(argv)
        except SystemExit as e:
            pytest.fail(f"kvbench {' '.join(argv)} exited {e.code}: {capsys.readouterr().err[-400:]}")
        out = capsys.readouterr().out
        ran += 1
        if argv[0] == "sweep":
            where = json.loads(out)["sweep_dir"] if out.startswith("{") else out.split("kvbench sweep -> ")[1].split()[0]
            _check_differ(argv, _summaries(Path(where)))
        elif argv[0] == "report":
            dirs = [Path(a) for a in argv[1:] if not a.startswith("-") and argv[argv.index(a) - 1] != "--out"]
            summaries = [s for d in dirs for s in _summaries(d)]
            if len(summaries) > 1:
                _check_differ(argv, summaries)
    return ran


def _check_differ(argv, rows: list[dict]) -> None:
    """The configurations differ; where slab is among them, the layout comparison alone (slab and
    paged without a prefix cache) differs too: the example must show what the layout does."""
    groups = [rows]
    if any(r.get("layout") == "slab" for r in rows):
        groups.append([r for r in rows if r.get("layout") == "slab" or not r.get("prefix_cache")])
    for group in groups:
        if len(group) < 2:
            continue
        alike = performs_alike(group, any(r.get("executor", "sim") != "sim" for r in group))
        assert alike is None, (f"README's example `kvbench {' '.join(argv)}` shows configurations that cannot "
                               f"differ: {alike}")


def test_readmes_sim_examples_run_and_show_differences(tmp_path, monkeypatch, capsys):
    ran = _run_examples(tmp_path, monkeypatch, capsys,
                        lambda argv: (argv[0] in RUNS or argv[:2] == ["trace", "gen"]) and "mooncake" not in " ".join(argv))
    assert ran >= 8  # the parser found README's examples (mutation: a parser that finds none fails here)


def _small_tiers(argv: list[str]) -> list[str]:
    """_small, and a tier sweep's GPU pool cut to 16 GiB: 30 Mooncake requests never fill an H200's
    pool (KV use at most 14%), so no block reaches the CPU tier and every configuration is alike; in
    16 GiB the pool evicts and write-back's copies slow TTFT p50 (8.06 s write-through, 8.32 s back)."""
    argv = _small(argv)
    if argv[0] == "sweep" and "--cpu-kv-mem" in argv and "--kv-mem" not in argv:
        argv += ["--kv-mem", "16GiB"]
    return argv


@pytest.mark.slow
def test_readmes_mooncake_examples_run(tmp_path, monkeypatch, capsys):
    ran = _run_examples(tmp_path, monkeypatch, capsys,
                        lambda argv: argv[0] in RUNS + ("trace",) and "mooncake" in " ".join(argv)
                        and argv[:2] != ["trace", "whatif"], small=_small_tiers)
    assert ran >= 3
