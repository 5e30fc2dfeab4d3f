"""The report's charts of clusters and tiers: several replicas by router (``routing``), disaggregated
prefill/decode layouts beside mixed replicas (``layouts``), and the hit rate each prefix-cache tier or a
shared store served (``tiers``). Same conventions as kvbench.report.charts, whose helpers they use.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvbench.engine.records import parse_slo
from kvbench.report import words
from kvbench.report.charts import (CEILING_STYLE, _dots, _figure, _hbars, _log_if_wide, _ms_text, _pct,
                                   finish_rows)
from kvbench.report.data import Run, Section


def routing(section: Section) -> Figure | None:
    """Where runs had several replicas: hit rate, TTFT p50/p99 and load balance by router and
    replica count (one replica drawn too, as the reference)."""
    mixed = [r for r in section.runs if r.value("disagg") in (None, "none")]  # (P:D runs: the layouts chart)
    multi = [r for r in mixed if (r.metric("replicas") or 1) > 1]
    if not multi:
        return None
    runs = [r for r in mixed if (r.metric("replicas") or 1) > 1 or r.value("replicas") in (None, 1)]
    n = len(runs)
    fig = _figure(12, 1.9 + 0.32 * n)
    hits, ttft, bal = fig.subplots(1, 3, sharey=True, width_ratios=[1, 1.25, 1])
    y = np.arange(n)[::-1]
    _hbars(hits, y, runs, [_pct(r.metric("prefix_hit_rate")) for r in runs], "{:.1f}%", 100)
    handles = _hits_and_ttft(section, runs, y, hits, ttft, "Prefix hit rate\n% of prompt tokens")
    busy = [r.metric("balance_busy_max_over_mean") for r in runs]
    _hbars(bal, y, runs, busy, "{:.2f}", max([b for b in busy if b is not None] or [1.0]) * 1.3,
           missing="one replica")
    bal.axvline(1.0, color="black", lw=0.8)
    bal.set_title("Load balance\nbusiest replica's busy time / mean", fontsize=9)
    bal.set_xlabel("ratio (1 = even; lower is better)")
    finish_rows(fig, (hits, ttft, bal), handles,
                 f"Routing across replicas: hit rate, latency and balance by router\n{section.title}")
    return fig


def _hits_and_ttft(section: Section, runs: list[Run], y, hits, ttft, title: str) -> list:
    """The hit-rate axes' ceiling, title and run labels, and the TTFT p50/p99 axes, of a
    one-row-per-run figure; returns the legend handles they add."""
    handles = []
    if section.ceiling is not None:
        handles.append(hits.axvline(100 * section.ceiling, gid="ceiling",
                                    label=f"ceiling: ideal hit rate {section.ceiling:.1%}", **CEILING_STYLE))
    hits.set_title(title, fontsize=9)
    hits.set_xlabel("% (higher is better)")
    hits.set_yticks(y, [r.label for r in runs])
    hits.set_ylim(-0.6, len(runs) - 0.4)
    _latency_dots(ttft, y, runs, "ttft_ms", "TTFT, time to first token")
    return handles


def _latency_dots(ax, y, runs: list[Run], column: str, name: str, slo_ms: float | None = None) -> list:
    """One latency's p50 (filled) to p99 (open) per row, on a time axis from zero (log if wide); the
    SLO's threshold drawn where it falls on that axis. Returns the legend handles it adds."""
    _dots(ax, y, runs, f"{column}_p50", f"{column}_p99")
    _log_if_wide(ax, seconds=True)
    ax.set_title(f"{name}\np50 (filled) to p99 (open)", fontsize=9)
    ax.set_xlabel(("log scale" if ax.get_xscale() == "log" else "ms") + " (lower is better)")
    ax.margins(x=0.15)
    if slo_ms is None:
        return []
    lo, hi = ax.get_xlim()
    if hi < slo_ms <= 3 * hi:  # near enough to widen the axis for; farther, named, not drawn
        hi = slo_ms * 1.1
        ax.set_xlim(lo, hi)
    if lo <= slo_ms <= hi:
        return [ax.axvline(slo_ms, color="#a11d1d", ls=":", lw=1.4, label="--slo objective")]
    ax.set_title(f"{name}\np50 (filled) to p99 (open); SLO {_ms_text(slo_ms)} off scale", fontsize=9)
    return []


def _shared_slo(runs: list[Run]) -> dict[str, float]:
    """The --slo objectives (ms by name) every run was held to; {} where they differ or none was given."""
    texts = {r.value("slo") for r in runs}
    if len(texts) != 1:
        return {}
    try:
        return parse_slo(texts.pop())
    except ValueError:  # a hand-edited config.json
        return {}


def _layout_rows(section: Section, runs: list[Run], with_gpus: bool) -> list[str]:
    """Each run's layout in words (P:D 3:1, 4 mixed replicas), then the group's other varying
    settings that it uses, and its GPUs where the runs differ in them."""
    others = [n for n in section.varying if n not in ("disagg", "replicas")]
    names = []
    for r in runs:
        text = " ".join(filter(None, [words.layout(r.value("disagg"), r.replicas),
                                      words.label(r.settings, others, r.unused)]))
        gpus = f" · {r.gpus} GPU{'s' * (r.gpus != 1)}" if with_gpus else ""
        names.append(words.shorten(text, words.MAX_LABEL - len(gpus)) + gpus)
    return names


def layouts(section: Section) -> Figure | None:
    """Where a run disaggregated prefill and decode: goodput per GPU of each P:D layout beside the
    mixed-replica runs, one row each, grouped by the GPUs they use; and the TTFT and TPOT each paid."""
    if not any(r.disagg for r in section.runs) or len(section.runs) < 2:
        return None
    runs = sorted(section.runs, key=lambda r: (r.gpus, bool(r.disagg)))  # the group's order inside
    counts = sorted({r.gpus for r in runs})
    rows: list[float] = []  # a gap between GPU counts
    for i, r in enumerate(runs):
        rows.append((rows[-1] + 1 + 0.6 * (r.gpus != runs[i - 1].gpus)) if i else 0.0)
    y = rows[-1] - np.array(rows)  # the first on top
    fig = _figure(12, 1.9 + 0.32 * (rows[-1] + 1))
    good, ttft, tpot = fig.subplots(1, 3, sharey=True, width_ratios=[1.2, 1.2, 1.2])
    key = "goodput_req_per_s" if any(r.metric("goodput_req_per_s") is not None for r in runs) else "req_per_s"
    values = [r.per_gpu(key) for r in runs]
    _hbars(good, y, runs, values, "{:.3g}", max([v for v in values if v is not None] or [1.0]) * 1.3,
           missing="no --slo")
    good.set_title("Goodput per GPU\nrequests meeting every --slo objective" if key == "goodput_req_per_s" else
                   "Requests per GPU (no --slo:\nevery finished request counts)", fontsize=9)
    good.set_xlabel("requests/s per GPU (higher is better)")
    good.set_yticks(y, _layout_rows(section, runs, with_gpus=len(counts) > 1))
    good.set_ylim(-0.6, y[0] + 0.6)
    slo = _shared_slo(runs)
    handles = _latency_dots(ttft, y, runs, "ttft_ms", "TTFT, time to first token", slo.get("ttft"))
    handles += _latency_dots(tpot, y, runs, "tpot_ms", "TPOT, time per output token", slo.get("tpot"))
    gpus = "by GPUs used" if len(counts) > 1 else f"{counts[0]} GPU{'s' * (counts[0] != 1)} each"
    finish_rows(fig, (good, ttft, tpot), handles,
                 f"Disaggregated prefill/decode against mixed replicas, {gpus}\n{section.title}")
    return fig


TIER_PARTS = (("hit_rate_gpu", "GPU pool", "#1f77b4"), ("hit_rate_cpu", "CPU tier", "#ff7f0e"),
              ("hit_rate_disk", "disk tier", "#2ca02c"), ("hit_rate_store", "shared store", "#9467bd"))


def _stack_by_tier(ax, y, rates: dict) -> list:
    """One horizontal bar per row, the hit rate each tier served (``rates``: TIER_PARTS key -> a
    share per row) stacked in chain order, the total written beside it; a lower tier that served
    nothing is left out. Returns the legend handles."""
    left = np.zeros(len(y))
    handles = []
    for key, name, color in TIER_PARTS:
        part = 100 * np.asarray(rates[key], dtype=float)
        if key != "hit_rate_gpu" and not part.any():
            continue
        ax.barh(y, part, 0.7, left=left, color=color, alpha=0.85)
        handles.append(Line2D([], [], color=color, lw=8, label=f"served by the {name}"))
        left += part
    for yi, total in zip(y, left):
        ax.text(total + 1, yi, f"{total:.1f}%", va="center", fontsize=8, color="#222")
    ax.set_xlim(0, 105)
    return handles


def tiers(section: Section) -> Figure | None:
    """Where runs had prefix-cache tiers behind the pool: the hit rate each tier served (stacked), the
    TTFT it bought and the bytes loaded, one row per run (runs without tiers drawn as the reference)."""
    tiered = [r for r in section.runs if any(r.metric(key) is not None for key, _, _ in TIER_PARTS[1:])]
    if not tiered:
        return None
    runs = [r for r in section.runs if r.metric("prefix_hit_rate") is not None]
    n = len(runs)
    fig = _figure(12, 1.9 + 0.32 * n)
    hits, ttft, moved = fig.subplots(1, 3, sharey=True, width_ratios=[1.3, 1.2, 0.9])
    y = np.arange(n)[::-1]
    handles = _stack_by_tier(hits, y, {key: [r.metric(key) if r.metric(key) is not None else
                                              (r.metric("prefix_hit_rate") if key == "hit_rate_gpu" else 0.0)
                                              for r in runs] for key, _, _ in TIER_PARTS})
    handles += _hits_and_ttft(section, runs, y, hits, ttft, "Prefix hit rate by tier\n% of prompt tokens")
    gb = [None if r.metric("bytes_loaded") is None else r.metric("bytes_loaded") / 1e9 for r in runs]
    _hbars(moved, y, runs, gb, "{:,.0f} GB", max([g for g in gb if g is not None] or [1.0]) * 1.35,
           missing="no tiers", texts=[None if r.metric("load_s") is None or g is None else
                                      f"{g:,.0f} GB in {r.metric('load_s'):,.1f} s" for r, g in zip(runs, gb)])
    moved.set_title("KV loaded from the tiers\nbytes, and the time the loads took", fontsize=9)
    moved.set_xlabel("GB")
    finish_rows(fig, (hits, ttft, moved), handles,
                 f"Prefix-cache tiers: what each tier serves and the TTFT it buys\n{section.title}")
    return fig
