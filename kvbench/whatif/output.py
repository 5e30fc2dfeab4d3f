"""The what-if's results and outputs: the records (``WhatIfHead``, ``WhatIf``), whatif.parquet (one row
per budget and policy), whatif.png and whatif.json, and the terminal's tables (``TextTable``: text only,
laid out by the command's printer); the frame both what-ifs (the curve's, the tiers') write."""
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


# --------------------------------------------------------------------------------- tables

@dataclass(slots=True)
class TextTable:
    """A terminal table as text: what its cells say, never how wide they may be. The command prints
    it through its terminal-aware printer (kvbench.cli.console.print_table), which lays it out at the
    terminal's width, one row per block where it does not fit, and whole when piped."""

    title: str
    columns: list[str]
    rows: list[list[str]]  # one text per column
    caption: str = ""
    words: frozenset[str] = frozenset()  # columns of words, aligned left; the others hold figures
    best: frozenset[tuple[int, int]] = frozenset()  # (row, column): the best figure of its row


def table(w: WhatIf) -> TextTable:
    """One row per budget, one column per policy (the best of a row marked), then the ceiling."""
    policies = list(dict.fromkeys(r["policy"] for r in w.rows))
    by_budget: dict[int, dict] = {}
    for r in w.rows:
        cells = by_budget.setdefault(r["budget_bytes"], {"blocks": r["budget_blocks"], "label": r["budget"]})
        cells[r["policy"]] = r
    rows, best = [], set()
    for i, (_, cells) in enumerate(sorted(by_budget.items())):
        best |= {(i, 2 + j) for j in _best([cells[p]["hit_rate"] for p in policies])}
        rows.append([cells["label"], f"{cells['blocks']:,}", *(f"{cells[p]['hit_rate']:.4f}" for p in policies),
                     f"{w.ceiling:.4f}"])
    return TextTable(f"prefix hit rate: {os.path.basename(w.trace)}"
                     + (" (radix: SGLang's node eviction)" if w.prefix_mode == "radix" else ""),
                     ["budget", "blocks", *column_names(policies).values(), "ceiling"], rows,
                     caption=f"block {w.block_size} tokens; {w.model} {w.kv_dtype}: {w.kv_bytes_per_token:,} B of KV "
                             f"per token; last {w.window_requests:,} of {w.requests:,} requests counted (warm-up "
                             f"{w.warmup:g})", best=frozenset(best))


VERSUS_LRU_CAPTION = ("points: 100 x (hit rate - lru's); (13%): the share of the lru -> belady gap closed, (hit "
                      "rate - lru's) / (belady's - lru's), given where a policy does at least as well as lru; gap: "
                      "belady's hit rate - lru's, in points")


def _best(values: list) -> list[int]:
    """Where the highest of a row's figures are (None: no figure); none where they are all equal."""
    have = [v for v in values if v is not None]
    if len(set(have)) < 2:
        return []
    return [j for j, v in enumerate(values) if v == max(have)]


def versus_lru(hit_rate: float, lru: float, belady: float | None) -> str:
    """One policy against lru at one budget, as every table writes it: the hit-rate difference in
    points, signed, then the share of the lru -> belady gap closed where that share means something
    (the policy at least as good as lru, belady better than lru), or 'below lru' where the policy
    does worse: '+1.70 (13%)', '-4.94 (below lru)', '+0.00' with no gap. A share below zero is never
    written: over a small gap a small loss would read as -500%."""
    text = points(hit_rate - lru)
    if hit_rate < lru:
        return f"{text} (below lru)"
    if belady is not None and belady > lru:
        return f"{text} ({(hit_rate - lru) / (belady - lru):.0%})"
    return text


def points(diff: float) -> str:
    """A difference of two hit rates in percentage points, signed, two decimals; one that rounds to
    zero without being zero is '+<0.01' or '-<0.01', so that its sign is not lost."""
    text = f"{100 * diff:+.2f}"
    if diff and float(text) == 0:
        return f"{'+' if diff > 0 else '-'}<0.01"
    return text


def gap_table(w: WhatIf) -> TextTable | None:
    """The curve's policies against lru (``versus_lru_table``)."""
    return versus_lru_table(w.rows)


def versus_lru_table(rows: Sequence[dict]) -> TextTable | None:
    """Every policy but lru and belady against lru, one row per budget: the points gained or lost and
    the share of the lru -> belady gap closed (``versus_lru``), with the gap itself; None without lru,
    belady and another policy. ``rows``: what-if rows (budget_bytes, policy, hit_rate; budget, the
    label, where they have it): a WhatIf's, or whatif.parquet's as kvbench report reads it."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    others = [p for p in policies if p not in ("lru", "belady")]
    if not others or "lru" not in policies or "belady" not in policies:
        return None
    by_budget: dict[float, dict] = {}
    for r in rows:
        label = r.get("budget")
        cells = by_budget.setdefault(r["budget_bytes"], {
            "label": label if isinstance(label, str) else format_bytes(int(r["budget_bytes"]))})
        cells[r["policy"]] = r["hit_rate"]
    out: list[list[str]] = []
    best = set()
    for _, cells in sorted(by_budget.items()):
        lru, opt = cells.get("lru"), cells.get("belady")
        if lru is None:
            continue
        best |= {(len(out), 2 + j) for j in _best([cells.get(p) for p in others])}
        out.append([cells["label"], "-" if opt is None else f"{100 * (opt - lru):.2f}" if opt > lru else "none",
                    *("-" if p not in cells else versus_lru(cells[p], lru, opt) for p in others)])
    return TextTable("each policy against lru: hit-rate points (share of the lru -> belady gap closed)",
                     ["budget", "gap", *column_names(others).values()], out, caption=VERSUS_LRU_CAPTION,
                     best=frozenset(best))


def tiers_table(w, tiers: Sequence[str]) -> TextTable:
    """The tiered what-if (kvbench.whatif.tiers.TieredWhatIf): one row per (gpu, cpu, disk) sizes and
    GPU policy, the hit rate of each tier (of ``tiers``, fastest first: the gpu and each lower tier
    some row has), their total and the ceiling."""
    shown = [t for t in tiers if t == "gpu" or any(r[f"{t}_blocks"] for r in w.rows)]
    rows = [[*(r[name] for name in shown), column_names([r["policy"]])[r["policy"]],
             *(f"{r[f'hit_rate_{name}']:.4f}" for name in shown), f"{r['hit_rate']:.4f}", f"{w.ceiling:.4f}"]
            for r in w.rows]
    return TextTable(f"prefix hit rate by tier: {os.path.basename(w.trace)}",
                     [*shown, "policy", *(f"hit {name}" for name in shown), "total", "ceiling"], rows,
                     caption=f"block {w.block_size} tokens; {w.model} {w.kv_dtype}: {w.kv_bytes_per_token:,} B of "
                             f"KV per token; lower tiers {w.tier_policy}, {w.offload}; last {w.window_requests:,} of "
                             f"{w.requests:,} requests counted (warm-up {w.warmup:g})",
                     words=frozenset({"policy"}))
