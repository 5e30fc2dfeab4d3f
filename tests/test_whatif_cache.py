"""What ``kvbench trace whatif`` keeps between runs (kvbench.trace.cache) and what it imports: a cached
answer, and one computed from the cached pieces or the cached hashed trace, is the uncached one byte
for byte (the shipped traces and the whole real Mooncake trace); a rewritten trace is read and hashed
again; a touched one is checked by its sha256; a cache folder that cannot be written changes nothing;
the cache stays in its bounds; the command loads neither the other commands nor pandas, pyarrow,
matplotlib or torch (nor numba when the answer is cached); and only a process of its own leaves its
heap uncollected at exit."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import types
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
from kvbench.whatif.blocktrace import HashedTrace, read_hashed_cached

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
    _same_arrays(a, b, cache._ARRAYS)


def _same_arrays(a, b, names) -> None:
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
        assert (x.flags.c_contiguous, x.flags.writeable, x.flags.aligned) == \
               (y.flags.c_contiguous, y.flags.writeable, y.flags.aligned), name
    assert a.sessions == b.sessions


def _same_hashed_from_cache(path: Path, block_size: int) -> None:
    """The trace hashed at ``block_size`` as the cache gives it back is the one hashed now, as
    _same_pieces holds Pieces (read and stored first where it is not kept)."""
    read_hashed_cached(path, block_size)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(HashedTrace, "of", _refuse)
        got = read_hashed_cached(path, block_size)
    want = HashedTrace.of(read_pieces(path), block_size)
    assert got.block_size == want.block_size
    _same_arrays(got, want, [f.name for f in dataclasses.fields(HashedTrace)
                             if isinstance(getattr(want, f.name), np.ndarray)])


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
    assert len(_entries(home, "hashed")) == 1
    for entry in _entries(home, "answers"):
        entry.unlink()
    with monkeypatch.context() as m:  # the hashed trace kept: the what-if runs, the trace neither read nor hashed
        m.setattr(cache, "read_pieces", _refuse)
        m.setattr(HashedTrace, "of", _refuse)
        assert _whatif(trace, *args) == plain
    for entry in _entries(home, "answers") + _entries(home, "hashed"):
        entry.unlink()
    with monkeypatch.context() as m:  # the pieces kept: the trace hashed from them, not read
        m.setattr(cache, "read_pieces", _refuse)
        assert _whatif(trace, *args) == plain
    assert len(_entries(home, "hashed")) == 1
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
    _same_hashed_from_cache(copy, 16)


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
    _same_hashed_from_cache(mooncake, 512)


def test_another_question_is_another_answer(tmp_path, home):
    trace = tmp_path / "chat.jsonl"
    trace.write_bytes((REPO / "traces" / "chat.jsonl").read_bytes())
    _age(trace)
    runs = [("--budgets", "1GiB"), ("--budgets", "2GiB"), ("--budgets", "1GiB", "--warmup", "0.25"),
            ("--budgets", "1GiB", "--policies", "lru"), ("--budgets", "1GiB", "--block-size", "32"),
            ("--budgets", "1GiB", "--kv-dtype", "fp8"), ("--budgets", "1GiB", "--replicas", "2"),
            ("--budgets", "1GiB", "--replicas", "2", "--router", "session")]  # sessions from the hashed trace
    for args in runs:
        assert _whatif(trace, *args, "--json") == _whatif(trace, *args, "--json", env={"KVBENCH_NO_CACHE": "1"})
    assert len(_entries(home, "answers")) == len(runs) and len(_entries(home, "pieces")) == 1
    assert len(_entries(home, "hashed")) == 2  # one per block size


def test_a_hashed_trace_answers_for_its_block_size_and_its_file_only(tmp_path, home, monkeypatch):
    """The hashed trace kept for one block size answers a new question at that block size without the
    trace being read or hashed again, and answers for no other block size or content of the file."""
    path = _trace(tmp_path / "t.jsonl", 40)
    asked = ["--budget-blocks", "4,16", "--json"]
    before = _whatif(path, *asked)
    new = ["--budget-blocks", "2,8", "--json"]
    want = _whatif(path, *new, env={"KVBENCH_NO_CACHE": "1"})
    with monkeypatch.context() as m:
        m.setattr(cache, "read_pieces", _refuse)
        m.setattr(HashedTrace, "of", _refuse)
        assert _whatif(path, *new) == want

    def again(*args) -> str:  # computed from whatever the cache holds, held to the uncached answer
        for entry in _entries(home, "answers"):
            entry.unlink()
        want = _whatif(path, *args, env={"KVBENCH_NO_CACHE": "1"})
        assert _whatif(path, *args) == want
        return want

    assert again("--block-size", "8", *asked) != before
    assert len(_entries(home, "hashed")) == 2
    size = path.stat().st_size
    _trace(path, 40, 31)  # rewritten: the same size, other content
    assert path.stat().st_size == size
    assert again(*asked) != before


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
        # hashed once for its pieces' and its hashed trace's entries; a file of another size, not
        # before it is read again
        events = []
        real_hash, real_read = cache.file_sha256, cache.read_pieces
        cache.file_sha256 = lambda p: events.append("hash") or real_hash(p)
        cache.read_pieces = lambda p: events.append("read") or real_read(p)
        try:
            assert _whatif(path, "--budget-blocks", "4,16", "--json") == want
        finally:
            cache.file_sha256, cache.read_pieces = real_hash, real_read
        assert events == (["hash", "read"] if same_size else ["read", "hash"])
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


def test_a_hash_taken_while_the_trace_was_racy_is_not_kept(tmp_path, home, monkeypatch):
    """A file's sha256 serves the later entries of one process only where an entry would trust it: a
    hash taken within RACY_NS of the mtime may be of content rewritten since under the same stat."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(GOOD % (i, i, 30) for i in range(40)))
    written = path.stat()
    now_ns = [written.st_mtime_ns]  # the cache's clock
    monkeypatch.setattr(cache, "time", types.SimpleNamespace(time_ns=lambda: now_ns[0], time=time.time))
    cache.read_pieces_cached(path)  # racy: hashed, nothing kept
    path.write_text("".join(GOOD % (i, i, 31) for i in range(40)))  # in place: the same size and inode ...
    os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns))  # ... and mtime (a coarse clock's)
    assert cache.FileState.of(path.stat()) == cache.FileState.of(written)
    now_ns[0] += AN_HOUR_NS  # settled: read and kept
    cache.read_pieces_cached(path)
    (entry,) = _entries(home, "pieces")
    assert json.loads(np.load(entry)["header"].tobytes())["sha256"] == cache.file_sha256(path)


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
    # the tables printed by the terminal-aware printer (its module: shutil and dataclasses; rich on use)
    assert answered == {"kvbench.cli.console", "kvbench.cli.main", "kvbench.cli.trace", "kvbench.cli.types"}
    assert not {"pandas", "pyarrow", "matplotlib"} & _loaded([*args, "--json"], tmp_path / "xdg0")


_EXIT_PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen" if gc.get_freeze_count() else "collected"))  # after main's: LIFO
from kvbench.cli.main import main
{run}
"""


@pytest.mark.parametrize("run, at_exit", [
    ("main()", "frozen"),  # the process's own command line (the kvbench script, python -m kvbench)
    ("main(sys.argv[1:])", "collected"),  # a caller's (a test's): its heap is left alone
    ("import triton; main()", "collected"),  # nanobind, under triton, would report its objects leaked
])
def test_only_a_command_line_of_its_own_leaves_the_heap_to_the_process_end(run, at_exit):
    if run.startswith("import triton") and importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    r = subprocess.run([sys.executable, "-c", _EXIT_PROBE.format(run=run), "--version"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == at_exit
    assert "leak" not in r.stderr


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
