"""``kvbench report``: runs group into comparable sections, each chart is drawn only where it says
something, legends are short words off the data, the ceiling is each group's own, the page references
nothing outside itself, its headline table fits a 1400-px window in Chromium, and building it raises no
warning. A scaled-down copy of reports/make_example.sh runs by default; the real script under -m slow."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from kvbench.cli import main
from kvbench.cli.replay import REPLAY_OPTIONS
from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import replay
from kvbench.report import charts, cluster_charts, html
from kvbench.report.data import group, load_inputs
from kvbench.report.html import build_report
from kvbench.report.words import MAX_LABEL
from kvbench.sweep import (
    Config,
    add_comparisons,
    default_sweep_dir,
    parse_grid,
    run_sweep,
)

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
SIM = dict(executor="sim", model="llama-3-8b", max_model_len=8192)
RAW_KEYS = re.compile(r"\bpc_(on|off)\b|memdefault|\bm_|\bts\d|\blim\d|limdefault|nbdefault|mmldefault")


def _sweep(root: Path, name: str, trace: str, **grid) -> None:
    grid, _ = add_comparisons(parse_grid({k: str(v) for k, v in grid.items()}, REPLAY_OPTIONS))  # as the CLI does
    run_sweep(str(REPO / "traces" / trace), grid, str(root / name))


def _as_model_run(src: Path, dst: Path, eviction: str, mass: float | None) -> None:
    """A model-executor run (tiny model, CPU, 8 requests) written from a sim run's files, as the
    engine writes one: the report reads it from config.json and summary.json."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["settings"].update(executor="model", model="tiny", limit=8, kv_mem=None, eviction=eviction)
    config["trace"]["requests"] = 8
    config["environment"]["device_name"] = "cpu"
    (dst / "config.json").write_text(json.dumps(config))
    summary = json.loads((dst / "summary.json").read_text())
    summary.update(attention_mass_kept=mass, kv_capacity_tokens=524288,
                   evicted_tokens=0 if eviction == "none" else 7000, recalled_tokens=57 * (eviction == "infinigen"))
    (dst / "summary.json").write_text(json.dumps(summary))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The example's shape, small: a chat sweep (paged/slab x block size x prefix cache), an agent
    sweep over cache policies, an agent eviction sweep that shares one configuration with it, three
    model-executor eviction runs, chat runs that differ from the sweep in one comparable key each
    (requests, KV pool, time scale, GPU, model, executor), a what-if table."""
    root = tmp_path_factory.mktemp("report-data")
    _sweep(root, "chat", "chat.jsonl", layout="paged,slab", block_size="16,64", **SIM, kv_mem="4GiB",
           time_scale=0.1, limit=40)
    agent = dict(SIM, max_model_len=16384, kv_mem="3GiB", limit=15)
    _sweep(root, "agent", "agent.jsonl", layout="paged,slab", block_size="16,64", cache_policy="lru,belady", **agent)
    _sweep(root, "agent-eviction", "agent.jsonl", eviction="none,h2o", kv_budget=0.2, **agent)
    model = root / "agent-eviction-model"
    model.mkdir()
    for name, mass in (("none", None), ("h2o", 0.946), ("infinigen", 0.986)):
        _as_model_run(root / "agent-eviction" / ("paged-h2o" if name != "none" else "paged-none"),
                      model / f"paged-{name}", name, mass)
    # the chat sweep's paged bs16 again, each time with one thing that forbids comparing it with the sweep
    for name, change in (("chat-first-20", dict(limit=20)), ("chat-8GiB", dict(kv_mem="8GiB")),
                         ("chat-ts0.2", dict(time_scale=0.2)), ("chat-h100", dict(gpu="h100")),
                         ("chat-qwen", dict(model="qwen2.5-7b"))):
        replay(str(REPO / "traces/chat.jsonl"), ReplayConfig(**{**SIM, "kv_mem": "4GiB", "time_scale": 0.1,
                                                                "limit": 40, **change}), str(root / name))
    # and on the other executor, everything else equal (the device named as the sim's GPU)
    shutil.copytree(root / "chat" / "paged-bs16-pc_on", root / "chat-model-executor")
    config = json.loads((root / "chat-model-executor" / "config.json").read_text())
    config["settings"]["executor"] = "model"
    config["environment"]["device_name"] = "h200"
    (root / "chat-model-executor" / "config.json").write_text(json.dumps(config))
    wi = root / "whatif"
    wi.mkdir()
    budgets = 2.0 ** np.arange(26, 34)
    pd.DataFrame([{"budget_bytes": b, "budget_blocks": int(b // 2**21), "policy": p,
                   "hit_rate": min(0.9, 0.1 * k * (1.0 if p == "belady" else 0.8)), "ceiling": 0.93}
                  for p in ("lru", "fifo", "belady") for k, b in enumerate(budgets)]
                 ).to_parquet(wi / "whatif.parquet")
    return root


@pytest.fixture(scope="module")
def example(data, tmp_path_factory):
    """The report of everything in ``data``, built with every warning an error."""
    out = tmp_path_factory.mktemp("report") / "example"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = build_report([str(data)], str(out))
    inputs = _inputs([str(data)])
    return SimpleNamespace(out=out, rep=rep, page=(out / "index.html").read_text(), inputs=inputs,
                           figures=list(_figures(inputs)))


def _inputs(paths):
    inputs = load_inputs(paths)
    charts.assign_styles(inputs.sections)
    return inputs


# -- the invariants, shared with the slow test over the real example ----------------------------
def _group_key(run_dir: Path) -> tuple:
    """What must be equal for two runs to be compared, read straight from config.json."""
    c = json.loads((run_dir / "config.json").read_text())
    s = c["settings"]
    hardware = s.get("gpu") if s.get("executor") == "sim" else c["environment"].get("device_name")
    return (c["trace"]["sha256"], c["trace"]["requests"], s["model"], s["executor"], hardware,
            s["time_scale"], s.get("kv_mem"), s.get("num_blocks"))


def _figures(inputs):
    """(section, chart name, figure) for every chart a section draws."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with matplotlib.rc_context(charts.RC):
        for section in inputs.sections:
            for stem, _, chart in html.SECTION_CHARTS:
                fig = chart(section)
                if fig is not None:
                    FigureCanvasAgg(fig).draw()  # lays out: every bounding box below is final
                    yield section, stem, fig


def _overlap(a, b) -> bool:
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 0.5 and min(a.y1, b.y1) - max(a.y0, b.y0) > 0.5


def check_report(page: str, inputs, figures, run_dirs: list[Path]) -> None:
    # one section per comparable group, each group's runs agreeing on every key
    keys = {_group_key(d) for d in run_dirs}
    sections = [m for m in re.findall(r"<h2 id='([^']+)'", page)]
    assert len(sections) == len(inputs.sections) == len(keys), (sections, len(keys))
    for section in inputs.sections:
        assert len({_group_key(Path(r.dir)) for r in section.runs}) == 1, section.title
        # the ceiling is the group's own: the best ideal of its runs (summary.json), beaten by none of them
        summaries = [json.loads((Path(r.dir) / "summary.json").read_text()) for r in section.runs]
        ideals = [s["ideal_hit_rate"] for s in summaries if s.get("ideal_hit_rate") is not None]
        assert section.ceiling == (max(ideals) if ideals else None), section.title
        hits = [s["prefix_hit_rate"] for s, r in zip(summaries, section.runs) if r.setting("prefix_cache")]
        if hits and section.ceiling is not None:
            assert section.ceiling >= max(hits) - 1e-12, (section.title, section.ceiling, max(hits))
        for r in section.runs:
            assert len(r.label) <= MAX_LABEL and not RAW_KEYS.search(r.label), r.label
    for section, stem, fig in figures:
        renderer = fig.canvas.get_renderer()
        visible = [ax for ax in fig.axes if ax.get_visible()]
        legends = list(fig.legends) + [ax.get_legend() for ax in visible if ax.get_legend() is not None]
        for leg in legends:
            for text in leg.get_texts():
                assert len(text.get_text()) <= MAX_LABEL, (stem, text.get_text())
            box = leg.get_window_extent(renderer)
            for ax in visible:
                assert not _overlap(box, ax.get_window_extent(renderer)), (section.slug, stem, "legend on an axes")
        for ax in visible:
            for tick in ax.get_yticklabels():
                assert len(tick.get_text()) <= MAX_LABEL, (stem, tick.get_text())
            for line in ax.get_lines():
                if line.get_linestyle() in ("None", "", " ") or line.get_transform() != ax.transData:
                    continue  # markers only, or a reference line across the axes
                xs = np.asarray(line.get_xdata(), float)
                assert len(np.unique(xs[np.isfinite(xs)])) >= 2, (section.slug, stem, line.get_label(),
                                                                   "a single x value drawn as a line")
            if stem == "overview":
                for line in ax.get_lines():
                    if line.get_gid() == "ceiling":
                        assert line.get_xdata()[0] == pytest.approx(100 * section.ceiling)


def _run_dirs(root: Path) -> list[Path]:
    return sorted({p.parent for p in root.rglob("summary.json")})


def test_example_report_invariants(example, data):
    # the agent-eviction sweep's 'none' run is the agent sweep's bs16 lru configuration: merged
    run_dirs = [d for d in _run_dirs(data) if not (d.name == "paged-none" and d.parent.name == "agent-eviction")]
    check_report(example.page, example.inputs, example.figures, run_dirs)
    assert "agent-eviction/paged-none has the same settings" in example.page.replace(str(data) + "/", "")


# -- grouping, labels, ratios -------------------------------------------------------------------
CHAT40 = ("chat.jsonl · llama-3-8b, sim cost model of H200 · 4GiB KV pool · 40 requests · arrival times x0.1",)
CHAT20 = ("chat.jsonl", 20)


def _section(inputs, title_part: str, requests: int | None = None):
    found = [s for s in inputs.sections if title_part in s.title
             and (requests is None or f"· {requests} requests" in s.title)]
    assert len(found) == 1, [s.title for s in inputs.sections]
    return found[0]


def test_runs_that_are_not_comparable_are_apart(example):
    chat40 = _section(example.inputs, *CHAT40)
    chat20 = _section(example.inputs, *CHAT20)
    model = _section(example.inputs, "tiny, model executor")
    assert len(chat40.runs) == 5 and len(chat20.runs) == 1 and len(model.runs) == 3
    # labels in words, only the settings that vary in the group
    assert [r.label for r in chat40.runs] == ["slab", "paged bs16", "paged bs16 +prefix", "paged bs64",
                                               "paged bs64 +prefix"]
    assert [r.label for r in model.runs] == ["no eviction", "h2o", "infinigen"]
    assert chat20.runs[0].label == "paged bs16 +prefix"  # alone: described, not blank
    # ratios to slab only where the group has one
    text = {s.slug: example.page.split(f"<h2 id='{s.slug}'>")[1].split("<h2")[0] for s in example.inputs.sections}
    assert "× slab" in text[chat40.slug] and "1.00× slab" not in text[chat40.slug]
    assert "× slab" not in text[chat20.slug] and "× slab" not in text[model.slug]


def test_a_setting_the_report_does_not_know_varies_inside_a_group(example):
    """A setting added to ReplayConfig after this report was written (tp_new) splits nothing and is
    named; one an older run lacks (watermark) reads as its default."""
    from kvbench.report.data import Run

    r0, r1 = [r for r in _section(example.inputs, *CHAT40).runs if not r.is_baseline][:2]
    a = Run(r0.dir, "a", {**r0.config, "settings": {**r0.settings, "tp_new": 1}}, r0.summary)
    b = Run(r0.dir, "b", {**r0.config, "settings": {**r0.settings, "tp_new": 2}}, r0.summary)
    old = Run(r1.dir, "old", {**r1.config, "settings": {k: v for k, v in r1.settings.items() if k != "watermark"}},
              r1.summary)
    (section,) = group([a, b, old])
    assert "tp_new" in section.varying and "watermark" not in section.varying
    assert "tp new 1" in a.label and "tp new 2" in b.label


def test_styles_are_one_per_configuration(example):
    for section in example.inputs.sections:
        styles = [(r.color, r.marker) for r in section.runs]
        assert len(set(styles)) == len(styles), section.title
        assert all((r.color == "black") == r.is_baseline for r in section.runs)
    # a label seen in two groups keeps its colour
    by_label: dict[str, set] = {}
    for section in example.inputs.sections:
        for r in section.runs:
            by_label.setdefault(r.label, set()).add(r.color)
    assert by_label["paged bs16 +prefix"] and len(by_label["paged bs16 +prefix"]) == 1


# -- which charts ------------------------------------------------------------------------------
def test_charts_follow_what_varies(example):
    pngs = {p.name for p in example.out.glob("*.png")}
    slug = {name: _section(example.inputs, *args).slug for name, args in
            (("chat40", CHAT40), ("chat20", CHAT20), ("model", ("tiny, model executor",)),
             ("agent", ("agent.jsonl · llama",)))}
    assert f"{slug['chat40']}-block_size.png" in pngs and f"{slug['agent']}-block_size.png" in pngs
    assert f"{slug['chat20']}-block_size.png" not in pngs and f"{slug['model']}-block_size.png" not in pngs
    assert f"{slug['chat40']}-eviction.png" not in pngs and f"{slug['model']}-eviction.png" in pngs
    assert all(f"{s}-overview.png" in pngs for s in slug.values())
    assert not [p for p in pngs if p.endswith("-disagg.png")]  # no run disaggregated prefill and decode
    figs = {(s.slug, stem): fig for s, stem, fig in example.figures}
    # the sim eviction group has no attention-mass panel (nothing measured); the model group has one
    assert len(figs[(slug["agent"], "eviction")].axes) == 1
    assert len(figs[(slug["model"], "eviction")].axes) == 2
    # concurrency: one axes for 3 runs, one panel per run for more
    assert len([a for a in figs[(slug["model"], "concurrency")].axes if a.get_visible()]) == 1
    agent_runs = len(_section(example.inputs, "agent.jsonl · llama").runs)
    assert len([a for a in figs[(slug["agent"], "concurrency")].axes if a.get_visible()]) == agent_runs
    # the memory timeline of runs that used a sliver of a huge pool is scaled to what they used
    model = _section(example.inputs, "tiny, model executor")
    ax = figs[(slug["model"], "timeline")].axes[0]
    used = max(r.summary["peak_slots_allocated"] for r in model.runs)
    assert ax.get_ylim()[1] < 0.5 * 524288 and ax.get_ylim()[1] >= used


PD = dict(SIM, limit=20, time_scale=0.05, slo="ttft=100")  # an SLO some requests miss


def test_goodput_per_gpu_of_each_pd_layout_beside_mixed_replicas(tmp_path):
    """A --disagg sweep (mixed, 1:1, 3:1) and mixed runs of 2 and 4 replicas: the P:D chart has one
    bar per layout, grouped by GPUs, each the goodput per GPU its summary.json gives (P:D: the
    engine's own figure; mixed: goodput / (replicas x tp)). Mutation: goodput not divided by the
    GPUs, or every request counted instead of those meeting the SLO -> fails."""
    from kvbench.engine.runs import replay as replay_any

    _sweep(tmp_path, "pd", "chat.jsonl", disagg="none,1:1,3:1", **PD)
    for n in (2, 4):
        replay_any(str(REPO / "traces" / "chat.jsonl"), ReplayConfig(**PD, replicas=n), str(tmp_path / f"mixed-{n}"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = build_report([str(tmp_path)], str(tmp_path / "rep"))
    inputs = _inputs([str(tmp_path)])
    (section,) = inputs.sections
    assert f"{section.slug}-disagg.png" in rep.charts
    assert f"alt='{section.slug}-disagg.png'" in (tmp_path / "rep" / "index.html").read_text()

    expected = {}
    for d in _run_dirs(tmp_path):
        s = json.loads((d / "summary.json").read_text())
        if s.get("disagg"):
            p, dec = s["disagg"]["prefill_instances"], s["disagg"]["decode_instances"]
            name, gpus, per_gpu = f"P:D {p}:{dec}", p + dec, s["disagg"]["goodput_req_per_s_per_gpu"]
        else:
            c = json.loads((d / "config.json").read_text())["settings"]
            gpus = c["replicas"] * c["tp"]
            name, per_gpu = f"{c['replicas']} mixed replica{'s' * (gpus > 1)}", s["goodput_req_per_s"] / gpus
        expected[f"{name} · {gpus} GPU{'s' * (gpus > 1)}"] = (gpus, per_gpu)
    assert any(json.loads((d / "summary.json").read_text())["slo_attainment"] < 1 for d in _run_dirs(tmp_path))

    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with matplotlib.rc_context(charts.RC):
        fig = cluster_charts.layouts(section)
        FigureCanvasAgg(fig).draw()
    assert assert_levels_from_zero(fig, "disagg") == 3
    good = fig.axes[0]
    rows = dict(zip(np.round(good.get_yticks(), 6), (t.get_text() for t in good.get_yticklabels())))
    plotted = {rows[round(b.get_y() + b.get_height() / 2, 6)]: b.get_width() for b in good.patches}
    assert plotted.keys() == expected.keys() and all(len(name) <= MAX_LABEL for name in plotted)
    for name, (_, per_gpu) in expected.items():
        assert plotted[name] == pytest.approx(per_gpu, rel=1e-9), name
    # top to bottom by GPUs used, mixed first in each; a wider gap between GPU counts than inside one
    top_down = sorted(rows, reverse=True)
    assert [rows[y] for y in top_down] == sorted(expected, key=lambda n: (expected[n][0], "P:D" in n))
    gaps = {(expected[rows[a]][0] != expected[rows[b]][0], round(a - b, 6)) for a, b in zip(top_down, top_down[1:])}
    assert gaps == {(False, 1.0), (True, 1.6)}
    # TTFT and TPOT panels: each layout's p99 drawn (open marker), the SLO's threshold dotted
    for ax, key in ((fig.axes[1], "ttft_ms_p99"), (fig.axes[2], "tpot_ms_p99")):
        p99 = sorted(x for line in ax.get_lines() if line.get_markerfacecolor() == "white" for x in line.get_xdata())
        assert p99 == pytest.approx(sorted(r.summary[key] for r in section.runs))
    assert [line.get_xdata()[0] for line in fig.axes[1].get_lines() if line.get_label() == "--slo objective"] == [100]
    # the routing chart compares mixed replicas only: a P:D run's instances are not replicas behind a router
    with matplotlib.rc_context(charts.RC):
        fig = cluster_charts.routing(section)
        FigureCanvasAgg(fig).draw()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) == 3 and not any("P:D" in t for t in labels), labels


def test_report_of_a_single_run_via_cli(data, tmp_path, capsys):
    out = tmp_path / "one"
    main(["report", str(data / "chat-first-20"), "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out / "index.html")
    assert {p.name for p in out.glob("*.png")} == {f"chat-{s}.png" for s in ("overview", "latency", "timeline",
                                                                             "concurrency")}
    page = (out / "index.html").read_text()
    assert "chat-first-20" in page and "× slab" not in page


def test_report_without_dirs_reads_runs(data, tmp_path, monkeypatch, capsys):
    (tmp_path / "runs" / "nested").mkdir(parents=True)
    shutil.copytree(data / "chat", tmp_path / "runs" / "nested" / "chat-sweep-0")  # two levels down
    monkeypatch.chdir(tmp_path)
    main(["report"])
    assert capsys.readouterr().out.strip() == os.path.join("reports", "runs", "index.html")
    assert (tmp_path / "reports" / "runs" / "chat-overview.png").exists()
    assert default_sweep_dir("traces/chat.jsonl", {"layout": ["paged", "slab"]}).startswith(
        os.path.join("runs", "chat-sweep-"))


def test_a_run_where_nothing_ran_gets_no_empty_charts(tmp_path):
    """Every request rejected (longer than --max-model-len): no steps, no latencies; the report says
    so in its headline and draws no empty time series, without a warning."""
    trace = tmp_path / "long.jsonl"
    trace.write_text('{"t": 0, "prompt": [{"unique": 100}], "output_len": 4}\n')
    replay(str(trace), ReplayConfig(**{**SIM, "max_model_len": 50}), str(tmp_path / "run"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = build_report([str(tmp_path / "run")], str(tmp_path / "rep"))
    assert rep.charts == ["long-overview.png"]


def test_bad_report_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "empty" in err[0]
    monkeypatch.chdir(tmp_path)  # no runs/ here
    with pytest.raises(SystemExit) as e:
        main(["report"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "runs" in err[0]


# -- the sweep's table -------------------------------------------------------------------------
def _table(capsys, grid: dict, rows: list[tuple[dict, dict]]) -> str:
    from kvbench.cli.sweep import _print_table

    configs = [Config(f"c{i}", ReplayConfig(**s)) for i, (s, _) in enumerate(rows)]
    state = SimpleNamespace(configs=configs, summaries={c.name: m for c, (_, m) in zip(configs, rows)},
                            status={c.name: "done" for c in configs})
    _print_table(state, "runs/x-sweep-1", grid)
    return capsys.readouterr().out


def test_sweep_table_eviction_columns_and_identical_rows(capsys):
    base = {"output_tok_per_s": 100.0, "ttft_ms_p50": 5.0, "e2e_ms_p50": 50.0, "prefix_hit_rate": 0.5,
            "internal_frag": 0.01, "kv_util": 0.2, "mean_running": 3.0, "preemptions": 0,
            "evicted_tokens": 0, "recalled_tokens": 0, "attention_mass_kept": None, "cache_evictions": 0}
    out = _table(capsys, {"cache_policy": ["lru", "fifo"]},
                 [({"cache_policy": "lru"}, dict(base)), ({"cache_policy": "fifo"}, dict(base))])
    assert "Every row is the same although cache policy varied" in out and "cache_evictions = 0" in out
    assert "evicted" not in out and "kvbench report runs/x-sweep-1" in out
    out = _table(capsys, {"eviction": ["none", "h2o"]},
                 [({"eviction": "none"}, dict(base)),
                  ({"eviction": "h2o"}, {**base, "evicted_tokens": 1234, "attention_mass_kept": 0.95})])
    assert "evicted" in out and "1,234" in out and "0.950" in out and "Every row" not in out


def test_headline_says_why_identical_rows_are_identical(example):
    """Two cache policies that never had to choose give the same figures: the table says why."""
    from kvbench.report.data import Run
    from kvbench.report.html import _headline

    r = _section(example.inputs, *CHAT20).runs[0]
    runs = [Run(r.dir, p, {**r.config, "settings": {**r.settings, "cache_policy": p}}, {**r.summary, "cache_evictions": 0})
            for p in ("lru", "fifo")]
    (section,) = group(runs)
    table = _headline(section)
    assert "Every row is the same although cache policy varied" in table and "cache_evictions = 0" in table
    runs[1].summary["output_tok_per_s"] *= 2
    assert "Every row" not in _headline(group(runs)[0])


# -- the page ----------------------------------------------------------------------------------
EXTERNAL = [
    re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I),  # remote or protocol-relative
    re.compile(r"<script\b[^>]*\bsrc\s*=", re.I),
    re.compile(r"<link\b[^>]*\brel\s*=\s*[\"']?stylesheet", re.I),
    re.compile(r"@import", re.I),
    re.compile(r"url\(\s*[\"']?\s*(?:https?:)?//", re.I),
    re.compile(r"<(?:iframe|object|embed)\b", re.I),
]


def test_page_references_nothing_outside_itself(example):
    for pattern in EXTERNAL:
        assert not pattern.search(example.page), pattern.pattern
    srcs = re.findall(r"""\bsrc\s*=\s*["']([^"']*)""", example.page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert len(srcs) == len(example.rep.charts)


def _near(img: np.ndarray, hex_color: str, tol: float = 0.08) -> int:
    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img[..., :3] - rgb).max(axis=-1) < tol).sum())


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, timeout=120, check=True, text=True)


# Appended to a copy of the page (the report itself has no script): every headline table must fit its
# box at the window's width, with nothing to scroll sideways.
FIT_PROBE = ("<script>document.title = Array.from(document.querySelectorAll('table.headline')).map("
             "t => t.parentElement.scrollWidth <= t.parentElement.clientWidth + 1 ? 'fits' : 'overflows').join(',')"
             "</script>")


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing: apt-get install chromium")
def test_chromium_renders_the_charts_and_the_headline_fits_1400px(example, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", (example.out / "index.html").as_uri())
    img = imread(shot)  # float RGB(A) in [0, 1]
    assert img.shape[:2] == (3000, 1400)
    white = (img[..., :3].min(axis=-1) > 0.97).mean()
    assert white < 0.9, f"page is {white:.0%} white"
    # the charts' own colours (matplotlib's blue and orange): drawn only by decoded images
    assert _near(img, "#1f77b4") > 500 and _near(img, "#ff7f0e") > 300
    probe = tmp_path / "probe.html"
    probe.write_text(example.page.replace("</body>", FIT_PROBE + "</body>"))
    dom = _chromium(tmp_path, "--window-size=1400,1000", "--dump-dom", probe.as_uri()).stdout
    verdicts = re.search(r"<title>([^<]*)</title>", dom).group(1).split(",")
    assert len(verdicts) == len(example.inputs.sections) and set(verdicts) == {"fits"}, verdicts


# -- the real example (minutes) ----------------------------------------------------------------
@pytest.mark.slow
def test_make_example_report(tmp_path):
    """reports/make_example.sh as shipped, into a temporary directory; its report rebuilt with every
    warning an error and held to the same invariants."""
    env = {**os.environ, "KVBENCH_EXAMPLE_RUNS": str(tmp_path / "runs"), "KVBENCH_EXAMPLE_OUT": str(tmp_path / "r")}
    subprocess.run(["bash", str(REPO / "reports" / "make_example.sh")], env=env, check=True, capture_output=True,
                   timeout=1800)
    runs = tmp_path / "runs"
    paths = [str(p) for p in sorted(runs.iterdir())]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_report(paths, str(tmp_path / "again"))
    inputs = _inputs(paths)
    kept = {r.dir for s in inputs.sections for r in s.runs}
    check_report((tmp_path / "again" / "index.html").read_text(), inputs, list(_figures(inputs)),
                 [d for d in _run_dirs(runs) if str(d) in kept])


# -- ratios, winners, axes: what a reader takes from the page -----------------------------------
def test_every_figure_the_slab_has_gets_its_ratio_and_colour(example):
    """A worse TPOT than the slab's is a red ratio, as a better throughput is a green one (the TPOT
    ratio was once missing); within 5% no colour. Mutation: ratio off for TPOT -> fails."""
    from kvbench.report.html import HEADLINE, _headline

    section = _section(example.inputs, *CHAT40)
    table = _headline(section)
    base = next(r for r in section.runs if r.is_baseline)
    seen = set()
    for r in section.runs:
        if r.is_baseline:
            continue
        row = next(tr for tr in table.split("<tr")[2:] if f">{r.label}<" in tr)
        cells = re.findall(r"<td>(.*?)</td>", row)
        for (key, _, _, up, ratio), cell in zip(HEADLINE, cells):
            if key == "prefix_hit_rate":
                assert "× slab" not in cell  # the slab has no prefix cache: no ratio
                continue
            a, b = r.metric(key), base.metric(key)
            if a is None or not b:
                continue
            x = a / b
            cls = "" if abs(x - 1) <= 0.05 else (" up" if (x > 1) == up else " down")
            assert f"<span class='x{cls}'>" in cell, (r.label, key, cell)
            seen.add((key, cls))
    assert ("tpot_ms_p50", " down") in seen  # paged holds more sequences at once: each decodes slower


RATIO = re.compile(r"^(0|\d{1,3}(,\d{3})*(\.\d+)?)× slab$")


def test_a_ratio_is_written_one_way(example):
    """Every ratio to the slab reads as the figure over the slab's, 'N× slab', never '23× lower than
    slab' beside '0.17× slab' (mutation: 'lower than' below 0.1 again -> fails)."""
    from kvbench.report.html import _times

    assert _times(2.941) == "2.94× slab" and _times(0.53) == "0.53× slab" and _times(0.17) == "0.17× slab"
    assert _times(0.044) == "0.044× slab" and _times(0.00033) == "0.00033× slab"
    assert _times(250.0) == "250× slab" and _times(12345.0) == "12,000× slab"
    assert _times(0.0) == "0× slab" and _times(None) == "–"
    for x in np.geomspace(1e-5, 1e5, 61):
        assert RATIO.match(_times(float(x))), _times(float(x))
    # and on the page: every ratio cell, and every other '×' a number or the column's own name
    cells = re.findall(r"<span class='x[^']*'>([^<]*)</span>", example.page)
    assert cells and all(RATIO.match(c) for c in cells), [c for c in cells if not RATIO.match(c)][:3]
    text = re.sub(r"<[^>]+>", " ", example.page)
    assert not re.search(r"lower than|higher than|times (lower|higher|fewer|more)", text)
    for m in re.finditer(r"(\S*)×", text):
        assert m.group(1).lstrip("(") == "" or re.fullmatch(r"\d[\d,]*(\.\d+)?", m.group(1).lstrip("(")), text[m.start() - 40:m.end() + 20]


def test_configurations_that_cannot_differ_name_no_winner(tmp_path):
    """Paged against slab on a pool the trace never fills: every throughput and latency is the same,
    so the report says why instead of naming a 'highest throughput' (mutation: always name one)."""
    grid = parse_grid({"layout": "paged,slab", "block_size": "16,64", "prefix_cache": "off", "limit": "15"},
                      REPLAY_OPTIONS)
    run_sweep(str(REPO / "traces" / "chat.jsonl"), grid, str(tmp_path / "sw"))
    build_report([str(tmp_path / "sw")], str(tmp_path / "rep"))
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "Highest throughput" not in page
    assert ("No configuration is faster: throughput, latency and concurrency agree exactly because the KV pool "
            "never filled") in page
    # and where memory binds, the winner is named
    assert "Highest throughput" in build_report_page(tmp_path, kv_mem="4GiB", time_scale="0.1")


def build_report_page(tmp_path: Path, **grid) -> str:
    g = parse_grid({"layout": "paged,slab", "prefix_cache": "off", "limit": "40", "max_model_len": "8192",
                    **grid}, REPLAY_OPTIONS)
    run_sweep(str(REPO / "traces" / "chat.jsonl"), g, str(tmp_path / "sw2"))
    build_report([str(tmp_path / "sw2")], str(tmp_path / "rep2"))
    return (tmp_path / "rep2" / "index.html").read_text()


def test_settings_read_as_words_and_the_figures_are_defined_on_the_page(example):
    shared = re.findall(r"Shared by every run: ([^<]*)<", example.page)
    assert shared and not any("None" in s or "=" in s for s in shared), shared[:1]
    assert "<a href='#metrics'>What each figure means</a>" in example.page
    glossary = example.page.split("<h2 id=metrics>", 1)[1]
    for name in ("TTFT", "TPOT", "internal frag.", "KV util", "× slab"):
        assert f">{name}<" in glossary


# independent axes, not levels: engine time, and a signed error whose zero is drawn inside the range
TIME_AXES = ("engine time (s)", "seconds from the first request")


def assert_levels_from_zero(fig, name: str) -> int:
    """Every linear axis of ``fig`` on which levels are compared starts at zero: a value axis (not
    categories: ticks named by run, policy or figure; not time), whose data are not signed. A log
    axis is exempt (it compares ratios, and says 'log scale'). -> how many axes were checked."""
    from matplotlib.ticker import FixedLocator

    def categories(axis) -> bool:  # ticks placed by hand and named in words: runs, policies, figures
        names = axis.get_major_formatter().format_ticks(axis.get_majorticklocs())
        return isinstance(axis.get_major_locator(), FixedLocator) and not all(
            re.fullmatch(r"[-\d.,]+", n.replace("\u2212", "-")) for n in names)

    checked = 0
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for which, axis, scale, lim, shared in (("x", ax.xaxis, ax.get_xscale(), ax.get_xlim(), ax.get_shared_x_axes()),
                                                ("y", ax.yaxis, ax.get_yscale(), ax.get_ylim(), ax.get_shared_y_axes())):
            # a small panel's label may be left to its column's lowest panel: any sharing axes' counts
            labels = {(a.get_xlabel() if which == "x" else a.get_ylabel()) for a in shared.get_siblings(ax)}
            label = "/".join(sorted(labels))
            if scale != "linear" or categories(axis) or labels & set(TIME_AXES):
                continue
            data = ax.dataLim.intervalx if which == "x" else ax.dataLim.intervaly
            if np.isfinite(data).all() and data[0] < 0:  # signed: zero inside the range
                assert lim[0] < 0 < lim[1], (name, ax.get_title(), which, lim)
                continue
            assert lim[0] == 0, (name, ax.get_title(), which, label, lim)
            checked += 1
    return checked


def test_every_axis_that_compares_levels_starts_at_zero(example, tmp_path):
    """TPOT p50 6.4 against 10.9 ms drawn from 6 ms looks like a chasm: every chart of the report
    (sections, what-ifs, prediction) starts its compared axes at zero. Mutation: the latency axes'
    zero dropped (charts._log_if_wide) -> fails on the TPOT panel."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvbench.report import prediction, whatif_charts

    checked = sum(assert_levels_from_zero(fig, f"{section.slug}-{stem}") for section, stem, fig in example.figures)
    stems = {stem for _, stem, _ in example.figures}
    assert {"overview", "block_size", "latency", "concurrency", "timeline", "eviction"} <= stems, stems
    # the what-if's charts, the tiered one from a table of the tiered what-if
    tiers = tmp_path / "tiers"
    main(["trace", "whatif", str(REPO / "traces" / "chat.jsonl"), "--tiers", "gpu=256MiB,1GiB,cpu=1GiB",
          "--policies", "lru,belady", "--out", str(tiers)])
    whatifs = example.inputs.whatifs + load_inputs([str(tiers)]).whatifs
    # a live run and the sim run that predicts it (tests/data/live: a real vLLM server's run)
    live = tmp_path / "live"
    shutil.copytree(REPO / "tests" / "data" / "live" / "run-chat60", live)
    replay(str(live / "trace.jsonl"), ReplayConfig(model="tiny", block_size=32, num_blocks=255, max_model_len=4096,
                                                   time_scale=0.1, max_concurrency=16, dependent_turns=True,
                                                   overlong="truncate"), str(tmp_path / "sim"))
    (pair,) = prediction.pair([r for s in _inputs([str(live), str(tmp_path / "sim")]).sections for r in s.runs])
    with matplotlib.rc_context(charts.RC):
        more = [(f"whatif-{w.label}", (whatif_charts.whatif_tiers if whatif_charts.tiered(w.table)
                                       else whatif_charts.whatif)(w)) for w in whatifs]
        more.append(("prediction", prediction.chart(pair)))
        for name, fig in more:
            assert fig is not None, name
            FigureCanvasAgg(fig).draw()
            checked += assert_levels_from_zero(fig, name)
    assert checked >= 40


def test_a_linear_latency_axis_has_plain_ticks_from_zero_when_values_agree():
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(charts.RC):
        fig = Figure()
        ax = fig.subplots()
        ax.plot([1_000_000.0, 1_000_000.4], [0, 1], "o")
        charts._log_if_wide(ax, seconds=True)
        ax.margins(x=0.15)
        FigureCanvasAgg(fig).draw()
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ax.xaxis.get_offset_text().get_text() == ""  # no '1e6' in the corner
    assert ax.get_xlim()[0] == 0 and len(labels) == len(set(labels)) >= 2
    assert all(label.endswith(" s") or label.endswith(" ms") for label in labels), labels
