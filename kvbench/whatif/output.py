"""The what-if's results and outputs: the records (``WhatIfHead``, ``WhatIf``), whatif.parquet (one row
per budget and policy), whatif.png and whatif.json, and the terminal's tables; the frame both what-ifs
(the curve's, the tiers') write."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvbench.jsonio import dumps
from kvbench.memory.policies import split_policy
from kvbench.whatif.blocktrace import BlockTrace

COLUMNS = ["budget_bytes", "budget_blocks", "policy", "hit_rate", "ceiling"]  # read by kvbench report
PARQUET = "whatif.parquet"
PNG = "whatif.png"


def column_names(policies: Sequence[str]) -> dict[str, str]:
    """A short header per policy: the registry name (``learned`` for ``learned:FILE``), or the
    whole value when two values share a name."""
    base = {p: split_policy(p)[0] for p in policies}
    return {p: b if list(base.values()).count(b) == 1 else p for p, b in base.items()}


# --------------------------------------------------------------------------------- outputs

def format_bytes(n: int) -> str:
    """8589934592 -> '8GiB'; sizes that are no whole binary unit keep two decimals."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.2f}{unit}"
    return f"{n}B"


@dataclass(slots=True)
class WhatIfHead:
    """What every what-if result opens with (WhatIf, kvbench.whatif.tiers.TieredWhatIf): the
    settings and the prepared trace's counts. ``head`` fills it."""

    trace: str
    model: str
    kv_dtype: str
    kv_bytes_per_token: int
    block_size: int
    warmup: float
    requests: int
    window_requests: int
    window_prompt_tokens: int
    distinct_blocks: int
    ceiling: float
    ceiling_hit_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def head(bt: BlockTrace, *, trace: str, model: str, kv_dtype: str, kv_bytes_per_token: int, block_size: int,
         warmup: float) -> dict:
    """WhatIfHead's fields for a prepared trace: the settings given and the trace's counts."""
    return {"trace": trace, "model": model, "kv_dtype": kv_dtype, "kv_bytes_per_token": kv_bytes_per_token,
            "block_size": block_size, "warmup": warmup, "requests": bt.requests,
            "window_requests": bt.requests - bt.window_start, "window_prompt_tokens": bt.window_prompt_tokens,
            "distinct_blocks": bt.distinct_blocks, "ceiling": bt.ceiling, "ceiling_hit_tokens": bt.ceiling_hit_tokens}


@dataclass(slots=True)
class WhatIf(WhatIfHead):
    """The curve and its settings: what ``--json``, the table, the parquet and the PNG show."""

    rows: list[dict]
    prefix_mode: str = "hash"
    # lru at every budget between the smallest and the largest asked for (log-spaced, at most
    # CURVE_POINTS): {"budget_bytes": [...], "hit_rate": [...]}; None without lru (or in radix mode)
    lru_curve: dict | None = None
    replicas: int = 1  # caches of the budget each, requests routed by router (kvbench.whatif.replicas)
    router: str | None = None
    replica_requests: list[int] | None = None  # requests each replica was sent
    replicas_ceiling: float | None = None  # one infinite cache per replica: the routed ceiling


SETTINGS = ("block_size", "model", "kv_dtype", "kv_bytes_per_token", "warmup", "trace")  # a column each


def to_frame(w, columns: Sequence[str] = tuple(COLUMNS)):
    """A what-if's rows (WhatIf, kvbench.whatif.tiers.TieredWhatIf) as a frame: ``columns`` first, the
    rest after, and each setting of the head (and the prefix mode, where it has one) a column."""
    import pandas as pd

    df = pd.DataFrame(w.rows)
    for name in (*SETTINGS, *(("prefix_mode",) if hasattr(w, "prefix_mode") else ())):
        df[name] = getattr(w, name)
    return df[list(columns) + [c for c in df.columns if c not in columns]]


def write_outputs(w, out_dir: str, columns: Sequence[str] = tuple(COLUMNS), chart: bool = True) -> list[str]:
    """``whatif.parquet`` (one row per point), ``whatif.png`` (the curve's chart: ``plot``; ``chart``
    False for a table it does not draw) and ``whatif.json``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, PARQUET)]
    to_frame(w, columns).to_parquet(paths[0], index=False)
    if chart:
        paths.append(os.path.join(out_dir, PNG))
        plot(w, paths[-1])
    paths.append(os.path.join(out_dir, "whatif.json"))
    with open(paths[-1], "w", encoding="utf-8") as fh:
        fh.write(dumps(w.to_dict(), indent=1))  # null, never NaN, where there is no figure
    return paths


def plot(w: WhatIf, path: str) -> None:
    """Hit rate against budget (log x), one line per policy, the ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    policies = list(dict.fromkeys(r["policy"] for r in w.rows))
    for p, name in column_names(policies).items():
        rows = sorted((r for r in w.rows if r["policy"] == p), key=lambda r: r["budget_bytes"])
        ax.plot([r["budget_bytes"] / 2**30 for r in rows], [r["hit_rate"] for r in rows],
                marker="o", label=name)
    if w.lru_curve is not None:  # lru between the points: one pass gives every budget
        ax.plot([b / 2**30 for b in w.lru_curve["budget_bytes"]], w.lru_curve["hit_rate"], color="gray",
                linewidth=0.8, label="lru, every budget")
    ax.axhline(w.ceiling, color="black", linestyle="--", label=f"ceiling (infinite cache) {w.ceiling:.3f}")
    ax.set_xscale("log", base=2)
    sizes = sorted({(r["budget_bytes"], r["budget"]) for r in w.rows})
    ax.set_xticks([b / 2**30 for b, _ in sizes], [label for _, label in sizes], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(f"KV cache budget (bytes, log scale; {w.model} {w.kv_dtype}: "
                  f"{format_bytes(w.kv_bytes_per_token)}/token)")
    ax.set_ylabel("prefix hit rate (hit tokens / prompt tokens)")
    ax.set_ylim(0, max(0.05, w.ceiling * 1.1, *(r["hit_rate"] * 1.1 for r in w.rows)))
    ax.set_title(f"Prefix hit rate vs KV budget: {os.path.basename(w.trace)}\n"
                 f"{'radix (SGLang: nodes, lru), ' if w.prefix_mode == 'radix' else ''}block size {w.block_size}, last {w.window_requests:,} of {w.requests:,} requests "
                 f"(warm-up {w.warmup:g})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(w: WhatIf):
    """A rich Table: one row per budget, one column per policy, then the ceiling."""
    from rich.table import Table

    policies = list(dict.fromkeys(r["policy"] for r in w.rows))
    t = Table(title=f"prefix hit rate: {os.path.basename(w.trace)}"
                    + (" (radix: SGLang's node eviction)" if w.prefix_mode == "radix" else ""),
              caption=f"block {w.block_size} tokens; {w.model} {w.kv_dtype}: "
                      f"{w.kv_bytes_per_token:,} B of KV per token; last {w.window_requests:,} of "
                      f"{w.requests:,} requests counted (warm-up {w.warmup:g})")
    t.add_column("budget", justify="right", min_width=7)
    t.add_column("blocks", justify="right")
    for p, name in column_names(policies).items():
        t.add_column(name, justify="right")
    t.add_column("ceiling", justify="right", style="dim", min_width=7)
    by_budget: dict[int, dict] = {}
    for r in w.rows:
        cells = by_budget.setdefault(r["budget_bytes"], {"blocks": r["budget_blocks"], "label": r["budget"]})
        cells[r["policy"]] = r
    for size, cells in sorted(by_budget.items()):
        best = max(cells[p]["hit_rate"] for p in policies)
        row = [cells["label"], f"{cells['blocks']:,}"]
        for p in policies:
            v = cells[p]["hit_rate"]
            row.append(f"[bold]{v:.4f}[/bold]" if v == best else f"{v:.4f}")
        row.append(f"{w.ceiling:.4f}")
        t.add_row(*row)
    return t


def gap_table(w: WhatIf):
    """A rich Table of the share of the lru -> belady gap each other policy closes, one row per
    budget (a budget with no gap, where belady does no better than lru, shows a dash); None
    without lru and belady among the policies."""
    from rich.table import Table

    policies = [p for p in dict.fromkeys(r["policy"] for r in w.rows) if p not in ("lru", "belady")]
    if not policies or not any(r.get("gap_closed") is not None for r in w.rows):
        return None
    t = Table(title="share of the lru -> belady gap closed",
              caption="(hit rate - lru's) / (belady's - lru's) at each budget: 0% is lru, 100% belady")
    t.add_column("budget", justify="right")
    for name in column_names(policies).values():
        t.add_column(name, justify="right")
    by_budget: dict[int, dict] = {}
    for r in w.rows:
        by_budget.setdefault(r["budget_bytes"], {"label": r["budget"]})[r["policy"]] = r.get("gap_closed")
    for _, cells in sorted(by_budget.items()):
        gaps = [cells[p] for p in policies]
        best = max((g for g in gaps if g is not None), default=None)
        t.add_row(cells["label"], *("-" if g is None else f"[bold]{g:.0%}[/bold]" if g == best else f"{g:.0%}"
                                    for g in gaps))
    return t
