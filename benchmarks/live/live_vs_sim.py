"""A trace sent to a running server (kvbench replay --endpoint), then simulated with the server's own
settings (ServerSettings.replay_fields: block size, usable blocks, max-num-seqs, max-batched-tokens,
max-model-len, prefix caching), and the two side by side.

    python benchmarks/live/live_vs_sim.py traces/chat.jsonl --endpoint http://127.0.0.1:8011 \
        [--server-log /tmp/vllm-cpu-8011.log] [--limit 40] [--time-scale 0.1] [--max-concurrency 8] \
        [--model tiny] [--out runs/live-vs-sim]

The settings come from the running server, or from its start-up log with --server-log. The sim's
times are its cost model's (--gpu, default h200), not the server's hardware: compare the memory and
cache figures, and read the times as what the modelled GPU would do. Run the client on a CPU the
server does not use (benchmarks/live/NOTES.md: taskset -c 0 for the client, the server on CPU 1).
"""
from __future__ import annotations

import argparse
import os

from kvbench.cli.console import Column, print_table
from kvbench.engine.config import ReplayConfig
from kvbench.engine.live import LiveOptions, replay_live
from kvbench.engine.replay import replay
from kvbench.engine.server import server_settings_from_log, server_settings_from_server

ROWS = [("requests", "{:.0f}"), ("completed", "{:.0f}"), ("errors", "{:.0f}"), ("prefix_hit_rate", "{:.4f}"),
        ("client_hit_rate", "{:.4f}"), ("ideal_hit_rate", "{:.4f}"), ("preemptions", "{:.0f}"),
        ("peak_running", "{:.0f}"), ("mean_running", "{:.2f}"), ("kv_util", "{:.4f}"), ("ttft_ms_p50", "{:.2f}"),
        ("tpot_ms_p50", "{:.2f}"), ("itl_ms_p50", "{:.2f}"), ("output_tok_per_s", "{:.1f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--server-log", default=None, help="read the settings from this vLLM start-up log")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--model", default="tiny", help="the sim's model (the served model's shape)")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--out", default="runs/live-vs-sim")
    a = ap.parse_args()
    settings = (server_settings_from_log(a.server_log) if a.server_log
                else server_settings_from_server(a.endpoint))
    workload = dict(limit=a.limit, time_scale=a.time_scale, max_concurrency=a.max_concurrency,
                    dependent_turns=True, model=a.model)
    live, live_dir = replay_live(a.trace, ReplayConfig(**workload), LiveOptions(endpoint=a.endpoint),
                                 os.path.join(a.out, "live"), force=True)
    sim_dir = os.path.join(a.out, "sim")
    sim = replay(a.trace, ReplayConfig(**workload, gpu=a.gpu, **settings.replay_fields()), sim_dir, force=True)
    fields = ", ".join(f"{k}={v}" for k, v in settings.replay_fields().items())
    rows = [[key, *("-" if s.get(key) is None else fmt.format(s[key]) for s in (live, sim))] for key, fmt in ROWS]
    print_table(f"live ({settings.describe()}) vs sim ({fields})",
                [Column("metric", right=False), Column("live"), Column("sim")], rows,
                caption=f"runs: {live_dir}, {sim_dir}")


if __name__ == "__main__":
    main()
