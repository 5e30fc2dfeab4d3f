"""A trace read as a stream (kvbench.trace.stream): the replay keeps a few numbers per request until it
issues it, reads it from the file then, and lets it go when it finishes; the ideal hit rate lets go of
keys no later request can hit. The same results as the requests held in memory, on the shipped and
real traces, sorted or not; the requests held bounded by those in flight; errors as iter_trace's."""
from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.errors import InputError
from kvbench.trace.format import Request, load_trace
from kvbench.trace.ideal import IdealCounter, block_expiry, ideal_hits
from kvbench.trace.keys import PrefixKeys
from kvbench.trace.stream import SharedNames, TraceIndex

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
MOONCAKE = ROOT.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
sys.path.insert(0, str(ROOT / "benchmarks"))
from make_big_trace import copies  # noqa: E402  (the benchmark's trace maker, tested here)


def sim(**kw) -> ReplayConfig:
    return ReplayConfig(executor="sim", model="llama-3-8b", **kw)


def run_files(run: Path) -> tuple[dict, list, list]:
    """A run's summary (but its wall time) and rows, NaN made comparable."""
    def rows(name: str) -> list:
        return [{k: "nan" if isinstance(v, float) and v != v else v for k, v in row.items()}
                for row in pq.read_table(run / name).to_pylist()]
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_s")
    return summary, rows("requests.parquet"), rows("steps.parquet")


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def mooncake_copies(tmp_path_factory) -> Path:
    """The shipped Mooncake slice three times over (copies share nothing, an hour apart)."""
    rows = [json.loads(line) for line in (TRACES / "mooncake_slice.jsonl").read_text().splitlines()]
    return write_lines(tmp_path_factory.mktemp("copies") / "slice3.jsonl", list(copies(rows, 3 * len(rows), 3600.0)))


@pytest.mark.parametrize("trace,kw", [("chat.jsonl", {"limit": 60}), ("rag.jsonl", {"time_scale": 0.05, "num_blocks": 3000}),
                                      ("agent.jsonl", {"prefix_mode": "radix", "limit": 100}), ("best_of_n.jsonl", {}),
                                      ("chat.jsonl", {"dependent_turns": True, "max_concurrency": 8, "limit": 60}),
                                      ("chat.jsonl", {"layout": "slab", "slab_reserve": "max", "limit": 60}),
                                      ("mooncake_slice.jsonl", {"cache_policy": "belady", "num_blocks": 8000})])
def test_streamed_trace_gives_the_results_of_the_requests_in_memory(tmp_path, trace, kw):
    path = str(TRACES / trace)
    cfg = sim(**kw)
    streamed = Replay(path, cfg, str(tmp_path / "stream"))
    assert isinstance(streamed.trace, TraceIndex)
    streamed.run()
    Replay(path, cfg, str(tmp_path / "memory"), requests=load_trace(path, limit=cfg.limit)).run()
    assert run_files(tmp_path / "stream") == run_files(tmp_path / "memory")


def test_an_unsorted_trace_is_replayed_in_arrival_order(tmp_path):
    """Lines shuffled: the same requests arrive in the same order (ties keep file order), read out
    of file order; the ideal gets a pass of its own in file order, as the list's does."""
    rows = [json.loads(line) for line in (TRACES / "chat.jsonl").read_text().splitlines()]
    random.Random(7).shuffle(rows)
    path = str(write_lines(tmp_path / "shuffled.jsonl", rows))
    idx = TraceIndex(path)
    assert not idx.sorted and list(idx.t) == sorted(r["t"] for r in rows)
    assert [idx.request(p).id for p in range(len(idx))] == [r.id for r in sorted(load_trace(path), key=lambda r: r.t)]
    cfg = sim(time_scale=0.2)
    Replay(path, cfg, str(tmp_path / "stream")).run()
    Replay(path, cfg, str(tmp_path / "memory"), requests=load_trace(path)).run()
    a, b = run_files(tmp_path / "stream"), run_files(tmp_path / "memory")
    assert a == b and a[0]["ideal_hit_rate"] > 0.5


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the real Mooncake trace is not beside the checkout")
def test_real_mooncake_streamed_equals_in_memory(tmp_path):
    from kvbench.trace.importers import convert

    path = str(tmp_path / "mooncake.jsonl")
    convert("mooncake", str(MOONCAKE), path, limit=500)
    cfg = sim(num_blocks=20000)
    Replay(path, cfg, str(tmp_path / "stream")).run()
    Replay(path, cfg, str(tmp_path / "memory"), requests=load_trace(path)).run()
    assert run_files(tmp_path / "stream") == run_files(tmp_path / "memory")


def test_ideal_lets_go_of_keys_no_later_request_can_hit(mooncake_copies):
    """Three copies that share nothing: with expiry the ideal's hits are the same as keeping every
    key, and the keys it holds at the peak are about one copy's, not three's."""
    reqs = load_trace(mooncake_copies)
    bs = 16
    names = SharedNames.of(reqs)
    keys_of = PrefixKeys(bs)
    keys_of.once = names.once
    kept, peak_kept = IdealCounter(bs), 0
    for k, r in enumerate(reqs):
        keys, prompt_len, pieces, shareable = keys_of.with_pieces(r)
        assert shareable == keys_of.shareable_blocks(r)
        kept.add(keys, prompt_len, shareable, block_expiry(pieces, len(keys), bs, names), at=k)
        peak_kept = max(peak_kept, len(kept.seen))
    whole = ideal_hits(reqs, bs)
    assert kept.result() == whole and whole.hit_tokens > 0
    everything = IdealCounter(bs)
    for r in reqs:
        everything.add(*keys_of(r), keys_of.shareable_blocks(r))
    assert len(everything.seen) > 2.5 * peak_kept
    assert len(kept.seen) < len(everything.seen) / 2  # let go as each copy's names are last used


def test_requests_held_never_exceed_those_in_flight(mooncake_copies):
    """Every Request object alive mid-run is one the engine issued and has not finished (in flight),
    plus at most the one being read: the trace is never held."""
    cfg = sim(max_concurrency=6, num_blocks=30000, time_scale=0.01)
    rp = Replay(str(mooncake_copies), cfg, str(mooncake_copies.parent / "held"))
    finished = [0]
    record = rp.accounts.request

    def count_finish(writer, rs, rep):
        finished[0] += 1
        record(writer, rs, rep)

    rp.accounts.request = count_finish
    seen = []
    ids = {json.loads(line)["id"] for line in mooncake_copies.read_text().splitlines()}

    def check(rep, start_s, end_s, batch, emitted):
        issued = rp._issuer.issued  # sampled at every 20th issue (the suite's other tests hold Requests too)
        if issued % 20 == 0 and (not seen or seen[-1][2] != issued):
            alive = sum(isinstance(o, Request) and o.id in ids for o in gc.get_objects())
            seen.append((alive, issued - finished[0], issued))

    rp.step_hook = check
    summary = rp.run()
    assert summary["completed"] == len(rp.trace) == 600
    assert len(seen) >= 20
    assert all(alive <= in_flight + 1 for alive, in_flight, _ in seen), seen
    assert max(in_flight for _, in_flight, _ in seen) == 6


def test_trace_index_refuses_bad_lines_as_iter_trace_does(tmp_path):
    good = json.dumps({"id": "a", "t": 0, "output_len": 2, "prompt": [{"unique": 4}]})
    cases = {
        "dup": [good, good.replace('"t": 0', '"t": 1')],
        "neg": [good, json.dumps({"id": "b", "t": 0, "output_len": -1, "prompt": [{"unique": 4}]})],
        "json": [good, "{not json"],
    }
    for name, lines in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(InputError) as streamed:
            TraceIndex(path)
        with pytest.raises(InputError) as listed:
            load_trace(path)
        assert str(streamed.value) == str(listed.value), name
        assert ":2:" in str(streamed.value) or "line 2" in str(streamed.value), str(streamed.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match="no requests"):
        TraceIndex(empty)


def test_trace_index_limit_and_names():
    idx = TraceIndex(TRACES / "chat.jsonl", limit=40)
    reqs = load_trace(TRACES / "chat.jsonl", limit=40)
    assert len(idx) == 40 and [idx.request(p).id for p in range(40)] == [r.id for r in sorted(reqs, key=lambda r: r.t)]
    names = SharedNames.of(reqs)
    assert np.array_equal(idx.names.seeds, names.seeds) and np.array_equal(idx.names.last_use, names.last_use)
    used = {}
    for k, r in enumerate(reqs):
        for n in {s.name for s in r.prompt if s.kind == "shared"} | ({r.output} if r.output else set()):
            used.setdefault(n, []).append(k)
    multi = {n: ks[-1] for n, ks in used.items() if len(ks) > 1}
    assert len(names) == len(multi) > 0
    assert all(names.shared(n) for n in multi) and not any(names.shared(n) for n in used if n not in multi)


def test_ctrl_c_keeps_every_finished_row(tmp_path):
    """kvbench replay interrupted by SIGINT: exit 130, the run readable, summary.json incomplete with
    the counts of the rows written. (The Mooncake slice ten times over: ~3 s of replay here, so the
    signal a second in lands mid-run; three copies ran ~1 s, and a faster replay finished first.)"""
    rows = [json.loads(line) for line in (TRACES / "mooncake_slice.jsonl").read_text().splitlines()]
    total = 10 * len(rows)
    trace = write_lines(tmp_path / "slice10.jsonl", list(copies(rows, total, 3600.0)))
    out = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "replay", str(trace), "--num-blocks", "8000",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (out / "steps.parquet").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal")
    assert proc.returncode == 130, err
    summary = json.loads((out / "summary.json").read_text())
    written = pq.read_table(out / "requests.parquet")
    if written.num_rows == total:  # every request finished before the signal: nothing was cut
        pytest.skip("the run finished before the signal")
    assert summary["complete"] is False and summary["completed"] == written.num_rows
    assert summary["steps"] == pq.read_table(out / "steps.parquet").num_rows


def test_name_counts_spilled_to_files_equal_those_in_memory(mooncake_copies):
    """Past ``spill`` uses the counter sorts its uses in 16 files by seed; the same shared names and
    last uses as counting them all at once."""
    from kvbench.trace.stream import NameCounter

    reqs = load_trace(mooncake_copies)
    whole = SharedNames.of(reqs)
    counter = NameCounter(spill=500)
    for k, r in enumerate(reqs):
        counter.add(r, k)
    spilled = counter.result()
    assert len(whole) > 100
    assert np.array_equal(spilled.seeds, whole.seeds) and np.array_equal(spilled.last_use, whole.last_use)


def _settled_copy(src: Path, dst: Path, age_s: float = 60.0) -> Path:
    """A copy of ``src`` whose mtime is ``age_s`` in the past: settled, so the trace cache keeps what
    is read from it (kvbench.trace.cache.RACY_NS)."""
    dst.write_bytes(src.read_bytes())
    past = time.time_ns() - int(age_s * 1e9)
    os.utime(dst, ns=(past, past))
    return dst


@pytest.fixture
def scans(tmp_path, monkeypatch) -> list:
    """A trace cache of the test's own, and the --limit of every pass TraceIndex makes over a file."""
    import kvbench.trace.stream as stream

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KVBENCH_NO_CACHE", raising=False)
    made: list = []
    real_scan = stream._scan
    monkeypatch.setattr(stream, "_scan", lambda path, limit: made.append(limit) or real_scan(path, limit))
    return made


def test_the_index_is_read_back_from_the_trace_cache(tmp_path, scans):
    """A settled trace is scanned once: the next TraceIndex of it (another run, a sweep's next
    configuration) reads the same arrays back; one rewritten is scanned again; the hash is the file's."""
    trace = _settled_copy(TRACES / "agent.jsonl", tmp_path / "agent.jsonl")
    first = TraceIndex(trace)
    again = TraceIndex(trace)
    assert scans == [None]
    assert first.sha256 == again.sha256 == hashlib.sha256(trace.read_bytes()).hexdigest()
    for name in ("t", "order", "prompt_len", "output_len", "n", "file_offsets", "file_lines"):
        assert np.array_equal(getattr(first, name), getattr(again, name)), name
    assert np.array_equal(first.names.seeds, again.names.seeds) and first.sorted == again.sorted
    assert [again.request(p) for p in range(len(again))] == [first.request(p) for p in range(len(first))]
    # a limit is an index of its own (its names are the first N requests'), with no hash of the whole file
    cut = TraceIndex(trace, limit=50)
    assert scans == [None, 50] and len(cut) == 50 and cut.sha256 is None
    # rewritten in place (another content, another mtime): scanned again, never the old index
    rows = [json.loads(line) for line in trace.read_text().splitlines()][:30]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    past = time.time_ns() - 30 * 10**9
    os.utime(trace, ns=(past, past))
    fresh = TraceIndex(trace)
    assert scans == [None, 50, None] and len(fresh) == 30
    assert fresh.sha256 == hashlib.sha256(trace.read_bytes()).hexdigest()


def test_a_trace_with_a_duplicate_id_is_refused_every_time_never_cached(tmp_path, scans):
    good = json.dumps({"id": "a", "t": 0, "output_len": 2, "prompt": [{"unique": 4}]})
    src = tmp_path / "src.jsonl"
    src.write_text(good + "\n" + good.replace('"t": 0', '"t": 1') + "\n")
    trace = _settled_copy(src, tmp_path / "dup.jsonl")
    for _ in range(2):
        with pytest.raises(InputError, match="duplicate request id 'a'"):
            TraceIndex(trace)
    assert scans == [None, None]


def test_a_sweep_scans_the_trace_once_for_all_its_configurations(tmp_path, scans):
    from kvbench.sweep.runner import run_sweep

    trace = _settled_copy(TRACES / "chat.jsonl", tmp_path / "chat.jsonl")
    state = run_sweep(str(trace), {"block_size": [16, 32], "cache_policy": ["lru", "fifo"], "limit": [None, 60]},
                      str(tmp_path / "sweep"))
    assert len(state.summaries) == 8 and sorted(scans, key=str) == [60, None]  # the limit's pass, the whole trace's
    configs = [json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/config.json")]
    assert {c["trace"]["sha256"] for c in configs} == {hashlib.sha256(trace.read_bytes()).hexdigest()}


def test_an_index_made_hashes_the_trace_once(tmp_path, scans, monkeypatch):
    """The pass hashes the file as it reads it; keeping the index does not read the file again."""
    import kvbench.trace.cache as cache

    trace = _settled_copy(TRACES / "chat.jsonl", tmp_path / "chat.jsonl")
    hashed = []
    real = cache._sha256_at
    monkeypatch.setattr(cache, "_sha256_at", lambda path, state: hashed.append(path) or real(path, state))
    made = TraceIndex(trace)
    again = TraceIndex(trace)
    assert scans == [None] and hashed == [] and made.sha256 == again.sha256


def test_names_by_seed_memoise_what_count_once_memoises(tmp_path):
    """PrefixKeys asks stream.OnceNames about a request's seeds in one compiled call (its names'
    hash table); the pieces it marks to memoise, and so the memo's entries and hits, and the blocks
    it reads as shareable are those a set of the trace's used-once names (count_once) gives, on the
    real Mooncake trace's first 500 requests."""
    from kvbench.trace.importers import convert

    path = str(tmp_path / "mooncake.jsonl")
    convert("mooncake", str(MOONCAKE), path, limit=500)
    reqs = load_trace(path)
    by_set, by_seed = PrefixKeys(16), PrefixKeys(16)
    by_set.count_once(reqs)
    by_seed.once = SharedNames.of(reqs).once
    some_shared = 0
    for r in reqs:
        a, b = by_set.with_pieces(r), by_seed.with_pieces(r)
        assert np.array_equal(a.pieces.memoise, b.pieces.memoise)
        assert np.array_equal(a.keys, b.keys)
        assert a.shareable == b.shareable == by_set.shareable_blocks(r) == by_seed.shareable_blocks(r)
        some_shared += a.shareable is not None and a.shareable > 0
    assert by_set.memo_state.tolist() == by_seed.memo_state.tolist()
    assert by_seed.memo_state[2] > 0  # Mooncake's shared hash ids are hit in the memo
    assert some_shared > 50  # requests that share a prefix and then have their own hash ids


@pytest.mark.parametrize("name", ["chat.jsonl", "agent.jsonl", "rag.jsonl", "best_of_n.jsonl", "mooncake_slice.jsonl"])
def test_shareable_blocks_read_off_the_pieces_are_shareable_blocks(name):
    """with_pieces reads a request's shareable blocks off its flattened pieces (compiled_ideal.
    keep_shared): the same as PrefixKeys.shareable_blocks walking its segments, names asked by seed
    or by a set, on every shipped trace (chat's and agent's answers are named: an answer used once
    is not the prompt's own piece)."""
    reqs = load_trace(TRACES / name)
    for bs in (16, 64):
        by_set, by_seed = PrefixKeys(bs), PrefixKeys(bs)
        by_set.count_once(reqs)
        by_seed.once = SharedNames.of(reqs).once
        seen = set()
        for r in reqs:
            want = by_set.shareable_blocks(r)
            assert by_set.with_pieces(r).shareable == by_seed.with_pieces(r).shareable == want, r.id
            seen.add(want is None)
        assert False in seen  # requests with pieces of their own


def test_an_answer_used_once_is_not_its_prompts_own_piece(tmp_path):
    """A prompt wholly shared whose named answer no other request names: every prompt block is
    shareable (None), the answer's piece, after the prompt, counts for nothing."""
    lines = [{"id": "a", "t": 0, "prompt": [{"shared": "sys", "len": 64}], "output_len": 40, "output": "ans-a"},
             {"id": "b", "t": 1, "prompt": [{"shared": "sys", "len": 64}, {"unique": 32}], "output_len": 4}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    reqs = load_trace(path)
    keys_of = PrefixKeys(16)
    keys_of.once = SharedNames.of(reqs).once
    a, b = (keys_of.with_pieces(r) for r in reqs)
    assert a.pieces.seq_lens[0] > a.prompt_len  # the answer's piece is there, used once
    assert a.shareable is None and b.shareable == 4
