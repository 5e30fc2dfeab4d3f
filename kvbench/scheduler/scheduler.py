"""Layer 4, the scheduler: continuous batching over a KV manager, as vLLM v1 does it.

Each step has a token budget (``max_batched_tokens``) and a sequence cap (``max_num_seqs``).
Running sequences go first, each asking for what it lacks (1 token when decoding, a chunk of its
prompt when prefilling: chunked prefill); when one cannot get a block, the most recently admitted
running sequence is preempted (freed, to be recomputed later) until it can. Then waiting sequences
are admitted in arrival order while blocks allow, above a small watermark; admission looks the prompt
up in the prefix cache so cached tokens skip prefill. A request with n > 1 is prefilled once and
forked into n samples when its first token is sampled. The slab layout runs through the same code:
its ``allocate`` reserves a whole slab at admission and never fails afterwards.

Token eviction (kvbench.eviction.evictor) hooks in at three points and never changes this flow: after each
step's commit it may shrink the sequences about to decode (``after_step``), it forgets a sequence
whose KV is freed (``release``), and it adds its queued slot moves, offloads and recalls to the
next batch (``fill_batch``). An evicted sequence holds ``num_kv`` slots but has computed
``num_kv + dropped`` tokens; that sum is what scheduling compares against ``num_tokens``.

Hot path: per step, O(1) work per scheduled sequence plus O(blocks it gains); no per-token objects.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvbench.scheduler.batch import StepBatch, StepResult
from kvbench.scheduler.request import RequestState, Sequence


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    watermark_frac: float | None = None  # blocks kept free at admission; None: the layout's own


@dataclass(slots=True)
class StepPlan:
    """What the scheduler decided this step: (sequence, tokens to compute) pairs."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: int = 0


class Scheduler:
    def __init__(self, kv, cfg: SchedulerConfig, *, needs_tokens: bool = False, streams=None,
                 evictor=None):
        from kvbench.eviction.evictor import NoEviction

        self.kv = kv
        self.evictor = evictor if evictor is not None else NoEviction()
        self.steps = 0
        self.cfg = cfg
        self.needs_tokens = needs_tokens
        self.streams = streams
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        frac = kv.watermark_frac if cfg.watermark_frac is None else cfg.watermark_frac
        self.watermark = int(frac * kv.num_blocks)
        self._next_id = 0
        # prefix-cache counters in tokens (spec §4): first admissions, and resumptions apart
        self.query_tokens = 0
        self.hit_tokens = 0
        self.resumed_query_tokens = 0
        self.resumed_hit_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0

    # -- queues -----------------------------------------------------------------------------
    def new_seq(self, rs: RequestState, tokens: np.ndarray | None, next_use=None,
                keys: list[int] | None = None, reserve: int = 0) -> Sequence:
        self._next_id += 1
        return Sequence(tokens=tokens, next_use=next_use, keys=keys, reserve=reserve,
                        seq_id=self._next_id, rs=rs, num_tokens=len(rs.prompt),
                        out_tokens=[] if self.needs_tokens else None)

    def add(self, s: Sequence) -> None:
        self.waiting.append(s)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, now_s: float) -> StepPlan:
        kv, cfg = self.kv, self.cfg
        plan = StepPlan()
        budget = cfg.max_batched_tokens
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            num_new = min(s.num_tokens - s.num_kv - s.dropped, budget)
            while not kv.allocate(s, num_new):
                victim = running.pop()
                self._preempt(victim)
                plan.preempted += 1
                if victim is s:
                    break
            else:
                plan.seqs.append(s)
                plan.num_new.append(num_new)
                budget -= num_new
                i += 1
                continue
            break
        if plan.preempted:  # memory is short: admit nothing new this step
            return plan
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            s = waiting[0]
            floor, available = kv.admission_floor(s, s.num_tokens, budget)
            if max(floor, s.wait_for_blocks) > available - (self.watermark if running else 0):
                break  # plainly short of memory: spare the lookup
            hits = kv.lookup(s, s.num_tokens)
            cached = kv.num_cached_tokens(s, hits)
            num_new = min(s.num_tokens - cached, budget)
            # the watermark keeps room for running sequences to grow; with none running, a request
            # that needs nearly the whole pool must still be admitted
            if not kv.allocate(s, num_new, hits, self.watermark if running else 0):
                # retry only once that many blocks are available (hits may change meanwhile, but
                # only by evictions, which do not make admission easier, or new registrations)
                s.wait_for_blocks = kv.last_shortfall - (self.watermark if running else 0)
                break
            s.wait_for_blocks = 0
            waiting.popleft()
            rs = s.rs
            if s.resumed:
                self.resumed_query_tokens += s.num_tokens
                self.resumed_hit_tokens += cached
                recompute = max(0, s.computed_before - cached)
                rs.recomputed_tokens += recompute
                self.recomputed_tokens += recompute
                s.resumed = False
            else:
                self.query_tokens += s.num_tokens
                self.hit_tokens += cached
                rs.cached_tokens = cached
                if rs.first_sched_s != rs.first_sched_s:  # NaN: first time scheduled
                    rs.first_sched_s = now_s
            running.append(s)
            plan.seqs.append(s)
            plan.num_new.append(num_new)
            budget -= num_new
        return plan

    def _preempt(self, s: Sequence) -> None:
        """Free a running sequence; it waits at the head of the queue to be recomputed."""
        s.computed_before = s.num_kv + s.dropped
        self.kv.free(s)
        self.evictor.release(s)
        s.resumed = True
        s.rs.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(s)

    # -- building the executor's batch ---------------------------------------------------------
    def build_batch(self, plan: StepPlan) -> StepBatch:
        batch = StepBatch(block_size=self.kv.block_size, copies=self.kv.take_copies())
        self.evictor.fill_batch(batch)
        tokens = self.needs_tokens
        for s, n in zip(plan.seqs, plan.num_new):
            start = s.num_kv + s.dropped
            if start + n == s.num_tokens and start == s.num_tokens - 1 and s.num_out > 0:
                batch.decode_seq_ids.append(s.seq_id)
                batch.decode_positions.append(start)
                batch.decode_slots.append(s.num_kv)
                if tokens:
                    batch.decode_tokens.append(s.last_token)
            else:
                batch.prefill_seq_ids.append(s.seq_id)
                batch.prefill_starts.append(start)
                batch.prefill_lens.append(n)
                batch.prefill_last.append(start + n == s.num_tokens)
                if tokens:
                    batch.prefill_tokens.append(self._token_ids(s, start, n))
            if tokens:
                batch.block_tables[s.seq_id] = s.table
        return batch

    def _token_ids(self, s: Sequence, start: int, n: int) -> np.ndarray:
        prompt = s.rs.prompt
        if start + n <= len(prompt):
            return prompt[start:start + n]
        gen = np.asarray(s.out_tokens, dtype=np.int32)
        return np.concatenate([prompt, gen])[start:start + n]

    # -- after the executor ran ----------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now_s: float) -> list[RequestState]:
        """Commit the step (KV written, tokens sampled, forks, finishes); return finished requests."""
        kv = self.kv
        sampled = result.sampled
        finished: list[RequestState] = []
        done_seqs = False
        for s, n in zip(plan.seqs, plan.num_new):
            kv.commit(s, n)
            if s.num_kv + s.dropped < s.num_tokens:
                continue  # a prefill chunk that did not reach the end
            rs = s.rs
            req = rs.req
            # a token was sampled
            if s.out_tokens is not None:  # only executors that take tokens need them
                tok = self._emitted_token(s, sampled)
                s.last_token = tok
                s.out_tokens.append(tok)
            s.num_out += 1
            s.num_tokens += 1
            rs.output_tokens += 1
            if s.num_out == 1 and rs.first_token_s != rs.first_token_s:
                rs.first_token_s = now_s
                if req.n > 1:
                    self._fork(s, req.n - 1)
            if s.num_out >= req.output_len:
                if s.out_tokens is not None:
                    if rs.samples is None:
                        rs.samples = []
                    rs.samples.append((s.seq_id, s.out_tokens))
                kv.free(s)
                self.evictor.release(s)
                s.num_tokens = -1  # marks finished for the sweep below
                done_seqs = True
                rs.live_seqs -= 1
                if rs.live_seqs == 0:
                    rs.finish_s = now_s
                    finished.append(rs)
        if done_seqs:
            self.running = [s for s in self.running if s.num_tokens >= 0]
        self.evictor.after_step(self.running, result, self.steps)
        self.steps += 1
        return finished

    def _emitted_token(self, s: Sequence, sampled) -> int:
        req = s.rs.req
        if req.output is not None and self.streams is not None:
            return int(self.streams.output_tokens(req, 1, s.num_out)[0])
        if sampled is not None:
            return int(sampled.get(s.seq_id, 0))
        return 0

    def _fork(self, parent: Sequence, n_children: int) -> None:
        """Parallel samples: children share the parent's KV (paged) or get a copy (slab)."""
        rs = parent.rs
        for _ in range(n_children):
            self._next_id += 1
            child = Sequence(tokens=parent.tokens, next_use=parent.next_use, keys=parent.keys,
                             seq_id=self._next_id, rs=rs, num_tokens=parent.num_tokens,
                             num_out=parent.num_out, last_token=parent.last_token,
                             out_tokens=None if parent.out_tokens is None else list(parent.out_tokens))
            rs.live_seqs += 1
            rs.output_tokens += 1
            if self.kv.fork(parent, child):
                self.running.append(child)
            else:  # slab: no room for another slab now; recompute the sample when there is
                child.resumed = True
                self.waiting.appendleft(child)
