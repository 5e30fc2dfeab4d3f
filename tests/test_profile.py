"""``kvbench calibrate --endpoint``: the profiling load (kvbench.engine.profile) and the staged live
run that sends it (LiveOptions.stages), against the fake OpenAI-compatible server of test_live."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from test_live import FakeServer

from kvbench.cli import main
from kvbench.engine import profile as P
from kvbench.engine.config import ReplayConfig
from kvbench.engine.live import LiveOptions, replay_live
from kvbench.engine.server import ServerSettings
from kvbench.trace.format import load_trace, write_trace
from kvbench.trace.tokens import TokenStreams

SERVER = ServerSettings(kind="vllm", block_size=32, num_gpu_blocks=16384, null_blocks=1, max_num_seqs=128,
                        max_num_batched_tokens=2048, max_model_len=4096)


def _tokens(r, streams: TokenStreams) -> list[int]:
    return streams.expand(r).tolist()  # the prompt's token ids, as the sim and the live client make them


def test_the_profile_spans_every_term_within_the_servers_limits():
    prof = P.profile(SERVER, seed=1, nonce="n1")
    st = prof.stages
    assert st[0].idle and st[0].requests == P.IDLE_REQUESTS
    levels = [s.concurrency for s in st[1:]]
    assert levels == [c for c in (1, 2, 4, 8, 16, 32, 64) for _ in (0, 1)]  # up to MAX_CONCURRENCY, under 128
    assert [s.long for s in st[1:]] == [False, True] * 7
    assert sum(s.requests for s in st) == len(prof.requests)
    by_stage = {}
    for r in prof.requests:
        by_stage.setdefault(r.meta["stage"], []).append(r)
        assert r.prompt_len + r.output_len <= SERVER.max_model_len and r.output_len >= 1
    short, long = by_stage["c8-short"], by_stage["c8-long"]
    # short prompts of their own, then long ones, two in three behind a shared prefix
    assert max(r.prompt_len for r in short) <= prof.short_prompt < min(r.prompt_len for r in long)
    assert all(len(r.prompt) == 1 for r in short)
    assert max(r.prompt_len for r in prof.requests) > 0.8 * prof.longest_prompt
    # decode batches from 1 to the cap: a stage sends at least twice its concurrency
    assert all(s.requests >= 2 * s.concurrency for s in st[1:])
    # sorted by trace time, the requests keep the stages' order (a live run issues them in it)
    order = [r.meta["stage"] for r in sorted(prof.requests, key=lambda r: r.t)]
    assert order == [r.meta["stage"] for r in prof.requests]


def test_the_load_is_sent_in_passes_each_with_prompts_of_its_own():
    """With passes=2 the whole load twice in a row (the fit states how far each term moved between the
    passes): the same stages, the idle requests shared out, every request and idle prompt new, each
    request's pass and stage in its meta, trace times in the stages' order (mutation: a pass's idle
    prompts drawn from the same index -> the second pass's repeat the first's -> fails)."""
    one, two = P.profile(SERVER, seed=1, nonce="n1"), P.profile(SERVER, seed=1, nonce="n1", passes=2)
    assert P.PASSES == 1 and two.passes == 2 and one.passes == 1
    first = [s for s in two.stages if s.pass_ == 1]
    second = [s for s in two.stages if s.pass_ == 2]
    assert [(s.concurrency, s.long, s.idle) for s in first] == [(s.concurrency, s.long, s.idle) for s in second]
    assert [(s.concurrency, s.long, s.requests) for s in first[1:]] == [(s.concurrency, s.long, s.requests)
                                                                        for s in one.stages[1:]]
    assert first[0].requests == second[0].requests == P.IDLE_REQUESTS // 2
    assert second[0].name == "p2-idle" and second[5].name == "p2-c4-short"
    assert len({r.id for r in two.requests}) == len(two.requests) == sum(s.requests for s in two.stages)
    assert [r.meta["pass"] for r in two.requests] == [s.pass_ for s in two.stages for _ in range(s.requests)]
    streams = TokenStreams()
    idle = [tuple(_tokens(r, streams)) for r in two.requests if r.meta["stage"].endswith("idle")]
    assert len(set(idle)) == len(idle) // 2  # each idle prompt twice in a row, none again in the other pass
    assert len({t[:16] for t in idle}) == len(idle) // 2  # nor its start: its first send is a cache miss
    order = [r.meta["stage"] for r in sorted(two.requests, key=lambda r: r.t)]
    assert order == [r.meta["stage"] for r in two.requests]
    assert "sent 2 times in a row" in two.describe() and "in a row" not in one.describe()
    with pytest.raises(ValueError, match="passes"):
        P.profile(SERVER, passes=0)


def test_idle_prompts_come_twice_and_a_new_profile_shares_nothing_with_the_last():
    prof = P.profile(SERVER, seed=1, nonce="n1")
    streams = TokenStreams()
    idle = [r for r in prof.requests if r.meta["stage"] == "idle"]
    for a, b in zip(idle[::2], idle[1::2]):
        assert _tokens(a, streams) == _tokens(b, streams) and a.output_len == b.output_len
    assert len({tuple(_tokens(r, streams)) for r in idle}) == len(idle) // 2
    # another nonce: other ids (a unique segment's tokens follow its request's id) and other prefixes
    other = P.profile(SERVER, seed=1, nonce="n2")
    names = {s.name for r in prof.requests for s in r.prompt if s.name}
    assert not names & {s.name for r in other.requests for s in r.prompt if s.name}
    assert not {r.id for r in prof.requests} & {r.id for r in other.requests}
    first = {tuple(_tokens(r, streams)[:32]) for r in prof.requests}
    assert not first & {tuple(_tokens(r, streams)[:32]) for r in other.requests}


def test_a_small_pool_lowers_the_longest_prompt_and_the_highest_concurrency():
    small = ServerSettings(kind="vllm", block_size=32, num_gpu_blocks=256, null_blocks=1, max_num_seqs=128,
                           max_num_batched_tokens=2048, max_model_len=4096)
    prof = P.profile(small, nonce="s")
    pool = 255 * 32
    assert prof.longest_prompt <= pool // 8
    top = max(s.concurrency for s in prof.stages)
    assert 1 < top < 64
    mean = sum(r.prompt_len + r.output_len for r in prof.requests) / len(prof.requests)
    assert top * mean <= pool  # the highest stage's sequences fit the pool, with room
    capped = P.profile(ServerSettings(max_num_seqs=8, max_model_len=4096), nonce="c")
    assert max(s.concurrency for s in capped.stages) == 8
    # long contexts: the top long stage's sequences (their own tokens and outputs, the prefixes once)
    # hold about half the pool, not all of it
    big = ServerSettings(kind="vllm", block_size=16, num_gpu_blocks=4001, null_blocks=1, max_num_seqs=256,
                         max_model_len=32768)
    prof = P.profile(big, nonce="b")
    top = max(s.concurrency for s in prof.stages)
    long = [r for r in prof.requests if r.meta["stage"] == f"c{top}-long"]
    own = sum(r.prompt[-1].length + r.output_len for r in long) / len(long)
    prefixes = {s.name: s.length for r in long for s in r.prompt if s.kind == "shared"}
    assert (top * own + sum(prefixes.values())) / (4000 * 16) < 0.7


def test_stages_run_one_after_another_each_a_closed_loop_of_its_concurrency(tmp_path):
    rows = [{"id": f"s{k}-{i}", "t": 0.0, "output_len": 6, "prompt": [{"unique": 20 + i}]}
            for k, n in enumerate((4, 6, 8)) for i in range(n)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FakeServer(ttft_s=0.02, itl_s=0.01) as fake:
        opts = LiveOptions(endpoint=fake.url, stages=((4, 1), (6, 3), (8, 8)))
        summary, out = replay_live(str(trace), ReplayConfig(model="tiny"), opts, str(tmp_path / "run"))
    assert summary["completed"] == 18
    got = pd.read_parquet(Path(out) / "requests.parquet")
    got["stage"] = got["id"].str[:2]
    ends = {}
    for stage, cap in (("s0", 1), ("s1", 3), ("s2", 8)):
        g = got[got["stage"] == stage]
        starts, finishes = g["arrival_s"].to_numpy(), g["finish_s"].to_numpy()
        peak = max(((starts <= s) & (finishes > s)).sum() for s in starts)
        assert peak == min(cap, len(g)), stage  # never more in flight than the stage's concurrency
        ends[stage] = (starts.min(), finishes.max())
    assert ends["s0"][1] <= ends["s1"][0] and ends["s1"][1] <= ends["s2"][0]  # a stage waits for the last
    assert json.loads((Path(out) / "config.json").read_text())["live"]["stages"] == [[4, 1], [6, 3], [8, 8]]


def test_stages_must_cover_the_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(load_trace(str(Path(__file__).resolve().parents[1] / "traces" / "chat.jsonl"), limit=5), trace)
    with FakeServer() as fake:
        from kvbench.engine.live import LiveRun
        from kvbench.errors import InputError

        with pytest.raises(InputError, match="stages hold 4 requests"):
            LiveRun(str(trace), ReplayConfig(model="tiny"), LiveOptions(endpoint=fake.url, stages=((4, 2),)),
                    str(tmp_path / "run"))


def test_calibrate_endpoint_keeps_its_run_and_refuses_a_fit_it_cannot_use(tmp_path, capsys, monkeypatch):
    """Against the fake server, whose times follow no engine's steps: the profiling run is kept as a
    live run directory (stages recorded), the fit is judged and refused without --force (exit 2), and
    ``calibrate --from-run`` on the kept run fits it again."""
    monkeypatch.setattr(P, "IDLE_GAP_S", 0.02)
    monkeypatch.setattr(P, "MAX_CONCURRENCY", 4)
    with FakeServer(ttft_s=0.005, itl_s=0.001, max_model_len=1024) as fake:
        with pytest.raises(SystemExit) as e:
            main(["calibrate", "--endpoint", fake.url, "--run-dir", str(tmp_path / "prof"), "-o",
                  str(tmp_path / "cal.json"), "--max-error", "0.0001"])
        out, err = capsys.readouterr()
    assert e.value.code == 2 and not (tmp_path / "cal.json").exists()
    assert "profiling load:" in err and "not fit for use" in err.splitlines()[-1]
    assert out.startswith("step = ") and "front end = " in out
    config = json.loads((tmp_path / "prof" / "config.json").read_text())
    levels = [c for _, c in config["live"]["stages"]]
    assert config["settings"]["executor"] == "live" and levels[:3] == [1, 1, 1] and levels == sorted(levels)
    assert "does not tell its max_num_seqs" in err  # the fake, as vLLM without dev mode, does not
    reqs = pd.read_parquet(tmp_path / "prof" / "requests.parquet")
    assert len(reqs) == sum(n for n, _ in config["live"]["stages"]) and reqs["rejected"].isna().all()
    main(["calibrate", "--from-run", str(tmp_path / "prof"), "-o", str(tmp_path / "cal.json"), "--force"])
    assert json.loads((tmp_path / "cal.json").read_text())["fit"]["run"] == str((tmp_path / "prof").resolve())
