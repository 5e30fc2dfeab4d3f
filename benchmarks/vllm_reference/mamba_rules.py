#!/usr/bin/env python3
"""Check a drive.py run of a Mamba hybrid (vLLM's align mode) against the rules of the project's notes
(vllm-mamba.md §4-§5), from its steps and requests files and the trace's tokens; prints counts.

    .venv/bin/python benchmarks/vllm_reference/mamba_rules.py TRACE STEPS.jsonl

Checked, for a block size bs (the summary's aligned block size) and a prompt of P tokens:
  * every prefix hit (first admission and re-admission) is a multiple of bs, at most
    floor((P - 1) / bs) * bs of the tokens it was computed on;
  * every prefill chunk that does not reach the end of the request's known tokens ends on a block
    boundary (a multiple of bs);
  * without prefill checkpoints, a request computing its prompt from below L = floor((P - 1)/bs)*bs
    stops at L (a chunk ends there), then computes the rest; with them (Qwen GDN on Hopper) the last
    chunk runs through L to the end;
  * every hit h of a request admitted at step a has a producer: a request with the same first h tokens
    whose chunk ended at h (or, with prefill checkpoints, whose last prompt chunk ran through its
    checkpoint at h = floor((P - 1)/bs)*bs) at a step before a (a state cached in step a cannot be hit in step a);
    counted: hits whose only producers are in step a - 1 (the one-step wait).
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    trace_path, steps_path = argv[0], argv[1]
    from kvbench.trace.format import load_trace
    from kvbench.trace.tokens import TokenStreams

    base = os.path.splitext(steps_path)[0]
    summ = json.load(open(base + ".summary.json"))
    mamba = summ["hybrid"]["mamba"]
    bs = mamba["aligned_block_size"]
    ckpt = mamba["mamba_has_prefill_checkpoint_blocks"]
    streams = TokenStreams()
    trace = {r.id: r for r in load_trace(trace_path, limit=summ["requests"])}
    reqs = {r["id"]: r for r in map(json.loads, open(base + ".requests.jsonl"))}
    tokens = {rid: [int(x) for x in streams.expand(trace[rid])] for rid in reqs}
    out = defaultdict(int)
    chunks = defaultdict(list)  # rid -> [(step, start, n)]
    ends_at = defaultdict(list)  # (end position) -> [(step, rid)]
    preempted_at = defaultdict(list)
    for st in map(json.loads, open(steps_path)):
        for (rid, n), start in zip(st["sched"], st["start"]):
            chunks[rid].append((st["step"], start, n))
            ends_at[start + n].append((st["step"], rid))
            P = reqs[rid]["prompt"]
            L = (P - 1) // bs * bs
            if ckpt and start < L < start + n and start + n >= P:
                ends_at[L].append((st["step"], rid))  # a prefill checkpoint exported inside the chunk
        for rid in st["preempted"]:
            preempted_at[rid].append(st["step"])
    violations = []
    hits = [(rid, r["admit_step"], r["cached"], r["prompt"]) for rid, r in reqs.items()]
    hits += [(rid, s, h, None) for rid, r in reqs.items() for s, h in r["readmits"]]
    for rid, step, h, prompt in hits:
        out["admissions"] += 1
        if h == 0:
            continue
        out["hits"] += 1
        if h % bs:
            violations.append(("hit not a multiple of bs", rid, step, h))
        if prompt is not None and h > (prompt - 1) // bs * bs:
            violations.append(("hit beyond floor((P-1)/bs)*bs", rid, step, h, prompt))
        prefix = tokens[rid][:h]
        producers = [s for s, q in ends_at[h] if q != rid and tokens[q][:h] == prefix] + \
                    [s for s, q in ends_at[h] if q == rid and s < step]
        before = [s for s in producers if s < step]
        if not before:
            violations.append(("hit without an earlier state at h", rid, step, h))
        elif max(before) == step - 1 and min(before) == step - 1:
            out["hits produced the step before"] += 1
        if any(s == step for s in producers):
            out["hits with a same-step producer too"] += 1
    for rid, cs in chunks.items():
        r = reqs[rid]
        P = r["prompt"]
        known = P  # tokens known before each chunk: prompt + outputs sampled so far
        L = (P - 1) // bs * bs
        first_prefill = [c for c in cs if c[1] < P]
        for step, start, n in cs:
            end = start + n
            is_last = n == 1 or end >= P  # decodes, and the chunk that reaches the prompt's end
            if not is_last and end % bs:
                violations.append(("chunk end off a block boundary", rid, step, start, n))
        if not first_prefill or rid in preempted_at:
            continue
        start0 = first_prefill[0][1]
        if start0 < L:
            out["prompts computed from below L"] += 1
            stops = {s + n for _, s, n in first_prefill}
            if ckpt:
                if L in stops:
                    out["  (checkpoints) ... still stopped at L"] += 1
                if first_prefill[-1][1] < L:
                    out["  (checkpoints) ... last chunk ran through L"] += 1
            else:
                if L in stops and P in stops:
                    out["  ... stopped at L, then the rest"] += 1
                else:
                    violations.append(("no stop at L", rid, L, first_prefill))
        elif start0 == L:
            out["prompts hit at L (one chunk left)"] += 1
        del known
    print(json.dumps({"block_size": bs, "prefill_checkpoints": ckpt, "counts": dict(out),
                      "violations": len(violations), "first_violations": violations[:10]}, indent=1))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
