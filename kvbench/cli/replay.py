"""``kvbench replay``: one configuration, one run directory (spec §1, §3).

The replay options are declared once, in REPLAY_OPTIONS; ``replay`` takes them typed and ``sweep``
takes each as a comma list (a grid), so the two commands can never disagree on a name or default.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import click

from kvbench.cli.types import PD, Count, Finite
from kvbench.engine import config as C
from kvbench.engine.link import LINKS
from kvbench.engine.config import (
    MAX_BLOCK_SIZE,
    MAX_NUM_BLOCKS,
    MAX_NUM_SEQS,
    MAX_TIME_SCALE,
    ReplayConfig,
)
from kvbench.errors import InputError
from kvbench.jsonio import dumps
from kvbench.trace.format import MAX_REQUEST_TOKENS


@dataclass(frozen=True)
class Opt:
    name: str  # ReplayConfig field
    kind: object  # click type, or "flag" for on/off
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


REPLAY_OPTIONS: list[Opt] = [
    Opt("layout", click.Choice(C.LAYOUTS), "paged blocks, or the slab baseline"),
    Opt("block_size", Count(1, MAX_BLOCK_SIZE), "tokens per KV block (paged)"),
    Opt("slab_reserve", click.Choice(C.SLAB_RESERVES), "slab size: max_model_len, or the request's own prompt+output"),
    Opt("prefix_cache", "flag", "reuse cached prompt blocks across requests"),
    Opt("prefix_mode", click.Choice(C.PREFIX_MODES), "block-hash chain (vLLM) or token radix tree (SGLang)"),
    Opt("cache_policy", str, f"which unused cached block to reclaim first: {', '.join(C.CACHE_POLICIES)}, "
        "or learned:FILE (a model from kvbench trace fit-policy)"),
    Opt("radix_eviction", click.Choice(C.RADIX_EVICTIONS), "radix: evict whole LRU leaf nodes (SGLang), or leaf blocks by --cache-policy"),
    Opt("eviction", click.Choice(C.EVICTIONS), "token-level KV eviction inside a sequence"),
    Opt("kv_budget", Finite(min=0, max=MAX_REQUEST_TOKENS, min_open=True), "per-sequence KV budget: a fraction of the sequence (< 1), or tokens (a whole number >= 1)"),
    Opt("sink_tokens", Count(0), "first tokens every eviction policy keeps"),
    Opt("executor", click.Choice(C.EXECUTORS), "the calibrated cost model (sim), or a real model forward over real KV tensors (model)"),
    Opt("model", str, "preset (tiny, llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, ...) or a local HF model "
        "folder [default: llama-3-8b for the sim; tiny for the model executor on a CPU]"),
    Opt("device", click.Choice(C.DEVICES), "where the model executor runs"),
    Opt("gpu", str, "hardware preset for the sim cost model (h200, h100, a100, a100-40gb, l40s, l4, b200, h20, mi300x)"),
    Opt("tp", Count(1, C.MAX_TP), "sim: tensor parallelism, weights and KV heads over N GPUs, two all-reduces per layer"),
    Opt("kv_dtype", click.Choice(C.KV_DTYPES), "KV cache dtype (sim: fp8 halves KV bytes; the model executor keeps KV in its compute dtype)"),
    Opt("dtype", click.Choice(C.DTYPES), "sim: weight dtype, fp8 on fp8 tensor cores (auto: bf16, or a --calibration's)"),
    Opt("disable_hybrid_kv_cache_manager", "flag", "a model with sliding-window or chunked-local layers: allocate "
        "every layer as full attention in one KV cache group (vLLM --disable-hybrid-kv-cache-manager; the compute "
        "stays windowed); unset: vLLM 0.34's default, off for chunked local attention (Llama 4) only"),
    Opt("front_end", "flag", "sim: each request passes the API server's front end (per request and per prompt "
        "token, one at a time) before the engine; --no-front-end: vLLM's offline LLM class"),
    Opt("eager", "flag", "sim: no CUDA graphs (vLLM --enforce-eager): every layer's kernel launches paid each step"),
    Opt("calibration", click.Path(dir_okay=False), "sim coefficients written by `kvbench calibrate`"),
    Opt("kv_mem", str, "KV pool size, e.g. 16GiB [default: 90% of free device memory after weights]"),
    Opt("num_blocks", Count(1, MAX_NUM_BLOCKS), "KV pool size in blocks (overrides --kv-mem)"),
    Opt("max_num_seqs", Count(1, MAX_NUM_SEQS), "most sequences running at once"),
    Opt("max_batched_tokens", Count(1), "token budget per engine step"),
    Opt("max_model_len", Count(1), "longest request (prompt + output) [default: the model's]"),
    Opt("overlong", click.Choice(C.OVERLONG), "a request longer than --max-model-len: the replayed engine's rule "
        "(vllm: a prompt of the limit or longer refused, a shorter one's output cut at the limit; sglang: prompt + "
        "output over the limit refused, as SGLang without --allow-auto-truncate) or refused whenever it is over "
        "(reject)"),
    Opt("admission", click.Choice(C.ADMISSIONS), "admit a waiting request when its whole prompt fits (vLLM >= 0.33), or its first chunk"),
    Opt("watermark", Finite(0, 1, max_open=True), "share of KV blocks kept free when admitting while others run (vLLM's watermark)"),
    Opt("admission_window", Count(0), "cache-aware admission: once --admission-threshold of the pool is held, "
        "the first N waiting requests go deepest cached prefix first (vLLM 0.34 --cache-aware-admission-window; 0: "
        "arrival order)"),
    Opt("admission_threshold", Finite(0, 1), "pool usage from which --admission-window reorders"),
    Opt("time_scale", Finite(min=0, max=MAX_TIME_SCALE, min_open=True), "multiply arrival times (0.5 = twice the rate)"),
    Opt("max_concurrency", Count(1, C.MAX_CONCURRENCY), "closed loop: at most C requests in flight, the next issued "
        "when one finishes (vllm bench serve --max-concurrency); arrival, queue and TTFT count from the issue"),
    Opt("slo", str, "service-level objectives in ms, e.g. ttft=200,tpot=50 (also e2e, itl: a request's longest "
        "gap): goodput counts the requests that meet all of them (vllm bench serve --goodput)"),
    Opt("dependent_turns", "flag", "a request that re-sends a named answer is issued only once that answer has "
        "finished, as a chat client sends its next turn"),
    Opt("limit", Count(1, 2**31 - 1), "replay only the first N requests"),
    Opt("max_requests", Count(1, 2**31 - 1), "stop issuing after N requests (in arrival order; those issued run "
        "to the end), as vllm bench serve --num-prompts"),
    Opt("max_seconds", Finite(min=0, min_open=True), "stop issuing requests S seconds after the first one "
        "(the sim's clock, or a live run's wall clock); those issued run to the end"),
    Opt("seed", Count(0, 2**63 - 1), "seed for every random choice"),
    Opt("replicas", Count(1, C.MAX_REPLICAS), "engine instances, each its own pool, scheduler and executor, one clock"),
    Opt("router", click.Choice(C.ROUTERS), "which replica an arriving request goes to (with --replicas > 1), or which prefill instance (--disagg); "
        "conductor: Mooncake's, the smallest queue + prefill given what each caches"),
    Opt("router_prefix_blocks", Count(1), "prefix router: leading prompt blocks consistent-hashed to a replica"),
    Opt("router_cache_weight", Finite(0, C.MAX_ROUTER_WEIGHT), "kv-aware: cost weight of the prompt blocks a replica must prefill (Dynamo's overlap weight)"),
    Opt("router_load_weight", Finite(0, C.MAX_ROUTER_WEIGHT), "kv-aware: cost weight of the replica's active blocks"),
    Opt("router_event_delay", Finite(0, C.MAX_ROUTER_WEIGHT), "kv-aware: engine seconds before a replica's KV event reaches the router's index"),
    Opt("disagg", PD(), "disaggregated serving: P:D, P prefill and D decode instances, each prompt's KV crossing "
        "--link to a decode instance, as vLLM's KV connectors (NIXL) run it; unset (or none): every replica "
        "does both phases"),
    Opt("link", click.Choice(tuple(LINKS)), "the network between prefill and decode instances, per GPU: "
        + "; ".join(f"{s.name}: {s.what}" for s in LINKS.values())),
    Opt("link_gbps", Finite(0, 1e5, min_open=True), "the link's rate in Gb/s per GPU and direction (instead of "
        "the preset's line rate: what a transfer reaches)"),
    Opt("link_latency_us", Finite(0, 1e7, min_open=True), "microseconds a transfer adds to its bytes' time "
        "(instead of the preset's)"),
    Opt("disagg_local_prefill", Count(0), "--disagg: a request whose prompt, less what the decode instance it "
        "reaches caches, is at most N tokens is prefilled there (NVIDIA Dynamo's conditional disaggregation, "
        "max_local_prefill_length); 0: every prompt is prefilled remotely"),
    Opt("decode_gpu", str, "--disagg: the decode instances' GPU [default: --gpu]"),
    Opt("decode_tp", Count(1, C.MAX_TP), "--disagg: GPUs per decode instance [default: --tp]"),
    Opt("decode_kv_mem", str, "--disagg: a decode instance's KV pool, e.g. 64GiB [default: --kv-mem]"),
    Opt("decode_num_blocks", Count(1, MAX_NUM_BLOCKS), "--disagg: a decode instance's pool in blocks [default: "
        "--num-blocks]"),
    Opt("decode_max_num_seqs", Count(1, MAX_NUM_SEQS), "--disagg: most sequences running on a decode instance "
        "[default: --max-num-seqs]"),
    Opt("decode_max_batched_tokens", Count(1), "--disagg: a decode instance's token budget per step [default: "
        "--max-batched-tokens]"),
    Opt("cpu_kv_mem", str, "prefix-cache tier in host DRAM behind the GPU pool, e.g. 512GiB (0: none)"),
    Opt("disk_kv_mem", str, "prefix-cache tier on local NVMe behind the CPU tier, e.g. 4TiB (0: none)"),
    Opt("offload", click.Choice(C.OFFLOADS), "blocks enter the tiers when computed (vLLM's, LMCache's offloading), or when evicted from the tier above"),
    Opt("load_policy", click.Choice(C.LOAD_POLICIES), "load tier hits always, or only when faster than recomputing them (the executor's prefill cost)"),
    Opt("cpu_bw", Finite(0, C.MAX_TIER_BW_GBPS, min_open=True), "GB/s per direction between the CPU tier and the GPUs (PCIe Gen5 x16: ~50)"),
    Opt("disk_bw", Finite(0, C.MAX_TIER_BW_GBPS, min_open=True), "GB/s per direction of the disk tier (one datacenter NVMe drive: ~7)"),
    Opt("cpu_cache_policy", str, "which block the CPU tier drops first (any --cache-policy)"),
    Opt("disk_cache_policy", str, "which block the disk tier drops first (any --cache-policy)"),
    Opt("store_kv_mem", str, "a KV store shared by every instance (Mooncake Store, LMCache's remote backend), "
        "e.g. 2TiB (0: none): each writes its computed blocks to it, each finds there what any wrote"),
    Opt("store_bw", Finite(0, C.MAX_TIER_BW_GBPS, min_open=True), "GB/s per direction between an instance and "
        "the store (a DRAM pool over one 400 Gb/s RDMA NIC: ~50; an SSD pool: ~7)"),
    Opt("store_cache_policy", str, "which block the store drops first (any --cache-policy)"),
    Opt("store_delay", Finite(0, C.MAX_STORE_DELAY_S), "seconds after the step that wrote a block ends before "
        "lookups find it in the store (its index's delay)"),
    Opt("store_decode", "flag", "--disagg: decode instances write their blocks (answers) to the store too "
        "(LMCache's save_decode_cache)"),
]
DEFAULTS = ReplayConfig()


def replay_options(fn):
    """Add every replay option, typed, with ReplayConfig's defaults."""
    for o in reversed(REPLAY_OPTIONS):
        default = getattr(DEFAULTS, o.name)
        if o.kind == "flag":
            fn = click.option(f"{o.flag}/--no-{o.flag[2:]}", o.name, default=default,
                              show_default=True, help=o.help)(fn)
        else:
            fn = click.option(o.flag, o.name, type=o.kind, default=default,
                              show_default=default is not None, help=o.help)(fn)
    return fn


def metadata_option(fn):
    """``--metadata KEY=VALUE`` (repeatable): tags recorded in config.json / sweep.json."""
    def convert(ctx, param, value):
        from kvbench.provenance import parse_metadata

        try:
            return parse_metadata(value)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--metadata") from None
    return click.option("--metadata", "metadata", multiple=True, callback=convert, metavar="KEY=VALUE",
                        help="a tag recorded with the results (repeatable), as vllm bench serve's --metadata")(fn)


def what_runs(cfg: ReplayConfig) -> str:
    """One line saying what a replay runs: the executor, the model and its hardware."""
    if cfg.executor == "sim":
        costs = "preset costs"
        if cfg.calibration:
            from kvbench.engine.fit_server import calibration_caveat

            said = calibration_caveat(cfg.calibration)  # a live fit: how it was judged, a poor one loudly
            costs = f"calibration {os.path.basename(cfg.calibration)}" + (f", {said}" if said else "")
        tp = f" x{cfg.tp} (tensor parallel)" if cfg.tp > 1 else ""
        front = ""
        if not cfg.calibration:
            from kvbench.executors import presets
            front = (f"; API server front end {presets.REQUEST_S * 1e3:.1f} + {presets.REQUEST_LATENCY_S * 1e3:.1f} ms "
                     "a request, --no-front-end: none" if cfg.front_end else "; no API server")
        return (f"sim executor: {cfg.model} on the {cfg.gpu.upper()}{tp} cost model ({costs}{front}); "
                "--executor model runs a real forward")
    return f"model executor: {cfg.model} with random weights, a real forward over real KV tensors (--device {cfg.device})"


def default_run_dir(trace: str) -> str:
    stem = os.path.splitext(os.path.basename(trace))[0]
    return os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


HEADLINE = [
    ("requests", "requests", "{:.0f}"), ("completed", "completed", "{:.0f}"),
    ("rejected", "rejected", "{:.0f}"), ("duration_s", "engine time (s)", "{:.2f}"),
    ("output_tok_per_s", "output tok/s", "{:.1f}"), ("ttft_ms_p50", "TTFT p50 (ms)", "{:.1f}"),
    ("ttft_ms_p99", "TTFT p99 (ms)", "{:.1f}"), ("tpot_ms_p50", "TPOT p50 (ms)", "{:.2f}"),
    ("e2e_ms_p50", "E2E p50 (ms)", "{:.1f}"), ("prefix_hit_rate", "prefix hit rate", "{:.4f}"),
    ("ideal_hit_rate", "ideal hit rate", "{:.4f}"), ("internal_frag", "internal fragmentation", "{:.4f}"),
    ("kv_util", "KV utilisation", "{:.4f}"), ("mean_running", "mean running seqs", "{:.1f}"),
    ("peak_running", "peak running seqs", "{:.0f}"), ("preemptions", "preemptions", "{:.0f}"),
    ("evicted_tokens", "evicted tokens", "{:.0f}"), ("recalled_tokens", "recalled tokens", "{:.0f}"),
]
LIVE_HEADLINE = [  # a live run's own figures
    ("errors", "errors (failed requests)", "{:.0f}"), ("client_hit_rate", "hit rate (cached tokens reported)", "{:.4f}"),
    ("itl_ms_p50", "ITL p50 (ms)", "{:.2f}"), ("req_per_s", "requests/s", "{:.2f}"),
]
TIER_HEADLINE = [  # with a tier behind the pool
    ("hit_rate_gpu", "hit rate: GPU pool", "{:.4f}"), ("hit_rate_cpu", "hit rate: CPU tier", "{:.4f}"),
    ("hit_rate_disk", "hit rate: disk tier", "{:.4f}"), ("bytes_loaded", "bytes loaded from tiers", "{:,.0f}"),
    ("bytes_stored", "bytes stored in tiers", "{:,.0f}"), ("load_s", "tier load time (s)", "{:.3f}"),
    ("tier_declined_tokens", "tier hits recomputed (auto)", "{:,.0f}"),
]


def print_summary(summary: dict, run_dir: str) -> None:
    from kvbench.cli.console import Column, print_table

    rows = []
    tiers = summary.get("hit_rate_cpu") is not None or summary.get("hit_rate_disk") is not None
    live = summary.get("errors") is not None
    for key, label, fmt in HEADLINE + (TIER_HEADLINE if tiers else []) + (LIVE_HEADLINE if live else []):
        v = summary.get(key)
        rows.append([label, "-" if v is None else fmt.format(v)])
    if summary.get("kv_cache_groups"):  # the model's KV cache groups and what a block of the pool costs
        rows.append(["KV cache groups", summary["kv_cache_groups"]])
    if summary.get("replicas"):
        rows.append(["requests max/mean per replica", f"{summary['balance_requests_max_over_mean']:.2f}"])
        rows.append(["busy time max/mean per replica", f"{summary['balance_busy_max_over_mean']:.2f}"])
        rows.append(["Jain's index (requests, busy)", f"{summary['jain_requests']:.3f}, {summary['jain_busy']:.3f}"])
        if summary.get("router_predicted_blocks") is not None:
            rows.append(["router predicted / hit blocks",
                         f"{summary['router_predicted_blocks']:,} / {summary['router_hit_blocks']:,}"])
    d = summary.get("disagg")
    if d:  # disaggregated prefill and decode (engine.disagg)
        rows.append(["instances (prefill : decode), GPUs", f"{d['prefill_instances']} : {d['decode_instances']}, {d['gpus']}"])
        rows.append(["link", f"{d['link']}, {d['link_gbps_per_instance']:,.0f} Gb/s an instance, "
                             f"{d['link_latency_us']:g} us a transfer"])
        rows.append(["KV moved per request (MB) p50 / p99", f"{d['bytes_p50'] / 1e6:,.1f} / {d['bytes_p99'] / 1e6:,.1f}"])
        rows.append(["transfer (ms) p50 / p99", f"{d['transfer_ms_p50']:.2f} / {d['transfer_ms_p99']:.2f}"])
        rows.append(["waiting for decode admission (ms) p50 / p99", f"{d['admit_ms_p50']:.1f} / {d['admit_ms_p99']:.1f}"])
        rows.append(["link utilisation (receiving, mean / max)", f"{d['link_util_recv']:.3f} / {d['link_util_recv_max']:.3f}"])
        rows.append(["decode-side hit rate (of prompts loaded)", f"{d['decode_hit_rate']:.4f}"])
        rows.append(["prefill blocks held for reads, mean / peak", f"{d['prefill_held_blocks_mean']:.1f} / {d['prefill_held_blocks_peak']:,}"])
        rows.append(["decode blocks awaiting KV, mean / peak", f"{d['decode_awaiting_blocks_mean']:.1f} / {d['decode_awaiting_blocks_peak']:,}"])
        rows.append(["busy (prefill / decode instances)", f"{d['prefill_busy']:.3f} / {d['decode_busy']:.3f}"])
        if d.get("goodput_req_per_s_per_gpu") is not None:
            rows.append(["goodput per GPU (req/s)", f"{d['goodput_req_per_s_per_gpu']:.3f}"])
    print_table(f"kvbench replay -> {run_dir}", [Column("metric", right=False), Column("value")], rows)
    if summary.get("per_replica"):
        def f(v, fmt):
            return "-" if v is None else fmt.format(v)
        heads = [Column(c) for c in ("replica", "reqs", "hit", "TTFT p50", "TTFT p99", "TPOT p50", "running",
                                     "preempt", "busy s")]
        rows = [[str(p["replica"]), f"{p['requests']:,}", f(p["prefix_hit_rate"], "{:.4f}"),
                 f(p["ttft_ms_p50"], "{:.1f}"), f(p["ttft_ms_p99"], "{:.1f}"), f(p["tpot_ms_p50"], "{:.2f}"),
                 f(p["mean_running"], "{:.1f}"), str(p["preemptions"]), f(p["busy_s"], "{:.1f}")]
                for p in summary["per_replica"]]
        print_table(f"{summary['replicas']} replicas, router {summary['router']} (times in ms)", heads, rows)


def unused_options(cfg: ReplayConfig) -> list[str]:
    """Options given away from their default that this configuration does not use (the sweep's
    collapse rule, kvbench.sweep.grid.not_applicable), one line each: a replay says so rather than
    ignore them silently."""
    from kvbench.sweep.grid import NOT_APPLICABLE, TIER_SETTINGS, not_applicable

    settings = cfg.to_dict()
    notes = []
    for n in sorted(not_applicable(settings)):
        if settings[n] == getattr(DEFAULTS, n):
            continue
        why = [f"--{k.replace('_', '-')} {_word(v)}" for (k, v), unused in NOT_APPLICABLE.items()
               if n in unused and settings.get(k) == v]
        if not why and n in TIER_SETTINGS:
            why = ["no --cpu-kv-mem, --disk-kv-mem or --store-kv-mem"]
        notes.append(f"--{n.replace('_', '-')} has no effect with {' and '.join(why) or 'these settings'}")
    return notes


def _word(v) -> str:
    return {True: "on", False: "off", None: "unset"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)


def run_with_progress(trace: str, cfg: ReplayConfig, out: str | None, quiet: bool = False,
                      force: bool = False, invocation=None):
    """Replay with a rich progress bar on stderr when stderr is a terminal; (summary, run dir).
    Without ``out`` the run goes to a new directory under runs/ named after the trace. Ctrl-C
    leaves a readable partial run (complete: false) and exits 130."""
    from kvbench.cli.console import say_compiling
    from kvbench.engine.runs import replay_class
    from kvbench.jit import REPLAY_MODULES

    say_compiling(REPLAY_MODULES)
    rp = replay_class(cfg)(trace, cfg, out or default_run_dir(trace), force=force, unique=out is None,
                invocation=invocation)
    rp.claim()
    click.echo(f"kvbench: {what_runs(rp.cfg)}", err=True)
    if cfg.layout == "slab" and cfg.slab_reserve == "max":
        why = "--max-model-len" if cfg.max_model_len else "the longest request, rounded up to a block"
        click.echo(f"kvbench: slab reservation: {rp.slab_reserve_tokens:,} tokens per sequence ({why})", err=True)
    try:
        if quiet or not sys.stderr.isatty():
            return rp.run(), rp.out_dir
        from kvbench.cli.console import progress_bar

        with progress_bar("replay") as bar:
            task = bar.add_task("replay", total=rp.planned, info="")  # the requests the limits let go

            def tick(p):
                tps = p.output_tokens / p.clock_s if p.clock_s > 0 else 0.0
                bar.update(task, completed=p.requests_done,
                           info=f"engine {p.clock_s:8.1f}s  {tps:9.0f} tok/s  step {p.steps}")
            return rp.run(tick), rp.out_dir
    except KeyboardInterrupt:
        click.echo(f"kvbench: interrupted; partial run (complete=false) in {rp.out_dir}", err=True)
        sys.exit(130)


@click.command(epilog="""
\b
Examples:
  kvbench replay traces/chat.jsonl                      # the sim: Llama-3-8B on the H200 cost model
  kvbench replay traces/chat.jsonl --layout slab --max-model-len 8192 --gpu h100
  kvbench replay traces/chat_cpu.jsonl --executor model --device cpu --limit 50 --metadata purpose=check
""")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@replay_options
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="run directory [default: runs/<trace>-<timestamp>, a new one for every run]")
@click.option("--force", is_flag=True, help="replace the run already in --out")
@metadata_option
@click.option("--csv", "csv", is_flag=True, help="also write the tables as CSV beside the parquet files")
@click.option("--json", "as_json", is_flag=True, help="print the summary as one JSON object on stdout")
@click.option("--endpoint", default=None, metavar="URL",
              help="live: send the trace to this OpenAI-compatible server (e.g. http://127.0.0.1:8000) and "
                   "measure it, instead of simulating; token-id prompts, streamed")
@click.option("--api", type=click.Choice(["completions", "chat"]), default="completions", show_default=True,
              help="live: /v1/completions or /v1/chat/completions")
@click.option("--served-model", default=None, help="live: the model name the server serves [default: its first]")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="live: bearer token [env OPENAI_API_KEY]")
@click.option("--header", "headers", multiple=True, metavar="'NAME: VALUE'", help="live: an HTTP header (repeatable)")
@click.option("--warmup", type=Count(0, 10**6), default=0, show_default=True,
              help="live: requests sent first and left out of every statistic")
@click.option("--request-timeout", type=Finite(min=0, min_open=True), default=600.0, show_default=True,
              help="live: seconds before a request is given up (recorded as an error)")
@click.option("--retries", type=Count(0, 100), default=2, show_default=True,
              help="live: times a request that failed before its first byte is sent again")
@click.option("--metrics-interval", type=Finite(min=0), default=1.0, show_default=True,
              help="live: seconds between scrapes of the server's /metrics (0: before and after only)")
@click.option("--remap-vocab", is_flag=True,
              help="live: map token ids the served model does not have onto its vocabulary, keeping the sharing")
@click.option("--like-server", "like_server", default=None, metavar="URL|LOG",
              help="sim: take the block size, pool, sequence cap, token budget, max length and prefix caching from "
                   "a running server (its URL) or its start-up log, for a like-for-like prediction (options given "
                   "explicitly win); outputs that do not fit are cut as vLLM's server cuts them")
def replay(trace, out, force, metadata, csv, as_json, endpoint, api, served_model, api_key, headers, warmup,
           request_timeout, retries, metrics_interval, remap_vocab, like_server, **opts):
    """Replay TRACE under one configuration and write a run directory (config.json, summary.json,
    requests.parquet, steps.parquet). With --endpoint, send it to a running server and measure that
    instead (the same run files; a /metrics timeline in place of steps.parquet)."""
    from kvbench.provenance import Invocation

    invocation = Invocation.from_argv(metadata)
    if endpoint is not None:
        summary, out = _replay_live(trace, out, force, as_json, invocation, opts, endpoint, api, served_model,
                                    api_key, headers, warmup, request_timeout,
                                    retries, metrics_interval, remap_vocab)
    else:
        live_only = {"--api": api != "completions", "--served-model": served_model is not None,
                     "--header": bool(headers), "--warmup": warmup != 0, "--remap-vocab": remap_vocab}
        for flag, given_ in live_only.items():
            if given_:
                click.echo(f"kvbench: note: {flag} has no effect without --endpoint", err=True)
        if like_server is not None:
            _take_server_settings(opts, like_server)
        given = ReplayConfig(**opts)  # as the user gave it (validate turns a slab's prefix cache off)
        cfg = ReplayConfig(**opts).validate()
        for note in unused_options(given):
            click.echo(f"kvbench: note: {note}", err=True)
        summary, out = run_with_progress(trace, cfg, out, quiet=as_json, force=force, invocation=invocation)
    if csv:
        from kvbench.report.export import export_csv

        export_csv(out)
    if endpoint is None and summary["rejected"] * 2 > summary["requests"]:
        click.echo(f"kvbench: warning: {summary['rejected']:,} of {summary['requests']:,} requests were rejected: "
                   "their prompt + output is longer than the max model length (--max-model-len)", err=True)
    if as_json:
        click.echo(dumps({"run_dir": out, **summary}))
    else:
        print_summary(summary, out)
        click.echo(f"run directory: {out}", err=True)


def _take_server_settings(opts: dict, where: str) -> None:
    """Fill the replay options a server's settings decide, where the user left them at their default
    (--like-server: a URL is asked, anything else read as a vLLM start-up log)."""
    from kvbench.engine.lengths import engine_rule
    from kvbench.engine.server import server_settings_from_log, server_settings_from_server

    settings = (server_settings_from_server(where) if "://" in where else server_settings_from_log(where))
    ctx = click.get_current_context()
    taken = []
    fields = {**settings.replay_fields(), "overlong": engine_rule(settings.kind)}
    for name, value in fields.items():
        if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT:
            opts[name] = value
            taken.append(f"--{name.replace('_', '-')} {_word(value)}")
    click.echo(f"kvbench: like the server ({settings.describe()}): {', '.join(taken) or 'nothing left to take'}",
               err=True)


def _replay_live(trace, out, force, as_json, invocation, opts, endpoint, api, served_model, api_key, headers,
                 warmup, request_timeout, retries, metrics_interval, remap_vocab):
    """replay --endpoint: the same workload settings, sent to a server (kvbench.engine.live)."""
    from kvbench.cli.console import progress_bar
    from kvbench.engine.live import LiveOptions, LiveRun

    ctx = click.get_current_context()
    if ctx.get_parameter_source("overlong") is not click.core.ParameterSource.DEFAULT:
        click.echo("kvbench: note: --overlong has no effect with --endpoint: the server applies its own engine's "
                   "length rule (config.json records which)", err=True)
    if ctx.get_parameter_source("dependent_turns") is click.core.ParameterSource.DEFAULT:
        opts["dependent_turns"] = True  # a client sends a turn once the answer it quotes is in
    cfg = ReplayConfig(**opts).validate()
    parsed = {}
    for h in headers:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise InputError(f"expected 'NAME: VALUE', got {h!r}", field="--header")
        parsed[name.strip()] = value.strip()
    live = LiveOptions(endpoint=endpoint, api=api, served_model=served_model, api_key=api_key, headers=parsed,
                       warmup=warmup, request_timeout_s=request_timeout, retries=retries,
                       metrics_interval_s=metrics_interval, remap_vocab=remap_vocab)
    run = LiveRun(trace, cfg, live, out or default_run_dir(trace), force=force, unique=out is None,
                  invocation=invocation)
    click.echo(f"kvbench: {run.describe()}", err=True)
    try:
        if as_json or not sys.stderr.isatty():
            return run.run(), run.out_dir
        with progress_bar("live") as bar:
            task = bar.add_task("live", total=None, info="")

            def tick(done: int, of: int, errors: int) -> None:
                bar.update(task, completed=done, total=of, info=f"errors {errors}" if errors else "")
            return run.run(tick), run.out_dir
    except KeyboardInterrupt:
        click.echo(f"kvbench: interrupted; partial run (complete=false) in {run.out_dir}", err=True)
        sys.exit(130)


COMMANDS = [replay]

__all__ = ["REPLAY_OPTIONS", "replay_options", "replay", "COMMANDS", "InputError"]
