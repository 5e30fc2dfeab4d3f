"""``kvbench trace ...``: generate (``gen``), ``convert`` and ``inspect`` request traces.

Each command is a thin shell over the trace layer (kvbench.workloads, kvbench.trace.importers,
kvbench.trace.stats): it parses flags, calls one function, and prints data to stdout and a one-line
summary to stderr. Bad values raise click.BadParameter/UsageError or InputError; cli.main turns
them into one line and exit 2.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import click

from kvbench.cli.types import Count, Finite
from kvbench.engine.sizes import MAX_BLOCK_SIZE
from kvbench.errors import InputError
from kvbench.jsonio import dumps
from kvbench.trace.format import MAX_REQUEST_TOKENS, write_trace

_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def make_out_dir(path: str) -> None:
    """Create an output directory, or refuse it in one line naming --out."""
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError("is not a directory (or lies under a file)", file=path, field="--out") from None
    except OSError as e:
        raise InputError(f"cannot create it ({e.strerror or e})", file=path, field="--out") from None


def _note(message: str) -> None:
    click.echo(f"kvbench: {message}", err=True)


@click.group(context_settings=_SETTINGS)
def trace():
    """Generate, convert and inspect request traces (spec §2: JSONL, one request per line)."""


# ------------------------------------------------------------------------------------------- gen

_ARRIVAL_OPTIONS = [
    click.Option(["--arrival"], type=click.Choice(["poisson", "gamma"]), default="poisson",
                 show_default=True, help="arrival process of requests (sessions for chat/agent)"),
    click.Option(["-o", "--out"], required=True, type=click.Path(dir_okay=False),
                 help="trace file to write (JSONL)"),
]


def _knob_option(f: dataclasses.Field) -> click.Option:
    """A click option from a generator's dataclass field (its type, default, help and minimum)."""
    meta = f.metadata
    kind = type(f.default)
    if kind is int:  # every count has a ceiling: lengths and counts allocate
        ptype = click.IntRange(min=meta.get("min"), max=meta.get("max") or MAX_REQUEST_TOKENS,
                               min_open=meta.get("min_open", False))
    else:
        ptype = Finite(min=meta.get("min"), max=meta.get("max"), min_open=meta.get("min_open", False))
    return click.Option([f"--{f.name.replace('_', '-')}"], type=ptype, default=f.default,
                        show_default=True, help=meta.get("help"))


def _gen_command(workload) -> click.Command:
    from kvbench.workloads import Common, generate

    common_fields = [f for f in dataclasses.fields(Common) if f.metadata and f.name in workload.common]
    param_fields = dataclasses.fields(workload.params)

    def run(**kw):
        out = kw.pop("out")
        src = click.get_current_context().get_parameter_source("burstiness")
        if kw.get("arrival") == "poisson" and src is not click.core.ParameterSource.DEFAULT:
            raise click.BadParameter("needs --arrival gamma (Poisson gaps have CV 1)",
                                     param_hint="--burstiness")
        common = Common(**{f.name: kw.pop(f.name) for f in common_fields}, arrival=kw.pop("arrival", "poisson"))
        try:
            reqs = generate(workload, common, workload.params(**kw))
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        n = write_trace(reqs, out)
        tokens = sum(r.prompt_len for r in reqs)
        _note(f"wrote {n} {workload.name} requests ({tokens} prompt tokens, "
              f"{reqs[-1].t:.1f} s of arrivals) to {out}")

    params = ([_knob_option(f) for f in common_fields]
              + [o for o in _ARRIVAL_OPTIONS if o.name in (*workload.common, "out")]
              + [_knob_option(f) for f in param_fields])
    epilog = f"\b\nExample:\n  {workload.example}\n  kvbench trace inspect {workload.example.split()[-1]}"
    doc = (sys.modules[workload.build.__module__].__doc__ or workload.summary).replace("``", "")
    return click.Command(workload.name, params=params, callback=run, help=doc,
                         short_help=workload.summary, epilog=epilog, context_settings=_SETTINGS)


class _GenGroup(click.Group):
    """Commands built from the workload registry on first use (keeps ``kvbench --help`` fast)."""

    def _commands(self) -> dict:
        if not self.commands:
            from kvbench.workloads import WORKLOADS
            for w in WORKLOADS.values():
                self.add_command(_gen_command(w))
        return self.commands

    def list_commands(self, ctx):
        return list(self._commands())

    def get_command(self, ctx, name):
        return self._commands().get(name)


@trace.group(cls=_GenGroup, context_settings=_SETTINGS, epilog="""
\b
Examples:
  kvbench trace gen chat --requests 250 --rate 2 --seed 1 -o chat.jsonl
  kvbench trace gen rag --requests 250 --zipf 1.2 --arrival gamma --burstiness 3 -o rag.jsonl
  kvbench trace gen best-of-n --requests 30 --n 8 -o bon.jsonl
""")
def gen():
    """Generate a synthetic trace: chat, rag, agent, best-of-n, or random (vllm bench serve's fixed lengths).

    Every length is lognormal around the mean its flag sets (spread --len-sigma); arrivals are
    Poisson or gamma at --rate requests per second; the same flags and --seed give the same file.
    """


# --------------------------------------------------------------------------------------- convert

_SHAREGPT_ONLY = ("tokenizer", "rate", "think_s", "seed", "arrival", "burstiness")


@trace.command(context_settings=_SETTINGS, epilog="""
\b
Examples:
  kvbench trace convert --from mooncake conversation_trace.jsonl -o mooncake.jsonl
  kvbench trace convert --from mooncake conversation_trace.jsonl --limit 200 -o slice.jsonl
  kvbench trace convert --from azure AzureLLMInferenceTrace_conv.csv -o azure.jsonl
  kvbench trace convert --from burstgpt BurstGPT_1.csv -o burstgpt.jsonl
  kvbench trace convert --from sharegpt sharegpt.json --tokenizer ./llama3-tokenizer --rate 2 -o sg.jsonl
""")
@click.option("--from", "fmt", required=True,
              type=click.Choice(["mooncake", "azure", "burstgpt", "sharegpt"]),
              help="format of SRC")
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False),
              help="kvbench trace to write (JSONL)")
@click.option("--limit", type=Count(1, 2**31 - 1), help="write only the first N requests")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False),
              help="sharegpt: local Hugging Face tokenizer folder for token counts; without one "
                   "a text of C characters counts ceil(C / 4) tokens")
@click.option("--rate", type=Finite(min=0, min_open=True), default=1.0, show_default=True,
              help="sharegpt: mean request rate, per second (conversations start at rate / turns)")
@click.option("--think-s", type=Finite(min=0), default=30.0, show_default=True,
              help="sharegpt: mean think time between a conversation's turns, seconds")
@click.option("--seed", type=Count(0, 2**63 - 1), default=0, show_default=True, help="sharegpt: seed of arrivals")
@click.option("--arrival", type=click.Choice(["poisson", "gamma"]), default="poisson",
              show_default=True, help="sharegpt: arrival process of conversations")
@click.option("--burstiness", type=Finite(min=0, min_open=True), default=1.0,
              show_default=True, help="sharegpt: CV of gamma gaps")
def convert(fmt, src, out, limit, **sharegpt):
    """Convert a public trace (Mooncake, Azure, BurstGPT, ShareGPT) into a kvbench trace.

    \b
    mooncake  JSONL with timestamp (ms), input_length, output_length, hash_ids (512-token blocks):
              hash id h becomes the shared segment mooncake/<h>; rows with 0 output are skipped.
    azure     CSV TIMESTAMP,ContextTokens,GeneratedTokens: one unique segment per request.
    burstgpt  CSV, columns by header name (6- or 8-column release): failed rows (0 response
              tokens) are skipped; Session ID, when present, becomes the session.
    sharegpt  JSON list of {id, conversations: [{from, value}]}: turn k re-sends turns 1..k-1 as
              shared segments and names its answer (output) so the next turn hits it. Token
              counts: --tokenizer, or about 4 characters per token without one. Arrivals are
              made up: --rate, --arrival, --think-s.
    """
    from kvbench.trace.importers import convert as run_convert

    ctx = click.get_current_context()
    if fmt != "sharegpt":
        given = [k for k in _SHAREGPT_ONLY
                 if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--{given[0].replace('_', '-')} applies to --from sharegpt only")
        sharegpt = {}
    report = run_convert(fmt, src, out, limit=limit, **sharegpt)
    for line in report.notes:
        _note(f"note: {line}")
    _note(report.summary(fmt, out))


# --------------------------------------------------------------------------------------- inspect

@trace.command(context_settings=_SETTINGS, epilog="""
\b
Examples:
  kvbench trace inspect traces/chat.jsonl
  kvbench trace inspect traces/mooncake_slice.jsonl --block-size 32 --json
""")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--block-size", type=Count(1, MAX_BLOCK_SIZE), default=16, show_default=True,
              help="tokens per KV block for the ideal prefix hit rate")
@click.option("--prefix-mode", type=click.Choice(["hash", "radix"]), default="hash", show_default=True,
              help="ideal in whole blocks (hash) or to the token (radix)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of a table")
def inspect(trace_path, block_size, prefix_mode, as_json):
    """Validate a trace and print its statistics and ideal prefix hit rate.

    The ideal hit rate is the ceiling a prefix cache can reach on this trace: an infinite cache,
    requests one at a time in trace order, whole blocks only, the last prompt token always computed.
    """
    from kvbench.trace.stats import inspect_trace

    stats = inspect_trace(trace_path, block_size, prefix_mode)
    if as_json:
        click.echo(dumps(stats.to_dict()))
        return
    _print_table(trace_path, stats)


def _print_table(title: str, s) -> None:
    from kvbench.cli.console import Column, print_table

    def dist(d: dict) -> str:
        return (f"p50 {d['p50']:.0f} · p90 {d['p90']:.0f} · p99 {d['p99']:.0f} · max {d['max']} "
                f"· mean {d['mean']:.0f}")

    rows = [
        ["requests", f"{s.requests:,}"], ["sessions", f"{s.sessions:,}"],
        ["samples (sum of n)", f"{s.samples:,}"], ["duration", f"{s.duration_s:,.1f} s"],
        ["prompt tokens", f"{s.prompt_tokens:,}"], ["output tokens", f"{s.output_tokens:,}"],
        ["prompt length", dist(s.prompt_len)], ["output length", dist(s.output_len)],
        ["shared segments", f"{s.shared_segments:,} names, {s.shared_tokens:,} tokens"],
        [f"ideal hit rate (block {s.block_size})", f"{s.ideal_hit_rate:.4f}"],
    ]
    print_table(title, [Column("figure", right=False), Column("value", right=False)], rows)


# ---------------------------------------------------------------------------------------- whatif

def whatif_layout(spec, kv_dtype: str, block_size: int, tp: int = 1, gpu: str = "h200"):
    """The model's KV cache groups as a replay would run them (engine.setup.kv_layout_of's default: the
    hybrid manager on, off for chunked local attention; a recurrent state on one of ``tp`` GPUs, with
    the prefill checkpoints of ``gpu``'s GDN kernel)."""
    from kvbench.executors.sim import STATE_CHECKPOINT_GPUS
    from kvbench.memory.groups import group_layers

    layers = spec.kv_layers(kv_dtype, tp, checkpoints=gpu in STATE_CHECKPOINT_GPUS)
    try:
        return group_layers(layers, block_size, disable_hybrid=any(s.kind == "chunked" for s in layers))
    except ValueError as e:
        raise InputError(str(e), field="--model") from None


def refuse_for_groups(layout, name: str, option: str, why: str) -> None:
    """One line: what the what-if does not model for a model with several KV cache groups."""
    raise InputError(f"{name} keeps its KV in groups ({layout.describe()}): {why}", field=option)


DEFAULT_BUDGETS = "8GiB,16GiB,32GiB,64GiB,128GiB,1024GiB"


def _split(text: str, field: str) -> list[str]:
    """A comma list given on the command line; an empty list or an empty item is refused (an empty
    --policies is no policy, not the default)."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise InputError("is empty: give a comma-separated list, or leave the option out for its default",
                         field=field)
    if not all(items):
        raise InputError(f"empty value in the list {text!r}", field=field)
    return items


@trace.command(context_settings=_SETTINGS, epilog=f"""
\b
Examples:
  kvbench trace whatif traces/chat.jsonl --model llama-3.1-8b --budgets 1GiB,4GiB,16GiB
  kvbench trace whatif mooncake.jsonl --block-size 512 --warmup 0.5 --model llama-3.1-8b \\
      --kv-dtype bf16 --budgets {DEFAULT_BUDGETS} -j 2 --out runs/whatif
  kvbench trace whatif traces/rag.jsonl --budget-blocks 1000,5000,20000 --policies lru,belady --json
  kvbench trace whatif traces/chat.jsonl --budgets 1GiB,4GiB --replicas 4 --router prefix
  kvbench trace whatif mooncake.jsonl --block-size 512 --policies lru \\
      --tiers gpu=16GiB,cpu=0,128GiB,512GiB,2TiB,disk=0,4TiB --offload write-back
  kvbench trace whatif mooncake.jsonl --budgets 64GiB,1024GiB --policies lru,belady --budget-counts cache
""")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--block-size", type=Count(1, MAX_BLOCK_SIZE), default=16, show_default=True,
              help="tokens per KV block")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help="preset or Hugging Face config: sets the KV bytes per token")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp16", "fp8", "fp32"]), default="bf16",
              show_default=True, help="KV cache element type")
@click.option("--budgets", help=f"KV memory sizes, comma-separated  [default: {DEFAULT_BUDGETS}]")
@click.option("--budget-blocks", help="KV budgets in blocks instead of bytes, comma-separated")
@click.option("--policies", default=None,
              help="cache policies to compare, comma-separated, learned:FILE for a model from fit-policy "
                   "[default: every policy; radix: lru]")
@click.option("--prefix-mode", type=click.Choice(["hash", "radix"]), default="hash", show_default=True,
              help="vLLM's block-hash cache, or SGLang's radix tree (whole leaf nodes evicted, lru)")
@click.option("--warmup", type=Finite(min=0, max=1, max_open=True), default=0.5,
              show_default=True, help="fraction of requests that only warm the cache (not counted)")
@click.option("-j", "--jobs", type=Count(1, 256), default=1, show_default=True,
              help="processes, one (budget, policy) point each")
@click.option("--replicas", type=Count(1, 1024), default=1, show_default=True,
              help="replicas, each with a cache of the budget; requests routed by --router")
@click.option("--router", type=click.Choice(["round-robin", "least-loaded", "session", "prefix", "kv-aware"]),
              default="round-robin", show_default=True,
              help="with --replicas: which replica a request goes to (one request at a time: no load; "
                   "kv-aware's index learns from routing and never forgets)")
@click.option("--router-prefix-blocks", type=Count(1), default=4, show_default=True,
              help="prefix router: leading blocks hashed")
@click.option("--budget-counts", type=click.Choice(["pool", "cache"]), default="pool", show_default=True,
              help="pool: the running request's blocks count against the budget (a GPU pool); cache: the "
                   "budget holds only cached blocks, requests run outside it (a KV store; belady may "
                   "decline to store a block)")
@click.option("--tiers", "tiers_text", metavar="gpu=SIZE[,SIZE..][,cpu=SIZE..][,disk=SIZE..]",
              help="hit rate per tier: a GPU pool (--policies) and external stores behind it (host DRAM, "
                   "local NVMe; 0 = none), every combination of the sizes listed, e.g. "
                   "gpu=16GiB,cpu=0,128GiB,512GiB,disk=4TiB (replaces --budgets)")
@click.option("--tier-policy", default="lru", show_default=True,
              help="with --tiers: the cache policy of the cpu and disk tiers (belady: offline optimum)")
@click.option("--offload", type=click.Choice(["write-through", "write-back"]), default="write-through",
              show_default=True, help="with --tiers: store every computed block in every lower tier, or "
                                      "what the tier above evicts")
@click.option("--tp", type=Count(1, 64), default=1, show_default=True,
              help="a model with recurrent (Mamba, linear-attention) layers: the GPUs its state is split "
                   "over, which sets vLLM's block size (as in kvbench replay)")
@click.option("--gpu", default="h200", show_default=True,
              help="a model with Gated DeltaNet layers: the GPU, whose GDN prefill kernel (Hopper: "
                   "FlashInfer's, exporting its checkpoints) sets vLLM's block size")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of a table")
@click.option("--out", type=click.Path(file_okay=False),
              help="also write whatif.parquet, whatif.png and whatif.json into this directory")
@click.option("--no-cache", is_flag=True,
              help="read TRACE again rather than its parsed copy kept in $XDG_CACHE_HOME/kvbench (or "
                   "~/.cache/kvbench); KVBENCH_NO_CACHE=1 does the same")
def whatif(trace_path, block_size, model, kv_dtype, budgets, budget_blocks, policies, prefix_mode, warmup,
           jobs, replicas, router, router_prefix_blocks, budget_counts, tiers_text, tier_policy, offload,
           tp, gpu, as_json, out, no_cache):
    """Prefix hit rate against KV cache size and cache policy, straight from a trace.

    Prompts are replayed one after another in trace order (no concurrency, no decode) through a
    prefix cache of each budget, evicting with each policy (the replay's own: lru, fifo, lfu, lru2,
    arc, s3fifo, prefix, learned, and belady, the offline optimum); the hit rate counts the requests
    after the warm-up, beside the infinite-cache ceiling, and each policy is shown against lru in
    hit-rate points, with the share of the lru -> belady gap it closes where it does not lose to lru.
    Budgets in bytes become blocks through the model's KV bytes per token
    (layers x KV heads x head dim x 2 x dtype bytes).
    """

    from kvbench.executors.presets import get_model
    from kvbench.memory.policies import CACHE_POLICIES, check_policy
    from kvbench.trace.cache import TraceAnswer
    from kvbench import whatif as wi

    spec = get_model(model)
    layout = whatif_layout(spec, kv_dtype, block_size, tp, gpu)
    if layout.is_hybrid:
        return _whatif_groups(trace_path, spec, layout, kv_dtype, tp, budgets, budget_blocks, policies, prefix_mode,
                              warmup, replicas, budget_counts, tiers_text, as_json, out)
    per_token = spec.kv_bytes_per_token(kv_dtype)
    block_bytes = per_token * block_size
    if out:  # before the work: a path that cannot hold the results is refused now
        make_out_dir(out)
    chosen = (_split(policies, "--policies") if policies is not None
              else ["lru"] if prefix_mode == "radix" else list(CACHE_POLICIES))
    if prefix_mode == "radix" and chosen != ["lru"]:
        raise InputError("radix mode evicts whole leaf nodes by recency (SGLang's lru): give --policies lru",
                         field="--policies")
    for p in chosen:
        try:
            check_policy(p, load=True)
        except ValueError as e:
            raise InputError(str(e), field="--policies") from None
    if not chosen:
        raise InputError("no policy given", field="--policies")
    if budgets is not None and budget_blocks is not None:
        raise click.UsageError("give --budgets or --budget-blocks, not both")
    if tiers_text is not None or budget_counts == "cache":
        if jobs > 1:  # said, not silently dropped: these points share one GPU run each, in one process
            _note(f"-j {jobs}: the tiered and store what-ifs run in one process")
        return _whatif_stores(trace_path, spec, kv_dtype, per_token, block_size, chosen, warmup, budgets,
                              budget_blocks, prefix_mode, replicas, budget_counts, tiers_text, tier_policy, offload,
                              as_json, out, not no_cache)
    plan = _budget_plan(budgets, budget_blocks, block_size, block_bytes)
    _note(f"{spec.name} {kv_dtype}: {per_token:,} bytes of KV per token ({wi.format_bytes(per_token)}); "
          f"a block of {block_size} tokens is {wi.format_bytes(block_bytes)}")
    settings = dict(trace=trace_path, model=spec.name, kv_dtype=kv_dtype, kv_bytes_per_token=per_token,
                    block_size=block_size, budgets=plan, policies=chosen, warmup=warmup, jobs=jobs,
                    prefix_mode=prefix_mode, replicas=replicas, router=router,
                    router_prefix_blocks=router_prefix_blocks)
    # the same question about the same file and code is answered from the cache; --out computes (its
    # files are written from the computed result)
    answer = TraceAnswer(trace_path, _question(settings), use_cache=not (no_cache or out))
    kept = answer.get()
    try:
        result = None if kept is None else wi.WhatIf(**kept)
    except TypeError:  # not a WhatIf's fields (an entry edited by hand): computed again
        result = None
    if result is None:
        from kvbench.cli.console import say_compiling, working
        from kvbench.jit import WHATIF_MODULES

        compiling = say_compiling(WHATIF_MODULES)
        with working("compiling, then the what-if (once per install)", compiling):
            # the trace as the what-if needs it, without a Request per line; hashed once per file and block size
            result = wi.whatif(wi.read_hashed_cached(trace_path, block_size, use_cache=not no_cache), **settings)
        answer.put(result.to_dict())
    if not _show(result, wi.write_outputs(result, out) if out else [], as_json, wi.table, wi.gap_table):
        return
    if result.replicas > 1:
        _note(f"{result.replicas} replicas with a cache of the budget each, router {result.router}: requests "
              f"per replica {', '.join(f'{n:,}' for n in result.replica_requests)}; ceiling with one infinite "
              f"cache per replica {result.replicas_ceiling:.4f} (one shared: {result.ceiling:.4f})")
    too_large = {(r["budget_bytes"], r["budget"]): r["too_large_requests"] for r in result.rows
                 if r["too_large_requests"]}
    for (_, label), n in sorted(too_large.items()):
        _note(f"at {label}, {n} counted requests have more whole blocks than the budget: each ran as "
              "its first blocks that fit (an engine with this pool would refuse it)")


def _whatif_groups(trace_path, spec, layout, kv_dtype, tp, budgets, budget_blocks, policies, prefix_mode, warmup,
                   replicas, budget_counts, tiers_text, as_json, out):
    """The what-if of a model with several KV cache groups (kvbench.whatif.groups): each request through
    the replay's hybrid pool and rules, vLLM's free queue (lru) evicting; what it does not model is
    refused in one line, naming the option."""
    from kvbench.trace.format import load_trace
    from kvbench import whatif as wi
    from kvbench.whatif.groups import whatif_groups

    name = spec.name
    if prefix_mode == "radix":
        refuse_for_groups(layout, name, "--prefix-mode", "SGLang runs such a model on its own hybrid radix caches "
                          "(mem_cache/swa_radix_cache.py, mamba_radix_cache.py), which kvbench does not model; "
                          "drop --prefix-mode radix for vLLM's")
    chosen = ["lru"] if policies is None else _split(policies, "--policies")
    if chosen != ["lru"]:
        refuse_for_groups(layout, name, "--policies", "vLLM's hybrid manager evicts by its free queue (lru), the "
                          "only policy modelled for groups: give --policies lru")
    if replicas > 1:
        refuse_for_groups(layout, name, "--replicas", "the what-if of replicas is not modelled for groups: "
                          "measure it with kvbench replay --replicas")
    if tiers_text is not None or budget_counts == "cache":
        refuse_for_groups(layout, name, "--tiers" if tiers_text is not None else "--budget-counts",
                          "tiers and stores behind the pool are not modelled for groups")
    block_bytes = layout.bytes_per_block * tp
    plan = _budget_plan(budgets, budget_blocks, layout.block_size, block_bytes)
    if out:
        make_out_dir(out)
    _note(f"{name} {kv_dtype} on {tp} GPU(s): KV cache groups {layout.describe()}; a block of "
          f"{layout.block_size} tokens is {wi.format_bytes(block_bytes)} of the pool")
    requests = load_trace(trace_path)
    got = whatif_groups(requests, layout, plan, warmup=warmup, max_model_len=spec.max_model_len)
    window = len(requests) - got["window_start"]
    result = wi.WhatIf(trace=trace_path, model=name, kv_dtype=kv_dtype,
                       kv_bytes_per_token=spec.kv_bytes_per_token(kv_dtype), block_size=layout.block_size,
                       warmup=warmup, requests=len(requests), window_requests=window,
                       window_prompt_tokens=got["window_prompt_tokens"], distinct_blocks=got["distinct_blocks"],
                       ceiling=got["rows"][0]["ceiling"] if got["rows"] else 0.0,
                       ceiling_hit_tokens=got["ceiling_hit_tokens"], rows=got["rows"])
    if not _show(result, wi.write_outputs(result, out) if out else [], as_json, wi.table):
        return
    _note(f"ceiling: {result.ceiling:.4f} with every group's rules (where a window or a recurrent state is kept); "
          f"{got['ideal']:.4f} for a cache of every whole block")
    for r in result.rows:
        if r["too_large_requests"]:
            _note(f"at {r['budget']}, {r['too_large_requests']} requests did not fit the pool even empty: "
                  "counted as misses (an engine with this pool would refuse them)")


def _question(settings: dict) -> dict:
    """The what-if's settings as the answer cache's question: JSON values, and each file a policy
    names (learned:FILE) by its content."""
    from kvbench.memory.policies import split_policy
    from kvbench.provenance import file_sha256

    files = {arg: file_sha256(arg) for _, arg in map(split_policy, settings["policies"]) if arg is not None}
    budgets = [[b.bytes, b.blocks, b.label] for b in settings["budgets"]]
    return {"command": "trace whatif", **settings, "budgets": budgets, "policy_files": files}


def _budget_plan(budgets, budget_blocks, block_size: int, block_bytes: int):
    """--budgets (bytes) or --budget-blocks -> curve.Budget list, each holding a block; InputError
    otherwise."""
    from kvbench.engine.sizes import parse_size
    from kvbench import whatif as wi

    if budget_blocks is not None:
        counts = []
        for x in _split(budget_blocks, "--budget-blocks"):
            if not x.isdigit() or not 1 <= int(x) <= 2**31 - 1:
                raise InputError(f"not a block count in [1, 2^31): {x[:30]!r}", field="--budget-blocks")
            counts.append(int(x))
        plan = wi.budgets_from_blocks(counts, block_bytes)
    else:
        texts = _split(DEFAULT_BUDGETS if budgets is None else budgets, "--budgets")
        plan = wi.budgets_from_bytes([parse_size(x, "--budgets") for x in texts], block_bytes, texts)
    if not plan:
        raise InputError("no budget given", field="--budget-blocks" if budget_blocks else "--budgets")
    for b in plan:
        if b.blocks < 1:
            raise InputError(f"{wi.format_bytes(b.bytes)} holds no block of {block_size} tokens "
                             f"({wi.format_bytes(block_bytes)})", field="--budgets")
    return plan


def _show(result, paths: list[str], as_json: bool, *tables) -> bool:
    """Note the files written, then print the result as JSON or as its tables (each ``table(result)``:
    a kvbench.whatif.output.TextTable, or None for none), through the one terminal-aware printer.
    Returns whether the tables were printed (the notes after them are for a reader of tables)."""
    for path in paths:
        _note(f"wrote {path}")
    if as_json:
        click.echo(dumps(result.to_dict()))
        return False
    from kvbench.cli.console import Column, print_table

    for table in tables:
        t = table(result)
        if t is not None:
            print_table(t.title, [Column(c, right=c not in t.words) for c in t.columns], t.rows, t.caption,
                        bold=t.best)
    return True


def _whatif_stores(trace_path, spec, kv_dtype, per_token, block_size, chosen, warmup, budgets, budget_blocks,
                   prefix_mode, replicas, budget_counts, tiers_text, tier_policy, offload, as_json, out,
                   use_cache):
    """``whatif --tiers`` and ``whatif --budget-counts cache`` (kvbench.whatif.tiers)."""
    from kvbench.cli.console import say_compiling
    from kvbench.jit import WHATIF_MODULES
    from kvbench.memory.policies import check_policy
    from kvbench import whatif as wi
    from kvbench.whatif import output as wi_output
    from kvbench.whatif import tiers as wt

    what = "--tiers" if tiers_text is not None else "--budget-counts cache"
    say_compiling(WHATIF_MODULES)
    if prefix_mode != "hash":
        raise InputError("block-hash prefixes only (give --prefix-mode hash)", field=what)
    if replicas > 1:
        raise InputError("one cache only (give --replicas 1)", field=what)
    block_bytes = per_token * block_size
    if tiers_text is not None:
        if budget_counts != "pool":
            raise InputError("the gpu tier is a pool and the tiers behind it are stores: drop --budget-counts",
                             field="--tiers")
        if budgets is not None or budget_blocks is not None:
            raise click.UsageError("give --tiers or --budgets/--budget-blocks, not both")
        tiers = wt.parse_tiers(tiers_text)
        try:
            check_policy(tier_policy, load=True)
        except ValueError as e:
            raise InputError(str(e), field="--tier-policy") from None
        for name, sizes in tiers.items():
            for size, label in sizes:
                if (size or name == "gpu") and size < block_bytes:
                    raise InputError(f"{name}={label} holds no block of {block_size} tokens "
                                     f"({wi.format_bytes(block_bytes)})", field="--tiers")
        result = wt.whatif_tiers(wi.read_hashed_cached(trace_path, block_size, use_cache=use_cache), trace=trace_path,
                                 model=spec.name, kv_dtype=kv_dtype, kv_bytes_per_token=per_token,
                                 block_size=block_size, tiers=tiers, policies=chosen, tier_policy=tier_policy,
                                 offload=offload, warmup=warmup)
        _show(result, wt.write_outputs(result, out) if out else [], as_json,
              lambda w: wi_output.tiers_table(w, wt.TIERS))
        return
    plan = _budget_plan(budgets, budget_blocks, block_size, block_bytes)
    result = wt.whatif_cache(wi.read_hashed_cached(trace_path, block_size, use_cache=use_cache), trace=trace_path,
                             model=spec.name, kv_dtype=kv_dtype, kv_bytes_per_token=per_token,
                             block_size=block_size, budgets=plan, policies=chosen, warmup=warmup)
    if _show(result, wi.write_outputs(result, out) if out else [], as_json, wi.table):
        _note("budgets count cached blocks only (an external KV store): requests run outside them")


# ------------------------------------------------------------------------------------ fit-policy

@trace.command("fit-policy", context_settings=_SETTINGS, epilog="""
\b
Examples:
  kvbench trace fit-policy mooncake.jsonl --block-size 512 --warmup 0.5 -o mooncake-policy.json
  kvbench trace whatif mooncake.jsonl --block-size 512 --warmup 0.5 \\
      --policies lru,arc,learned:mooncake-policy.json,belady
  kvbench replay mooncake.jsonl --executor sim --cache-policy learned:mooncake-policy.json
""")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False),
              help="where to write the policy (JSON)")
@click.option("--block-size", type=Count(1, MAX_BLOCK_SIZE), default=16, show_default=True,
              help="tokens per KV block")
@click.option("--warmup", type=Finite(min=0, max=1, max_open=True), default=0.5, show_default=True,
              help="fraction of requests to train on (the part a what-if with this --warmup only warms "
                   "the cache with); 0 trains on the whole trace")
@click.option("--window-s", type=Finite(min=0, max=1e9, min_open=True), default=None,
              help="reuse within this many seconds is the label [default: the median reuse gap]")
@click.option("--samples", type=Count(1, 1024), default=16, show_default=True,
              help="cached blocks drawn after each training request")
@click.option("--seed", type=Count(0, 2**32 - 1), default=0, show_default=True)
def fit_policy(trace_path, out, block_size, warmup, window_s, samples, seed):
    """Fit the learned cache policy on the first part of a trace.

    A logistic model of "this cached block is looked up again within W seconds", over features the
    policy knows online (chain depth, hits, prompt length, continuations, time between uses, time
    since last use); use it with --cache-policy learned:FILE (replay) or --policies learned:FILE
    (whatif).
    """
    from kvbench.trace.format import load_trace
    from kvbench.whatif.fit import fit

    reqs = load_trace(trace_path)
    try:
        model = fit(reqs, block_size, warmup=warmup, window_s=window_s, samples_per_request=samples,
                    seed=seed, trace=trace_path)
    except ValueError as e:
        raise InputError(str(e), file=trace_path) from None
    try:
        model.save(out)
    except OSError as e:
        raise InputError(f"cannot write it ({e.strerror or e})", file=out, field="--out") from None
    f = model.fit
    _note(f"trained on {f['train_requests']:,} of {f['of_requests']:,} requests, {f['rows']:,} rows, "
          f"{f['positive_share']:.1%} reused within {model.window_s:g} s; held-out AUC "
          f"{f.get('heldout_auc', float('nan')):.3f}")
    _note(f"wrote {out}")
