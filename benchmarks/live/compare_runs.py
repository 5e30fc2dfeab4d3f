"""The table of benchmarks/live_check.sh: a vLLM server's figures over its live repeats beside kvbench's
predictions of them, pool by pool, against the goals, with the load the machine carried during each run.

    python benchmarks/live/compare_runs.py DIR      # DIR: what live_check.sh wrote; markdown on stdout

DIR holds cal/ (the calibration's live run and calibrate.txt), one folder per pool and trace (large,
small: the chat trace; agent-large, agent-small: the generated agent trace) with live-1..N and
sim-calibrated, sim-default, and phases.tsv (each phase's start, end and load average). A goal is
judged against the median of the live repeats; the repeats' own range says how far the server moves
between two runs of the same load. A sim is paired with the live runs by the report's rule
(kvbench.report.prediction.predicts) plus the workload settings that rule leaves out.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

import pandas as pd

from kvbench.report.data import Run
from kvbench.report.prediction import predicts

# summary key, name, format, goal kind ("abs": |sim - server| <= tol, "rel": |sim / server - 1| <= tol)
FIGURES = (("prefix_hit_rate", "prefix hit rate", "{:.4f}", "abs", 0.01),
           ("preemptions", "preemptions", "{:.0f}", "rel", 0.25),
           ("ttft_ms_p50", "TTFT p50 (ms)", "{:.1f}", "rel", 0.20),
           ("tpot_ms_p50", "TPOT p50 (ms)", "{:.2f}", "rel", 0.20),
           ("itl_ms_p50", "ITL p50 (ms)", "{:.2f}", None, None))
SIMS = (("sim-calibrated", "predicted (cal.json)"), ("sim-default", "predicted (default clock)"))
# workload settings a sim must share with the live runs beyond the report's engine settings
WORKLOAD = ("time_scale", "max_concurrency", "limit", "overlong", "dependent_turns")


def load(run_dir: str) -> Run | None:
    paths = [os.path.join(run_dir, f) for f in ("config.json", "summary.json")]
    if not all(os.path.exists(p) for p in paths):
        return None
    config, summary = (json.loads(Path(p).read_text()) for p in paths)
    return Run(run_dir, os.path.basename(run_dir), config, summary)


def load_samples(out_dir: str) -> list[tuple[float, float]]:
    """(epoch s, 1-minute load average) every few seconds over the whole check (load.tsv)."""
    path = os.path.join(out_dir, "load.tsv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(float(p[0]), float(p[1])) for p in (line.split() for line in f) if len(p) >= 2]


def phases(out_dir: str) -> dict[str, dict]:
    """phases.tsv rows by phase name, the run folder relative to DIR where the phase is a run's, each
    with ``load_during``: the mean and peak of the 1-minute load average sampled while it ran."""
    path = os.path.join(out_dir, "phases.tsv")
    if not os.path.exists(path):
        return {}
    samples = load_samples(out_dir)
    rows = {}
    with open(path) as f:
        for row in csv.DictReader(f, delimiter="\t"):
            t0, t1 = (time.mktime(time.strptime(row[k], "%Y-%m-%d %H:%M:%S")) for k in ("started", "ended"))
            during = [v for t, v in samples if t0 <= t <= t1 + 1]
            row["load_during"] = f"{statistics.mean(during):.2f} / {max(during):.2f}" if during else "-"
            name = row["phase"]
            rows[os.path.relpath(name.split(":")[0], out_dir) if os.sep in name else name] = row
    return rows


def fmt(v, f: str) -> str:
    return "-" if v is None else f.format(v)


def judge(sim: float | None, server: float | None, kind: str | None, tol: float | None) -> tuple[str, str]:
    """(the error in words, 'yes'/'no'/'' for the goal)."""
    if sim is None or server is None:
        return "-", ""
    if kind == "abs":
        return f"{sim - server:+.4f}", "yes" if abs(sim - server) <= tol + 1e-12 else "no"
    if server == 0:
        err = "0" if sim == 0 else f"+{sim:g} (server 0)"
        return err, ("" if kind is None else "yes" if sim == 0 else "no")
    rel = sim / server - 1
    return f"{rel:+.0%}", ("" if kind is None else "yes" if abs(rel) <= tol + 1e-12 else "no")


def goal_words(kind: str | None, tol: float | None) -> str:
    return "-" if kind is None else f"within {tol:g}" if kind == "abs" else f"within {tol:.0%}"


def mismatches(sim: Run, live: Run) -> list[str]:
    out = [] if predicts(sim, live) else ["engine settings or trace differ (kvbench.report.prediction.predicts)"]
    out += [f"{k}: sim {sim.value(k)!r}, live {live.value(k)!r}" for k in WORKLOAD if sim.value(k) != live.value(k)]
    return out


def pool_tables(out_dir: str, pool: str, ph: dict) -> tuple[list[str], list[str], list[str]]:
    d = os.path.join(out_dir, pool)
    lives = sorted((r for r in (load(os.path.join(d, n)) for n in os.listdir(d) if n.startswith("live-")) if r),
                   key=lambda r: int(r.name.split("-")[1]))
    sims = {key: load(os.path.join(d, key)) for key, _ in SIMS}
    figures, runs, notes = [], [], []
    blocks = lives[0].config.get("server", {}).get("num_gpu_blocks") if lives else None
    label = f"{pool} ({blocks:,} blocks)" if blocks else pool
    for key, name, f, kind, tol in FIGURES:
        vals = [r.metric(key) for r in lives]
        got = [v for v in vals if v is not None]
        med = statistics.median(got) if got else None
        span = f"{fmt(min(got), f)} - {fmt(max(got), f)}" if got else "-"
        row = [label, name, " / ".join(fmt(v, f) for v in vals), span, fmt(med, f)]
        for sim_key, _ in SIMS:
            sim = sims[sim_key]
            v = sim.metric(key) if sim else None
            err, met = judge(v, med, kind, tol)
            row += [fmt(v, f), err] + ([goal_words(kind, tol), met] if sim_key == "sim-calibrated" else [met])
        figures.append("| " + " | ".join(row) + " |")
    for r in [*lives, *(s for s in sims.values() if s)]:
        s, p = r.summary, ph.get(os.path.join(pool, r.name), {})
        done = f"{s.get('completed')} / {s.get('rejected')} / {s.get('truncated')} / {s.get('errors', '-')}"
        runs.append(f"| {pool}/{r.name} | {done} | {fmt(r.metric('mean_running'), '{:.1f}')} | "
                    f"{fmt(r.metric('peak_running'), '{:.0f}')} | {fmt(r.metric('duration_s'), '{:.1f}')} | "
                    f"{p.get('started', '-')} | {p.get('wall_s', '-')} | {p.get('load_during', '-')} | "
                    f"{p.get('load_before', '-')} | {p.get('load_after', '-')} |")
        if r.value("executor") == "live" and (not s.get("complete") or (s.get("errors") or 0) > (s.get("rejected") or 0)):
            notes.append(f"{pool}/{r.name}: complete={s.get('complete')}, errors {s.get('errors')} "
                         f"(of which refused {s.get('rejected')})")
    for sim_key, _ in SIMS:
        sim = sims[sim_key]
        for live in lives if sim else []:
            notes += [f"{pool}/{sim_key} vs {live.name}: {m}" for m in mismatches(sim, live)]
    return figures, runs, notes


def per_request(out_dir: str, pool: str, most: int = 3) -> list[str]:
    """Rows of the per-request table: for each live run of a pool, the served requests whose cached
    tokens (as the server reported them) differ from the calibrated sim's, and by how much."""
    d = os.path.join(out_dir, pool)
    sim_path = os.path.join(d, "sim-calibrated", "requests.parquet")
    if not os.path.exists(sim_path):
        return []
    sim = pd.read_parquet(sim_path).set_index("id")["cached_tokens"]
    rows = []
    for name in sorted(n for n in os.listdir(d) if n.startswith("live-")):
        path = os.path.join(d, name, "requests.parquet")
        if not os.path.exists(path):
            continue
        live = pd.read_parquet(path).set_index("id")
        live = live[live["rejected"].isna() & live["cached_tokens"].notna()]["cached_tokens"]
        both = live.index.intersection(sim.dropna().index)
        diff = (live.loc[both] - sim.loc[both]).astype(int)
        off = diff[diff != 0]
        worst = off.abs().sort_values(ascending=False).index[:most]
        named = ", ".join(f"{i}: {int(live[i])} vs {int(sim[i])}" for i in worst) or "-"
        rows.append(f"| {pool}/{name} | {len(both)} | {len(off)} | {int(off.abs().sum()):,} | "
                    f"{int(off.sum()):+,} | {named} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    a = ap.parse_args()
    ph = phases(a.dir)
    pools = [p for p in ("large", "small", "agent-large", "agent-small") if os.path.isdir(os.path.join(a.dir, p))]
    head = ["pool", "figure", "server: repeat 1 / 2 / ...", "server range", "server median"]
    head += ["predicted (cal.json)", "error", "goal", "met", "predicted (default clock)", "error", "met"]
    figures, runs, notes = [], [], []
    for pool in pools:
        f_, r_, n_ = pool_tables(a.dir, pool, ph)
        figures += f_
        runs += r_
        notes += n_
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    print("\n".join(figures))
    print("\nError: predicted / server median - 1 (hit rate: predicted - server median); a goal is met when the "
          "error is within it.\n")
    print("| run | completed / refused / output cut / errors | mean running | peak running | duration (s) "
          "| started | wall (s) | load during (mean / peak) | load before (1/5/15 min) | load after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cal = load(os.path.join(a.dir, "cal", "live"))
    if cal:
        s, p = cal.summary, ph.get(os.path.join("cal", "live"), {})
        print(f"| cal/live ({os.path.basename(cal.trace.get('path', '?'))}) | {s.get('completed')} / "
              f"{s.get('rejected')} / {s.get('truncated')} / {s.get('errors')} | {fmt(cal.metric('mean_running'), '{:.1f}')} "
              f"| {fmt(cal.metric('peak_running'), '{:.0f}')} | {fmt(cal.metric('duration_s'), '{:.1f}')} | "
              f"{p.get('started', '-')} | {p.get('wall_s', '-')} | {p.get('load_during', '-')} | "
              f"{p.get('load_before', '-')} | {p.get('load_after', '-')} |")
    print("\n".join(runs))
    agent = os.path.join(a.dir, "agent-trace.txt")
    if os.path.exists(agent):
        print(f"\nThe agent trace: `{Path(agent).read_text().strip().removeprefix('agent trace: ')}`")
    print("\nPer request: the served requests whose cached tokens differ between each live run and the "
          "calibrated sim (the server's usage.prompt_tokens_details against requests.parquet):\n")
    print("| run | requests compared | differ | total difference (tokens) | live - sim (tokens) | "
          "largest (id: live vs sim) |")
    print("|---|---|---|---|---|---|")
    for pool in pools:
        print("\n".join(per_request(a.dir, pool)))
    other = [(k, v) for k, v in ph.items() if not os.path.isdir(os.path.join(a.dir, k))]
    if other:
        print("\n| phase | started | wall (s) | load during (mean / peak) | load before | load after |\n"
              "|---|---|---|---|---|---|")
        for k, v in other:
            print(f"| {k} | {v['started']} | {v['wall_s']} | {v['load_during']} | {v['load_before']} | "
                  f"{v['load_after']} |")
    cal_txt = os.path.join(a.dir, "cal", "calibrate.txt")
    if os.path.exists(cal_txt):
        print("\nCalibration (`kvbench calibrate --from-run cal/live`):\n")
        print("\n".join("    " + line for line in Path(cal_txt).read_text().splitlines()))
    print("\nChecks: " + ("; ".join(notes) if notes else "every sim replayed its live runs' requests under "
                          "the same engine and workload settings; every live run complete, no failed request "
                          "beyond those the server refused as too long."))


if __name__ == "__main__":
    main()
