"""``kvbench trace gen|convert|inspect`` as a user runs them: outputs, help, bad flags (one line,
exit 2), and the shipped traces reproducible from the commands in traces/README.md."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli.main import _register, cli

REPO = Path(__file__).resolve().parents[1]
INSPECT_KEYS = {"requests", "sessions", "duration_s", "prompt_tokens", "output_tokens", "block_size",
                "ideal_hit_rate"}


@pytest.fixture(scope="module")
def runner():
    _register()
    return CliRunner()


def _kvbench(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def test_gen_then_inspect_json(runner, tmp_path):
    out = tmp_path / "rag.jsonl"
    r = runner.invoke(cli, ["trace", "gen", "rag", "--requests", "40", "--chunks", "2", "--seed", "3",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["trace", "inspect", str(out), "--json", "--block-size", "32"])
    assert r.exit_code == 0
    stats = json.loads(r.stdout)
    assert INSPECT_KEYS <= stats.keys()
    assert (stats["requests"], stats["block_size"]) == (40, 32)
    assert 0 < stats["ideal_hit_rate"] < 1 and stats["prompt_len"]["p50"] > 0


def test_inspect_table(runner):
    r = runner.invoke(cli, ["trace", "inspect", str(REPO / "traces" / "best_of_n.jsonl")])
    assert r.exit_code == 0
    assert "ideal hit rate (block 16)" in r.stdout and "samples (sum of n)" in r.stdout
    assert "240" in r.stdout  # 30 requests x n=8


@pytest.mark.parametrize("args", [
    ["trace", "gen"], ["trace", "gen", "chat"], ["trace", "gen", "agent"], ["trace", "convert"],
    ["trace", "inspect"],
])
def test_help_has_runnable_examples(runner, args):
    r = runner.invoke(cli, [*args, "--help"])
    assert r.exit_code == 0 and "kvbench trace" in r.output and "Example" in r.output


def test_help_examples_run(tmp_path):
    # The examples shown by `trace gen chat --help` work as written (run in a scratch folder).
    _register()
    help_text = CliRunner().invoke(cli, ["trace", "gen", "chat", "--help"]).output
    commands = [line.strip() for line in help_text.splitlines() if line.strip().startswith("kvbench ")]
    assert len(commands) == 2
    for cmd in commands:
        r = _kvbench(*shlex.split(cmd)[1:], cwd=tmp_path)
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args,words", [
    (["trace", "gen", "chat", "--rate", "0", "-o", "x.jsonl"], "--rate"),
    (["trace", "gen", "chat", "--burstiness", "2", "-o", "x.jsonl"], "--arrival gamma"),
    (["trace", "gen", "rag", "--chunks", "9", "--corpus-docs", "4", "-o", "x.jsonl"], "--corpus-docs"),
    (["trace", "gen", "nosuch", "-o", "x.jsonl"], "nosuch"),
    (["trace", "inspect", "traces/chat.jsonl", "--block-size", "0"], "--block-size"),
    (["trace", "convert", "--from", "csv", "a", "-o", "b"], "--from"),
    (["trace", "convert", "--from", "azure", "a.csv", "--tokenizer", ".", "-o", "b"], "sharegpt only"),
    (["trace", "gen", "chat", "-o", "/nonexistent/dir/x.jsonl"], "cannot write"),
])
def test_bad_flags_are_one_line_exit_2(args, words):
    r = _kvbench(*args, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr and "Traceback" not in r.stderr


def _readme_commands():
    text = (REPO / "traces" / "README.md").read_text()
    return re.findall(r"`(kvbench trace gen [^`]+)`", text)


@pytest.mark.parametrize("command", _readme_commands())
def test_shipped_traces_are_reproducible(tmp_path, command):
    argv = shlex.split(command)[1:]
    shipped = REPO / argv[argv.index("-o") + 1]
    argv[argv.index("-o") + 1] = str(tmp_path / shipped.name)
    r = _kvbench(*argv)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / shipped.name).read_bytes() == shipped.read_bytes()
    assert shipped.stat().st_size < 1_000_000


def test_readme_lists_every_shipped_trace():
    assert len(_readme_commands()) == 5
    text = (REPO / "traces" / "README.md").read_text()
    for path in (REPO / "traces").glob("*.jsonl"):
        assert f"`{path.name}`" in text


def test_shipped_mooncake_slice_is_reproducible(tmp_path):
    text = (REPO / "traces" / "README.md").read_text()
    (command,) = re.findall(r"`(kvbench trace convert [^`]+)`", text)
    argv = shlex.split(command)[1:]
    src = argv[argv.index("--from") + 2]
    if not (REPO / src).exists():
        pytest.skip(f"real trace {src} not found next to the repository")
    shipped = REPO / argv[argv.index("-o") + 1]
    argv[argv.index("-o") + 1] = str(tmp_path / shipped.name)
    r = _kvbench(*argv, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / shipped.name).read_bytes() == shipped.read_bytes()
