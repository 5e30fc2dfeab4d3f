"""``best-of-n``: one prompt, ``n`` parallel samples (the ``n`` field), as in best-of-n sampling or
self-consistency. The samples share the prompt's blocks inside one request (reference-counted, not a
prefix-cache hit); prompts are unique across requests unless a shared system prompt is asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.trace.format import Request, Segment
from kvbench.workloads.common import Common, Workload, knob, stamp_independent
from kvbench.workloads.sampling import lognormal_len


@dataclass(frozen=True)
class BestOfNParams:
    n: int = knob(8, "parallel samples per request", min=1)
    prompt_len: int = knob(2000, "mean prompt tokens (unique)", min=1)
    system_len: int = knob(0, "shared system prompt tokens before the prompt (0: none)")
    output_len: int = knob(100, "mean tokens per sample", min=1)


def build(c: Common, p: BestOfNParams, rng: np.random.Generator) -> list[Request]:
    system = (Segment("shared", p.system_len, name="sys/best-of-n"),) if p.system_len else ()
    meta = {"workload": "best-of-n"}
    reqs = []
    for i in range(c.requests):
        prompt = system + (Segment("unique", lognormal_len(rng, p.prompt_len, c.len_sigma)),)
        reqs.append(Request(id=f"b{i}", t=0.0, prompt=prompt, n=p.n, meta=meta,
                            output_len=lognormal_len(rng, p.output_len, c.len_sigma),
                            prompt_len=sum(s.length for s in prompt)))
    return stamp_independent(reqs, c, rng)


WORKLOAD = Workload("best-of-n", "one prompt, n parallel samples per request", BestOfNParams, build,
                    "kvbench trace gen best-of-n --requests 30 --n 8 --seed 1 -o best_of_n.jsonl")
