"""The what-if's charts: hit rate against KV budget, one line per policy (or block size, prefix mode),
and, for the tiered what-if, each combination's hit rate stacked by the tier that served it."""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from kvbench.report.charts import CEILING_STYLE, MARKERS, PALETTE, _figure, _legend_below, _legend_right
from kvbench.report.cluster_charts import TIER_PARTS, _stack_by_tier
from kvbench.report.data import WhatIf


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
        one = g["budget_bytes"].nunique() < 2
        ax.plot(g["budget_bytes"] / 2**30, 100 * g["hit_rate"], marker=MARKERS[i % len(MARKERS)], ms=4,
                ls="none" if one else "-", color=PALETTE[i % len(PALETTE)], label=name)
    if "ceiling" in df.columns:
        ax.axhline(100 * float(df["ceiling"].max()), label="ceiling (infinite cache)", **CEILING_STYLE)
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
    _legend_right(fig, ax.get_lines())
    return fig


def tiered(df) -> bool:
    """A what-if table with tiers behind the GPU (``kvbench trace whatif --tiers``)."""
    return {"hit_rate_gpu", "hit_rate_cpu", "hit_rate_disk"} <= set(df.columns) and any(
        c in df.columns and df[c].fillna(0).astype(float).any() for c in ("cpu_bytes", "disk_bytes"))


def whatif_tiers(w: WhatIf) -> Figure | None:
    """What-if with tiers: one row per policy and budget combination, the hit rate each tier serves
    stacked, the ceiling drawn."""
    df = w.table
    if df.empty or not tiered(df):
        return None
    sizes = [c for c in ("gpu", "cpu", "disk") if f"{c}_bytes" in df.columns]
    df = df.sort_values(["policy", *(f"{c}_bytes" for c in sizes)], kind="stable").reset_index(drop=True)
    n = len(df)
    fig = _figure(10, 1.6 + 0.28 * n)
    ax = fig.subplots()
    y = np.arange(n)[::-1]
    handles = _stack_by_tier(ax, y, {key: df[key].fillna(0).to_numpy(dtype=float) if key in df.columns else np.zeros(n)
                                     for key, _, _ in TIER_PARTS})  # (the what-if has no shared store)
    if "ceiling" in df.columns:
        c = float(df["ceiling"].max())
        handles.append(ax.axvline(100 * c, label=f"ceiling (infinite cache) {c:.1%}", **CEILING_STYLE))

    def label(row) -> str:
        parts = [f"{t} {row[t]}" for t in sizes if t in row and str(row[t]) not in ("0", "None", "nan")]
        return f"{row['policy']}: " + " + ".join(parts)
    ax.set_yticks(y, [label(r) for _, r in df.iterrows()])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("prefix hit rate (% of prompt tokens, higher is better)")
    ax.grid(axis="y", visible=False)
    ax.tick_params(axis="y", length=0)
    ax.set_title(f"What-if with tiers: hit rate served by each tier ({w.label})", weight="bold")
    _legend_below(fig, handles)
    return fig


# (file stem, caption, chart): the order they appear in a section
