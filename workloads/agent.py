"""``agent``: tool-using agent runs, where each step re-reads everything before it.

A run opens with a shared tool/scaffold prompt (``sys/agent-v<k>``) and its task
(``agent/<run>/task``). Step k re-sends the whole context so far: scaffold, task, and for every
earlier step its answer (the ``output`` stream ``agent/<run>/a<j>``, re-sent at full length) and the
tool result that followed it (``agent/<run>/tool<j>``: new to this run, shared-named only so later
steps re-send the same tokens). After the first step nearly every prompt token is a prefix hit.

With chance ``quote`` a step's answer quotes earlier context instead of saying something new, as
agents do when they act on what they read (a path from a listing, a line of a file, the task's
words): its ``output`` stream is the task's or an earlier tool result's, chosen uniformly, so its
first tokens repeat that segment's opening tokens (beyond the segment's length the stream goes on
with tokens the context does not hold). Later steps re-send the answer under that name. Quoting
changes no prompt's prefix structure; it gives attention something old to re-read, which is what
separates permanent token eviction (H2O) from offload and recall (InfiniGen) on a real model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.trace.format import Request, Segment
from kvbench.workloads.common import Common, Workload, knob, stamp_sessions
from kvbench.workloads.sampling import lognormal_len


@dataclass(frozen=True)
class AgentParams:
    system_len: int = knob(1200, "mean scaffold (tool definitions) tokens", min=1)
    scaffolds: int = knob(2, "distinct scaffolds runs draw from", min=1)
    task_len: int = knob(150, "mean task description tokens", min=1)
    output_len: int = knob(120, "mean tokens per step's answer (a tool call or thought)", min=1)
    tool_len: int = knob(200, "mean tool result tokens", min=1)
    steps: float = knob(6.0, "mean steps per run (geometric)", min=1)
    think_s: float = knob(2.0, "mean tool latency between steps, seconds")
    max_context: int = knob(16000, "end a run before prompt+answer would pass this", min=16)
    quote: float = knob(0.5, "chance a step's answer quotes the task or an earlier tool result", max=1)


def build(c: Common, p: AgentParams, rng: np.random.Generator) -> list[Request]:
    cap = p.max_context // 4
    scaffolds = [Segment("shared", int(n), name=f"sys/agent-v{v}")
                 for v, n in enumerate(lognormal_len(rng, p.system_len, c.len_sigma, p.scaffolds,
                                                     hi=cap))]
    meta = {"workload": "agent"}
    runs: list[list[Request]] = []
    total = 0
    while total < c.requests:
        rid = f"r{len(runs)}"
        task = Segment("shared", lognormal_len(rng, p.task_len, c.len_sigma, hi=cap),
                       name=f"agent/{rid}/task")
        context = [scaffolds[rng.integers(p.scaffolds)], task]
        context_len = context[0].length + task.length
        steps: list[Request] = []
        for k in range(1, int(rng.geometric(1.0 / p.steps)) + 1):
            answer_len = lognormal_len(rng, p.output_len, c.len_sigma, hi=cap)
            if context_len + answer_len > p.max_context:
                break
            quoted = [task.name] + [f"agent/{rid}/tool{j}" for j in range(1, k)]
            pick = quoted[rng.integers(len(quoted))]
            answer = pick if rng.random() < p.quote else f"agent/{rid}/a{k}"
            steps.append(Request(id=f"{rid}-s{k}", t=0.0, prompt=tuple(context), output_len=answer_len,
                                 session=rid, output=answer, meta=meta, prompt_len=context_len))
            tool = Segment("shared", lognormal_len(rng, p.tool_len, c.len_sigma, hi=cap),
                           name=f"agent/{rid}/tool{k}")
            context += [Segment("shared", answer_len, name=answer), tool]
            context_len += answer_len + tool.length
        runs.append(steps)
        total += len(steps)
    return stamp_sessions(runs, c, p.think_s, rng)


WORKLOAD = Workload("agent", "agent runs: a shared scaffold, each step re-sending the whole context",
                    AgentParams, build, "kvbench trace gen agent --requests 250 --seed 1 -o agent.jsonl")
