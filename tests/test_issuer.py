"""When requests are issued (kvbench.engine.issuer) and what the client sees of them: a closed loop of
C slots as vllm bench serve --max-concurrency runs it, dependent turns that wait for the answer they
quote, the inter-token latency of every gap, request and token throughput, goodput against SLOs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.issuer import Issuer, answer_dependencies
from kvbench.engine.records import goodput, itl_summary, parse_slo, weighted_percentile
from kvbench.engine.replay import replay
from kvbench.trace.format import Request, Segment, load_trace

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "traces" / "chat.jsonl"


def _req(i: int, t: float, prompt=(("unique", 8),), output: str | None = None) -> Request:
    segs = [Segment(kind=k, length=v) if k == "unique" else Segment(kind="shared", name=k, length=v)
            for k, v in prompt]
    return Request(id=f"r{i}", t=t, prompt=tuple(segs), output_len=4, index=i, output=output)


def _drive(issuer: Issuer, service_s: float) -> list[float]:
    """Issue everything, each request taking ``service_s`` from its issue: the issue times."""
    import heapq

    running: list[tuple[float, int]] = []
    issued = {}
    while not issuer.done():
        t = issuer.next_time()
        if t is not None and (not running or t <= running[0][0]):
            pos, at = issuer.issue()
            issued[pos] = at
            heapq.heappush(running, (at + service_s, pos))
        else:
            end, pos = heapq.heappop(running)
            issuer.finished(pos, end)
    return [issued[i] for i in range(len(issued))]


def test_no_cap_issues_at_the_trace_times_scaled():
    reqs = [_req(i, t) for i, t in enumerate((0.0, 1.0, 1.0, 5.0))]
    assert _drive(Issuer(reqs, time_scale=2.0), service_s=10.0) == [0.0, 2.0, 2.0, 10.0]


def test_a_cap_of_c_is_a_closed_loop_when_every_time_is_zero():
    reqs = [_req(i, 0.0) for i in range(7)]
    # C = 3 users, each request 1 s: 3 at 0, 3 at 1, 1 at 2 (vllm bench serve --max-concurrency 3)
    assert _drive(Issuer(reqs, max_concurrency=3), 1.0) == [0, 0, 0, 1, 1, 1, 2]
    # with arrival times, a request goes at max(its time, a free slot), first come first served
    reqs = [_req(i, t) for i, t in enumerate((0.0, 0.5, 0.6, 3.0))]
    assert _drive(Issuer(reqs, max_concurrency=1), 1.0) == [0.0, 1.0, 2.0, 3.0]
    # mutation: slots never freed -> it never finishes (guarded by done())


def test_dependent_turns_wait_for_the_answer_they_quote():
    a = _req(0, 0.0, output="s/answer-1")
    b = _req(1, 0.5, prompt=(("s/answer-1", 4), ("unique", 8)))  # re-sends a's answer
    c = _req(2, 0.6)
    assert answer_dependencies([a, b, c]) == {1: 0}
    times = _drive(Issuer([a, b, c], dependent_turns=True), service_s=2.0)
    assert times == [0.0, 2.0, 0.6]  # b waits for a's finish; c does not wait for b
    assert _drive(Issuer([a, b, c]), service_s=2.0) == [0.0, 0.5, 0.6]  # off: the trace's times


def test_the_last_writer_of_an_answer_is_the_one_waited_for():
    reqs = [_req(0, 0.0, output="x"), _req(1, 1.0, output="x"), _req(2, 2.0, prompt=(("x", 2),))]
    assert answer_dependencies(reqs) == {2: 1}


def test_a_closed_loop_replay_never_holds_more_than_c(tmp_path):
    cfg = ReplayConfig(limit=40, max_concurrency=3)
    summary = replay(str(CHAT), cfg, str(tmp_path / "c3"))
    assert summary["peak_running"] <= 3 and summary["completed"] == 40
    rows = pd.read_parquet(tmp_path / "c3" / "requests.parquet")
    # at any moment at most 3 requests are between issue (arrival_s) and finish
    events = sorted([(t, 1) for t in rows["arrival_s"]] + [(t, -1) for t in rows["finish_s"]],
                    key=lambda e: (e[0], e[1]))
    assert max(np.cumsum([d for _, d in events])) <= 3
    # open loop: the trace's own arrivals, more at once
    open_ = replay(str(CHAT), ReplayConfig(limit=40, time_scale=0.05), str(tmp_path / "open"))
    assert open_["peak_running"] > 3


def test_dependent_turns_in_the_sim_reach_the_ceiling_the_trace_allows(tmp_path):
    """Chat turns re-send the previous answer: waiting for it, every such block is cached when the
    turn arrives, and at a high arrival rate the hit rate rises toward the ideal."""
    fast = dict(limit=60, time_scale=0.02)
    off = replay(str(CHAT), ReplayConfig(**fast), str(tmp_path / "off"))
    on = replay(str(CHAT), ReplayConfig(**fast, dependent_turns=True), str(tmp_path / "on"))
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"]
    rows = pd.read_parquet(tmp_path / "on" / "requests.parquet").set_index("id")
    reqs = load_trace(CHAT, limit=60)
    for pos, dep in answer_dependencies(reqs).items():
        assert rows.loc[reqs[pos].id, "arrival_s"] >= rows.loc[reqs[dep].id, "finish_s"] - 1e-9


def test_itl_counts_every_gap_and_tpot_is_its_mean_per_request(tmp_path):
    summary = replay(str(CHAT), ReplayConfig(limit=30, time_scale=0.1), str(tmp_path / "r"))
    rows = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    done = rows[rows["output_tokens"] > 1]
    # a request's TPOT is the mean of its gaps, so its longest gap is at least its TPOT
    assert (done["itl_ms_max"] >= done["tpot_ms"] - 1e-9).all()
    # the pooled mean of all gaps is the token-weighted mean of TPOT
    weights = done["output_tokens"] - 1
    assert summary["itl_ms_mean"] == pytest.approx((done["tpot_ms"] * weights).sum() / weights.sum(), rel=1e-9)
    assert summary["itl_ms_p50"] <= summary["itl_ms_p90"] <= summary["itl_ms_p99"]
    assert summary["req_per_s"] == pytest.approx(30 / summary["duration_s"])
    assert summary["total_tok_per_s"] > summary["output_tok_per_s"]


def test_weighted_percentiles_equal_numpys_on_the_repeated_values():
    rng = np.random.default_rng(0)
    for _ in range(50):
        v = rng.choice(rng.random(6), size=rng.integers(1, 6), replace=False)
        c = rng.integers(1, 9, size=len(v))
        for q in (0, 1, 50, 90, 99, 100):
            assert weighted_percentile(v, c, q) == pytest.approx(np.percentile(np.repeat(v, c), q))
    s = itl_summary([{0.01: 3}, {0.01: 1, 0.05: 1}])
    assert s["itl_ms_mean"] == pytest.approx((4 * 10 + 50) / 5) and s["itl_ms_p50"] == pytest.approx(10)
    assert itl_summary({})["itl_ms_p99"] is None


def test_goodput_counts_requests_that_meet_every_slo():
    lat = {"ttft": np.array([100.0, 300.0, 50.0]), "tpot": np.array([10.0, 10.0, np.nan]),
           "e2e": np.array([1.0, 1.0, 1.0]), "itl": np.array([20.0, 20.0, 20.0])}
    assert goodput(lat, parse_slo("ttft=200,tpot=20"), 2.0) == {"slo_attainment": 2 / 3, "goodput_req_per_s": 1.0}
    assert goodput(lat, {}, 2.0)["goodput_req_per_s"] is None
    for bad in ("ttft", "ttft=x", "speed=5", "ttft=-1", "tpot=nan"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_slo_and_concurrency_are_options_with_one_line_errors(tmp_path, capsys):
    from kvbench.cli import main

    for args, flag in ((["--slo", "ttft=fast"], "--slo"), (["--max-concurrency", "0"], "--max-concurrency")):
        with pytest.raises(SystemExit) as e:
            main(["replay", str(CHAT), "--limit", "2", "--out", str(tmp_path / "x"), *args])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    main(["replay", str(CHAT), "--limit", "20", "--slo", "ttft=1000,tpot=100", "--max-concurrency", "2",
          "--out", str(tmp_path / "ok"), "--json"])
    s = json.loads(capsys.readouterr().out)
    assert s["slo_attainment"] == 1.0 and s["peak_running"] <= 2


def test_a_server_front_end_serves_one_request_at_a_time():
    from kvbench.engine.issuer import FrontEnd

    fe = FrontEnd(0.010, 0.001)
    assert not FrontEnd() and fe
    assert fe.admit(0.0, 100) == pytest.approx(0.110)  # 10 ms + 100 tokens x 1 ms
    assert fe.admit(0.05, 10) == pytest.approx(0.130)  # behind the first
    assert fe.admit(1.0, 0) == pytest.approx(1.010)  # the front end was free again


def test_front_end_latency_holds_no_one_and_each_replica_has_its_api_server(tmp_path):
    """The latency after the API process delays a request without holding the next one; with two servers
    (two replicas) two requests are served side by side, a third waits for the first free one; and a
    burst through two replicas leaves the front end in half the time it takes through one."""
    from kvbench.engine.issuer import FrontEnd

    fe = FrontEnd(0.010, 0.0, latency_s=0.005)
    assert fe.admit(0.0, 0) == pytest.approx(0.015) and fe.admit(0.0, 0) == pytest.approx(0.025)
    two = FrontEnd(0.010, 0.0, servers=2)
    assert [two.admit(0.0, 0) for _ in range(3)] == pytest.approx([0.010, 0.010, 0.020])
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "t": 0.0, "output_len": 2, "prompt": [{"unique": 16}]}) + "\n"
                             for i in range(400)))
    dur = {n: replay(str(trace), ReplayConfig(executor="sim", model="qwen3-0.6b", gpu="h100", replicas=n,
                                              num_blocks=4096), str(tmp_path / f"r{n}"))["duration_s"] for n in (1, 2)}
    from kvbench.executors import presets
    assert dur[1] >= 400 * presets.REQUEST_S and dur[2] < 0.6 * dur[1]


def test_a_fitted_front_end_delays_the_engine_not_the_clock_ttft_counts_from(tmp_path):
    """A calibration with a front end of 40 ms + 0.1 ms per prompt token: each request reaches the
    scheduler that much later, one after another, and TTFT (from the issue) grows by it."""
    def clock(front: bool) -> str:
        coef = {"matmul_flops": None, "attn_flops": None, "mem_bw": None, "kv_bw": None, "step_overhead_s": 0.002,
                "prefill_token_s": 1e-5, "decode_seq_s": 1e-4, **({"request_s": 0.04, "request_token_s": 1e-4}
                                                                  if front else {})}
        path = tmp_path / f"clock-{front}.json"
        path.write_text(json.dumps({"kvbench_calibration": 3, "coefficients": coef}))
        return str(path)

    trace = tmp_path / "two.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "t": 0.0, "output_len": 3, "prompt": [{"unique": 100}]}) + "\n"
                             for i in range(2)))
    rows = {}
    for front in (False, True):
        replay(str(trace), ReplayConfig(executor="sim", model="tiny", calibration=clock(front)), str(tmp_path / f"run-{front}"))
        rows[front] = pd.read_parquet(tmp_path / f"run-{front}" / "requests.parquet").set_index("id")
    plain, fronted = rows[False], rows[True]
    assert (fronted["arrival_s"] == plain["arrival_s"]).all()  # issued at the same times
    # without: both prefilled in one step, 2 ms + 200 x 0.01 ms; with: r0 reaches the engine at 50 ms
    # and is prefilled alone (2 ms + 1 ms), r1 at 100 ms, behind r0 in the front end
    assert plain["ttft_ms"].tolist() == pytest.approx([4.0, 4.0])
    assert fronted.loc["r0", "ttft_ms"] == pytest.approx(53.0)
    assert 100 < fronted.loc["r1", "ttft_ms"] < 110


def test_a_request_refused_as_too_long_still_takes_its_turn_in_the_front_end(tmp_path):
    """vLLM's API process refuses a prompt longer than max-model-len after reading it: r0 (300 tokens,
    over 200) holds the front end for 40 + 30 ms, so r1 reaches the engine at 70 + 50 ms, as
    calibrate --from-run's spans (fit_server.span_rows) assume."""
    coef = {"matmul_flops": None, "attn_flops": None, "mem_bw": None, "kv_bw": None, "step_overhead_s": 0.002,
            "prefill_token_s": 1e-5, "decode_seq_s": 1e-4, "request_s": 0.04, "request_token_s": 1e-4}
    clock = tmp_path / "clock.json"
    clock.write_text(json.dumps({"kvbench_calibration": 3, "coefficients": coef}))
    trace = tmp_path / "two.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "t": 0.0, "output_len": 3, "prompt": [{"unique": n}]}) + "\n"
                             for i, n in enumerate((300, 100))))
    replay(str(trace), ReplayConfig(executor="sim", model="tiny", calibration=str(clock), max_model_len=200),
           str(tmp_path / "run"))
    rows = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("id")
    assert rows["rejected"].notna().tolist() == [True, False]
    assert rows.loc["r1", "ttft_ms"] == pytest.approx(123.0)  # 120 ms in the front end, then 2 + 1 ms


def test_max_requests_and_max_seconds_stop_issuing_and_the_issued_run_out():
    reqs = [_req(i, float(i)) for i in range(6)]  # one a second
    issuer = Issuer(reqs, max_requests=4)
    assert _drive(issuer, 10.0) == [0.0, 1.0, 2.0, 3.0] and issuer.done() and issuer.stopped
    # --max-seconds counts from the first request's time, scaled: 2.5 s at scale 0.5 allows t <= 5
    reqs = [_req(i, 10.0 + i) for i in range(8)]
    assert _drive(Issuer(reqs, time_scale=0.5, max_seconds=2.5), 10.0) == [5.0, 5.5, 6.0, 6.5, 7.0, 7.5]
    # a closed loop's issue time is what counts: 3 slots, 1 s each; the 3 due at 2 s are past 1.5 s
    reqs = [_req(i, 0.0) for i in range(9)]
    assert _drive(Issuer(reqs, max_concurrency=3, max_seconds=1.5), 1.0) == [0, 0, 0, 1, 1, 1]
    # a live run's wall clock may already be past the limit when a request falls due
    late = Issuer([_req(i, float(i)) for i in range(3)], max_seconds=1.0)
    assert late.next_time(now=1.2) is None and late.done()
    # no limit reached: not stopped
    whole = Issuer(reqs, max_requests=9)
    _drive(whole, 1.0)
    assert whole.done() and not whole.stopped


def test_the_sim_stops_issuing_as_a_live_run_does(tmp_path):
    """--max-requests on a sorted trace is --limit (same rows, same figures); --max-seconds issues the
    requests due within S s of the first; the summary counts the requests issued."""
    trace = REPO / "traces" / "mooncake_slice.jsonl"
    cut = replay(str(trace), ReplayConfig(max_requests=60), str(tmp_path / "cut"))
    lim = replay(str(trace), ReplayConfig(limit=60), str(tmp_path / "lim"))
    assert (cut["requests"], cut["not_issued"], lim["not_issued"]) == (60, 140, 0)
    for k in ("completed", "prefix_hit_rate", "ideal_hit_rate", "ttft_ms_p50", "tpot_ms_p90", "steps", "duration_s"):
        assert cut[k] == lim[k], k
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "cut" / "requests.parquet"),
                                  pd.read_parquet(tmp_path / "lim" / "requests.parquet"))
    times = np.array([r.t for r in load_trace(CHAT)])
    s = replay(str(CHAT), ReplayConfig(max_seconds=30.0), str(tmp_path / "s"))
    due = int((times <= times[0] + 30.0).sum())
    assert s["requests"] == s["completed"] == due and s["not_issued"] == len(times) - due and 0 < due < len(times)
    rows = pd.read_parquet(tmp_path / "s" / "requests.parquet")
    assert len(rows) == due and rows["arrival_s"].max() <= times[0] + 30.0


def test_a_cut_run_with_dependent_turns_counts_the_ideal_of_the_requests_issued(tmp_path):
    """Dependent turns count the ideal in a pass of its own: with a limit, over the requests issued --
    the same as the whole run of a trace holding only those."""
    cfg = dict(dependent_turns=True, time_scale=0.05)
    cut = replay(str(CHAT), ReplayConfig(**cfg, max_requests=70), str(tmp_path / "cut"))
    issued = set(pd.read_parquet(tmp_path / "cut" / "requests.parquet")["id"])
    sub = tmp_path / "sub.jsonl"
    sub.write_text("".join(line for line in CHAT.read_text().splitlines(keepends=True)
                           if json.loads(line)["id"] in issued))
    whole = replay(str(sub), ReplayConfig(**cfg), str(tmp_path / "whole"))
    assert len(issued) == 70 and cut["ideal_hit_rate"] == pytest.approx(whole["ideal_hit_rate"], rel=1e-12)
    assert cut["ideal_hit_rate"] != replay(str(CHAT), ReplayConfig(**cfg), str(tmp_path / "all"))["ideal_hit_rate"]


def test_belady_with_a_limit_the_run_decides_is_refused(tmp_path, capsys):
    from kvbench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["replay", str(CHAT), "--cache-policy", "belady", "--dependent-turns", "--max-seconds", "20",
              "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-seconds" in err and len(err.strip().splitlines()) == 1
    # otherwise the requests issued are the first ones: belady runs, in a pool tight enough to evict
    main(["replay", str(CHAT), "--cache-policy", "belady", "--max-requests", "40", "--max-concurrency", "8",
          "--num-blocks", "400", "--out", str(tmp_path / "ok"), "--json"])
    lim = replay(str(CHAT), ReplayConfig(cache_policy="belady", limit=40, max_concurrency=8, num_blocks=400),
                 str(tmp_path / "lim"))
    assert json.loads(capsys.readouterr().out)["prefix_hit_rate"] == lim["prefix_hit_rate"]


def test_a_dependent_turn_due_before_the_time_limit_still_goes_after_its_answer():
    """Past --max-seconds for the next plain request, a turn due earlier that waits on an answer in
    flight is issued once the answer is in; only then does issuing stop for good."""
    issuer = Issuer.of_times([0.0, 1.0, 10.0], {1: 0}, max_seconds=5.0)
    assert issuer.issue() == (0, 0.0)
    assert issuer.next_time() is None and not issuer.done()  # the answer is still in flight
    issuer.finished(0, 0.5)
    assert issuer.issue() == (1, 1.0)
    assert issuer.next_time() is None and issuer.done()  # nothing in flight releases anything now


def test_a_limited_run_cut_short_counts_the_requests_it_issued(tmp_path):
    from kvbench.engine.replay import Replay

    rp = Replay(str(CHAT), ReplayConfig(max_requests=200, time_scale=0.2), str(tmp_path / "cut"))

    steps = []

    def stop(replica, start, end, batch, emitted):  # Ctrl-C at the 40th step
        steps.append(end)
        if len(steps) == 40:
            raise KeyboardInterrupt
    rp.step_hook = stop
    with pytest.raises(KeyboardInterrupt):
        rp.run()
    s = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert not s["complete"] and 0 < s["requests"] < 200
    assert s["not_issued"] == 250 - s["requests"] and s["completed"] <= s["requests"]


def test_requests_a_limit_never_issues_are_not_checked_against_the_pool(tmp_path):
    """The pool bound, the slab size and the up-front fit check cover the requests the limits may
    issue: 300 blocks hold chat's first 30 requests, not a later one."""
    from kvbench.errors import InputError, RunError

    with pytest.raises((InputError, RunError)):
        replay(str(CHAT), ReplayConfig(num_blocks=300), str(tmp_path / "all"))
    s = replay(str(CHAT), ReplayConfig(num_blocks=300, max_requests=30), str(tmp_path / "cut"))
    assert s["complete"] and s["requests"] == s["completed"] == 30


def test_stages_are_closed_loops_one_after_another():
    """Stages (calibrate --endpoint's profile): stage k's requests go only once every request of stage
    k-1 has finished, at most its concurrency at once, each at its trace time or a free slot
    (mutation: the wait for the stage before dropped -> a stage-2 request goes at 0 -> fails)."""
    times = [0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    iss = Issuer.of_times(times, {}, stages=[(3, 1), (4, 2)])
    events = []  # (position, issue time)
    clock, running = 0.0, []
    while not iss.done():
        at = iss.next_time()
        if at is not None and (not running or at <= min(running)[0]):
            pos, t = iss.issue()
            events.append((pos, t))
            running.append((t + 1.0, pos))  # every request takes 1 s
            continue
        running.sort()
        end, pos = running.pop(0)
        iss.finished(pos, end)
    assert [t for _, t in events[:3]] == [0.0, 1.0, 2.0]  # stage 1: one at a time
    # stage 2 waits for stage 1's last finish (3.0), then two at once
    assert [t for _, t in events[3:]] == [3.0, 3.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="stages hold 3"):
        Issuer.of_times(times, {}, stages=[(3, 1)])
    with pytest.raises(ValueError, match="at least 1"):
        Issuer.of_times(times, {}, stages=[(3, 1), (0, 2), (4, 2)])
    with pytest.raises(ValueError, match="at least 1"):
        Issuer.of_times(times, {}, stages=[(3, 0), (4, 2)])
    with pytest.raises(ValueError, match="dependent turns"):  # a dependent of the next stage would jump the line
        Issuer.of_times(times, {3: 0}, stages=[(3, 1), (4, 2)])
