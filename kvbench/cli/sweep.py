"""``kvbench sweep``: every replay option as a comma list, the grid run into one resumable directory.

The options come from kvbench.cli.replay.REPLAY_OPTIONS, so sweep and replay share every name and type; the
grid, the resume rule and the workers live in kvbench.sweep.runner.
"""
from __future__ import annotations

import os
import sys

import click

from kvbench.cli.console import Column, print_table, progress_bar
from kvbench.cli.replay import REPLAY_OPTIONS, metadata_option
from kvbench.cli.types import Count, Finite
from kvbench.engine.config import has_tiers
from kvbench.errors import RunError
from kvbench.jsonio import dumps
from kvbench.sweep import (
    Event,
    add_comparisons,
    compares,
    default_sweep_dir,
    expand,
    import_ray,
    make_sweep_dir,
    parse_grid,
    preflight,
    run_sweep,
)

TABLE = [("output_tok_per_s", "tok/s", "{:.0f}"), ("ttft_ms_p50", "TTFT p50 ms", "{:.1f}"),
         ("e2e_ms_p50", "E2E p50 ms", "{:.0f}"), ("prefix_hit_rate", "hit rate", "{:.3f}"),
         ("internal_frag", "int. frag", "{:.3f}"), ("kv_util", "KV util", "{:.3f}"),
         ("mean_running", "mean running", "{:.1f}"), ("preemptions", "preempt", "{:.0f}")]
# shown when some configuration evicts tokens
EVICTION_TABLE = [("evicted_tokens", "evicted", "{:,.0f}"), ("recalled_tokens", "recalled", "{:,.0f}"),
                  ("attention_mass_kept", "attn mass kept", "{:.3f}")]
# shown when some configuration has prefix-cache tiers
TIER_TABLE = [("hit_rate_cpu", "CPU tier hits", "{:.3f}"), ("hit_rate_disk", "disk tier hits", "{:.3f}"),
              ("load_s", "tier load s", "{:.1f}")]


def grid_options(fn):
    """Every replay option, taking a comma list (default: replay's default)."""
    for o in reversed(REPLAY_OPTIONS):
        hint = "on,off" if o.kind == "flag" else "comma list"
        fn = click.option(o.flag, o.name, type=str, default=None, metavar="LIST",
                          help=f"{o.help} ({hint})")(fn)
    return fn


class _Display:
    """Progress across the grid on stderr (a rich bar when stderr is a terminal, else nothing)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.running: list[str] = []
        if not enabled:
            return
        self.bar = progress_bar("sweep")
        self.task = self.bar.add_task("sweep", total=total, info="")

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def __call__(self, e: Event) -> None:
        if e.kind == "start":
            self.running.append(e.name)
        elif e.name in self.running:
            self.running.remove(e.name)
        if e.kind == "fail":
            click.echo(f"kvbench: {e.name} failed: {e.error}", err=True)
        elif e.kind in ("skip", "note"):
            click.echo(f"kvbench sweep: {e.name}: {e.message}", err=True)
        if self.bar is None:
            return
        if e.kind in ("done", "skip", "fail"):
            self.bar.advance(self.task)
        self.bar.update(self.task, info="running: " + ", ".join(self.running[:3])
                        + (" ..." if len(self.running) > 3 else ""))


def _print_table(state, out_dir: str, grid: dict) -> None:
    from kvbench.report.words import performs_alike, rows_identical, why_identical

    summaries = [state.summaries.get(c.name) or {} for c in state.configs]
    columns = list(TABLE)
    if any(c.settings.get("eviction", "none") != "none" for c in state.configs):
        columns += EVICTION_TABLE
    if any(has_tiers(c.settings) for c in state.configs):
        columns += TIER_TABLE
    done = [s for s in summaries if s]
    varying = [n for n, values in grid.items() if len(values) > 1]
    notes = []
    if rows_identical(done, [k for k, _, _ in columns]):
        notes.append(why_identical(varying, done))
    else:
        alike = performs_alike(done, measured=any(c.settings.get("executor") != "sim" for c in state.configs))
        if alike:
            notes.append(alike)
    notes.append(f"charts: kvbench report {out_dir}")
    vs_slab = "slab" in grid.get("layout", ())
    heads = [Column("run", right=False)] + ([Column("vs slab", right=False)] if vs_slab else [])
    heads += [Column(label) for _, label, _ in columns] + [Column("status", right=False)]
    rows = []
    for c, s in zip(state.configs, summaries):
        cells = ["-" if s.get(k) is None else fmt.format(s[k]) for k, _, fmt in columns]
        first = [compares(c.settings, grid)] if vs_slab else []
        rows.append([c.name, *first, *cells, state.status.get(c.name, "pending").split(":")[0]])
    print_table(f"kvbench sweep -> {out_dir}", heads, rows, caption="\n".join(notes))


@click.command(epilog="""
\b
Examples:
  kvbench sweep traces/chat.jsonl --block-size 8,16,32,64 --layout paged,slab \\
      --max-model-len 8192 --kv-mem 4GiB --time-scale 0.1 -j 2
  kvbench sweep traces/agent.jsonl --executor model --eviction none,h2o,infinigen \\
      --backend ray --ray-address auto
Re-running the same command resumes: finished configurations are kept, the rest are run again.
""")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@grid_options
@click.option("-j", "--jobs", type=Count(1, 256), default=1, show_default=True,
              help="local worker processes")
@click.option("--out", "out", type=str, default=None,
              help="sweep directory, or a storage URI every Ray node reaches (s3://..., gs://..., any "
                   "pyarrow filesystem) [default: a directory named after the trace and the grid]")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local processes, or one Ray task per configuration (pip install 'kvbench[ray]')")
@click.option("--ray-address", default=None,
              help="Ray cluster to join (e.g. auto, ray://head:10001) [default: start a local one]; the "
                   "trace goes to the workers through Ray and their runs come back to --out")
@click.option("--cpus-per-task", type=Finite(min=0, max=1024), default=1.0, show_default=True,
              help="ray: CPUs each configuration's task asks for (the model executor also asks one GPU)")
@click.option("--max-retries", type=Count(0, 100), default=3, show_default=True,
              help="ray: times a task lost with its node is run again")
@metadata_option
@click.option("--csv", "csv", is_flag=True, help="also write sweep.parquet as sweep.csv")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
def sweep(trace, jobs, out, backend, ray_address, cpus_per_task, max_retries, metadata, csv, as_json, **raw):
    """Replay TRACE under every configuration of a grid: one run directory per distinct
    configuration, plus sweep.parquet (one row per configuration) and sweep.json (the grid)."""
    from kvbench.provenance import Invocation, file_sha256
    from kvbench.sweep.runner import check_sweep_dir
    from kvbench.sweep.store import SweepStore
    from kvbench.trace.format import load_trace

    grid, notes = add_comparisons(parse_grid(raw, REPLAY_OPTIONS))
    for note in notes:
        click.echo(f"kvbench sweep: {note}", err=True)
    configs = expand(grid)  # checks every configuration before anything runs
    total = len(configs)
    # a bad trace exits 2 now; so does a request no configuration's pool could hold
    requests = load_trace(trace, limit=None if None in grid.get("limit", [None]) else max(grid["limit"]))
    if backend == "ray":
        import_ray()
    preflight(configs, requests, trace)
    out = out or default_sweep_dir(trace, grid)
    check_sweep_dir(SweepStore(out), os.path.abspath(trace), file_sha256(trace), grid)  # before a word is said
    make_sweep_dir(out)
    click.echo(f"kvbench sweep: {total} configuration{'s' * (total != 1)} -> {out}", err=True)
    from kvbench.cli.console import say_compiling
    from kvbench.jit import REPLAY_MODULES

    say_compiling(REPLAY_MODULES)
    display = _Display(total, enabled=sys.stderr.isatty() and not as_json)
    try:
        with display:
            state = run_sweep(trace, grid, out, jobs=jobs, backend=backend, ray_address=ray_address,
                              on_event=display, cpus_per_task=cpus_per_task, max_retries=max_retries,
                              invocation=Invocation.from_argv(metadata))
    except KeyboardInterrupt:
        click.echo(f"kvbench: interrupted; finished runs kept in {out}; "
                   "run the same command again to resume", err=True)
        sys.exit(130)
    failed = [n for n, st in state.status.items() if st.startswith("failed")]
    if csv and state.store.local is not None:
        from kvbench.report.export import export_csv

        export_csv(out)
    if as_json:
        click.echo(dumps({"sweep_dir": out, "configurations": total,
                               "ran": sum(st == "done" for st in state.status.values()),
                               "skipped": sum(st == "skipped" for st in state.status.values()),
                               "failed": failed, "parquet": os.path.join(out, "sweep.parquet")}))
    else:
        _print_table(state, out, grid)
    if failed:
        raise RunError(f"{len(failed)} of {total} configurations failed ({', '.join(failed[:3])}"
                       f"{' ...' if len(failed) > 3 else ''}); see {os.path.join(out, 'sweep.json')}")


COMMANDS = [sweep]
