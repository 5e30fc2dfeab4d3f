"""A deliberately simple re-implementation of vLLM v1's scheduling and prefix-cache rules (vLLM 0.33:
``vllm/v1/core/sched/scheduler.py: Scheduler.schedule``, ``vllm/v1/core/kv_cache_manager.py:
KVCacheManager.allocate_slots``, ``vllm/v1/core/block_pool.py: BlockPool``), written from vLLM's
source and not from kvbench's, for a differential test of kvbench's engine. Slow and obvious on
purpose: blocks are ints, a block's hash is the tuple of every token up to its end, the free queue is
a list of never-cached free blocks plus an LRU OrderedDict of idle cached ones.

Rules: running requests first, in order; each asks for what it lacks (chunked by the token budget);
when its blocks do not fit, the last running request is preempted (blocks freed tail first, state
reset, put at the head of the waiting queue), until it fits or it preempted itself. No admission in a
step that preempted. Waiting requests in order while the budget lasts and fewer than max_num_seqs
run: prefix lookup (whole blocks, never the one holding the last token), admitted only if the whole
sequence fits in the free blocks (hits counted, idle hits counting as taken), else stop. New blocks
are cached (hashed) as soon as they are allocated, up to the tokens computed by the end of the step;
a hash computed twice is cached twice. A request's sampled tokens extend its sequence and are
hashed the same way. Hit statistics are taken at admission: first admissions and resumptions apart.
"""
from __future__ import annotations

from collections import OrderedDict


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RefRequest:
    def __init__(self, rid: str, arrival: float, prompt: list[int], max_tokens: int, emit):
        self.id, self.arrival, self.max_tokens = rid, arrival, max_tokens
        self.tokens = list(prompt)  # prompt + sampled tokens
        self.num_prompt = len(prompt)
        self.emit = emit  # k -> the k-th sampled token
        self.computed = 0
        self.blocks: list[int] = []
        self.num_cached_blocks = 0
        self.outputs = 0
        self.preemptions = 0
        self.first_hits: int | None = None


class RefEngine:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_batched_tokens: int):
        self.bs, self.max_num_seqs, self.budget = block_size, max_num_seqs, max_batched_tokens
        self.free = list(range(num_blocks))  # never-cached free blocks
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0, least recent first
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, tuple] = {}
        self.by_hash: dict[tuple, list[int]] = {}
        self.waiting: list[RefRequest] = []
        self.running: list[RefRequest] = []
        self.query = self.hits = self.resumed_query = self.resumed_hits = 0
        self.preemptions = 0

    # -- block pool
    def num_free(self) -> int:
        return len(self.free) + len(self.idle)

    def _new_block(self) -> int:
        if self.free:
            return self.free.pop()
        b, _ = self.idle.popitem(last=False)  # evict the least recently freed cached block
        h = self.hash_of.pop(b)
        self.by_hash[h].remove(b)
        if not self.by_hash[h]:
            del self.by_hash[h]
        return b

    def _release(self, r: RefRequest) -> None:
        for b in reversed(r.blocks):  # tail first: a prefix outlives its continuation
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.idle[b] = None
                else:
                    self.free.append(b)
        r.blocks, r.num_cached_blocks, r.computed = [], 0, 0

    def _lookup(self, r: RefRequest) -> list[int]:
        hits = []
        for j in range((len(r.tokens) - 1) // self.bs):
            copies = self.by_hash.get(tuple(r.tokens[:(j + 1) * self.bs]))
            if not copies:
                break
            hits.append(copies[0])
        return hits

    def _allocate(self, r: RefRequest, num_new: int, hits: list[int], full: bool) -> bool:
        idle_hits = sum(1 for b in hits if self.ref[b] == 0)
        have = len(r.blocks) + len(hits)
        if full and cdiv(len(r.tokens), self.bs) - have + idle_hits > self.num_free():
            return False
        computed = r.computed + len(hits) * self.bs
        if max(0, cdiv(computed + num_new, self.bs) - have) + idle_hits > self.num_free():
            return False
        for b in hits:
            if self.ref[b] == 0:
                del self.idle[b]
            self.ref[b] += 1
        r.blocks += hits
        r.computed = computed
        r.num_cached_blocks = max(r.num_cached_blocks, len(hits))
        while len(r.blocks) < cdiv(computed + num_new, self.bs):
            b = self._new_block()
            self.ref[b] = 1
            r.blocks.append(b)
        # cache every block full once this step's tokens are computed
        full_blocks = min(computed + num_new, len(r.tokens)) // self.bs
        for j in range(r.num_cached_blocks, full_blocks):
            h = tuple(r.tokens[:(j + 1) * self.bs])
            self.hash_of[r.blocks[j]] = h
            self.by_hash.setdefault(h, []).append(r.blocks[j])
        r.num_cached_blocks = max(r.num_cached_blocks, full_blocks)
        return True

    # -- scheduler
    def schedule(self) -> tuple[list[tuple[str, int]], list[str]]:
        budget, scheduled, preempted = self.budget, [], []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(len(r.tokens) - r.computed, budget)
            ok = self._allocate(r, n, [], False)
            while not ok:
                victim = self.running.pop()
                self._release(victim)
                victim.preemptions += 1
                self.preemptions += 1
                self.waiting.insert(0, victim)
                preempted.append(victim.id)
                if victim is r:
                    break
                ok = self._allocate(r, n, [], False)
            if not ok:
                break
            scheduled.append((r, n))
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            hits = self._lookup(r)
            n = min(len(r.tokens) - len(hits) * self.bs, budget)
            if not self._allocate(r, n, hits, True):
                break
            self.waiting.pop(0)
            if r.preemptions:
                self.resumed_query += len(r.tokens)
                self.resumed_hits += len(hits) * self.bs
            else:
                self.query += len(r.tokens)
                self.hits += len(hits) * self.bs
                r.first_hits = len(hits) * self.bs
            self.running.append(r)
            scheduled.append((r, n))
            budget -= n
        self._last = scheduled
        return [(r.id, n) for r, n in scheduled], preempted

    def update(self) -> None:
        """The step ran: its tokens are computed; a request that caught up samples a token."""
        for r, n in self._last:
            r.computed += n
            if r.computed == len(r.tokens):
                r.tokens.append(r.emit(r.outputs))
                r.outputs += 1
                if r.outputs >= r.max_tokens:
                    self._release(r)
                    self.running.remove(r)


def replay(requests: list[RefRequest], engine: RefEngine, step_ms) -> list:
    """Arrivals up to the clock, schedule, advance the clock by ``step_ms(prefill_tokens, decodes)``,
    update; returns per step ([(request id, tokens)], [preempted ids])."""
    pending = sorted(requests, key=lambda r: r.arrival)
    clock, log = 0.0, []
    while pending or engine.waiting or engine.running:
        while pending and pending[0].arrival <= clock:
            engine.waiting.append(pending.pop(0))
        if not engine.waiting and not engine.running:
            clock = max(clock, pending[0].arrival)
            continue
        sched, pre = engine.schedule()
        prefill = sum(n for r, n in engine._last if not (n == 1 and r.outputs > 0 and r.computed == len(r.tokens) - 1))
        decodes = sum(1 for r, n in engine._last if n == 1 and r.outputs > 0 and r.computed == len(r.tokens) - 1)
        engine.update()
        clock += step_ms(prefill, decodes) / 1e3
        log.append((sched, pre))
    return log
