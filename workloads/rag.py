"""``rag``: retrieval-augmented generation, where reuse is partial.

Every prompt is a shared system prompt (``sys/rag``), then ``chunks`` documents retrieved from a
corpus whose popularity follows Zipf's law (``rag/doc-<i>``, each document with a fixed length, in
retrieval order), then a unique query. A prefix hit covers the system prompt and as many leading
documents as an earlier request retrieved in the same order: popular documents first make it
likely, later positions rarely match.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.trace.format import Request, Segment
from kvbench.workloads.common import Common, Workload, knob, stamp_independent
from kvbench.workloads.sampling import lognormal_len


@dataclass(frozen=True)
class RagParams:
    system_len: int = knob(400, "system prompt tokens (mean of its one draw)", min=1)
    chunks: int = knob(4, "documents retrieved per request", min=1)
    chunk_len: int = knob(250, "mean document tokens (one length per document)", min=1)
    corpus_docs: int = knob(1000, "documents in the corpus", min=1)
    zipf: float = knob(1.1, "Zipf exponent of document popularity (0: uniform)")
    query_len: int = knob(60, "mean query tokens (unique)", min=1)
    output_len: int = knob(200, "mean answer tokens", min=1)


def build(c: Common, p: RagParams, rng: np.random.Generator) -> list[Request]:
    if p.chunks > p.corpus_docs:
        raise ValueError(f"--chunks {p.chunks} is more than --corpus-docs {p.corpus_docs}")
    system = Segment("shared", lognormal_len(rng, p.system_len, c.len_sigma), name="sys/rag")
    doc_lens = lognormal_len(rng, p.chunk_len, c.len_sigma, p.corpus_docs)
    popularity = 1.0 / np.arange(1, p.corpus_docs + 1) ** p.zipf
    popularity /= popularity.sum()
    meta = {"workload": "rag"}
    reqs = []
    for i in range(c.requests):
        docs = rng.choice(p.corpus_docs, size=p.chunks, replace=False, p=popularity)
        query = lognormal_len(rng, p.query_len, c.len_sigma)
        prompt = ((system,) + tuple(Segment("shared", int(doc_lens[d]), name=f"rag/doc-{d}")
                                    for d in docs) + (Segment("unique", query),))
        reqs.append(Request(id=f"q{i}", t=0.0, prompt=prompt,
                            output_len=lognormal_len(rng, p.output_len, c.len_sigma), meta=meta,
                            prompt_len=sum(s.length for s in prompt)))
    return stamp_independent(reqs, c, rng)


WORKLOAD = Workload("rag", "retrieval-augmented prompts: system prompt, Zipf-popular documents, a query",
                    RagParams, build, "kvbench trace gen rag --requests 250 --seed 1 -o rag.jsonl")
