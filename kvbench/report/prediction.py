"""Prediction beside measurement: a live run (``kvbench replay --endpoint``) and the simulated runs that
predicted it, in one section of the report. The report keeps runs apart by executor and hardware; a
live run and a sim run are set side by side instead when they replayed the same requests of the same
trace under the same engine settings (``ENGINE``: block size, pool, sequence cap, token budget, maximum
length, load), the sim's pool counted as the server's usable blocks. The chart draws the two on the
figures a user checks first, the running sequences over time, and each request's prediction error
(predicted / measured - 1, joined by request id, as BLIS reports it); the words say the differences.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from kvbench.report.data import Run

# what must be equal for a sim run to predict a live one (the load's and the engine's settings)
ENGINE = ("block_size", "max_num_seqs", "max_batched_tokens", "max_model_len", "time_scale", "max_concurrency",
          "limit", "prefix_cache")
FIGURES = (("prefix_hit_rate", "prefix hit rate", "{:.3f}"), ("preemptions", "preemptions", "{:.0f}"),
           ("ttft_ms_p50", "TTFT p50 (ms)", "{:.1f}"), ("ttft_ms_p90", "TTFT p90 (ms)", "{:.1f}"),
           ("tpot_ms_p50", "TPOT p50 (ms)", "{:.2f}"), ("tpot_ms_p90", "TPOT p90 (ms)", "{:.2f}"),
           ("itl_ms_p50", "ITL p50 (ms)", "{:.2f}"), ("itl_ms_p90", "ITL p90 (ms)", "{:.2f}"),
           ("mean_running", "mean running", "{:.1f}"), ("output_tok_per_s", "output tok/s", "{:,.0f}"))


@dataclass
class Prediction:
    live: Run
    sims: list[Run]


def is_live(r: Run) -> bool:
    return r.setting("executor") == "live"


# a live run's engine settings are the server's (config.json "server"), where the server told them
SERVER_FIELDS = {"block_size": "block_size", "max_num_seqs": "max_num_seqs",
                 "max_batched_tokens": "max_num_batched_tokens", "max_model_len": "max_model_len",
                 "prefix_cache": "prefix_caching"}


def engine_settings(r: Run) -> dict:
    """The settings ENGINE names and the pool in blocks a request can hold, as the run had them: a
    live run's engine ones from its server (None where the server did not say), a sim's its own."""
    out = {k: r.value(k) for k in ENGINE}
    if is_live(r):
        server = r.config.get("server") or {}
        out.update({k: server.get(v) for k, v in SERVER_FIELDS.items()})
        out["pool"] = server.get("usable_blocks")
    else:
        out["pool"] = r.summary.get("num_blocks")
    return out


def predicts(sim: Run, live: Run) -> bool:
    """The sim run replayed the live run's requests under its settings (one the server did not
    state is taken as agreed)."""
    if sim.trace_key != live.trace_key:
        return False
    a, b = engine_settings(sim), engine_settings(live)
    return all(b[k] is None or a[k] == b[k] for k in b)


def pair(runs: list[Run]) -> list[Prediction]:
    """Each live run with the sim runs that replayed the same requests under the same settings."""
    sims = [r for r in runs if r.setting("executor") == "sim"]
    out = []
    for r in runs:
        if is_live(r):
            mine = [s for s in sims if predicts(s, r)]
            if mine:
                out.append(Prediction(r, mine))
    return out


def _rel(a, b) -> float | None:
    return None if a is None or b in (None, 0) else a / b - 1


def words(p: Prediction) -> list[str]:
    """The differences in words, one sentence per figure that moved more than a few percent."""
    out = []
    for sim in p.sims:
        parts = []
        for key, name, fmt in FIGURES:
            a, b = sim.metric(key), p.live.metric(key)
            if a is None or b is None:
                continue
            if key == "prefix_hit_rate":
                if abs(a - b) >= 0.01:
                    parts.append(f"{name} {fmt.format(a)} against {fmt.format(b)} ({a - b:+.3f})")
            elif key == "preemptions":
                if a != b:
                    parts.append(f"{a:.0f} preemptions against {b:.0f}")
            elif (r := _rel(a, b)) is not None and abs(r) > 0.1:
                parts.append(f"{name} {fmt.format(a)} against {fmt.format(b)} ({r:+.0%})")
        out.append(f"{sim.label or sim.name} predicts " + ("; ".join(parts) if parts else
                                                          "every figure within 10% (hit rate within 0.01)") + ".")
    return out


def request_errors(live: Run, sim: Run, key: str) -> np.ndarray:
    """Per request (joined by id), predicted / measured - 1 of ``key`` (a requests.parquet column)."""
    a = sim.requests.set_index("id")[key]
    b = live.requests.set_index("id")[key]
    both = a.index.intersection(b.index)
    x, y = a.loc[both].to_numpy(dtype=float), b.loc[both].to_numpy(dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (y > 0)
    return x[ok] / y[ok] - 1


def chart(p: Prediction) -> Figure | None:
    from kvbench.report.charts import _figure, binned

    fig = _figure(12, 4.2)
    bars, timeline, errors = fig.subplots(1, 3, width_ratios=[1.4, 1.2, 1])
    runs = [p.live, *p.sims]
    keys = [k for k, _, _ in FIGURES if k.endswith("_p50") or k.endswith("_p90")]
    x = np.arange(len(keys))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        vals = [r.metric(k) or 0.0 for k in keys]
        bars.bar(x + i * width, vals, width, label="measured (server)" if i == 0 else f"predicted: {r.label or r.name}",
                 color="black" if i == 0 else None, alpha=0.8)
    bars.set_xticks(x + width * (len(runs) - 1) / 2, [k.replace("_ms_", " ") for k in keys], rotation=30, fontsize=8)
    bars.set_yscale("log")  # TTFT tails and per-token gaps differ by orders of magnitude
    bars.set_ylabel("ms (log scale)")
    bars.set_title("Latency: measured against predicted", fontsize=9)
    bars.legend(fontsize=7)
    for i, r in enumerate(runs):
        if len(r.steps) and r.steps["running"].notna().any():
            t, running = binned(r.steps, "running", hold=True)
            timeline.plot(t - (t[0] if len(t) else 0), running, lw=1.2, color="black" if i == 0 else None,
                          label="measured" if i == 0 else "predicted")
    timeline.set_ylim(bottom=0)  # measured against predicted levels: from zero
    timeline.set_title("Running sequences over time", fontsize=9)
    timeline.set_xlabel("seconds from the first request")
    timeline.legend(fontsize=7)
    for key, label in (("ttft_ms", "TTFT"), ("e2e_ms", "E2E")):
        for sim in p.sims:
            err = request_errors(p.live, sim, key)
            if len(err):
                errors.hist(np.clip(err, -1, 2), bins=30, alpha=0.5, label=f"{label} ({sim.label or sim.name})")
    errors.axvline(0, color="black", lw=1)
    errors.set_title("Per request: predicted / measured - 1", fontsize=9)
    errors.legend(fontsize=7)
    fig.suptitle(f"Prediction beside measurement: {p.live.name}", fontsize=10)
    return fig


def table(p: Prediction) -> list[list[str]]:
    """Rows (figure, measured, each prediction) for the page."""
    rows = []
    for key, name, fmt in FIGURES:
        cells = [name]
        for r in (p.live, *p.sims):
            v = r.metric(key)
            cells.append("–" if v is None else fmt.format(v))
        rows.append(cells)
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        cells = [f"{label}: median |per-request error|", ""]
        for sim in p.sims:
            err = request_errors(p.live, sim, key)
            cells.append(f"{np.median(np.abs(err)):.0%}" if len(err) else "–")
        rows.append(cells)
    return rows
