"""The report: PNG charts and one self-contained ``index.html`` for runs, sweeps and what-if tables.

The page opens offline: images are base64 data URIs, the CSS is inline, there is no script, font or
stylesheet to fetch. Each trace gets a section that opens with the headline table (every
configuration, and its ratios to the slab baseline when one is present), then a few findings, the
charts (report.charts), and the settings and versions of the runs (config.json).
"""
from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass, field

from kvbench import __version__
from kvbench.report.charts import SECTION_CHARTS, render, whatif
from kvbench.report.data import BASELINE, Inputs, Run, Section, load_inputs

# (summary key, header, format, higher is better) -- the headline table, in this order
HEADLINE = [
    ("output_tok_per_s", "output tok/s", "{:,.0f}", True),
    ("mean_running", "mean running seqs", "{:.1f}", True),
    ("peak_running", "peak running seqs", "{:.0f}", True),
    ("ttft_ms_p50", "TTFT p50 (ms)", "{:,.1f}", False),
    ("tpot_ms_p50", "TPOT p50 (ms)", "{:.2f}", False),
    ("e2e_ms_p50", "E2E p50 (ms)", "{:,.0f}", False),
    ("prefix_hit_rate", "prefix hit rate", "{:.1%}", True),
    ("internal_frag", "internal frag.", "{:.1%}", False),
    ("kv_util", "KV util", "{:.1%}", True),
    ("preemptions", "preemptions", "{:.0f}", False),
]
# the ratios to the baseline shown first, as "× slab"
RATIOS = [("output_tok_per_s", "throughput"), ("mean_running", "mean concurrency"),
          ("ttft_ms_p50", "TTFT p50"), ("e2e_ms_p50", "E2E p50")]
ENVIRONMENT = ["kvbench", "git_commit", "python", "torch", "triton", "transformers", "device_name"]

CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#222;line-height:1.4;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:19px;border-bottom:2px solid #ddd;padding-bottom:4px;
margin-top:36px}h3{font-size:15px;margin:22px 0 6px}
.meta{color:#666;font-size:13px}
table{border-collapse:collapse;font-size:12px;margin:6px 0 12px}
th,td{border:1px solid #ddd;padding:3px 5px;text-align:right;white-space:nowrap}
th{background:#f3f5f8;white-space:normal;max-width:76px;vertical-align:bottom;font-weight:600}td.name,th.name{text-align:left}
tr.baseline td{background:#fafafa;font-style:italic}
td.up{color:#11702f;font-weight:600}td.down{color:#a11d1d}
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


def build_report(paths: list[str], out_dir: str, title: str = "kvbench report") -> Report:
    """Load ``paths`` (runs, sweeps, what-if tables), write the PNGs and index.html into ``out_dir``."""
    inputs = load_inputs(paths)
    os.makedirs(out_dir, exist_ok=True)
    report = Report(out_dir, os.path.join(out_dir, "index.html"))
    body = [f"<h1>{_e(title)}</h1>",
            f"<p class=meta>kvbench {_e(__version__)} · {_describe_inputs(inputs)}</p>"]
    if len(inputs.sections) + len(inputs.whatifs) > 1:
        body.append(_contents(inputs))
    for section in inputs.sections:
        body.append(_section(section, report))
    for i, w in enumerate(inputs.whatifs):
        png = f"whatif-{i + 1}.png"
        body.append(f"<h2 id=whatif-{i + 1}>What-if: {_e(w.label)}</h2>")
        if render(whatif, w, os.path.join(out_dir, png)):
            report.charts.append(png)
            body.append(_figure(out_dir, png, "Prefix hit rate each cache policy would reach with a "
                                "given cache budget; the dashed line is the ceiling (infinite cache)."))
        else:
            body.append("<p>This table has no budget_bytes and hit_rate columns to chart.</p>")
    page = ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")
    with open(report.index, "w", encoding="utf-8") as fh:
        fh.write(page)
    return report


def _e(text) -> str:
    return html.escape(str(text))


def _describe_inputs(inputs: Inputs) -> str:
    runs = sum(len(s.runs) for s in inputs.sections)
    parts = [f"{runs} run{'s' * (runs != 1)} of {len(inputs.sections)} "
             f"trace{'s' * (len(inputs.sections) != 1)}"]
    if inputs.whatifs:
        parts.append(f"{len(inputs.whatifs)} what-if table{'s' * (len(inputs.whatifs) != 1)}")
    return _e(", ".join(parts))


def _contents(inputs: Inputs) -> str:
    items = [f"<li><a href='#{s.slug}'>{_e(s.title)}</a> ({len(s.runs)} runs)</li>" for s in inputs.sections]
    items += [f"<li><a href='#whatif-{i + 1}'>What-if: {_e(w.label)}</a></li>"
              for i, w in enumerate(inputs.whatifs)]
    return "<ul>" + "".join(items) + "</ul>"


def _figure(out_dir: str, png: str, caption: str) -> str:
    with open(os.path.join(out_dir, png), "rb") as fh:
        data = base64.b64encode(fh.read()).decode("ascii")
    return (f"<figure><img alt='{_e(png)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _section(section: Section, report: Report) -> str:
    first = section.runs[0]
    trace = first.trace
    out = [f"<h2 id='{_e(section.slug)}'>Trace {_e(section.title)}</h2>",
           f"<p class=meta>{_e(trace.get('path', '?'))} · sha256 {_e(str(trace.get('sha256'))[:16])} · "
           f"{_e(trace.get('requests', '?'))} requests replayed · {len(section.runs)} configuration"
           f"{'s' * (len(section.runs) != 1)}</p>",
           "<h3>Headline</h3>", _headline(section), _findings(section)]
    for stem, caption, chart in SECTION_CHARTS:
        png = f"{section.slug}-{stem}.png"
        if render(chart, section, os.path.join(report.out_dir, png)):
            report.charts.append(png)
            out.append(_figure(report.out_dir, png, caption))
    out += ["<h3>Settings</h3>", _settings(section), "<h3>Versions</h3>", _versions(section)]
    return "\n".join(out)


# -- tables ------------------------------------------------------------------------------------
def _fmt(fmt: str, v) -> str:
    return "–" if v is None or v != v else fmt.format(v)  # v != v: NaN (no request finished)


def _ratio(run: Run, base: Run | None, key: str) -> float | None:
    if base is None:
        return None
    a, b = run.metric(key), base.metric(key)
    return a / b if a is not None and b not in (None, 0) and a == a and b == b else None


def _headline(section: Section) -> str:
    has_base = any(r.is_baseline for r in section.runs)
    heads = ["<th class=name>configuration</th>"]
    heads += [f"<th>{_e(s.replace('_', ' '))}</th>" for s in section.varying]
    if has_base:
        heads += [f"<th>{_e(n)}<br>× {_e(BASELINE[1])}</th>" for _, n in RATIOS]
    heads += [f"<th>{_e(h)}</th>" for _, h, _, _ in HEADLINE]
    rows = []
    better = {k: up for k, _, _, up in HEADLINE}
    for r in section.runs:
        base = section.baseline_for(r)
        flag = "" if r.summary.get("complete") else " (incomplete)"
        cells = [f"<td class=name>{_e(r.label + flag)}</td>"]
        cells += [f"<td>{_e(_setting_text(r, s))}</td>" for s in section.varying]
        if has_base:
            for key, _ in RATIOS:
                x = _ratio(r, base, key)
                cls = ""
                if x is not None and not r.is_baseline and abs(x - 1) > 0.05:
                    cls = " class=up" if (x > 1) == better[key] else " class=down"
                cells.append(f"<td{cls}>{_times(x)}</td>")
        cells += [f"<td>{_fmt(fmt, r.metric(k))}</td>" for k, _, fmt, _ in HEADLINE]
        rows.append(f"<tr{' class=baseline' if r.is_baseline else ''}>{''.join(cells)}</tr>")
    note = (f"<p class=meta>× {_e(BASELINE[1])}: the ratio to the {_e(BASELINE[1])} run with the "
            "closest settings; green is better, red worse.</p>" if has_base else "")
    return (f"<div class=scroll><table><tr>{''.join(heads)}</tr>{''.join(rows)}</table></div>{note}")


def _times(x: float | None) -> str:
    """A ratio with two significant digits at least: 2.94×, 0.0012×."""
    if x is None:
        return "–"
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"


def _setting_text(run: Run, name: str) -> str:
    if not run.uses(name):
        return "n/a"
    v = run.settings.get(name)
    if v is None:
        return "default"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def _findings(section: Section) -> str:
    """Three sentences a reader would otherwise dig out of the table."""
    runs = [r for r in section.runs if r.metric("output_tok_per_s") is not None]
    if len(runs) < 2:
        return ""
    items = []
    best = max(runs, key=lambda r: r.metric("output_tok_per_s"))
    base = section.baseline_for(best)
    x = _ratio(best, base, "output_tok_per_s")
    items.append(f"Highest throughput: <b>{_e(best.label)}</b>, "
                 f"{best.metric('output_tok_per_s'):,.0f} output tok/s"
                 + (f", {x:.2f}× {_e(base.label)}" if x is not None and base is not best else "") + ".")
    frag = min(runs, key=lambda r: r.metric("internal_frag") or 0)
    worst = max(runs, key=lambda r: r.metric("internal_frag") or 0)
    if worst is not frag:
        items.append(f"Internal fragmentation ranges from {frag.metric('internal_frag'):.1%} "
                     f"(<b>{_e(frag.label)}</b>) to {worst.metric('internal_frag'):.1%} "
                     f"(<b>{_e(worst.label)}</b>).")
    cached = [r for r in runs if r.setting("prefix_cache")]
    if cached:
        top = max(cached, key=lambda r: r.metric("prefix_hit_rate") or 0)
        items.append(f"Best prefix hit rate: <b>{_e(top.label)}</b>, {top.metric('prefix_hit_rate'):.1%} "
                     f"of prompt tokens, against an ideal of {top.metric('ideal_hit_rate') or 0:.1%}.")
    return "<ul class=findings>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


def _settings(section: Section) -> str:
    runs = section.runs
    common = [k for k in runs[0].settings if k not in section.varying]
    pairs = " · ".join(f"{_e(k)}={_e(_setting_text(runs[0], k))}" for k in common
                       if all(r.uses(k) for r in runs))
    extra = ["num_blocks", "max_model_len_effective"]
    heads = "".join(f"<th>{_e(h)}</th>" for h in ["run directory", *section.varying, *extra])
    rows = "".join(
        "<tr><td class=name>" + _e(r.dir) + "</td>"
        + "".join(f"<td>{_e(_setting_text(r, s))}</td>" for s in section.varying)
        + "".join(f"<td>{_e(r.config.get(k, '–'))}</td>" for k in extra) + "</tr>" for r in runs)
    return (f"<p class=meta>Shared by every run: {pairs or '–'}</p>"
            f"<div class=scroll><table><tr>{heads}</tr>{rows}</table></div>")


def _versions(section: Section) -> str:
    groups: dict[tuple, list[str]] = {}
    for r in section.runs:
        env = r.config.get("environment", {})
        key = tuple(str(env.get(k)) for k in ENVIRONMENT)
        groups.setdefault(key, []).append(r.label)
    heads = "".join(f"<th>{_e(h)}</th>" for h in ["runs", *ENVIRONMENT])
    rows = []
    for key, labels in groups.items():
        who = f"all {len(labels)}" if len(groups) == 1 else ", ".join(labels)
        vals = [v[:12] if name == "git_commit" else v for name, v in zip(ENVIRONMENT, key)]
        rows.append(f"<tr><td class=name>{_e(who)}</td>" + "".join(f"<td>{_e(v)}</td>" for v in vals) + "</tr>")
    return f"<div class=scroll><table><tr>{heads}</tr>{''.join(rows)}</table></div>"
