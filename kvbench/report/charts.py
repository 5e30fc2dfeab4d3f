"""The report's charts: one function per chart, each taking a Section (one comparable group) and
returning a matplotlib Figure, or None when the group has nothing for it to show.

Which charts a group gets follows from what varies in it: block-size axes only with two block sizes
or more, eviction panels only where token eviction ran, time series overlaid for a few runs and as
small multiples for more. Every configuration keeps one colour and marker in every chart
(assign_styles: by its label, carried to later groups where it is free; the slab baseline is black). Legends sit outside the axes, and
run names come from the group's labels (report.words), so nothing here knows what a layout, a policy
or an executor is; the one setting named is the x axis of the block-size chart. The charts of
clusters and tiers (routing, P:D layouts, tiers) are in report.cluster_charts; the list of a section's
charts, SECTION_CHARTS, in report.html.

Figures are made without pyplot (Figure + the Agg canvas), so building a report never touches a
global backend or leaks figures.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvbench.report import words
from kvbench.report.data import Run, Section

X_SETTING = "block_size"  # the x axis of the "against block size" chart
BASELINE_STYLE = {"color": "black", "ls": "--", "lw": 1.6}
CEILING_STYLE = {"color": "black", "ls": "-.", "lw": 1.4}  # the ideal hit rate, wherever it is drawn
FIGURE_DPI = 100
TIME_BINS = 300  # points per time series: enough to show bursts, small PNGs
OVERVIEW_MAX = 24  # configurations in the headline figure (the table has them all)
OVERLAY_MAX = 4  # time series drawn on one axes; more get one small panel each
GRID_MAX = 16  # small panels at most; more runs: the headline's mean and peak say it
CDF_MAX = 6  # latency CDFs on one axes; more runs: percentiles as dots
RC = {"font.size": 9, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
      "axes.spines.right": False, "legend.fontsize": 8, "legend.framealpha": 0.85}
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf"]
MARKERS = ["o", "^", "D", "v", "P", "X", "<", ">", "h"]
BASE_COLOR, BASE_MARKER = "black", "s"
# what a memory timeline stacks: (label, colour)
MEMORY_PARTS = (("live tokens", "#1f77b4"), ("empty slots in held blocks", "#d62728"),
                ("cached prefix blocks", "#ff7f0e"))


def render(chart, subject, path: str) -> bool:
    """Draw ``chart(subject)`` into a PNG at ``path`` under the report's style; False if it had nothing."""
    import matplotlib

    with matplotlib.rc_context(RC):
        fig = chart(subject)
        if fig is None:
            return False
        fig.savefig(path, format="png", dpi=FIGURE_DPI, pil_kwargs={"optimize": True})
    return True


def assign_styles(sections: list[Section]) -> None:
    """A (colour, marker) per configuration, the same in every chart of its group and, where it is
    free there, the one the same label had in an earlier group; no two configurations of a group
    share both. Baselines are black squares."""
    styles = [(PALETTE[i % len(PALETTE)], MARKERS[(i + i // len(PALETTE)) % len(MARKERS)])
              for i in range(len(PALETTE) * len(MARKERS))]
    before: dict[str, tuple[str, str]] = {}
    for section in sections:
        chosen: dict[str, tuple[str, str]] = {}
        others = [r for r in section.runs if not r.is_baseline]
        for r in others:  # labels seen before keep their style unless two claim the same one
            if r.label in before and before[r.label] not in chosen.values():
                chosen[r.label] = before[r.label]
        free = iter([s for s in styles if s not in chosen.values()])
        for r in section.runs:
            if r.is_baseline:
                r.color, r.marker = BASE_COLOR, BASE_MARKER
                continue
            if r.label not in chosen:
                chosen[r.label] = next(free, styles[0])
            r.color, r.marker = chosen[r.label]
            before.setdefault(r.label, chosen[r.label])


def _figure(width_in: float, height_in: float) -> Figure:
    return Figure(figsize=(width_in, height_in), dpi=FIGURE_DPI, layout="constrained")


def _line_style(r: Run) -> dict:
    return dict(BASELINE_STYLE) if r.is_baseline else {"color": r.color, "lw": 1.3}


def _pct(v: float | None) -> float | None:
    return None if v is None else 100 * v


def _legend_below(fig: Figure, handles, ncols: int = 4) -> None:
    """One legend for the figure, under its axes (never on the data)."""
    seen: dict[str, object] = {}
    for h in handles:
        if h.get_label() and not h.get_label().startswith("_") and h.get_label() not in seen:
            seen[h.get_label()] = h
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center",
                   ncols=min(ncols, len(seen)))


def _legend_right(fig: Figure, handles) -> None:
    seen = {h.get_label(): h for h in handles if h.get_label() and not h.get_label().startswith("_")}
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside right upper")


def _ms_text(v: float, _=None) -> str:
    """A tick in milliseconds as a person writes it: 16 ms, 1 s, 100 s."""
    return f"{v / 1000:g} s" if v >= 1000 else f"{v:g} ms"


def _log_if_wide(ax, seconds: bool = False) -> None:
    """Log x for data spanning a decade or more, with plain tick labels (1000, not 10^3; with
    ``seconds``, milliseconds written as 16 ms or 2 s). A linear axis gets the same labels (never an
    offset such as 1e6 in the corner) and starts at zero: the runs' levels are compared on it, and an
    axis cut above zero draws 6.4 against 10.9 ms as a chasm."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    text = FuncFormatter(_ms_text if seconds else lambda v, _: f"{v:g}")
    lo, hi = ax.dataLim.intervalx
    if np.isfinite(lo) and np.isfinite(hi) and lo > 0 and hi / lo >= 10:  # narrower: a linear axis
        ax.set_xscale("log")
        # two decades or less get 1-2-5 ticks, so that at least two are labelled
        ax.xaxis.set_major_locator(LogLocator(base=10, numticks=6, subs=(1.0,) if hi / lo > 100 else (1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(text)
        ax.xaxis.set_minor_formatter(NullFormatter())
        return
    ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
    ax.xaxis.set_major_formatter(text)
    ax.set_xlim(0, hi * 1.15 if np.isfinite(hi) and hi > 0 else 1.0)


def _grid(fig: Figure, n: int, ncols: int = 4, **kw):
    """``n`` small panels, ``ncols`` to a row; the spare ones hidden. -> list of n axes."""
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return list(axes[:n])


def _outer_labels(axes: list, ncols: int) -> None:
    """Axis labels on the left column and on the lowest panel of each column only (a column whose
    last row is short keeps them one row up)."""
    n = len(axes)
    for i, ax in enumerate(axes):
        if i + ncols < n:
            ax.tick_params(labelbottom=False)
            ax.set_xlabel("")
        if i % ncols:
            ax.tick_params(labelleft=False)
            ax.set_ylabel("")


# -- the headline: every configuration on the four questions -----------------------------------
def _hbars(ax, y, runs: list[Run], values: list[float | None], fmt: str, xmax: float,
           missing: str | list[str] = "–", texts: list[str] | None = None) -> None:
    """One horizontal bar per run in its colour (the baseline hatched), its value written beside it
    (``fmt``, or ``texts`` one per run); ``missing`` (one text, or one per run) where a run has no value."""
    missing = [missing] * len(runs) if isinstance(missing, str) else missing
    texts = texts or [None] * len(runs)
    xmax = xmax if xmax > 0 else 1.0  # nothing ran: an empty scale, not a singular one
    for yi, r, v, why, text in zip(y, runs, values, missing, texts):
        if v is None:
            ax.text(xmax * 0.01, yi, why, va="center", fontsize=8, color="grey", style="italic")
            continue
        ax.barh(yi, v, 0.7, color=r.color, alpha=0.85 if not r.is_baseline else 0.7,
                hatch="//" if r.is_baseline else None, edgecolor="white" if r.is_baseline else None)
        inside = v > 0.4 * xmax  # a long bar carries its number inside
        ax.text(v - 0.01 * xmax if inside else v + 0.01 * xmax, yi, fmt.format(v) if text is None else text,
                va="center", ha="right" if inside else "left", fontsize=8, color="white" if inside else "#222")
    ax.set_xlim(0, xmax)


def _dots(ax, y, runs: list[Run], lo_key: str, hi_key: str) -> None:
    """p50 (filled) and p99 (open) of one latency per run, joined by a thin bar."""
    for yi, r in zip(y, runs):
        lo, hi = r.metric(lo_key), r.metric(hi_key)
        if lo is not None and hi is not None and hi > lo:
            ax.hlines(yi, lo, hi, color=r.color, lw=2, alpha=0.35)
        if lo is not None:
            ax.plot([lo], [yi], marker=r.marker, color=r.color, ms=7, ls="none")
        if hi is not None:
            ax.plot([hi], [yi], marker=r.marker, color=r.color, mfc="white", ms=7, ls="none")


def overview(section: Section) -> Figure | None:
    """Slab and paged side by side: internal fragmentation, prefix hit rate against the group's
    ceiling, mean (and peak) concurrency, TTFT and TPOT p50/p99 — one row per configuration."""
    runs = section.runs[:OVERVIEW_MAX]
    n = len(runs)
    fig = _figure(12, 1.9 + 0.3 * n)
    axes = fig.subplots(1, 5, sharey=True, width_ratios=[1, 1, 1, 1.25, 1.25])
    y = np.arange(n)[::-1]  # the first run on top
    frag, hits, conc, ttft, tpot = axes

    _hbars(frag, y, runs, [_pct(r.metric("internal_frag")) for r in runs], "{:.1f}%", 100)
    frag.set_title("Internal fragmentation\n% of held slots empty", fontsize=9)
    frag.set_xlabel("% (lower is better)")
    frag.set_yticks(y, [r.label for r in runs])
    frag.set_ylim(-0.6, n - 0.4)

    cached = [bool(r.setting("prefix_cache")) for r in runs]
    _hbars(hits, y, runs, [_pct(r.metric("prefix_hit_rate")) if c else None for r, c in zip(runs, cached)],
           "{:.1f}%", 100, missing=["–" if c else "no prefix cache" for c in cached])
    handles = []
    ceiling = section.ceiling
    if ceiling is not None:
        line = hits.axvline(100 * ceiling, gid="ceiling", label=f"ceiling: ideal hit rate {ceiling:.1%}",
                            **CEILING_STYLE)
        handles.append(line)
    hits.set_title("Prefix hit rate\n% of prompt tokens", fontsize=9)
    hits.set_xlabel("% (higher is better)")

    means = [r.metric("mean_running") for r in runs]
    peaks = [r.metric("peak_running") for r in runs]
    top = max([p for p in peaks + means if p is not None] or [1]) * 1.3
    _hbars(conc, y, runs, means, "{:.1f}", top)
    for yi, p in zip(y, peaks):
        if p is not None:
            conc.plot([p], [yi], marker="|", ms=12, mew=2, color="black", ls="none")
    handles.append(Line2D([], [], marker="|", ms=10, mew=2, color="black", ls="none", label="peak running"))
    conc.set_title("Concurrency\nmean running sequences", fontsize=9)
    conc.set_xlabel("sequences (higher is better)")

    for ax, key, name in ((ttft, "ttft_ms", "TTFT, time to first token"), (tpot, "tpot_ms", "TPOT, time per output token")):
        _dots(ax, y, runs, f"{key}_p50", f"{key}_p99")
        _log_if_wide(ax, seconds=True)
        ax.set_title(f"{name}\np50 (filled) to p99 (open)", fontsize=9)
        ax.set_xlabel(("log scale" if ax.get_xscale() == "log" else "ms") + " (lower is better)")
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(x=0.15)
    what = ("Slab against paged" if section.baselines else "Each configuration") + \
        ": fragmentation, prefix hits, concurrency, latency"
    more = f" (first {OVERVIEW_MAX} of {len(section.runs)})" if len(section.runs) > n else ""
    finish_rows(fig, axes, handles, f"{what}{more}\n{section.title}")
    return fig


def finish_rows(fig: Figure, axes, handles: list, title: str) -> None:
    """A one-row-per-run figure's last touches: p50/p99 keys in the legend below, no horizontal grid
    or y ticks, the title."""
    handles += [Line2D([], [], marker="o", color="grey", ls="none", label="p50"),
                Line2D([], [], marker="o", color="grey", mfc="white", ls="none", label="p99")]
    for ax in axes:
        ax.grid(axis="y", visible=False)
        ax.tick_params(axis="y", length=0)
    _legend_below(fig, handles)
    fig.suptitle(title, fontsize=10)


# -- against block size ------------------------------------------------------------------------
def _series(section: Section, runs: list[Run]) -> dict[str, list[Run]]:
    """Runs that differ only in block size, as series named by the settings that vary between the
    series; a series needs two block sizes (one block size says nothing about block size)."""
    from kvbench.report.words import label

    names = [n for n in section.varying if n not in (X_SETTING, "layout")]
    keyed: dict[str, list[Run]] = {}
    for r in runs:
        keyed.setdefault(label(r.settings, names, r.unused, loud=True), []).append(r)
    keyed = {k: v for k, v in keyed.items() if len({r.setting(X_SETTING) for r in v}) >= 2}
    members = [r for v in keyed.values() for r in v]
    names = [n for n in names if len({str(r.setting(n)) for r in members}) > 1]  # what tells series apart
    out: dict[str, list[Run]] = {}
    for loud in (False, True):
        out = {}
        for v in keyed.values():
            out[label(v[0].settings, names, v[0].unused, loud=loud) or "paged"] = v
        if len(out) == len(keyed):
            break
    return {k: sorted(v, key=lambda r: r.setting(X_SETTING)) for k, v in out.items()}


def block_size(section: Section) -> Figure | None:
    on_x = [r for r in section.runs if r.setting(X_SETTING) is not None]
    series = _series(section, on_x)
    if not series:
        return None
    cached = {k: [r for r in v if r.setting("prefix_cache")] for k, v in series.items()}
    cached = {k: v for k, v in cached.items() if len(v) >= 2}
    panels = [("internal_frag", "Internal fragmentation (% of held slots empty)", series),
              ("kv_util", "KV utilisation (% of the pool holding tokens)", series)]
    if cached:
        panels.append(("prefix_hit_rate", "Prefix hit rate (% of prompt tokens)", cached))
    fig = _figure(12, 4.2)
    axes = fig.subplots(1, len(panels))
    handles = []
    sizes = sorted({r.setting(X_SETTING) for v in series.values() for r in v})
    for ax, (key, title, groups) in zip(axes, panels):
        for name, group in groups.items():
            first = group[0]
            (line,) = ax.plot([r.setting(X_SETTING) for r in group], [_pct(r.metric(key)) for r in group],
                              marker=first.marker, color=first.color, ms=7, lw=1.5, label=name)
            handles.append(line)
        drawn = np.concatenate([np.asarray(line.get_ydata(), float) for line in ax.get_lines()])
        drawn = drawn[np.isfinite(drawn)]
        top = float(drawn.max()) if len(drawn) else 1.0
        if key == "prefix_hit_rate":
            ideal: dict[int, float] = {}
            for r in on_x:
                if r.metric("ideal_hit_rate") is not None:
                    x = r.setting(X_SETTING)
                    ideal[x] = max(ideal.get(x, 0.0), r.metric("ideal_hit_rate"))
            xs = [x for x in sorted(ideal) if x in sizes]
            if len(xs) >= 2:
                (line,) = ax.plot(xs, [100 * ideal[x] for x in xs], marker="_", ms=10, gid="ceiling",
                                  label="ceiling (infinite cache)", **CEILING_STYLE)
                handles.append(line)
            ax.set_ylim(0, 101)  # levels compared: from zero, however close the rates
        else:
            for b in section.baselines:
                v = _pct(b.metric(key))
                if v is None:
                    continue
                if v <= 3 * top:
                    handles.append(ax.axhline(v, label=b.label, **BASELINE_STYLE))
                    top = max(top, v)
                else:  # a slab far above would flatten the paged lines: named, not drawn
                    handles.append(Line2D([], [], ls="none", label=f"{b.label}: {v:.1f}% (off scale)"))
            ax.set_ylim(0, max(top * 1.15, 1.0))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens per block)")
        ax.set_ylabel("%")
        ax.set_title(title, fontsize=9)
    _legend_below(fig, handles, ncols=5)
    fig.suptitle(f"Against block size ({len(sizes)} sizes){'; slab dashed' if section.baselines else ''}"
                 f"\n{section.title}", fontsize=10)
    return fig


# -- over engine time --------------------------------------------------------------------------
def binned(steps, column: str, hold: bool, bins: int = TIME_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Time-weighted mean of a per-step column in equal bins of engine time: (bin centres s, values).

    ``hold``: the value lasts until the next step starts (memory, which stays put while the engine
    idles); otherwise only for the step's own duration (running sequences: none while idle).
    """
    if not len(steps):
        return np.zeros(0), np.zeros(0)
    # a run of several replicas: each replica's steps on its own, summed (the cluster's total)
    groups = ([g for _, g in steps.groupby("replica", sort=True)]
              if "replica" in steps.columns and steps["replica"].nunique() > 1 else [steps])
    t0 = float(steps["t_s"].min())
    parts = [(g["t_s"].to_numpy(float) - t0, g["dur_ms"].to_numpy(float) / 1e3, g[column].to_numpy(float))
             for g in groups]
    end = max(start[-1] + dur[-1] for start, dur, _ in parts)
    edges = np.linspace(0.0, max(end, 1e-9), bins + 1)
    integral = np.zeros(len(edges))
    for start, dur, values in parts:
        span = np.diff(np.append(start, start[-1] + dur[-1])) if hold else dur
        cum = np.concatenate([[0.0], np.cumsum(values * span)])
        k = np.clip(np.searchsorted(start, edges, side="right") - 1, 0, len(start) - 1)
        integral += cum[k] + values[k] * np.clip(edges - start[k], 0.0, span[k])
    return (edges[:-1] + edges[1:]) / 2, np.diff(integral) / np.diff(edges)


def concurrency(section: Section) -> Figure | None:
    """Running sequences over engine time: one axes for a few runs, one small panel each for more
    (the baseline repeated in grey behind each), nothing past GRID_MAX (the headline has the means)."""
    runs = [r for r in section.runs if len(r.steps)]  # a run that never stepped has no curve
    if not runs or len(runs) > GRID_MAX:
        return None
    curves = {r.name: binned(r.steps, "running", hold=False) for r in runs}
    if len(runs) <= OVERLAY_MAX:
        fig = _figure(10, 3.6)
        ax = fig.subplots()
        for r in runs:
            t, v = curves[r.name]
            ax.plot(t, v, label=f"{r.label} (mean {r.metric('mean_running') or 0:.1f})", alpha=0.9,
                    **_line_style(r))
        ax.set_xlabel("engine time (s)")
        ax.set_ylabel("running sequences")
        ax.set_ylim(bottom=0)
        _legend_below(fig, ax.get_lines(), ncols=2)
    else:
        ncols = 4 if len(runs) > 9 else 3
        fig = _figure(12, 0.9 + 1.75 * math.ceil(len(runs) / ncols))
        axes = _grid(fig, len(runs), ncols, sharex=True, sharey=True)
        base = next((r for r in runs if r.is_baseline), None)
        handles = []
        top = max([float(np.max(v)) for _, v in curves.values() if len(v)] or [1.0]) * 1.08
        for ax, r in zip(axes, runs):
            if base is not None and r is not base:
                t, v = curves[base.name]
                handles += ax.plot(t, v, color="0.6", lw=0.9, label=f"{base.label} (for reference)")
            t, v = curves[r.name]
            ax.plot(t, v, color=r.color, lw=1.1)
            ax.set_title(f"{r.label} · mean {r.metric('mean_running') or 0:.1f}", fontsize=8)
            ax.set_ylim(0, top)
            ax.set_xlabel("engine time (s)")
            ax.set_ylabel("running seqs")
        _outer_labels(axes, ncols)
        _legend_below(fig, handles)
    fig.suptitle(f"Concurrency over engine time (time-weighted mean per bin)\n{section.title}", fontsize=10)
    return fig


def memory_timeline(section: Section) -> Figure | None:
    """Per run, KV token slots over engine time: live tokens, empty slots in the blocks running
    sequences hold (internal fragmentation), cached prefix blocks. One y scale for the group, cut at
    what the runs used; the pool's size is drawn only when it is on that scale. A run that does not
    know its live tokens (a live run: a server reports blocks in use, not tokens) is left out."""
    runs = [r for r in section.runs if len(r.steps) and r.steps["tokens_live"].notna().any()][:GRID_MAX]
    if not runs:
        return None
    stacks = {}
    for r in runs:
        t, live = binned(r.steps, "tokens_live", hold=True)
        _, held = binned(r.steps, "slots_allocated", hold=True)
        _, cached = binned(r.steps, "blocks_cached", hold=True)
        stacks[r.name] = (t, [live, np.maximum(held - live, 0), cached * r.block_size])
    used = max([float(np.max(sum(s))) for _, s in stacks.values() if len(s[0])] or [1.0])
    pools = [r.metric("kv_capacity_tokens") for r in runs if r.metric("kv_capacity_tokens")]
    pool = max(pools) if pools else None
    on_scale = pool is not None and pool <= 1.3 * used
    top = (pool if on_scale else used) * 1.08 or 1.0
    ncols = 4 if len(runs) > 9 else min(3, len(runs))
    fig = _figure(12 if ncols > 2 else 8, 1.0 + 1.9 * math.ceil(len(runs) / ncols))
    axes = _grid(fig, len(runs), ncols, sharex=True, sharey=True)
    handles = []
    for ax, r in zip(axes, runs):
        t, parts = stacks[r.name]
        handles += ax.stackplot(t, *parts, colors=[c for _, c in MEMORY_PARTS],
                                labels=[n for n, _ in MEMORY_PARTS], lw=0)
        if on_scale and r.metric("kv_capacity_tokens"):
            handles.append(ax.axhline(r.metric("kv_capacity_tokens"), color="black", ls=":", lw=1.2,
                                      label="pool capacity"))
        ax.set_title(r.label, fontsize=8)
        ax.set_ylim(0, top)
        ax.margins(x=0)
        ax.set_xlabel("engine time (s)")
        ax.set_ylabel("KV token slots")
    _outer_labels(axes, ncols)
    _legend_below(fig, handles)
    scale = "" if on_scale or pool is None else \
        f"; pool {pool:,.0f} token slots, axis cut at {top:,.0f} (the most used)"
    more = f"; first {GRID_MAX} of {len(section.runs)} runs" if len(section.runs) > GRID_MAX else ""
    fig.suptitle(f"KV memory over engine time{scale}{more}\n{section.title}", fontsize=10)
    return fig


# -- per request -------------------------------------------------------------------------------
LATENCIES = (("ttft_ms", "TTFT: time to first token"), ("tpot_ms", "TPOT: time per output token"),
             ("e2e_ms", "E2E: end-to-end latency"))


def latency(section: Section) -> Figure | None:
    """CDFs for a few runs; p50/p90/p99 dots per configuration for more."""
    runs = [r for r in section.runs if any(r.metric(f"{c}_p50") is not None for c, _ in LATENCIES)]
    if not runs:  # no request finished
        return None
    if len(runs) <= CDF_MAX:
        fig = _figure(12, 3.6)
        axes = fig.subplots(1, 3, sharey=True)
        for ax, (column, name) in zip(axes, LATENCIES):
            for r in runs:
                v = np.sort(r.requests[column].to_numpy(float))
                v = v[np.isfinite(v) & (v > 0)]
                if len(v):
                    one = len(np.unique(v)) < 2  # a single value is a point, not a line
                    ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=r.label, marker=r.marker if one else None,
                            **({**_line_style(r), "ls": "none"} if one else _line_style(r)))
            _log_if_wide(ax, seconds=True)
            ax.set_xlabel(f"{column.split('_')[0].upper()} ({'log scale' if ax.get_xscale() == 'log' else 'ms'})")
            ax.set_title(name, fontsize=9)
        axes[0].set_ylabel("share of requests (CDF)")
        axes[0].set_ylim(0, 1.02)
        _legend_below(fig, axes[0].get_lines(), ncols=3)
        fig.suptitle(f"Latency distributions\n{section.title}", fontsize=10)
        return fig
    n = len(runs)
    fig = _figure(12, 1.7 + 0.28 * n)
    axes = fig.subplots(1, 3, sharey=True)
    y = np.arange(n)[::-1]
    for ax, (column, name) in zip(axes, LATENCIES):
        for yi, r in zip(y, runs):
            pts = [r.metric(f"{column}_{p}") for p in ("p50", "p90", "p99")]
            have = [p for p in pts if p is not None]
            if len(have) >= 2 and max(have) > min(have):
                ax.hlines(yi, min(have), max(have), color=r.color, lw=2, alpha=0.35)
            for p, fill in zip(pts, (r.color, "0.85", "white")):
                if p is not None:
                    ax.plot([p], [yi], marker=r.marker, color=r.color, mfc=fill, ms=6, ls="none")
        _log_if_wide(ax, seconds=True)
        ax.margins(x=0.1)
        ax.set_xlabel("log scale" if ax.get_xscale() == "log" else "ms")
        ax.set_title(name, fontsize=9)
        ax.grid(axis="y", visible=False)
    axes[0].set_yticks(y, [r.label for r in runs])
    axes[0].set_ylim(-0.6, n - 0.4)
    _legend_below(fig, [Line2D([], [], marker="o", color="grey", mfc=f, ls="none", label=p)
                        for p, f in (("p50", "grey"), ("p90", "0.85"), ("p99", "white"))])
    fig.suptitle(f"Latency percentiles per configuration\n{section.title}", fontsize=10)
    return fig


def eviction(section: Section) -> Figure | None:
    """Where token eviction ran: tokens evicted, recalled and offloaded per configuration, and the
    attention mass kept where it was measured (model executor)."""
    runs = [r for r in section.runs if r.setting("eviction") not in (None, "none")]
    if not runs:
        return None
    mass = [r.metric("attention_mass_kept") for r in runs]
    measured = any(m is not None for m in mass)
    n = len(runs)
    fig = _figure(12 if measured else 8, 1.7 + 0.42 * n)
    axes = fig.subplots(1, 2 if measured else 1, sharey=True, squeeze=False).ravel()
    y = np.arange(n)[::-1]
    counters = [(k, name, c) for k, name, c in (("evicted_tokens", "evicted", "#d62728"),
                                                 ("recalled_tokens", "recalled", "#2ca02c"),
                                                 ("offloaded_tokens", "offloaded", "#9467bd"))
                if any(r.metric(k) for r in runs)] or [("evicted_tokens", "evicted", "#d62728")]
    h = 0.8 / len(counters)
    handles = []
    for i, (key, name, color) in enumerate(counters):
        vals = [r.metric(key) or 0 for r in runs]
        bars = axes[0].barh(y + 0.4 - h * (i + 0.5), vals, h, color=color, label=f"{name} tokens")
        axes[0].bar_label(bars, fmt="{:,.0f}", fontsize=7, padding=2)
        handles.append(bars)
    axes[0].margins(x=0.2)
    axes[0].set_xlim(left=0)
    axes[0].set_xlabel("tokens (whole run)")
    axes[0].set_title("Tokens evicted, recalled and offloaded", fontsize=9)
    axes[0].set_yticks(y, [r.label for r in runs])
    axes[0].set_ylim(-0.6, n - 0.4)
    if measured:
        # drawn as what is lost, from zero: 98.4% and 99.0% kept differ by a third in what is lost
        lost = [None if m is None else 100 * (1 - m) for m in mass]
        top = max([v for v in lost if v is not None] or [1.0]) * 1.6
        _hbars(axes[1], y, runs, lost, "{:.1f}%", top, missing="not measured (sim)",
               texts=[None if m is None else f"{100 * m:.1f}% kept" for m in mass])
        axes[1].set_xlabel("% of the full cache's attention weight lost (lower is better)")
        axes[1].set_title("Attention mass kept by the evicting cache", fontsize=9)
    for ax in axes:
        ax.grid(axis="y", visible=False)
    _legend_below(fig, handles)
    fig.suptitle(f"Token eviction\n{section.title}", fontsize=10)
    return fig
