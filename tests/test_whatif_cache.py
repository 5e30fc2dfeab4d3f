"""What ``kvbench trace whatif`` keeps between runs (kvbench.trace.cache) and what it imports: a cached
answer is the uncached one byte for byte (the shipped traces and the whole real Mooncake trace); a
rewritten trace is read again; a touched one is checked by its sha256; a cache folder that cannot be
written changes nothing; the cache stays in its bounds; and the command loads neither the other
commands nor pandas, pyarrow, matplotlib or torch (nor numba when the answer is cached)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from kvbench.cli.main import COMMANDS, cli
from kvbench.provenance import code_fingerprint
from kvbench.trace import cache
from kvbench.trace.importers import convert
from kvbench.trace.pieces import read_pieces

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
SHIPPED = sorted((REPO / "traces").glob("*.jsonl"))
AN_HOUR_NS = 3600 * 10**9
HEAVY = ("pandas", "pyarrow", "matplotlib", "torch", "transformers")


def _age(path: Path, ns: int = AN_HOUR_NS) -> None:
    """Set the file's mtime ``ns`` into the past: a trace written earlier, not racy (cache.RACY_NS)."""
    t = os.stat(path).st_mtime_ns - ns
    os.utime(path, ns=(t, t))


def _whatif(trace, *args, env=None) -> str:
    r = CliRunner().invoke(cli, ["trace", "whatif", str(trace), *args], env=env, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def _entries(home: Path, kind: str) -> list[Path]:
    folder = home / "kvbench" / kind
    return sorted(folder.iterdir()) if folder.exists() else []


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A cache folder of the test's own (XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KVBENCH_NO_CACHE", raising=False)
    return tmp_path / "xdg"


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    """The whole real Mooncake conversation trace, converted (an hour old: cacheable)."""
    if not REAL.exists():
        pytest.skip(f"real trace not found at {REAL}")
    out = tmp_path_factory.mktemp("mooncake") / "mooncake.jsonl"
    convert("mooncake", REAL, out)
    _age(out)
    return out


def _from_cache(path: Path):
    """The trace's Pieces as the cache gives them back (read and stored first where they are not)."""
    cache.read_pieces_cached(path)
    real = cache.read_pieces
    cache.read_pieces = _refuse
    try:
        return cache.read_pieces_cached(path)
    finally:
        cache.read_pieces = real


def _same_pieces(a, b) -> None:
    """Equal arrays of the same dtype and memory layout (numba compiles a function per layout: a cached
    array that differed in either would compile again), and equal sessions."""
    for name in cache._ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
        assert (x.flags.c_contiguous, x.flags.writeable, x.flags.aligned) == \
               (y.flags.c_contiguous, y.flags.writeable, y.flags.aligned), name
    assert a.sessions == b.sessions


# ------------------------------------------------------------------------------- the same answers

def _cached_runs_equal_the_uncached(trace: Path, home: Path, monkeypatch, *args) -> str:
    """Run the what-if uncached, then cached four ways, and hold every output to the uncached one:
    first (both read and stored), the answer cached, the pieces cached (the trace unread), and with
    --no-cache. -> the uncached output."""
    import kvbench.whatif

    plain = _whatif(trace, *args, env={"KVBENCH_NO_CACHE": "1"})
    assert not _entries(home, "pieces") and not _entries(home, "answers")
    assert _whatif(trace, *args) == plain
    assert len(_entries(home, "pieces")) == 1 and len(_entries(home, "answers")) == 1
    with monkeypatch.context() as m:  # the answer kept: neither the trace nor the what-if is run
        m.setattr(cache, "read_pieces", _refuse)
        m.setattr(kvbench.whatif, "whatif", _refuse)
        assert _whatif(trace, *args) == plain
    for entry in _entries(home, "answers"):
        entry.unlink()
    with monkeypatch.context() as m:  # the pieces kept: the what-if runs, the trace is not read
        m.setattr(cache, "read_pieces", _refuse)
        assert _whatif(trace, *args) == plain
    shutil.rmtree(home / "kvbench")
    assert _whatif(trace, *args, "--no-cache") == plain
    assert not (home / "kvbench").exists()  # neither read nor written
    return plain


def _refuse(*a, **k):
    raise AssertionError("called, where the cache should have answered (or been off)")


@pytest.mark.parametrize("trace", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_cached_answers_are_the_uncached_ones_on_the_shipped_traces(trace, tmp_path, home, monkeypatch):
    copy = tmp_path / trace.name  # a copy of its own, an hour old whatever the checkout's mtime
    copy.write_bytes(trace.read_bytes())
    _age(copy)
    out = _cached_runs_equal_the_uncached(copy, home, monkeypatch, "--budgets", "256MiB,1GiB,8GiB", "--policies",
                                          "lru,fifo,arc,belady", "--json")
    assert json.loads(out)["requests"] > 0
    _same_pieces(_from_cache(copy), read_pieces(copy))


def test_cached_answers_are_the_uncached_ones_on_the_real_mooncake_trace(mooncake, home, monkeypatch):
    budgets = "8GiB,16GiB,32GiB,64GiB,128GiB,1024GiB"
    out = _cached_runs_equal_the_uncached(mooncake, home, monkeypatch, "--block-size", "512", "--policies",
                                          "lru,fifo,belady", "--budgets", budgets, "--json")
    assert json.loads(out)["requests"] == 12031
    for entry in _entries(home, "answers"):  # the table too, not only the JSON
        entry.unlink()
    table = _whatif(mooncake, "--block-size", "512", "--policies", "lru,fifo,belady", "--budgets", budgets,
                    env={"KVBENCH_NO_CACHE": "1"})
    assert _whatif(mooncake, "--block-size", "512", "--policies", "lru,fifo,belady", "--budgets", budgets) == table
    assert _whatif(mooncake, "--block-size", "512", "--policies", "lru,fifo,belady", "--budgets", budgets) == table
    _same_pieces(_from_cache(mooncake), read_pieces(mooncake))


def test_another_question_is_another_answer(tmp_path, home):
    trace = tmp_path / "chat.jsonl"
    trace.write_bytes((REPO / "traces" / "chat.jsonl").read_bytes())
    _age(trace)
    runs = [("--budgets", "1GiB"), ("--budgets", "2GiB"), ("--budgets", "1GiB", "--warmup", "0.25"),
            ("--budgets", "1GiB", "--policies", "lru"), ("--budgets", "1GiB", "--block-size", "32"),
            ("--budgets", "1GiB", "--kv-dtype", "fp8"), ("--budgets", "1GiB", "--replicas", "2")]
    for args in runs:
        assert _whatif(trace, *args, "--json") == _whatif(trace, *args, "--json", env={"KVBENCH_NO_CACHE": "1"})
    assert len(_entries(home, "answers")) == len(runs) and len(_entries(home, "pieces")) == 1


def test_the_store_and_tier_what_ifs_take_the_cached_pieces(tmp_path, home, monkeypatch):
    trace = tmp_path / "chat.jsonl"
    trace.write_bytes((REPO / "traces" / "chat.jsonl").read_bytes())
    _age(trace)
    for args in (["--budgets", "1GiB,4GiB", "--budget-counts", "cache"],
                 ["--tiers", "gpu=1GiB,cpu=0,4GiB", "--policies", "lru"]):
        want = _whatif(trace, *args, "--json", env={"KVBENCH_NO_CACHE": "1"})
        cache.read_pieces_cached(trace)
        with monkeypatch.context() as m:
            m.setattr(cache, "read_pieces", _refuse)
            assert _whatif(trace, *args, "--json") == want


# ---------------------------------------------------------------------------------- the rule

GOOD = '{"id":"%s","t":%d,"prompt":[{"shared":"sys","len":40},{"unique":%d}],"output_len":4}\n'


def _trace(path: Path, n: int, unique: int = 30) -> Path:
    path.write_text("".join(GOOD % (i, i, unique) for i in range(n)))
    _age(path)
    return path


def test_a_rewritten_trace_is_read_again(tmp_path, home):
    path = _trace(tmp_path / "t.jsonl", 40)
    before = _whatif(path, "--budget-blocks", "4,16", "--json")
    for n, unique, same_size in [(41, 30, False), (41, 31, True)]:  # rewritten in place, another mtime
        size = path.stat().st_size
        _trace(path, n, unique)
        assert (path.stat().st_size == size) == same_size
        want = _whatif(path, "--budget-blocks", "4,16", "--json", env={"KVBENCH_NO_CACHE": "1"})
        assert want != before
        hashed = []  # a file of another size is not even hashed before it is read again
        real = cache.file_sha256
        cache.file_sha256 = lambda p: hashed.append(p) or real(p)
        try:
            assert _whatif(path, "--budget-blocks", "4,16", "--json") == want
        finally:
            cache.file_sha256 = real
        assert len(hashed) == (2 if same_size else 1)  # (the lookup's, if the same size) and the store's
        _same_pieces(_from_cache(path), read_pieces(path))
        before = want


def test_a_touched_or_replaced_trace_is_checked_by_its_hash(tmp_path, home, monkeypatch):
    path = _trace(tmp_path / "t.jsonl", 40)
    cache.read_pieces_cached(path)
    _age(path, AN_HOUR_NS // 2)  # touched: the same bytes, another mtime
    with monkeypatch.context() as m:
        m.setattr(cache, "read_pieces", _refuse)
        _same_pieces(cache.read_pieces_cached(path), read_pieces(path))
        head = json.loads(np.load(_entries(home, "pieces")[0])["header"].tobytes())
        assert head["mtime_ns"] == path.stat().st_mtime_ns  # brought up to date: no hash next time
        m.setattr(cache, "file_sha256", _refuse)
        cache.read_pieces_cached(path)
    other = _trace(tmp_path / "other.jsonl", 40, 31)  # replaced by a file of the same size, other bytes
    assert other.stat().st_size == path.stat().st_size
    os.replace(other, path)
    got = cache.read_pieces_cached(path)
    assert got.prompt_lens.sum() == 40 * (40 + 31)
    _same_pieces(got, read_pieces(path))


def test_a_trace_read_just_after_it_was_written_is_not_cached(tmp_path, home):
    """Within RACY_NS of its mtime a trace may be rewritten with its stat unchanged (the timestamp's
    granularity): nothing read then is kept."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(GOOD % (i, i, 30) for i in range(40)))
    _whatif(path, "--budget-blocks", "4,16", "--json")
    assert not _entries(home, "pieces") and not _entries(home, "answers")
    _age(path)
    _whatif(path, "--budget-blocks", "4,16", "--json")
    assert len(_entries(home, "pieces")) == 1 and len(_entries(home, "answers")) == 1


def test_a_changed_kvbench_or_trace_code_is_a_miss(tmp_path, home, monkeypatch):
    path = _trace(tmp_path / "t.jsonl", 40)
    want = _whatif(path, "--budget-blocks", "4,16", "--json")
    monkeypatch.setattr(cache, "_trace_code", ["another"])
    import kvbench.provenance

    monkeypatch.setattr(kvbench.provenance, "code_fingerprint", lambda: "another")
    reads = []
    monkeypatch.setattr(cache, "read_pieces", lambda p: reads.append(p) or read_pieces(p))
    assert _whatif(path, "--budget-blocks", "4,16", "--json") == want
    assert len(reads) == 1  # the trace read again
    assert len(_entries(home, "answers")) == 2  # one per code
    assert len(_entries(home, "pieces")) == 1  # one per file: replaced
    head = json.loads(np.load(_entries(home, "pieces")[0])["header"].tobytes())
    assert head["code"] == "another" and head["sha256"] == cache.file_sha256(path)


def test_a_broken_entry_is_a_miss(tmp_path, home):
    path = _trace(tmp_path / "t.jsonl", 40)
    want = _whatif(path, "--budget-blocks", "4,16", "--json")
    for entry in _entries(home, "pieces"):
        entry.write_bytes(entry.read_bytes()[:100])
    for entry in _entries(home, "answers"):
        entry.write_text('{"not": "a what-if"}')
    assert _whatif(path, "--budget-blocks", "4,16", "--json") == want
    for entry in _entries(home, "answers"):
        entry.write_text("{")
    assert _whatif(path, "--budget-blocks", "4,16", "--json") == want
    _same_pieces(_from_cache(path), read_pieces(path))


# ------------------------------------------------------------------------------ where, and how much

def test_a_cache_folder_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    path = _trace(tmp_path / "t.jsonl", 40)
    want = _whatif(path, "--budget-blocks", "4,16", "--json", env={"KVBENCH_NO_CACHE": "1"})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "below"))  # a file where the folder should be
    assert _whatif(path, "--budget-blocks", "4,16", "--json") == want
    assert _whatif(path, "--budget-blocks", "4,16", "--json") == want
    assert sorted(os.listdir(tmp_path)) == ["a-file", "t.jsonl"]  # nothing beside the trace either


def test_off_by_env_or_flag(tmp_path, home, monkeypatch):
    path = _trace(tmp_path / "t.jsonl", 40)
    _whatif(path, "--budget-blocks", "4,16", "--json", "--no-cache")
    monkeypatch.setenv("KVBENCH_NO_CACHE", "1")
    _whatif(path, "--budget-blocks", "4,16", "--json")
    assert not (home / "kvbench").exists()
    monkeypatch.setenv("KVBENCH_NO_CACHE", "0")
    _whatif(path, "--budget-blocks", "4,16", "--json")
    assert (home / "kvbench").exists()


def test_the_cache_stays_in_its_bounds(tmp_path, home, monkeypatch):
    monkeypatch.setattr(cache, "MAX_PIECES", 3)
    monkeypatch.setattr(cache, "MAX_ANSWERS", 4)
    traces = [_trace(tmp_path / f"t{i}.jsonl", 20 + i) for i in range(6)]
    for i, path in enumerate(traces):
        _whatif(path, "--budget-blocks", "4,16", "--json")
        cache.read_pieces_cached(traces[0])  # used after every other: the most recent
        assert len(_entries(home, "pieces")) == min(i + 1, 3)
        assert len(_entries(home, "answers")) == min(i + 1, 4)
    names = {json.loads(np.load(e)["header"].tobytes())["trace"] for e in _entries(home, "pieces")}
    assert names == {str(traces[0]), str(traces[4]), str(traces[5])}  # the least recently used went
    one = _entries(home, "pieces")[0].stat().st_size
    monkeypatch.setattr(cache, "MAX_PIECES_BYTES", int(1.5 * one))  # now bytes bind first
    cache.read_pieces_cached(traces[1])
    assert [json.loads(np.load(e)["header"].tobytes())["trace"] for e in _entries(home, "pieces")] == [str(traces[1])]
    for entry in _entries(home, "pieces"):  # used "later" than now (a clock set back since): the new one stays
        os.utime(entry, (2**31, 2**31))
    cache.read_pieces_cached(traces[3])
    assert [json.loads(np.load(e)["header"].tobytes())["trace"] for e in _entries(home, "pieces")] == [str(traces[3])]
    stale = home / "kvbench" / "pieces" / "x.tmp"  # left by a process that died
    stale.write_text("")
    os.utime(stale, (0, 0))
    cache.read_pieces_cached(traces[2])
    assert not stale.exists()


# ---------------------------------------------------------------------------------------- imports

_PROBE = """
import json, sys
from kvbench.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m in {heavy!r} or m.startswith("kvbench.cli.")
                        or m in ("kvbench.engine.config", "kvbench.eviction"))), file=sys.stderr)
"""


def _loaded(args: list[str], xdg: Path) -> set[str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg)}
    env.pop("KVBENCH_NO_CACHE", None)
    r = subprocess.run([sys.executable, "-c", _PROBE.format(heavy={*HEAVY, "numba"}), *args], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stderr.strip().splitlines()[-1]))


def test_the_whatif_command_imports_only_what_it_needs(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes((REPO / "traces" / "chat.jsonl").read_bytes())
    _age(path)
    args = ["trace", "whatif", str(path), "--budgets", "1GiB,4GiB", "--policies", "lru,fifo,belady"]
    for attempt in range(3):  # again only where kvbench's code changed between the runs (another answer)
        code = code_fingerprint.__wrapped__()
        computed = _loaded(args, tmp_path / f"xdg{attempt}")
        answered = _loaded(args, tmp_path / f"xdg{attempt}")  # the answer cached: no compiled core runs
        if code_fingerprint.__wrapped__() == code:
            break
    assert computed == {"numba", "kvbench.cli.console", "kvbench.cli.main", "kvbench.cli.trace", "kvbench.cli.types"}
    assert answered == {"kvbench.cli.main", "kvbench.cli.trace", "kvbench.cli.types"}
    assert not {"pandas", "pyarrow", "matplotlib"} & _loaded([*args, "--json"], tmp_path / "xdg0")


def test_commands_are_imported_when_used_and_all_are_listed():
    """main.COMMANDS names every command of every command module (a command missing there would be
    missing from kvbench), each resolving to the command of that name."""
    import importlib

    modules = {spec.split(":")[0] for spec in COMMANDS.values()}
    declared = {"trace"}
    for name in modules:
        declared |= {c.name for c in getattr(importlib.import_module(name), "COMMANDS", [])}
    assert declared == set(COMMANDS)
    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(COMMANDS)
    for name in COMMANDS:
        assert cli.get_command(ctx, name).name == name
    assert cli.get_command(ctx, "no-such-command") is None
