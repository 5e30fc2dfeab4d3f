"""``chat``: multi-turn conversations, the traffic prefix caching was built for.

Each session opens with one of a few shared system prompts (``sys/chat-v<k>``). Turn k re-sends the
system prompt and every earlier user message and answer, then its own user message; its answer is
the stream named by ``output`` (``chat/<session>/a<k>``), which turn k+1 re-sends with the same length,
so it hits the blocks cached while the answer was decoded. Turn counts are geometric; a session ends
before a turn's prompt plus answer would pass ``max_context``. Defaults give a mean prompt+output of
about 2.3k tokens (a slab reservation of 8,192 is then mostly waste, as the vLLM paper found).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.trace.format import Request, Segment
from kvbench.workloads.common import Common, Workload, knob, stamp_sessions
from kvbench.workloads.sampling import lognormal_len


@dataclass(frozen=True)
class ChatParams:
    system_len: int = knob(600, "mean system prompt tokens (one length per variant)", min=1)
    system_variants: int = knob(3, "distinct system prompts sessions draw from", min=1)
    user_len: int = knob(120, "mean user message tokens", min=1)
    output_len: int = knob(280, "mean answer tokens", min=1)
    turns: float = knob(5.0, "mean turns per session (geometric)", min=1)
    think_s: float = knob(20.0, "mean think time between turns, seconds")
    max_context: int = knob(8000, "end a session before prompt+answer would pass this", min=16)


def build(c: Common, p: ChatParams, rng: np.random.Generator) -> list[Request]:
    cap = p.max_context // 4  # any single message: the first turn always fits
    system = [Segment("shared", int(n), name=f"sys/chat-v{v}")
              for v, n in enumerate(lognormal_len(rng, p.system_len, c.len_sigma, p.system_variants,
                                                  hi=cap))]
    meta = {"workload": "chat"}
    sessions: list[list[Request]] = []
    total = 0
    while total < c.requests:
        sid = f"c{len(sessions)}"
        history = [system[rng.integers(p.system_variants)]]
        context = history[0].length
        turns: list[Request] = []
        for k in range(1, int(rng.geometric(1.0 / p.turns)) + 1):
            user_len = lognormal_len(rng, p.user_len, c.len_sigma, hi=cap)
            answer_len = lognormal_len(rng, p.output_len, c.len_sigma, hi=cap)
            if context + user_len + answer_len > p.max_context:
                break
            user = Segment("shared", user_len, name=f"chat/{sid}/u{k}")
            answer = f"chat/{sid}/a{k}"
            turns.append(Request(id=f"{sid}-t{k}", t=0.0, prompt=tuple(history) + (user,),
                                 output_len=answer_len, session=sid, output=answer, meta=meta,
                                 prompt_len=context + user_len))
            history += [user, Segment("shared", answer_len, name=answer)]
            context += user_len + answer_len
        sessions.append(turns)
        total += len(turns)
    return stamp_sessions(sessions, c, p.think_s, rng)


WORKLOAD = Workload("chat", "multi-turn chat sessions with shared system prompts", ChatParams, build,
                    "kvbench trace gen chat --requests 250 --rate 2 --seed 1 -o chat.jsonl")
