#!/usr/bin/env python3
"""Drive nano-vllm's own Scheduler + BlockManager without a model on a kvbench trace, and time it.

    python drive.py TRACE --nanovllm /path/to/nano-vllm [--num-blocks 48000] [--block-size 16]
                          [--limit N] [--json]

Real nano-vllm code: Scheduler (schedule, postprocess, preempt), BlockManager (xxh64 chained block
hashes with token confirmation), Sequence, SamplingParams, Config's module, all imported from the
checkout given by --nanovllm, unmodified. Faked: the model. Each step's cost comes from kvbench's
golden linear clock (0.1 ms per prefill token + 20 ms if the step decodes); every sequence that
completes its prefill or decodes gets kvbench's sampled token, TokenStreams.output_tokens(req, 1, k, 0)
(built once per request at arrival as output_tokens(req, output_len): the same tokens, since a
stream's token is a function of its position), and finishes after output_len tokens (ignore_eos).

Import plumbing (no nano-vllm function is patched):
  * nanovllm/__init__.py imports the LLM engine -> model runner -> torch.distributed, triton,
    flash_attn. The driver registers empty package modules ``nanovllm`` and ``nanovllm.engine`` whose
    __path__ is the checkout's folder, so ``nanovllm.engine.scheduler`` and its imports load from the
    checkout without running that __init__.
  * nanovllm.config imports ``transformers.AutoConfig`` (used only in Config.__post_init__, which needs
    a model folder). A stub module ``transformers`` with an empty AutoConfig class stands in, since the real
    one imports torch (~2.6 s, ~240 MB of RSS here) that the scheduler never uses;
    --real-transformers imports the real one when it is installed.
    The Scheduler reads five fields of its config; the driver passes a SimpleNamespace holding them
    instead of building Config (whose __post_init__ would read a model's config.json).
  * Block size: nano-vllm supports multiples of 256 only (Config asserts kvcache_block_size % 256 ==
    0, for its flash-attn paged-KV kernels; Sequence.block_size is a class attribute, 256).
    --block-size 256 is nano-vllm as shipped. Any other size (16, kvbench's default) sets the class
    attribute Sequence.block_size and BlockManager's block_size to it: the scheduling and hashing
    code is block-size agnostic, but nano-vllm itself would refuse that configuration.

Timing: ``loop_wall_s`` is the wall time of the scheduling loop minus the time spent building the
prompts (kvbench's token streams -> Python lists, and the answer tokens) of requests as they
arrive; that build time is reported as ``prompt_build_s``, trace loading as ``load_s``. Python's
cyclic GC walks every token list the scheduler holds (most of the trace waits in the queue at the
peak), and a collection lands in whichever part allocates: ``gc_s`` is its total in both parts, so
the split between loop and build varies from run to run while their sum does not.
Hit rate: the tokens nano-vllm's BlockManager.allocate marks as cached (seq.num_cached_tokens right
after allocation) at each request's first admission, over the admitted requests' prompt tokens
(kvbench's prefix_hit_rate: first admissions only; re-admissions after preemption counted apart).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import resource
import sys
import time
import types


def import_nanovllm(path: str, real_transformers: bool = False):
    """nano-vllm's Scheduler, Sequence, SamplingParams and BlockManager from a source checkout,
    without running nanovllm/__init__.py (which needs torch, triton and flash_attn)."""
    pkg_dir = os.path.join(os.path.abspath(path), "nanovllm")
    if not os.path.isfile(os.path.join(pkg_dir, "engine", "scheduler.py")):
        sys.exit(f"--nanovllm {path}: no nanovllm/engine/scheduler.py there (want a nano-vllm checkout)")
    for name, folder in (("nanovllm", pkg_dir), ("nanovllm.engine", os.path.join(pkg_dir, "engine"))):
        mod = types.ModuleType(name)
        mod.__path__ = [folder]
        mod.__package__ = name
        sys.modules[name] = mod
    stubbed = False
    if not real_transformers or importlib.util.find_spec("transformers") is None:
        # nanovllm.config: `from transformers import AutoConfig`, used only in Config.__post_init__,
        # which the driver never runs. The real import loads torch (~2.6 s, ~240 MB RSS here).
        stub = types.ModuleType("transformers")
        stub.AutoConfig = type("AutoConfig", (), {})  # a placeholder class (Config annotates with it)
        sys.modules["transformers"] = stub
        stubbed = True
    sched_mod = importlib.import_module("nanovllm.engine.scheduler")
    seq_mod = importlib.import_module("nanovllm.engine.sequence")
    bm_mod = importlib.import_module("nanovllm.engine.block_manager")
    sp_mod = importlib.import_module("nanovllm.sampling_params")
    return sched_mod.Scheduler, seq_mod.Sequence, sp_mod.SamplingParams, bm_mod.BlockManager, stubbed


def git_head(path: str) -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a kvbench trace (JSONL)")
    ap.add_argument("--nanovllm", required=True, help="a nano-vllm source checkout")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the file")
    ap.add_argument("--num-blocks", type=int, default=48000)
    ap.add_argument("--block-size", type=int, default=16,
                    help="256 (or a multiple): nano-vllm as shipped; other sizes: see the docstring")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="kvbench's default (nano-vllm's: 512)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="kvbench's default (nano-vllm's: 16384)")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    ap.add_argument("--decode-step-ms", type=float, default=20.0)
    ap.add_argument("--check-tokens", type=int, default=0,
                    help="also check, for the first N requests, that output_tokens(req, L)[k] equals "
                         "output_tokens(req, 1, k, 0) (the per-token rule); not timed")
    ap.add_argument("--real-transformers", action="store_true",
                    help="import the installed transformers for nanovllm.config (default: a stub)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line only")
    a = ap.parse_args(argv)

    Scheduler, Sequence, SamplingParams, _BlockManager, stubbed = import_nanovllm(a.nanovllm, a.real_transformers)

    import numpy as np

    from kvbench.trace.format import load_trace
    from kvbench.trace.tokens import TokenStreams

    t0 = time.perf_counter()
    trace = load_trace(a.trace, limit=a.limit)
    for r in trace:
        if r.n != 1:
            sys.exit(f"request {r.id}: n={r.n}; this driver only supports n=1")
    reqs = sorted(trace, key=lambda r: r.t)  # stable: arrival order, file order on ties (as kvbench)
    load_s = time.perf_counter() - t0
    streams = TokenStreams()

    if a.check_tokens:
        for r in reqs[:a.check_tokens]:
            whole = streams.output_tokens(r, r.output_len)
            each = [int(streams.output_tokens(r, 1, k, 0)[0]) for k in range(r.output_len)]
            assert whole.tolist() == each, f"request {r.id}: bulk and per-token output tokens differ"

    # nano-vllm as shipped: Sequence.block_size 256 (class attribute), Config asserts % 256 == 0.
    shipped_block = Sequence.block_size
    Sequence.block_size = a.block_size
    cfg = types.SimpleNamespace(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                eos=-1, kvcache_block_size=a.block_size, num_kvcache_blocks=a.num_blocks)
    sched = Scheduler(cfg)
    assert sched.block_manager.block_size == a.block_size and len(sched.block_manager.blocks) == a.num_blocks

    prefill_ns = round(a.prefill_ms_per_token * 1e6)
    decode_ns = round(a.decode_step_ms * 1e6)
    arrive = [round(r.t * 1e9) for r in reqs]
    n_req = len(reqs)

    answer: dict[int, list] = {}  # seq_id -> the request's output tokens
    first_hit: dict[int, int] = {}  # seq_id -> prefix-hit tokens at its first admission
    prompt_len: dict[int, int] = {}
    readmit_hits = readmits = 0
    preemptions = 0
    steps = prefill_steps = 0
    finished = 0
    peak_running = 0
    build_s = 0.0
    clock = 0
    nxt = 0
    waiting, running = sched.waiting, sched.running
    perf = time.perf_counter

    gc_s = [0.0, 0, 0.0]  # seconds in Python's cyclic GC, collections, start of the one running
    def on_gc(phase, info):
        if phase == "start":
            gc_s[2] = perf()
        else:
            gc_s[0] += perf() - gc_s[2]
            gc_s[1] += 1
    gc.callbacks.append(on_gc)
    t_loop = perf()
    while True:
        if nxt < n_req and arrive[nxt] <= clock:  # arrivals up to now, in order
            tb = perf()
            while nxt < n_req and arrive[nxt] <= clock:
                r = reqs[nxt]
                nxt += 1
                prompt = np.concatenate([streams.segment(seg, r.id, j) for j, seg in enumerate(r.prompt)])
                seq = Sequence(prompt.tolist(), SamplingParams(temperature=1.0, max_tokens=r.output_len,
                                                                ignore_eos=True))
                answer[seq.seq_id] = streams.output_tokens(r, r.output_len).tolist()
                prompt_len[seq.seq_id] = seq.num_prompt_tokens
                sched.add(seq)
            build_s += perf() - tb
        if not waiting and not running:
            if nxt >= n_req:
                break
            clock = max(clock, arrive[nxt])
            continue
        chunk_head = waiting[0].seq_id if waiting and waiting[0].block_table else None
        n_running = len(running)
        seqs, is_prefill = sched.schedule()
        if is_prefill:
            prefill_steps += 1
            ntok = 0
            tokens = []
            for seq in seqs:
                ntok += seq.num_scheduled_tokens
                sid = seq.seq_id
                if sid != chunk_head:  # allocated in this step: num_cached_tokens is its prefix hit
                    if sid in first_hit:
                        readmits += 1
                        readmit_hits += seq.num_cached_tokens
                    else:
                        first_hit[sid] = seq.num_cached_tokens
                if seq.num_cached_tokens + seq.num_scheduled_tokens >= seq.num_tokens:
                    tokens.append(answer[sid][seq.num_tokens - seq.num_prompt_tokens])
                else:
                    tokens.append(-1)  # mid-prefill chunk: postprocess ignores the token
            clock += ntok * prefill_ns
        else:
            preemptions += n_running - len(running)  # decode removes running seqs only by preempting
            tokens = [answer[seq.seq_id][seq.num_tokens - seq.num_prompt_tokens] for seq in seqs]
            clock += decode_ns
        peak_running = max(peak_running, len(running))
        sched.postprocess(seqs, tokens, is_prefill)
        for seq in seqs:
            if seq.is_finished:
                finished += 1
                del answer[seq.seq_id]
        steps += 1
    loop_s = perf() - t_loop - build_s
    gc.callbacks.remove(on_gc)

    hit = sum(first_hit.values())
    prompt_tokens = sum(prompt_len[s] for s in first_hit)
    out = {
        "engine": "nano-vllm", "nanovllm_commit": git_head(a.nanovllm), "trace": os.path.basename(a.trace),
        "requests": n_req, "finished": finished, "steps": steps, "prefill_steps": prefill_steps,
        "decode_steps": steps - prefill_steps, "preemptions": preemptions, "peak_running": peak_running,
        "prefix_hit_rate": hit / prompt_tokens if prompt_tokens else 0.0, "hit_tokens": hit,
        "prompt_tokens": prompt_tokens, "readmits": readmits, "readmit_hit_tokens": readmit_hits,
        "engine_duration_s": clock / 1e9,
        "loop_wall_s": round(loop_s, 3), "prompt_build_s": round(build_s, 3), "load_s": round(load_s, 3),
        "gc_s": round(gc_s[0], 3), "gc_collections": gc_s[1],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "config": {"num_blocks": a.num_blocks, "block_size": a.block_size,
                   "nanovllm_shipped_block_size": shipped_block, "max_num_seqs": a.max_num_seqs,
                   "max_num_batched_tokens": a.max_num_batched_tokens,
                   "prefill_ms_per_token": a.prefill_ms_per_token, "decode_step_ms": a.decode_step_ms,
                   "transformers_stubbed": stubbed},
    }
    if finished != n_req:
        out["error"] = f"{n_req - finished} requests unfinished"
    if a.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    return 0 if finished == n_req else 2


if __name__ == "__main__":
    sys.exit(main())
