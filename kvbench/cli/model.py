"""``kvbench selfcheck`` and ``kvbench calibrate``: the model executor checked against transformers,
and the sim executor's coefficients measured on this device."""
from __future__ import annotations

import json
import sys

import click

from kvbench.engine import config as C


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
    engine, hash and radix prefix modes (prefix-cache hits, a hit ending inside a block, a forced
    preemption, n=2 samples, chunked prefill), whose sampled logits and greedy tokens must match
    transformers on the same tokens. Exits 1 when any disagrees beyond the precision's tolerance
    (float32: logits within 1e-3 and every token equal).
    """
    from kvbench.engine.selfcheck import run_engine_selfcheck, run_selfcheck

    forwards = run_selfcheck(device=device, model=model, seed=seed, attention=attention)
    engines = {m: run_engine_selfcheck(device=device, model=model, seed=seed, attention=attention,
                                       prefix_mode=m) for m in ("hash", "radix")}
    ok = forwards["ok"] and all(e["ok"] for e in engines.values())
    result = {"ok": ok, "forwards": forwards, "engine": engines["hash"], "engine_radix": engines["radix"]}
    if as_json:
        click.echo(json.dumps(result, default=str))
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
                       f"{x['cow_copies']} copy-on-write copies, prefill chunks of {x['max_batched_tokens']}")
        click.echo("selfcheck: " + ("PASS" if ok else "FAIL"))
    if not ok:
        sys.exit(1)


@click.command(epilog="""
\b
Examples:
  kvbench calibrate --device cuda --model llama-3-8b -o h200-llama3-8b.json
  kvbench replay traces/chat.jsonl --executor sim --model llama-3-8b --calibration h200-llama3-8b.json
""")
@click.option("--device", type=click.Choice(C.DEVICES), default="auto", show_default=True)
@click.option("--model", default="tiny", show_default=True, help="preset or local HF model folder")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="a smaller grid (seconds on a CPU)")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), required=True,
              help="calibration file to write (JSON)")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
def calibrate(device, model, seed, quick, out, as_json):
    """Measure prefill and decode steps of the model executor on this device and fit the sim
    executor's coefficients (matmul rate, memory bandwidth, per-step overhead) to them."""
    from kvbench.executors.calibrate import calibrate as run, write
    from kvbench.executors.model import ModelExecutor
    from kvbench.executors.presets import get_model

    ex = ModelExecutor(model, device, seed)
    spec = ex.spec if hasattr(ex, "spec") else get_model(model)
    result = run(ex, spec, quick=quick, seed=seed)
    write(result, out)
    if as_json:
        click.echo(json.dumps(result))
        return
    c, f = result["coefficients"], result["fit"]
    click.echo(f"device {result['device_name']}, model {result['model']}: "
               f"matmul {c['matmul_flops'] / 1e12:.3g} TFLOP/s, memory {c['mem_bw'] / 1e9:.3g} GB/s, "
               f"overhead {c['step_overhead_s'] * 1e3:.3g} ms per step")
    click.echo(f"fit error (mean |predicted/measured - 1|): {f['mape_train']:.1%} on "
               f"{f['points_train']} points, {f['mape_heldout']:.1%} on {f['points_heldout']} held out")
    click.echo(f"wrote {out}", err=True)


COMMANDS = [selfcheck, calibrate]
