"""The what-if for a model whose KV falls into several groups (kvbench.memory.groups): sliding-window,
chunked-local or recurrent-state groups beside full attention, as vLLM 0.34's hybrid KV cache manager
keeps them.

Its model is the what-if's (prompts one after another in trace order, no concurrency; the hit rate of
the requests after the warm-up), but each request goes through the replay's own pool and rules
(kvbench.memory.hybrid.HybridKV on a pool of the budget's blocks, evicting by vLLM's free queue, lru):
what each group keeps (a window's blocks only where a lookup can end, a recurrent state only at the
prompt's last block boundary and at shared-prefix junctions), where a lookup can end in every group,
and where a recurrent state's prefill stops (HybridKV.split). The whole blocks of the prompt and of a
named answer are computed (what a later request can hit; an unnamed answer is never re-sent); the
answer goes in one chunk after the prompt (no group keeps anything there that a chunk per token would
not). A budget is blocks of the shared pool: a block is one group's page for each layer of the largest
group (KVLayout.bytes_per_block), and a request holds a block in every group it needs one in.

The ceiling is the same model on a pool that never evicts: what these rules let the trace hit, below
the token-level ideal (``ideal`` beside it) wherever a window or a state was not kept.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvbench.memory.contracts import SeqKV
from kvbench.memory.groups import KVLayout, cdiv
from kvbench.memory.hybrid import HybridKV
from kvbench.trace.format import Request
from kvbench.trace.keys import cached_sequence, lookup_blocks
from kvbench.trace.tokens import TokenStreams, block_keys
from kvbench.whatif.blocktrace import window_start


def hits_per_request(requests: Sequence[Request], layout: KVLayout, budget_blocks: int | None,
                     streams: TokenStreams | None = None, max_model_len: int = 1 << 30) -> tuple[list[int], int]:
    """(tokens each request hits, requests that did not fit the pool even empty) with a pool of
    ``budget_blocks`` (None: one that never evicts)."""
    streams = streams or TokenStreams()
    seqs = []
    for req in requests:
        prompt = streams.expand(req)
        seqs.append((req, prompt, cached_sequence(req, prompt, streams)))
    if budget_blocks is None:  # every block of every request, in every group: nothing is evicted
        budget_blocks = sum(cdiv(len(t), layout.block_size) + 3 for _, _, t in seqs) * len(layout.groups) + 1
    kv = HybridKV(budget_blocks, layout, prefix_cache=True, cache_policy="lru", max_batched_tokens=1 << 30,
                  max_model_len=max_model_len)
    hits, too_large = [], 0
    for req, prompt, tokens in seqs:
        hits.append(_one(kv, req, len(prompt), tokens))
        if hits[-1] < 0:
            hits[-1] = 0
            too_large += 1
    return hits, too_large


def _one(kv: HybridKV, req: Request, plen: int, tokens) -> int:
    """Run one request alone: its prompt (split where a state must be kept), then its named answer;
    -> the tokens its first lookup hit, or -1 when the pool cannot hold it."""
    s = SeqKV(tokens=tokens, prompt_len=plen, num_tokens=plen)
    kv.set_clock(float(req.t))
    hit = kv.lookup(s, plen)
    cached = kv.num_cached_tokens(s, hit)
    computed, first = cached, True
    try:
        while computed < plen:
            n = plen - computed
            if kv.aligned_split:
                n = kv.split(s, computed, n)
            if not kv.allocate(s, n, hit if first else (), must_fit=plen if first else 0):
                return -1
            kv.commit(s, n)
            kv.new_step()
            computed += n
            first = False
        rest = len(tokens) - plen
        if rest > 0:
            s.num_tokens = len(tokens) + 1  # (decoding: nothing of the answer is a prefill)
            if not kv.allocate(s, rest):
                return -1
            kv.commit(s, rest)
            kv.new_step()
        return cached
    finally:
        kv.free(s)


def _ideal(requests: Sequence[Request], bs: int, streams: TokenStreams | None) -> tuple[list[int], int]:
    """Each request's hit in an infinite cache of every whole block (one group of full attention), and
    the distinct blocks."""
    streams = streams or TokenStreams()
    seen: set[int] = set()
    out = []
    for req in requests:
        prompt = streams.expand(req)
        keys = [int(k) for k in block_keys(cached_sequence(req, prompt, streams), bs)]
        n, limit = 0, lookup_blocks(len(prompt), bs)
        while n < min(limit, len(keys)) and keys[n] in seen:
            n += 1
        out.append(n * bs)
        seen.update(keys)
    return out, len(seen)


def whatif_groups(requests: Sequence[Request], layout: KVLayout, budgets: Sequence, *, warmup: float,
                  streams: TokenStreams | None = None, max_model_len: int = 1 << 30) -> dict:
    """Each budget's lru point and the ceiling over the window after ``warmup``: {"rows": [...],
    "ceiling_hit_tokens", "window_start", "window_prompt_tokens", "ideal"}."""
    start = window_start(len(requests), warmup)
    prompts = sum(r.prompt_len for r in requests[start:])
    ceiling, _ = hits_per_request(requests, layout, None, streams, max_model_len)
    ceiling_hits = sum(ceiling[start:])
    rows = []
    for b in budgets:
        hits, too_large = hits_per_request(requests, layout, b.blocks, streams, max_model_len)
        got = sum(hits[start:])
        rows.append({"budget_bytes": b.bytes, "budget_blocks": b.blocks, "policy": "lru", "budget": b.label,
                     "hit_rate": got / prompts if prompts else 0.0,
                     "ceiling": ceiling_hits / prompts if prompts else 0.0, "hit_tokens": got,
                     "gap_closed": None, "evicted_blocks": None, "too_large_requests": too_large})
    ideal, distinct = _ideal(requests, layout.block_size, streams)
    ideal_hits = sum(ideal[start:])
    return {"rows": rows, "ceiling_hit_tokens": ceiling_hits, "window_start": start,
            "window_prompt_tokens": prompts, "ideal": ideal_hits / prompts if prompts else 0.0,
            "distinct_blocks": distinct}


__all__ = ["hits_per_request", "whatif_groups"]
