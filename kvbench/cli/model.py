"""``kvbench selfcheck`` and ``kvbench calibrate``: the model executor checked against transformers,
and the sim executor's coefficients measured on this device."""
from __future__ import annotations

import os
import statistics
import sys

import click

from kvbench.engine import config as C
from kvbench.errors import InputError
from kvbench.jsonio import dumps


@click.command(epilog="""
\b
Examples:
  kvbench selfcheck --device cpu
  kvbench selfcheck --device cuda --model llama-3-8b --json
""")
@click.option("--device", type=click.Choice(C.DEVICES), default="auto", show_default=True)
@click.option("--model", default="tiny", show_default=True, help="preset or local HF model folder")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--attention", type=click.Choice(["auto", "triton", "torch"]), default="auto",
              show_default=True, help="attention backend: Triton kernels (GPU) or torch references")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
def selfcheck(device, model, seed, attention, as_json):
    """Check the paged engine against transformers' implementation with the same weights.

    Two checks: (1) hand-driven paged forwards (shared-prefix reuse, chunked prefill mixed with
    decodes, copy-on-write samples, recompute) compared logit by logit; (2) replays through the real
    engine, hash and radix prefix modes and hash with CPU and disk tiers behind the pool (prefix-cache
    hits, a hit ending inside a block, a forced preemption, n=2 samples, chunked prefill, blocks
    written back to the tiers and loaded from them), whose sampled logits and greedy tokens must match
    transformers on the same tokens. Exits 1 when any disagrees beyond the precision's tolerance
    (float32: logits within 1e-3 and every token equal).
    """
    from kvbench.engine.selfcheck import run_engine_selfcheck, run_selfcheck, run_sliding_selfcheck

    forwards = run_selfcheck(device=device, model=model, seed=seed, attention=attention)
    engines = {m: run_engine_selfcheck(device=device, model=model, seed=seed, attention=attention,
                                       prefix_mode=m) for m in ("hash", "radix")}
    engines["tiers"] = run_engine_selfcheck(device=device, model=model, seed=seed, attention=attention, tiers=True)
    # a tiny random model with sliding-window layers: two KV cache groups, blocks freed as they leave the window
    engines["sliding"] = run_sliding_selfcheck(device=device, seed=seed, attention=attention)
    ok = forwards["ok"] and all(e["ok"] for e in engines.values())
    result = {"ok": ok, "forwards": forwards, "engine": engines["hash"], "engine_radix": engines["radix"],
              "engine_tiers": engines["tiers"], "engine_sliding": engines["sliding"]}
    if as_json:
        click.echo(dumps(result))
    else:
        f = forwards
        click.echo(f"model {f['model']} on {f['device']} ({f['dtype']}, attention {f['attention']})")
        click.echo(f"  paged forwards : max |logit diff| {f['max_logit_diff']:.2e} (tolerance "
                   f"{f['tolerance']:.0e}) over {f['positions_compared']} positions; greedy tokens "
                   f"equal {f['greedy_agree']:.1%} of {f['tokens_compared']}")
        for mode, e in engines.items():
            x = e["exercised"]
            click.echo(f"  engine ({mode:5s}): max |logit diff| {e['max_logit_diff']:.2e}, greedy tokens "
                       f"equal {e['greedy_agree']:.1%} of {e['tokens_compared']}; {e['completed']} "
                       f"requests, {x['prefix_hit_tokens']} prefix-hit tokens "
                       f"({x['partial_hit_tokens']} inside a block), {x['preemptions']} preemptions, "
                       f"{x['cow_copies']} copy-on-write copies, prefill chunks of {x['max_batched_tokens']}"
                       + (f"; tiers: {x['tier_bytes_loaded']:,} bytes loaded (hit rate cpu {x['cpu_hit_rate']:.3f}, "
                          f"disk {x['disk_hit_rate']:.3f}), {x['tier_bytes_stored']:,} stored"
                          if mode == "tiers" else "")
                       + (f"; {x['kv_groups']}: {x['freed_table_entries']:,} table entries freed by the window"
                          if mode == "sliding" else ""))
        click.echo("selfcheck: " + ("PASS" if ok else "FAIL"))
    if not ok:
        sys.exit(1)


@click.command(epilog="""
\b
Examples:
  kvbench calibrate --device cpu --quick -o cpu-tiny.json
  kvbench calibrate --device cuda --model llama-3-8b -o h200-llama3-8b.json
  kvbench replay traces/chat.jsonl --executor sim --model llama-3-8b --calibration h200-llama3-8b.json
  kvbench calibrate --endpoint http://127.0.0.1:8000 -o server.json   # profile a server, fit its clock
  kvbench calibrate --from-run runs/chat-live -o server.json     # a live run made (replay --endpoint)
""")
@click.option("--from-run", "from_run", type=click.Path(exists=True, file_okay=False), default=None,
              help="fit the sim's step clock to a live run (kvbench replay --endpoint) from its per-token times, "
                   "each step's work rebuilt by a sim replay of the same requests, instead of measuring here")
@click.option("--endpoint", default=None, metavar="URL",
              help="profile a running OpenAI-compatible server (vLLM, SGLang): send it a load that measures every "
                   "term (closed-loop stages at concurrency 1, 2, 4, ... up to its cap; prompt lengths and cached "
                   "shares spread), keep that live run in --run-dir, and fit the sim's clock to it (--from-run)")
@click.option("--run-dir", "run_dir", type=click.Path(file_okay=False), default=None,
              help="--endpoint: where the profiling run goes [runs/calibrate-<time>]")
@click.option("--server-log", "server_log", type=click.Path(exists=True, dir_okay=False), default=None,
              help="--endpoint: the server's start-up log, for the settings its API does not tell (vLLM's "
                   "--max-num-seqs and --max-num-batched-tokens, unless it runs with VLLM_SERVER_DEV_MODE=1)")
@click.option("--served-model", default=None, help="--endpoint: the model name the server serves [its first]")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="--endpoint: bearer token [env OPENAI_API_KEY]")
@click.option("--force", is_flag=True,
              help="--from-run/--endpoint: write the file even when the fit is not fit for use (held-out median "
                   "above --max-error, or a term the load did not measure apart); the sim then says so")
@click.option("--max-error", "max_error", type=click.FloatRange(0, min_open=True), default=0.2, show_default=True,
              help="--from-run/--endpoint: the held-out median |predicted/measured - 1| above which the fit is poor")
@click.option("--device", type=click.Choice(C.DEVICES), default="auto", show_default=True)
@click.option("--model", default="tiny", show_default=True, help="preset or local HF model folder")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="the CPU grid: single-sequence steps, seconds on a CPU; with --endpoint "
                                            "a shorter profiling load (stages up to 16 at once)")
@click.option("--passes", type=click.IntRange(1, 8), default=None,
              help="--endpoint: send the profiling load this many times in a row; the fit states how far each "
                   "coefficient moved between them (the server's drift, which a bootstrap within one pass does "
                   "not see) [default: 1]")
@click.option("--repeats", type=click.IntRange(1, 100), default=None,
              help="timed runs per step, the median kept [default: 30 with --quick, spread over ~20 s so a "
                   "shared CPU's changes of speed average out as they do over a replay; 5 otherwise]")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), required=True,
              help="calibration file to write (JSON)")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
def calibrate(from_run, endpoint, run_dir, server_log, served_model, api_key, force, max_error, device, model, seed, quick,
              passes, repeats, out, as_json):
    """Measure prefill chunks after a cached prefix, decode batches over a range of contexts and
    mixed steps (a chunk plus decodes) on the model executor, and fit the sim executor's
    per-operation coefficients (matmul and attention rates, weight and KV bandwidths, per-step
    overhead) to them. Prints the error per step kind on the fitted and the held-out steps.
    With --from-run, fit a step clock to a live server's run instead; with --endpoint, make that run
    first with a load chosen to measure every term (see their help). Either states each coefficient's
    bootstrap uncertainty and whether the load measured it apart from the others, and refuses to
    write a fit that is not fit for use unless --force."""
    if from_run is not None and endpoint is not None:
        raise InputError("give one of --from-run (a live run made) and --endpoint (make one now)", field="--endpoint")
    if passes is not None and endpoint is None:
        raise InputError("--passes is the profiling load's (--endpoint)", field="--passes")
    if from_run is not None:
        return _calibrate_from_run(from_run, out, as_json, force, max_error, seed)
    if endpoint is not None:
        return _calibrate_endpoint(endpoint, out, run_dir, server_log, served_model, api_key, model, seed, quick, as_json, force,
                                   max_error, passes)
    from kvbench.executors.calibrate import calibrate as run
    from kvbench.executors.calibrate import write
    from kvbench.executors.model import ModelExecutor
    from kvbench.executors.presets import get_model

    repeats = repeats or (30 if quick else 5)
    _writable(out)
    ex = ModelExecutor(model, device, seed)
    spec = ex.spec if hasattr(ex, "spec") else get_model(model)
    result = run(ex, spec, quick=quick, seed=seed, repeats=repeats)
    write(result, out)
    if as_json:
        click.echo(dumps(result))
        return
    c = result["coefficients"]
    click.echo(f"device {result['device_name']}, model {result['model']} ({result['dtype']}), "
               f"{len(result['points'])} steps in {result['seconds']:.1f} s")
    click.echo(f"  matmul {c['matmul_flops'] / 1e9:.4g} GFLOP/s, attention {c['attn_flops'] / 1e9:.4g} GFLOP/s, "
               f"weights {c['mem_bw'] / 1e9:.4g} GB/s, KV {c['kv_bw'] / 1e9:.4g} GB/s, "
               f"overhead {c['step_overhead_s'] * 1e3:.3g} ms per step")
    click.echo("  error |predicted/measured - 1|   fitted        held out")
    for kind, row in result["fit"]["per_kind"].items():
        cells = [f"{row[s]:6.1%} ({row['points_' + s]:2d})" if row[s] is not None else "     -      "
                 for s in ("train", "heldout")]
        click.echo(f"  {kind:8s}                       {cells[0]}   {cells[1]}")
    spread = result["fit"]["timing_spread"]
    if repeats > 1:
        click.echo(f"  timing spread over the {repeats} repeats (median step, (p75 - p25) / median): {spread:.1%}"
                   + ("  -- the machine's speed moved; errors this size are noise, not the model"
                      if spread > 0.05 else ""))
    click.echo(f"wrote {out}", err=True)


def _writable(out: str) -> None:
    """A path that cannot take the file is refused now, not after minutes of measuring."""
    where = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        raise InputError(f"cannot write here: {where} is not a writable directory", field="--out")


def _calibrate_from_run(run_dir: str, out: str, as_json: bool, force: bool, max_error: float, seed: int) -> None:
    from kvbench.engine.fit_server import fit_from_run

    _writable(out)
    doc = fit_from_run(run_dir, out, max_error=max_error, force=force, seed=seed)
    _say_fit(doc, out, as_json, force)


def _calibrate_endpoint(endpoint: str, out: str, run_dir: str | None, server_log: str | None, served_model: str | None, api_key: str | None,
                        model: str, seed: int, quick: bool, as_json: bool, force: bool, max_error: float,
                        passes: int | None = None) -> None:
    """calibrate --endpoint: the profiling load (kvbench.engine.profile) sent to the server as a live
    run in ``run_dir``, then the fit to that run."""
    import time

    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.fit_server import fit_from_run
    from kvbench.engine.live import LiveOptions, LiveRun
    from kvbench.engine.profile import PASSES, profile
    from kvbench.engine.records import claim_run_dir
    from kvbench.engine.server import base_url, server_settings_from_log, server_settings_from_server
    from kvbench.provenance import Invocation
    from kvbench.trace.format import write_trace

    _writable(out)
    opts = LiveOptions(endpoint=endpoint, served_model=served_model, api_key=api_key)
    server = server_settings_from_server(base_url(endpoint), opts.request_headers())
    if server_log is not None:
        logged = server_settings_from_log(server_log)
        server.fill(**{k: getattr(logged, k) for k in ("block_size", "num_gpu_blocks", "max_num_seqs",
                                                       "max_num_batched_tokens", "max_model_len", "chunked_prefill",
                                                       "prefix_caching")})
        server.sources.append(f"log:{server_log}")
    unknown = [f for f in ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks") if getattr(server, f) is None]
    if unknown:
        click.echo(f"kvbench: warning: the server does not tell its {' and '.join(unknown)} (vLLM tells them at "
                   "/server_info with VLLM_SERVER_DEV_MODE=1): the fit takes kvbench's defaults (and an unknown pool "
                   "bounds no stage of the profile); give --server-log LOG for the ones it started with", err=True)
    prof = profile(server, seed=seed, quick=quick, passes=PASSES if passes is None else passes)
    run_dir = claim_run_dir(run_dir or os.path.join("runs", f"calibrate-{time.strftime('%Y%m%d-%H%M%S')}"),
                            unique=run_dir is None)
    trace = os.path.join(run_dir, "profile.jsonl")
    write_trace(prof.requests, trace)
    opts.stages = tuple((st.requests, st.concurrency) for st in prof.stages)
    cfg = ReplayConfig(model=model, seed=seed, **server.replay_fields())
    run = LiveRun(trace, cfg, opts, run_dir, invocation=Invocation.from_argv())
    run.server.fill(**{k: getattr(server, k) for k in ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill",
                                                        "num_gpu_blocks", "block_size", "max_model_len")})
    if server_log is not None:
        run.server.sources.append(f"log:{server_log}")
    click.echo(f"kvbench: {run.describe()}", err=True)
    click.echo(f"kvbench: profiling load: {prof.describe()}", err=True)
    try:
        summary = run.run()
    except KeyboardInterrupt:
        click.echo(f"kvbench: interrupted; partial profiling run (complete=false) in {run_dir}, nothing fitted",
                   err=True)
        sys.exit(130)
    click.echo(f"kvbench: the profiling run ({summary['completed']} of {summary['requests']} requests served, "
               f"{summary['duration_s']:.1f} s) is in {run_dir}", err=True)
    if summary["errors"]:
        raise InputError(f"{summary['errors']} profiling requests failed (see {run_dir}/requests.parquet): a fit "
                         "needs every one served", field="--endpoint")
    doc = fit_from_run(run_dir, out, max_error=max_error, force=force, seed=seed)
    _say_fit(doc, out, as_json, force)


def _say_fit(doc: dict, out: str, as_json: bool, force: bool) -> None:
    """The fitted clock, how well it holds and how well each term was measured; exit 2 when it was
    not written (a poor fit without --force)."""
    from kvbench.engine.fit_server import TERM_NAMES, TERMS

    c, fit = doc["coefficients"], doc["fit"]
    if as_json:
        click.echo(dumps(doc))
    else:
        click.echo(f"step = {c['step_overhead_s'] * 1e3:.3f} ms + {c['prefill_token_s'] * 1e3:.4f} ms per prefill "
                   f"token + {c['decode_seq_s'] * 1e3:.4f} ms per decoding sequence + "
                   f"{c['context_token_s'] * 1e6:.4f} us per key read + {c['prefill_seq_s'] * 1e3:.3f} ms per "
                   "prefill chunk")
        click.echo(f"front end = {c['request_s'] * 1e3:.3f} ms + {c['request_token_s'] * 1e6:.3f} us per prompt "
                   "token, one request at a time, before the engine sees it")
        click.echo("  term                     coefficient  +- (its sd)        share of its spans  independent  measured"
                   + ("  by pass" if "passes" in fit["uncertainty"].get("step_overhead_s", {}) else ""))
        unit = {"step_overhead_s": (1e3, "ms"), "prefill_token_s": (1e6, "us"), "decode_seq_s": (1e3, "ms"),
                "context_token_s": (1e9, "ns"), "prefill_seq_s": (1e3, "ms"), "request_s": (1e3, "ms"),
                "request_token_s": (1e6, "us")}
        for t in TERMS:
            row, (k, u) = fit["terms"][t], unit[t]
            click.echo(f"  {TERM_NAMES[t]:24s} {row['coefficient'] * k:9.4f} {u}  +- {row['sd'] * k:8.4f} {u}"
                       f"   {row['share']:16.1%}  {row['independent']:11.1%}  "
                       + ("yes" if row["identifiable"] else "NO ")
                       + "".join(f"  {v * k:.4f}" if i == 0 else f" / {v * k:.4f}"
                                 for i, v in enumerate(fit["uncertainty"][t].get("passes", []))))
        for part in ("train", "heldout"):
            e = fit[part]
            if e["median_abs_rel_err"] is not None:
                click.echo(f"  {part:8s} {e['spans']:5d} spans: |predicted/measured - 1| median "
                           f"{e['median_abs_rel_err']:.1%}, mean {e['mean_abs_rel_err']:.1%}")
        kinds = [f"{name} {e['median_abs_rel_err']:.1%} ({e['spans']})"
                 for name, e in (("time to first token", fit["heldout_by_span"]["ttft"]),
                                 ("decode", fit["heldout_by_span"]["decode"])) if e["median_abs_rel_err"] is not None]
        terms = [f"{TERM_NAMES[t]} {e['median_abs_rel_err']:.1%} ({e['spans']})" for t, e in fit["heldout_by_term"].items()]
        click.echo("  held out, median by span: " + ", ".join(kinds) + "; by the term a span is mostly: " + ", ".join(terms))
        chk = fit["replay_check"]["heldout"]
        if chk["ttft_ms_p50_live"] is not None:
            click.echo(f"  held-out requests ({chk['requests']}) replayed on it: TTFT p50 {chk['ttft_ms_p50_sim']:.1f} ms "
                       f"(server {chk['ttft_ms_p50_live']:.1f}), TPOT p50 {chk['tpot_ms_p50_sim']:.2f} ms "
                       f"(server {chk['tpot_ms_p50_live']:.2f})")
        by_stage = fit["replay_check"].get("by_stage") or {}
        if by_stage:
            worst = sorted(by_stage.items(), key=lambda kv: -abs(kv[1]["tpot_p50_rel_err"]))[:3]
            click.echo(f"  per stage of the load ({len(by_stage)}), TPOT p50 error: median "
                       f"{statistics.median(abs(v['tpot_p50_rel_err']) for v in by_stage.values()):.0%}; worst "
                       + ", ".join(f"{st} {v['tpot_p50_rel_err']:+.0%} ({v['requests']})" for st, v in worst))
        for p in fit["problems"]:
            click.echo(f"  not fit for use: {p}")
        for w in fit["warnings"]:
            click.echo(f"  read with care: {w}")
        for a in fit["advice"]:
            click.echo(f"  load that would fix it: {a}")
    if fit["usable"]:
        click.echo(f"wrote {out}", err=True)
    elif force:
        click.echo(f"kvbench: warning: wrote {out} with --force although " + "; ".join(fit["problems"]), err=True)
    else:
        raise InputError("not written, the fit is not fit for use: " + "; ".join(fit["problems"])
                         + ". Fix: " + "; ".join(fit["advice"]) + ". --force writes it anyway", file=out,
                         field="--out")


COMMANDS = [selfcheck, calibrate]
