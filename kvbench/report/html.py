"""The report: PNG charts and one self-contained ``index.html`` for runs, sweeps and what-if tables.

The page opens offline: images are base64 data URIs, the CSS is inline, there is no script, font or
stylesheet to fetch. Each comparable group of runs (report.data.COMPARABLE) gets a section that opens
with the headline table (every configuration by its label, ratios to the group's slab baseline), a
few findings, the charts chosen for the group (report.charts), and the settings and versions of the
runs (config.json).
"""
from __future__ import annotations

import base64
import html
import os
from decimal import Decimal
from dataclasses import dataclass, field

from kvbench import __version__
from kvbench.errors import InputError
from kvbench.report import prediction
from kvbench.report.charts import (assign_styles, block_size, concurrency, eviction, latency, memory_timeline,
                                   overview, render)
from kvbench.report.cluster_charts import layouts, routing, tiers
from kvbench.report.whatif_charts import tiered, whatif, whatif_tiers
from kvbench.report.data import BASELINE, COMPARABLE, Inputs, Run, Section, load_inputs
from kvbench.report.words import (
    METRIC_DEFINITIONS,
    performs_alike,
    rows_identical,
    setting_words,
    why_identical,
)


SECTION_CHARTS = [
    ("overview", ("The four questions in one picture: internal fragmentation, prefix hit rate against "
                  "the group's ceiling (the trace's ideal hit rate: infinite cache, no concurrency), "
                  "mean and peak concurrency, and TTFT/TPOT p50 and p99, one row per configuration."),
     overview),
    ("block_size", ("Internal fragmentation, KV utilisation and prefix hit rate against block size, "
                    "one line per configuration that ran at two block sizes or more; slab dashed."), block_size),
    ("concurrency", "Running sequences over engine time: what the memory layout buys.", concurrency),
    ("latency", "Latency per configuration: CDFs for a few runs, p50/p90/p99 for more.", latency),
    ("timeline", ("KV token slots over engine time: live tokens, empty slots in the blocks running "
                  "sequences hold (internal fragmentation), and cached prefix blocks kept for reuse."),
     memory_timeline),
    ("eviction", ("Token eviction: tokens evicted, recalled and offloaded, and the attention mass kept "
                  "where the model executor measured it."), eviction),
    ("routing", ("Several replicas: prefix hit rate, TTFT p50/p99 and load balance (the busiest replica's "
                 "busy time over the mean) by router and replica count, one replica as the reference."), routing),
    ("disagg", ("Disaggregated prefill and decode: goodput per GPU (requests meeting every --slo objective per "
                "second, over the GPUs the layout uses: prefill and decode instances, or replicas x tp) of each "
                "P:D layout beside the mixed-replica runs, grouped by GPU count; TTFT and TPOT p50 to p99 per "
                "layout, the --slo objectives dotted."), layouts),
    ("tiers", ("Prefix-cache tiers behind the GPU pool: the share of prompt tokens each tier served "
               "(stacked), TTFT p50/p99, and the KV bytes loaded from the tiers with the time it took."), tiers),
]


def _ms(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:,.0f}"


# (summary key, header, format, higher is better, ratio to the baseline shown) -- the headline table.
# Every figure the slab baseline also has gets its ratio (the slab has no prefix cache).
HEADLINE = [
    ("output_tok_per_s", "output tok/s", "{:,.0f}".format, True, True),
    ("mean_running", "mean running seqs", "{:.1f}".format, True, True),
    ("peak_running", "peak running seqs", "{:.0f}".format, True, True),
    ("ttft_ms_p50", "TTFT p50 (ms)", _ms, False, True),
    ("ttft_ms_p99", "TTFT p99 (ms)", _ms, False, True),
    ("tpot_ms_p50", "TPOT p50 (ms)", _ms, False, True),
    ("tpot_ms_p99", "TPOT p99 (ms)", _ms, False, True),
    ("e2e_ms_p50", "E2E p50 (ms)", _ms, False, True),
    ("prefix_hit_rate", "prefix hit rate", "{:.1%}".format, True, False),
    ("internal_frag", "internal frag.", "{:.1%}".format, False, True),
    ("kv_util", "KV util", "{:.1%}".format, True, True),
    ("preemptions", "preempt&shy;ions", "{:,.0f}".format, False, True),
]
ENVIRONMENT = ["kvbench", "git_commit", "python", "torch", "triton", "transformers", "device_name"]
KEY_WORDS = {"trace": "trace", "requests": "requests replayed", "model": "model", "executor": "executor",
             "hardware": "GPU (or device)", "time_scale": "arrival time scale", "kv_pool": "KV pool size"}

CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#222;line-height:1.4;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;border-bottom:2px solid #ddd;padding-bottom:4px;
margin-top:36px}h3{font-size:15px;margin:22px 0 6px}
.meta{color:#666;font-size:13px}.note{font-size:13px;background:#fff8e1;padding:4px 8px;border-left:3px solid #f0b400}
table{border-collapse:collapse;font-size:12px;margin:6px 0 12px}
th,td{border:1px solid #ddd;padding:3px 5px;text-align:right;white-space:nowrap}
th{background:#f3f5f8;white-space:normal;max-width:76px;vertical-align:bottom;font-weight:600}
td.name,th.name{text-align:left}td.path{white-space:normal;word-break:break-all;text-align:left;font-size:11px}
tr.baseline td{background:#fafafa;font-style:italic}
span.x{display:block;font-size:11px}span.up{color:#11702f;font-weight:600}span.down{color:#a11d1d}
figure{margin:14px 0 22px}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:13px;color:#555}
ul.findings{font-size:14px}
.scroll{overflow-x:auto}
"""


@dataclass
class Report:
    out_dir: str
    index: str
    charts: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # inputs left out, one line each


def build_report(paths: list[str], out_dir: str, title: str = "kvbench report", on_bad: str = "skip") -> Report:
    """Load ``paths`` (runs, sweeps, what-if tables), write the PNGs and index.html into ``out_dir``.
    ``on_bad``: leave out ("skip") or stop at ("stop") an input that cannot be read."""
    inputs = load_inputs(paths, on_bad)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError("is not a directory (or lies under a file)", file=out_dir, field="--out") from None
    except OSError as e:
        raise InputError(f"cannot create the report directory ({e.strerror or e})", file=out_dir,
                         field="--out") from None
    report = Report(out_dir, os.path.join(out_dir, "index.html"), skipped=inputs.skipped)
    assign_styles(inputs.sections)
    body = [f"<h1>{_e(title)}</h1>",
            f"<p class=meta>kvbench {_e(__version__)} · {_describe_inputs(inputs)}</p>"]
    if inputs.sections:
        body.append("<p class=meta>Runs are compared only inside a group: the same "
                    + ", ".join(_e(KEY_WORDS.get(k, k)) for k, _ in COMPARABLE)
                    + ". Every other setting may vary inside a group, and a configuration is named by the "
                    "settings that do. <a href='#metrics'>What each figure means</a> (every figure: "
                    "docs/metrics.md in the kvbench repository).</p>")
    if inputs.skipped:
        body.append("<p class=meta>Left out, unreadable: " + "; ".join(_e(x) for x in inputs.skipped) + "</p>")
    if len(inputs.sections) + len(inputs.whatifs) > 1:
        body.append(_contents(inputs))
    for section in inputs.sections:
        body.append(_section(section, report))
    for i, p in enumerate(prediction.pair([r for s in inputs.sections for r in s.runs])):
        body.append(_prediction(p, i, report))
    for i, w in enumerate(inputs.whatifs):
        png = f"whatif-{i + 1}.png"
        body.append(f"<h2 id=whatif-{i + 1}>What-if: {_e(w.label)}</h2>")
        tiers = tiered(w.table)
        if render(whatif_tiers if tiers else whatif, w, os.path.join(out_dir, png)):
            report.charts.append(png)
            body.append(_figure(out_dir, png, (
                "Prefix hit rate per GPU budget, tier sizes and policy, stacked by the tier that served it "
                "(the GPU pool's prefix hit, then the continuation from the CPU and disk tiers); the dash-dot "
                "line is the ceiling (infinite cache)." if tiers else
                "Prefix hit rate each cache policy would reach with a given cache budget; the dash-dot line "
                "is the ceiling (infinite cache).")))
        else:
            body.append("<p>This table has no budget_bytes and hit_rate columns to chart.</p>")
        body.append(_gap_table(w.table))
    if inputs.sections:
        body.append(_glossary(any(s.baselines for s in inputs.sections)))
    page = ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            "<meta name=viewport content='width=device-width, initial-scale=1'>"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")
    with open(report.index, "w", encoding="utf-8") as fh:
        fh.write(page)
    return report


def _prediction(p: prediction.Prediction, i: int, report: Report) -> str:
    """A live run and the sim runs that predicted it: the figures side by side, the chart, the words."""
    out = [f"<h2 id=prediction-{i + 1}>Prediction beside measurement: {_e(p.live.name)}</h2>",
           f"<p class=meta>measured: {_e(p.live.dir)} (a live server); predicted: "
           + ", ".join(_e(s.dir) for s in p.sims) + "</p>"]
    png = f"prediction-{i + 1}.png"
    if render(prediction.chart, p, os.path.join(report.out_dir, png)):
        report.charts.append(png)
        out.append(_figure(report.out_dir, png, "Measured (black) against predicted: latency percentiles, running "
                                                "sequences over time, and each request's predicted / measured - 1."))
    heads = "".join(f"<th>{_e(h)}</th>" for h in ["figure", "measured", *(s.label or s.name for s in p.sims)])
    rows = "".join("<tr>" + "".join(f"<td class=name>{_e(c)}</td>" if j == 0 else f"<td>{_e(c)}</td>"
                                      for j, c in enumerate(row)) + "</tr>" for row in prediction.table(p))
    out.append(f"<div class=scroll><table><tr>{heads}</tr>{rows}</table></div>")
    out.append("<ul class=findings>" + "".join(f"<li>{_e(w)}</li>" for w in prediction.words(p)) + "</ul>")
    return "\n".join(out)


def _glossary(ratios: bool) -> str:
    rows = "".join(f"<tr><td class=name>{_e(name)}</td><td class=path>{_e(text)}</td></tr>"
                   for name, text in METRIC_DEFINITIONS if ratios or not name.startswith("×"))
    return f"<h2 id=metrics>What each figure means</h2><table>{rows}</table>"


def _gap_table(df) -> str:
    """What-if: each policy against lru per budget, in hit-rate points with the share of the lru ->
    belady gap closed, as the terminal writes it (kvbench.whatif.output.versus_lru_table); '' where
    the table has no lru, belady and another policy."""
    from kvbench.whatif.output import VERSUS_LRU_CAPTION, versus_lru_table

    if not {"budget_bytes", "policy", "hit_rate"} <= set(df.columns):
        return ""
    t = versus_lru_table(df.to_dict("records"))
    if t is None:
        return ""
    heads = "".join(f"<th>{_e(x)}</th>" for x in t.columns)
    rows = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    return (f"<p>{_e(t.title[0].upper() + t.title[1:])}.</p>"
            f"<div class=scroll><table><tr>{heads}</tr>{rows}</table></div>"
            f"<p class=meta>{_e(VERSUS_LRU_CAPTION[0].upper() + VERSUS_LRU_CAPTION[1:])}.</p>")


def _e(text) -> str:
    return html.escape(str(text))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _describe_inputs(inputs: Inputs) -> str:
    runs = sum(len(s.runs) for s in inputs.sections)
    parts = [f"{_plural(runs, 'configuration')} in {_plural(len(inputs.sections), 'comparable group')}"]
    if inputs.whatifs:
        parts.append(_plural(len(inputs.whatifs), "what-if table"))
    return _e(", ".join(parts))


def _contents(inputs: Inputs) -> str:
    items = [f"<li><a href='#{_e(s.slug)}'>{_e(s.title)}</a> ({_plural(len(s.runs), 'configuration')})</li>"
             for s in inputs.sections]
    items += [f"<li><a href='#whatif-{i + 1}'>What-if: {_e(w.label)}</a></li>"
              for i, w in enumerate(inputs.whatifs)]
    return "<ul>" + "".join(items) + "</ul>"


def _figure(out_dir: str, png: str, caption: str) -> str:
    with open(os.path.join(out_dir, png), "rb") as fh:
        data = base64.b64encode(fh.read()).decode("ascii")
    return (f"<figure><img alt='{_e(png)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _section(section: Section, report: Report) -> str:
    trace = section.runs[0].trace
    vary = ", ".join(_e(n.replace("_", " ")) for n in section.varying) or "nothing (one configuration)"
    out = [f"<h2 id='{_e(section.slug)}'>{_e(section.title)}</h2>",
           (f"<p class=meta>{_e(trace.get('path', '?'))} · sha256 {_e(str(trace.get('sha256'))[:16])} · "
            f"{_plural(len(section.runs), 'configuration')}; varying: {vary}</p>")]
    for i, (stem, caption, chart) in enumerate(SECTION_CHARTS):
        png = f"{section.slug}-{stem}.png"
        if render(chart, section, os.path.join(report.out_dir, png)):
            report.charts.append(png)
            out.append(_figure(report.out_dir, png, caption))
        if i == 0:  # the headline figure, then the same figures as numbers
            out += ["<h3>Headline</h3>", _headline(section), _findings(section)]
            for left, kept in section.merged:
                out.append(f"<p class=meta>{_e(left.dir)} has the same settings and figures as "
                           f"{_e(kept.dir)} (<b>{_e(kept.label)}</b>): shown once.</p>")
            out.append("<h3>Details</h3>")
    out += ["<h3>Settings</h3>", _settings(section), "<h3>Versions</h3>", _versions(section)]
    return "\n".join(out)


# -- tables ------------------------------------------------------------------------------------
def _ratio(run: Run, base: Run | None, key: str) -> float | None:
    if base is None or base is run:
        return None
    a, b = run.metric(key), base.metric(key)
    return a / b if a is not None and b not in (None, 0) else None


def _multiple(x: float) -> str:
    """A ratio as the number a reader multiplies by: two decimals from 0.1 to 100 (2.94, 0.53),
    two significant digits outside (0.044, 0.00033, 250, 12,000), never an exponent."""
    text = f"{x:.2f}"
    if 0.1 <= float(text) < 100:
        return text
    r = float(f"{x:.2g}")
    if r >= 10:
        return f"{r:,.0f}"
    return format(Decimal(repr(r)), "f") if r else "0"


def _times(x: float | None, base: str = BASELINE[1]) -> str:
    """A ratio to the baseline, always written one way, the figure over the baseline's: 2.94× slab,
    0.53× slab, 0.044× slab, 250× slab (never '23× lower than slab' beside '0.17× slab')."""
    if x is None:
        return "–"
    return f"{_multiple(x)}× {base}"


def _cell(run: Run, section: Section, key: str, fmt, up: bool, ratio: bool) -> str:
    if key == "prefix_hit_rate" and not run.setting("prefix_cache"):
        return "<td>off</td>"
    v = run.metric(key)
    text = "–" if v is None else fmt(v)
    x = _ratio(run, section.baseline_for(run), key) if ratio else None
    if x is not None:
        cls = "" if abs(x - 1) <= 0.05 else (" up" if (x > 1) == up else " down")
        text += f"<span class='x{cls}'>{_e(_times(x))}</span>"
    return f"<td>{text}</td>"


def _headline(section: Section) -> str:
    """One row per configuration, named in words; × slab under the figures where the group has one."""
    ceiling = section.ceiling
    heads = ["<th class=name>configuration</th>"]
    for key, head, *_ in HEADLINE:
        if key == "prefix_hit_rate" and ceiling is not None:
            head += f" (ceiling {ceiling:.1%})"
        heads.append(f"<th>{head}</th>")
    rows = []
    for r in section.runs:
        flag = "" if r.summary.get("complete", True) else " (incomplete)"
        cells = [f"<td class=name>{_e(r.label + flag)}</td>"]
        cells += [_cell(r, section, key, fmt, up, ratio) for key, _, fmt, up, ratio in HEADLINE]
        rows.append(f"<tr{' class=baseline' if r.is_baseline else ''}>{''.join(cells)}</tr>")
    notes = []
    if section.baselines:
        notes.append(f"× {_e(BASELINE[1])}: the ratio to this group's {_e(BASELINE[1])} run (green better, "
                     "red worse). A paged run without a prefix cache against the slab measures the layout "
                     "alone; a +prefix run, the layout and the prefix cache together.")
    if rows_identical([r.summary for r in section.runs], [k for k, *_ in HEADLINE]):
        notes.append(why_identical(section.varying, [r.summary for r in section.runs]))
    note = "".join(f"<p class=meta>{n}</p>" for n in notes)
    return f"<div class=scroll><table class=headline><tr>{''.join(heads)}</tr>{''.join(rows)}</table></div>{note}"


def _setting_text(run: Run, name: str) -> str:
    if not run.uses(name):
        return "n/a"
    return setting_words(name, run.value(name))[0]


def _findings(section: Section) -> str:
    """Three sentences a reader would otherwise dig out of the table."""
    runs = [r for r in section.runs if r.metric("output_tok_per_s") is not None]
    if len(runs) < 2:
        return ""
    items = []
    others = [r for r in runs if not r.is_baseline and r.metric("internal_frag") is not None]
    for base in section.baselines:
        if base.metric("internal_frag") is not None and others:
            lo = min(r.metric("internal_frag") for r in others)
            hi = max(r.metric("internal_frag") for r in others)
            span = f"{lo:.1%}" if abs(hi - lo) < 0.0005 else f"{lo:.1%}–{hi:.1%}"
            items.append(f"<b>{_e(base.label)}</b> leaves {base.metric('internal_frag'):.1%} of the KV slots it "
                         f"holds empty; the other configurations {span}.")
            break
    alike = performs_alike([r.summary for r in runs], measured=any(r.setting("executor") != "sim" for r in runs))
    if alike is not None:
        items.append(_e(alike))
    else:
        best = max(runs, key=lambda r: r.metric("output_tok_per_s"))
        base = section.baseline_for(best)
        x = _ratio(best, base, "output_tok_per_s")
        items.append(f"Highest throughput: <b>{_e(best.label)}</b>, {best.metric('output_tok_per_s'):,.0f} output "
                     f"tok/s at a mean of {best.metric('mean_running') or 0:.1f} running sequences"
                     + (f", {_multiple(x)}× <b>{_e(base.label)}</b> ({base.metric('mean_running') or 0:.1f} running)"
                        if x is not None else "") + ".")
    cached = [r for r in runs if r.setting("prefix_cache") and r.metric("prefix_hit_rate") is not None]
    if cached:
        top = max(cached, key=lambda r: r.metric("prefix_hit_rate"))
        ceiling = section.ceiling
        items.append(f"Best prefix hit rate: <b>{_e(top.label)}</b>, {top.metric('prefix_hit_rate'):.1%} of prompt "
                     "tokens" + (f", against this group's ceiling of {ceiling:.1%}" if ceiling is not None else "")
                     + ".")
    return "<ul class=findings>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


def _settings(section: Section) -> str:
    runs = section.runs
    first = runs[0]
    common = [k for k in first.settings if k not in section.varying and all(r.uses(k) for r in runs)]
    pairs = " · ".join(_e(setting_words(k, first.value(k))[0]) for k in common)
    extra = [("kv_capacity_tokens", "KV slots"), ("slab_reserve_tokens", "slab reserve (tokens)")]
    heads = "".join(f"<th>{h}</th>" for h in ["configuration", "run directory",
                                                *(_e(n.replace("_", " ")) for n in section.varying),
                                                *(_e(h) for _, h in extra)])
    rows = "".join(
        f"<tr><td class=name>{_e(r.label)}</td><td class=path>{_e(r.dir)}</td>"
        + "".join(f"<td>{_e(_setting_text(r, s))}</td>" for s in section.varying)
        + "".join(f"<td>{_e(_count(r.summary.get(k, r.config.get(k))))}</td>" for k, _ in extra) + "</tr>"
        for r in runs)
    return (f"<p class=meta>Shared by every run: {pairs or '–'}</p>"
            f"<div class=scroll><table><tr>{heads}</tr>{rows}</table></div>")


def _count(v) -> str:
    return "–" if v is None else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _versions(section: Section) -> str:
    groups: dict[tuple, list[str]] = {}
    for r in section.runs:
        env = r.environment
        key = tuple(str(env.get(k)) for k in ENVIRONMENT)
        groups.setdefault(key, []).append(r.label)
    heads = "".join(f"<th>{_e(h)}</th>" for h in ["runs", *ENVIRONMENT])
    rows = []
    for key, labels in groups.items():
        who = f"all {len(labels)}" if len(groups) == 1 else ", ".join(labels)
        vals = [v[:12] if name == "git_commit" else v for name, v in zip(ENVIRONMENT, key)]
        rows.append(f"<tr><td class=name>{_e(who)}</td>" + "".join(f"<td>{_e(v)}</td>" for v in vals) + "</tr>")
    return f"<div class=scroll><table><tr>{heads}</tr>{''.join(rows)}</table></div>"
