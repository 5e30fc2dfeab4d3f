"""The report's charts: one function per chart, each taking a Section (the runs of one trace) and
returning a matplotlib Figure, or None when the section has nothing for it to show.

Figures are made without pyplot (Figure + the Agg canvas), so building a report never touches a
global backend or leaks figures. Every chart has a title, axis labels with units and a legend.
Series are named from the settings that vary between the runs, so nothing here knows what a
layout, a policy or an executor is; the one named setting is the x axis, block size.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from kvbench.report.data import Run, Section, WhatIf
from kvbench.sweep import setting_token

X_SETTING = "block_size"  # the x axis of the "against block size" charts
BASELINE_STYLE = {"color": "black", "ls": "--", "lw": 1.6}
FIGURE_DPI = 100
TIME_BINS = 300  # points per time series: enough to show bursts, small PNGs
RC = {"font.size": 9, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
      "axes.spines.right": False, "legend.fontsize": 8, "legend.framealpha": 0.85}
MARKERS = ["o", "s", "^", "D", "v", "P"]
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896"]


def render(chart, subject, path: str) -> bool:
    """Draw ``chart(subject)`` into a PNG at ``path`` under the report's style; False if it had nothing."""
    import matplotlib

    with matplotlib.rc_context(RC):
        fig = chart(subject)
        if fig is None:
            return False
        fig.savefig(path, format="png", dpi=FIGURE_DPI, pil_kwargs={"optimize": True})
    return True


def _figure(width_in: float, height_in: float) -> Figure:
    return Figure(figsize=(width_in, height_in), dpi=FIGURE_DPI, layout="constrained")


def describe(run: Run, names: list[str]) -> str:
    """A run's label from the given settings (those it uses), e.g. ``paged pc_on``."""
    parts = [setting_token(n, run.settings.get(n)) for n in names if run.uses(n)]
    return " ".join(parts) or run.label


def series(section: Section, runs: list[Run], exclude: set[str]) -> dict[str, list[Run]]:
    """Runs grouped by the varying settings other than ``exclude`` (one line per group)."""
    names = [n for n in section.varying if n not in exclude]
    out: dict[str, list[Run]] = {}
    for r in runs:
        out.setdefault(describe(r, names), []).append(r)
    return out


def run_colors(runs: list[Run]) -> dict[str, str]:
    """One colour per run across every per-run chart; the baseline is black."""
    colors, i = {}, 0
    for r in runs:
        if r.is_baseline:
            colors[r.label] = "black"
        else:
            colors[r.label] = PALETTE[i % len(PALETTE)]
            i += 1
    return colors


def _style(run: Run, colors: dict[str, str]) -> dict:
    return dict(BASELINE_STYLE) if run.is_baseline else {"color": colors[run.label], "lw": 1.2}


# -- against block size ------------------------------------------------------------------------
def _against_block_size(ax, section: Section, runs: list[Run], value, exclude: set[str]) -> None:
    """Runs that use a block size: one line per series; the others (slab): a dashed level each."""
    on_x = [r for r in runs if r.setting(X_SETTING) is not None]
    level = [r for r in runs if r.setting(X_SETTING) is None]
    for i, (label, group) in enumerate(series(section, on_x, exclude | {X_SETTING}).items()):
        group.sort(key=lambda r: r.setting(X_SETTING))
        # marker shapes and sizes differ so that series lying on top of each other stay visible
        ax.plot([r.setting(X_SETTING) for r in group], [value(r) for r in group],
                marker=MARKERS[i % len(MARKERS)], ms=9 - 1.2 * (i % 4), mfc="none" if i % 2 else None,
                color=PALETTE[i % len(PALETTE)], label=label)
    for label, group in series(section, level, exclude | {X_SETTING}).items():
        for r in group:
            style = BASELINE_STYLE if r.is_baseline else {"color": "grey", "ls": ":"}
            ax.axhline(value(r), label=f"{label} ({value(r):.1f})", **style)
    sizes = sorted({r.setting(X_SETTING) for r in on_x})
    if sizes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
    ax.set_xlabel("block size (tokens per block)")


def frag_util(section: Section) -> Figure | None:
    fig = _figure(10, 3.8)
    axes = fig.subplots(1, 2)
    for ax, key, name in ((axes[0], "internal_frag", "Internal fragmentation"),
                          (axes[1], "kv_util", "KV utilisation")):
        _against_block_size(ax, section, section.runs, lambda r, k=key: 100 * (r.metric(k) or 0), set())
        ax.set_ylabel(f"{name.lower()} (%, time-weighted)")
        ax.set_title(name)
        ax.set_ylim(0, max(ax.get_ylim()[1], 5) * 1.15)  # headroom for the legend
        ax.legend(loc="upper center", ncols=2)
    levels = [r.label for r in section.runs if r.setting(X_SETTING) is None]
    fig.suptitle("Memory at each block size" + (" against runs without blocks (dashed)" if levels else ""),
                 weight="bold")
    return fig


def hit_rate(section: Section) -> Figure | None:
    runs = [r for r in section.runs if r.setting("prefix_cache")]
    if not runs:
        return None
    fig = _figure(10, 3.8)
    ax = fig.subplots()
    _against_block_size(ax, section, runs, lambda r: 100 * (r.metric("prefix_hit_rate") or 0),
                        {"prefix_cache"})
    ideal: dict[int, list[float]] = {}
    for r in runs:
        if r.metric("ideal_hit_rate") is not None and r.setting(X_SETTING) is not None:
            ideal.setdefault(r.setting(X_SETTING), []).append(r.metric("ideal_hit_rate"))
    if ideal:
        xs = sorted(ideal)
        ax.plot(xs, [100 * float(np.mean(ideal[x])) for x in xs], color="black", ls="--", lw=1.6,
                label="ideal (infinite cache): the ceiling")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    low = min(line.get_ydata().min() for line in ax.get_lines() if len(line.get_ydata()))
    # zoom in when every rate is high, so that policies a few points apart can be told apart
    ax.set_ylim(0 if low < 40 else 10 * math.floor((low - 5) / 10), 101)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Prefix hit rate against block size and cache policy", weight="bold")
    return fig


# -- over engine time --------------------------------------------------------------------------
def binned(steps, column: str, hold: bool, bins: int = TIME_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Time-weighted mean of a per-step column in equal bins of engine time: (bin centres s, values).

    ``hold``: the value lasts until the next step starts (memory, which stays put while the engine
    idles); otherwise only for the step's own duration (running sequences: none while idle).
    """
    start = steps["t_s"].to_numpy(float)
    dur = steps["dur_ms"].to_numpy(float) / 1e3
    values = steps[column].to_numpy(float)
    if not len(start):
        return np.zeros(0), np.zeros(0)
    start = start - start[0]
    end = start[-1] + dur[-1]
    span = np.diff(np.append(start, end)) if hold else dur
    cum = np.concatenate([[0.0], np.cumsum(values * span)])
    edges = np.linspace(0.0, max(end, 1e-9), bins + 1)
    k = np.clip(np.searchsorted(start, edges, side="right") - 1, 0, len(start) - 1)
    integral = cum[k] + values[k] * np.clip(edges - start[k], 0.0, span[k])
    return (edges[:-1] + edges[1:]) / 2, np.diff(integral) / np.diff(edges)


def concurrency(section: Section) -> Figure | None:
    colors = run_colors(section.runs)
    fig = _figure(10, 3.8)
    ax = fig.subplots()
    for r in section.runs:
        t, running = binned(r.steps, "running", hold=False)
        ax.plot(t, running, label=f"{r.label} (mean {r.metric('mean_running') or 0:.1f})",
                alpha=0.9, **_style(r, colors))
    ax.set_xlabel("engine time (s)")
    ax.set_ylabel("running sequences (time-weighted mean per bin)")
    ax.set_ylim(bottom=0)
    ax.set_title("Concurrency over engine time", weight="bold")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def memory_timeline(section: Section) -> Figure | None:
    runs = section.runs
    ncols = min(3, len(runs))
    nrows = math.ceil(len(runs) / ncols)
    fig = _figure(10, 0.6 + 2.3 * nrows)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    parts = (("blocks_used", "used", "#1f77b4"), ("blocks_cached", "cached (reusable prefix)", "#ff7f0e"),
             ("blocks_free", "free", "#dddddd"))
    for ax, r in zip(axes, runs):
        t = None
        stacks = []
        for column, _, _ in parts:
            t, v = binned(r.steps, column, hold=True)
            stacks.append(v)
        ax.stackplot(t, *stacks, colors=[c for _, _, c in parts], labels=[n for _, n, _ in parts])
        ax.set_title(r.label, fontsize=9)
        ax.set_xlabel("engine time (s)")
        ax.set_ylabel("KV blocks")
        ax.margins(x=0)
    for ax in axes[len(runs):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3)
    fig.suptitle("Memory timeline: used, cached and free KV blocks", weight="bold")
    return fig


# -- per request -------------------------------------------------------------------------------
LATENCIES = (("ttft_ms", "TTFT: time to first token"), ("tpot_ms", "TPOT: time per output token"),
             ("e2e_ms", "E2E: end-to-end latency"))


def _log_if_wide(ax) -> None:
    """Log x for data spanning a decade or more, with plain tick labels (1000, not 10^3)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    lo, hi = ax.dataLim.intervalx
    if lo > 0 and hi / lo >= 10:  # narrower data reads better on a linear axis
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())


def latency_cdfs(section: Section) -> Figure | None:
    colors = run_colors(section.runs)
    fig = _figure(10, 3.6)
    axes = fig.subplots(1, 3, sharey=True)
    for ax, (column, name) in zip(axes, LATENCIES):
        for r in section.runs:
            v = np.sort(r.requests[column].to_numpy(float))
            v = v[np.isfinite(v) & (v > 0)]
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=r.label, **_style(r, colors))
        _log_if_wide(ax)
        ax.set_xlabel(f"{column.split('_')[0].upper()} (ms{', log scale' if ax.get_xscale() == 'log' else ''})")
        ax.set_title(name, fontsize=9)
    axes[0].set_ylabel("share of requests (CDF)")
    axes[0].set_ylim(0, 1.02)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper")
    fig.suptitle("Latency distributions per configuration", weight="bold")
    return fig


def eviction(section: Section) -> Figure | None:
    runs = [r for r in section.runs if r.setting("eviction") not in (None, "none")]
    if not runs:
        return None
    fig = _figure(11, 4.6)
    axes = fig.subplots(1, 2)
    x = np.arange(len(runs))
    width = 0.4
    for i, (key, name) in enumerate((("evicted_tokens", "evicted"), ("recalled_tokens", "recalled"))):
        bars = axes[0].bar(x + (i - 0.5) * width, [r.metric(key) or 0 for r in runs], width,
                           label=f"{name} tokens", color=PALETTE[i])
        axes[0].bar_label(bars, fmt="{:,.0f}", fontsize=7, rotation=90, padding=2)
    axes[0].set_ylabel("tokens (whole run)")
    axes[0].margins(y=0.25)  # room for the rotated value labels
    axes[0].set_title("Evicted and recalled tokens")
    mass = [r.metric("attention_mass_kept") for r in runs]
    bars = axes[1].bar(x, [100 * m if m is not None else 0 for m in mass], 0.5, color=PALETTE[2],
                       label="attention mass kept")
    axes[1].bar_label(bars, labels=[f"{100 * m:.1f}%" if m is not None else "" for m in mass], fontsize=8)
    for xi, m in zip(x, mass):
        if m is None:  # the cost model has no attention weights to measure
            axes[1].text(xi, 2, "n/a", ha="center", fontsize=8)
    axes[1].set_ylabel("attention mass kept (% of full-cache weight)")
    axes[1].set_ylim(0, 105)
    axes[1].set_title("Attention mass kept")
    for ax in axes:
        ax.set_xlim(-1, len(runs))  # a lone run gets a bar, not a wall
        ax.set_xticks(x, [r.label for r in runs], rotation=30, ha="right", fontsize=8)
        ax.set_xlabel("configuration")
        ax.legend(loc="best")
    fig.suptitle("Token eviction", weight="bold")
    return fig


# -- what-if tables ----------------------------------------------------------------------------
WHATIF_SERIES = ("policy", "block_size", "prefix_mode")


def whatif(w: WhatIf) -> Figure | None:
    df = w.table
    if not {"budget_bytes", "hit_rate"} <= set(df.columns) or df.empty:
        return None
    keys = [c for c in WHATIF_SERIES if c in df.columns and (c == "policy" or df[c].nunique() > 1)]
    fig = _figure(10, 3.8)
    ax = fig.subplots()
    groups = df.groupby(keys, sort=True) if keys else [("all", df)]
    for i, (key, g) in enumerate(groups):
        g = g.sort_values("budget_bytes")
        name = " ".join(str(k) for k in (key if isinstance(key, tuple) else (key,)))
        ax.plot(g["budget_bytes"] / 2**30, 100 * g["hit_rate"], marker="o", ms=3,
                color=PALETTE[i % len(PALETTE)], label=name)
    if "ceiling" in df.columns:
        ax.axhline(100 * float(df["ceiling"].max()), label="ceiling (infinite cache)", **BASELINE_STYLE)
    ax.set_xscale("log")
    # tick every budget asked, labelled as the user wrote it (e.g. 512MiB), not as powers of ten
    budgets = df.drop_duplicates("budget_bytes").sort_values("budget_bytes")
    labels = budgets["budget"] if "budget" in budgets.columns else (budgets["budget_bytes"] / 2**30).map("{:g} GiB".format)
    ax.set_xticks(budgets["budget_bytes"] / 2**30, list(labels))
    ax.minorticks_off()
    ax.set_xlabel("prefix-cache budget (log scale)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_ylim(0, 105)
    ax.set_title(f"What-if: hit rate against cache budget ({w.label})", weight="bold")
    ax.legend(loc="lower right")
    return fig


# (file stem, caption, chart): the order they appear in a section
SECTION_CHARTS = [
    ("memory", "Internal fragmentation and KV utilisation, paged at each block size against slab.", frag_util),
    ("hit_rate", "Prefix hit rate against block size and cache policy; the dashed line is the "
                 "trace's ideal hit rate (infinite cache, no concurrency). The y axis is zoomed when "
                 "every rate is high.", hit_rate),
    ("concurrency", "Running sequences over engine time: what the memory layout buys.", concurrency),
    ("latency", "Latency CDFs per configuration (log scale).", latency_cdfs),
    ("timeline", "KV blocks used by running sequences, cached for reuse, and free.", memory_timeline),
    ("eviction", "Token eviction: tokens evicted and recalled, and the attention mass kept.", eviction),
]
