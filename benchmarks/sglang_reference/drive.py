"""Drive SGLang 0.5.23's own RadixCache (sglang/srt/mem_cache/radix_cache.py) without a model, one
request at a time, on a kvbench trace, and print the prefix hit rate (hit tokens / prompt tokens).

RadixCache decides every match, split and eviction (match_prefix, insert, evict, lock/unlock, i.e.
inc/dec_lock_ref); this file stands in only for the token-to-KV allocator (a free list of pages,
slot = page * page_size + offset) and walks each request through the calls SGLang's scheduler makes
for it when it runs alone:

  1. m = match_prefix(prompt, limit len - 1)    Req.init_next_round_input: max_prefix_len = input_len - 1;
                                                RadixCache page-aligns the key. hits = m.device_prefix_len
  2. lock(m.last_device_node)                   the request holds its matched path
  3. shortfall = extend - available; if > 0: evict(shortfall)
                                                allocator.evict_to_free_tokens -> evict_for_alloc -> evict
                                                (--conservative: extend + page_size, the over-estimate of
                                                alloc_paged_token_slots_extend; same hits on Mooncake)
  4. allocate ceil(extend / page) pages         the row: the prefix's slots, then the new ones
  5. insert(prompt, page-aligned)               RadixCache.checkpoint after the prefill
     --outputs: first decode output_len - 1 tokens (pages as they fill, evicting their shortfall:
     one reservation for all, since the tree does not change while one request decodes), then
     insert prompt + outputs and the prompt again (checkpoint(split_prompt=True) at finish)
  6. free the duplicate pages the insert found and the row's pages past the inserted key (the
     partial last page), unlock                 release_kv_cache

Token ids are kvbench's (TokenStreams().expand(req)); generated tokens are kvbench's sampled stream
of the request (Mooncake's answers are unnamed: no later prompt contains them).

--clock logical (default) replaces radix_cache's time.monotonic by a counter: the order of access
times is the same, without ties between calls that land on the same clock tick.

Usage:  python drive.py mooncake.jsonl --tokens 768000 [--page 16] [--limit N] [--outputs]
        [--conservative] [--clock logical|monotonic] [--per-request OUT.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
import types
from array import array

import stubs

stubs.install_after_transformers()

import numpy as np
import sglang.srt.mem_cache.radix_cache as rc
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from kvbench.trace.format import load_trace
from kvbench.trace.tokens import TokenStreams


class PagePool:
    """The token-to-KV allocator: ``num_pages`` pages. RadixCache calls ``free_segment`` (eviction)
    and reads ``device``."""

    device = "cpu"

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.free_pages = list(range(num_pages - 1, -1, -1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self.free_pages):
            raise RuntimeError(f"out of memory: {n} pages wanted, {len(self.free_pages)} free")
        got = self.free_pages[len(self.free_pages) - n:]
        del self.free_pages[len(self.free_pages) - n:]
        return got[::-1]

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        assert start_pos % self.page_size == 0
        if free_index.numel():
            self.free_pages.extend((free_index[::self.page_size] // self.page_size).tolist())


def slots_of(pages: list[int], n: int, page: int) -> torch.Tensor:
    """The first ``n`` slots of ``pages`` (int64)."""
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page + torch.arange(page)).reshape(-1)[:n]


def key_of(tokens: np.ndarray, limit: int | None = None) -> RadixKey:
    a = array("q")
    a.frombytes(tokens.astype("<i8").tobytes())
    return RadixKey(a, limit=limit)


def checkpoint(cache: RadixCache, pool: PagePool, seq: np.ndarray, row: torch.Tensor, protected: int,
               lock, split_at: int | None = None):
    """RadixCache.checkpoint: insert ``seq`` page-aligned (then the prompt again, ``split_at``
    tokens, as split_prompt does), free the row's pages in [protected, what the tree held already),
    point the row at the tree's pages and lock the inserted path in place of ``lock``.
    -> (new lock, tree-owned length: cache_protected_len)."""
    page = pool.page_size
    n_key = len(seq) // page * page
    key = key_of(seq[:n_key])
    res = cache.insert(InsertParams(key=key, value=row[:n_key].clone()))
    if split_at is not None and 0 < split_at // page * page < n_key:
        n_prompt = split_at // page * page
        cache.insert(InsertParams(key=key_of(seq[:n_prompt]), value=row[:n_prompt].clone(),
                                  inserted_len=n_prompt, priority=1))
    if res.prefix_len > protected:  # our copies of pages the tree holds already
        pool.free_segment(row[protected:res.prefix_len], start_pos=protected)
    node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    row[:n_key] = cache.path_device_indices(node)  # the row now points at the tree's pages
    cache.unlock(lock)
    return cache.lock(node), n_key


def run(trace: str, tokens: int, page: int = 16, limit: int | None = None, outputs: bool = False,
        conservative: bool = False, clock: str = "logical") -> dict:
    if clock == "logical":
        tick = itertools.count(1)
        rc.time = types.SimpleNamespace(monotonic=lambda: float(next(tick)), perf_counter=time.perf_counter)
    pool = PagePool(tokens // page, page)
    cache = RadixCache.create_simulated(mock_allocator=pool, page_size=page)
    streams = TokenStreams()
    reqs = load_trace(trace, limit=limit)
    hits: list[int] = []
    evicted = prompt_total = 0
    t0 = time.perf_counter()

    def reserve(n_tokens: int) -> None:
        nonlocal evicted
        short = n_tokens - pool.available_size()
        if short > 0:
            evicted += cache.evict(EvictParams(num_tokens=short)).num_tokens_evicted

    for r in reqs:
        prompt = streams.expand(r)
        L = len(prompt)
        m = cache.match_prefix(MatchPrefixParams(key=key_of(prompt, limit=L - 1)))
        h = m.device_prefix_len
        row = cache.path_device_indices(m.last_device_node)
        assert len(row) == h
        lock = cache.lock(m.last_device_node)
        extend = L - h
        reserve(extend + (page if conservative else 0))
        row = torch.cat([row, slots_of(pool.alloc_pages(-(-extend // page)), extend, page)])
        # checkpoint after the prefill: insert the prompt, free our copies of pages the tree holds,
        # hold the inserted path instead of the matched one
        lock, owned = checkpoint(cache, pool, prompt, row, h, lock)
        if outputs and r.output_len > 1:  # decode, then checkpoint prompt + outputs at finish
            n_out = r.output_len - 1
            in_page = min((page - L % page) % page, n_out)  # the prompt's last page fills first
            new_pages = -(-(n_out - in_page) // page)
            reserve(new_pages * page)
            row = torch.cat([row, row[-1] + 1 + torch.arange(in_page),
                             slots_of(pool.alloc_pages(new_pages), n_out - in_page, page)])
            seq = np.concatenate([prompt, streams.output_tokens(r, n_out)])
            lock, _ = checkpoint(cache, pool, seq, row, owned, lock, split_at=L)
            n_key = len(seq) // page * page
        else:
            n_key = L // page * page
        if len(row) > n_key:  # release_kv_cache: the partial last page
            pool.free_segment(row[n_key:], start_pos=n_key)
        cache.unlock(lock)
        hits.append(h)
        prompt_total += r.prompt_len
    return {"sglang": "0.5.23", "requests": len(reqs), "tokens": tokens, "page": page, "outputs": outputs,
            "conservative": conservative, "clock": clock, "hit_tokens": sum(hits),
            "prompt_tokens": prompt_total, "hit_rate": sum(hits) / prompt_total,
            "evicted_tokens": evicted, "wall_s": round(time.perf_counter() - t0, 1), "hits": hits}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--tokens", type=int, required=True, help="KV pool size in tokens")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--outputs", action="store_true", help="decode and insert the generated tokens too")
    ap.add_argument("--conservative", action="store_true", help="evict for extend + page_size tokens")
    ap.add_argument("--clock", choices=["logical", "monotonic"], default="logical")
    ap.add_argument("--per-request", help="also write the result with every request's hit tokens here")
    args = ap.parse_args(argv)
    out = run(args.trace, args.tokens, args.page, args.limit, args.outputs, args.conservative, args.clock)
    if args.per_request:
        with open(args.per_request, "w") as fh:
            json.dump(out, fh)
    print(json.dumps({k: v for k, v in out.items() if k != "hits"}))


if __name__ == "__main__":
    main()
