"""``kvbench selfcheck`` and ``kvbench calibrate``: the model executor checked against transformers,
and the sim executor's coefficients measured on this device."""
from __future__ import annotations

import os
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
  kvbench calibrate --from-run runs/chat-live -o server.json     # a live server's clock (replay --endpoint)
""")
@click.option("--from-run", "from_run", type=click.Path(exists=True, file_okay=False), default=None,
              help="fit the sim's step clock to a live run (kvbench replay --endpoint) from its per-token times, "
                   "each step's work rebuilt by a sim replay of the same requests, instead of measuring here")
@click.option("--device", type=click.Choice(C.DEVICES), default="auto", show_default=True)
@click.option("--model", default="tiny", show_default=True, help="preset or local HF model folder")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="the CPU grid: single-sequence steps, seconds on a CPU")
@click.option("--repeats", type=click.IntRange(1, 100), default=None,
              help="timed runs per step, the median kept [default: 30 with --quick, spread over ~20 s so a "
                   "shared CPU's changes of speed average out as they do over a replay; 5 otherwise]")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), required=True,
              help="calibration file to write (JSON)")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
def calibrate(from_run, device, model, seed, quick, repeats, out, as_json):
    """Measure prefill chunks after a cached prefix, decode batches over a range of contexts and
    mixed steps (a chunk plus decodes) on the model executor, and fit the sim executor's
    per-operation coefficients (matmul and attention rates, weight and KV bandwidths, per-step
    overhead) to them. Prints the error per step kind on the fitted and the held-out steps.
    With --from-run, fit a step clock to a live server's run instead (see its help)."""
    if from_run is not None:
        return _calibrate_from_run(from_run, out, as_json)
    from kvbench.executors.calibrate import calibrate as run
    from kvbench.executors.calibrate import write
    from kvbench.executors.model import ModelExecutor
    from kvbench.executors.presets import get_model

    repeats = repeats or (30 if quick else 5)
    # a path that cannot take the file is refused now, not after minutes of measuring
    where = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        raise InputError(f"cannot write here: {where} is not a writable directory", field="--out")
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


def _calibrate_from_run(run_dir: str, out: str, as_json: bool) -> None:
    from kvbench.engine.fit_server import fit_from_run

    where = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        raise InputError(f"cannot write here: {where} is not a writable directory", field="--out")
    doc = fit_from_run(run_dir, out)
    if as_json:
        click.echo(dumps(doc))
        return
    c, fit = doc["coefficients"], doc["fit"]
    click.echo(f"step = {c['step_overhead_s'] * 1e3:.3f} ms + {c['prefill_token_s'] * 1e3:.4f} ms per prefill token "
               f"+ {c['decode_seq_s'] * 1e3:.4f} ms per decoding sequence + {c['context_token_s'] * 1e6:.4f} us "
               f"per key read")
    click.echo(f"front end = {c['request_s'] * 1e3:.3f} ms + {c['request_token_s'] * 1e6:.3f} us per prompt token, "
               "one request at a time, before the engine sees it")
    for part in ("train", "heldout"):
        e = fit[part]
        if e["median_abs_rel_err"] is not None:
            click.echo(f"  {part:8s} {e['spans']:5d} spans: |predicted/measured - 1| median "
                       f"{e['median_abs_rel_err']:.1%}, mean {e['mean_abs_rel_err']:.1%}")
    chk = fit["replay_check"]["heldout"]
    if chk["ttft_ms_p50_live"] is not None:
        click.echo(f"  held-out requests ({chk['requests']}) replayed on it: TTFT p50 {chk['ttft_ms_p50_sim']:.1f} ms "
                   f"(server {chk['ttft_ms_p50_live']:.1f}), TPOT p50 {chk['tpot_ms_p50_sim']:.2f} ms "
                   f"(server {chk['tpot_ms_p50_live']:.2f})")
    click.echo(f"wrote {out}", err=True)


COMMANDS = [selfcheck, calibrate]
