"""Layer 4, the scheduler: continuous batching over a KV manager, as vLLM v1 does it
(``vllm/v1/core/sched/scheduler.py: Scheduler.schedule``, vLLM 0.33).

Each step has a token budget (``max_batched_tokens``) and a sequence cap (``max_num_seqs``).
Running sequences go first, in admission order, each asking for what it lacks (1 token when
decoding, a chunk of its prompt when prefilling: chunked prefill); when one cannot get its blocks,
the last running sequence is preempted (freed, to be recomputed later; it waits at the head of the
queue) until it can, or until it is itself the victim. A step that preempted admits nothing. Then
waiting sequences are admitted in arrival order while the budget, the cap and the free blocks allow:
admission looks the prompt up in the prefix cache (cached tokens skip prefill) and, by default,
requires that the whole sequence fit now, hits counted (``scheduler_reserve_full_isl``), though
chunked prefill computes it over several steps; ``--admission first-chunk`` checks only the first
chunk (vLLM v0 and vLLM v1 before 0.33). ``--watermark`` keeps a share of the blocks free at
admission while other sequences run (vLLM's ``watermark``, 0 by default). The first request that does
not fit stops admission for the step (first come, first served).

A request with n > 1 samples is prefilled once and forked into n sequences when its first token is
sampled (parallel sampling as in the PagedAttention paper: the prompt's blocks are shared by
refcount); it counts as n sequences against the cap from admission on. The slab layout runs through
the same code: its ``allocate`` reserves whole slabs (one per sample) at admission and never fails
afterwards.

Token eviction (kvbench.eviction) hooks in at three points and never changes this flow: after each
step's commit it may shrink the sequences about to decode (``after_step``), it forgets a sequence
whose KV is freed (``release``), and it adds its queued slot moves, offloads and recalls to the
next batch (``fill_batch``). An evicted sequence holds ``num_kv`` slots but has computed
``num_kv + dropped`` tokens; that sum is what scheduling compares against ``num_tokens``.

Hot path: per step, O(1) work per scheduled sequence plus O(blocks it gains); no per-token objects.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvbench.scheduler.batch import StepBatch, StepResult
from kvbench.scheduler.lane import DecodeLane
from kvbench.scheduler.request import RequestState, Sequence
from kvbench.trace.keys import sequence_tokens, sequence_tokens_of
from kvbench.trace.tokens import TokenStreams

if TYPE_CHECKING:
    from kvbench.eviction.evictor import Evictor, NoEviction
    from kvbench.memory.contracts import KVManager

ADMISSIONS = ("full-prompt", "first-chunk")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    admission: str = "full-prompt"  # the whole sequence must fit to admit it, or only its first chunk
    watermark: float = 0.0  # share of the blocks kept free when admitting while others run
    admission_window: int = 0  # cache-aware admission: reorder the first N waiting by cached prefix (0: off)
    admission_threshold: float = 0.5  # ... once this share of the pool is held


@dataclass(slots=True)
class StepPlan:
    """What the scheduler decided this step: (sequence, tokens to compute) pairs."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # in the order they were preempted
    running: int = 0  # sequences holding KV this step (running after scheduling, as vLLM counts them)
    lane: int = 0  # decodes the scheduler's DecodeLane took (one token each), not in seqs
    # KV loads this step started (a disaggregated decode instance): (sequence, tokens loaded, tokens hit here)
    loads: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing scheduled: no sequence computes a token this step."""
        return not self.seqs and not self.lane


class Scheduler:
    lane_enabled = True  # enable_lane may take the decode lane (tests set False to compare without it)

    def __init__(self, kv: KVManager, cfg: SchedulerConfig, *, needs_tokens: bool = False,
                 streams: TokenStreams | None = None, evictor: Evictor | NoEviction | None = None):
        from kvbench.eviction.evictor import NoEviction

        if cfg.admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {cfg.admission!r} (choose from {', '.join(ADMISSIONS)})")
        self.kv = kv
        self.evictor: Evictor | NoEviction = evictor if evictor is not None else NoEviction()
        self.steps = 0
        self.cfg = cfg
        self.full_prompt = cfg.admission == "full-prompt"
        self.needs_tokens = needs_tokens
        self.streams = streams if streams is not None else TokenStreams()  # the same tokens: streams are by name
        self.waiting: deque[Sequence] = deque()
        self.waiting_tokens = 0  # Σ num_tokens over waiting (a router's load figure, O(1) to read)
        self.running: list[Sequence] = []
        self.watermark = int(cfg.watermark * kv.num_blocks)
        self.num_seats = 0  # sum of ``seats`` over running sequences: what max_num_seqs caps
        self._next_id = 0
        # prefix-cache counters in tokens (spec §4): first admissions, and resumptions apart
        self.query_tokens = 0
        self.hit_tokens = 0
        self.resumed_query_tokens = 0
        self.resumed_hit_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        # inter-token latency: gap (s) -> how many times a sample waited that long between two tokens
        # (most gaps are one step's duration, so a count per distinct value keeps them all, exactly)
        self.itl_gaps: dict[float, int] = {}
        # of hit_tokens, those loaded from each tier behind the pool (kvbench.memory.tiers), by name
        self.tier_hit_tokens = {name: 0 for name in kv.tiers.names} if kv.tiers is not None else {}
        self.resumed_loaded_tokens = 0  # resumed requests' tokens loaded from the tiers
        self.lane: DecodeLane | None = None  # the running batch's steady decodes in arrays (enable_lane)
        # a KV manager with recurrent state in align mode ends prefill chunks where a state must be kept
        # (HybridKV.split: vLLM's Scheduler._mamba_block_aligned_split, after the budget's cut)
        self._split = kv.split if kv.aligned_split else None
        # Disaggregated prefill/decode (kvbench.engine.disagg), as vLLM 0.34 runs a KV connector:
        # a prefill leg's finished sequence keeps its blocks until the decode side has read them
        # (request_finished's delayed free), by request; a decode leg's sequences whose loads started
        # hold their blocks in start order (Scheduler.kv_holding_waiting) until admitted to run.
        self.held: dict[RequestState, Sequence] = {}
        self.holding: deque[Sequence] = deque()
        self.ready = 0  # of those holding, the ones whose KV has arrived
        self.remote_query_tokens = 0  # decode legs' prompts at their load, and what this pool already held
        self.remote_hit_tokens = 0

    def enable_lane(self) -> bool:
        """Run the steady decodes in a DecodeLane (kvbench.scheduler.lane) from now on, where the
        configuration allows it: the paged layout on the compiled pool, no tiers, no token eviction,
        an executor that takes no tokens. Only the scheduler may then read its running sequences'
        token counts mid-run (a replay with a step log or hook does not ask). -> whether it did."""
        from kvbench.eviction.evictor import NoEviction
        from kvbench.memory.array_pool import ArrayBlockPool
        from kvbench.memory.paged import PagedKV

        kv = self.kv
        pool = kv.pool if isinstance(kv, PagedKV) else None
        if not (self.lane_enabled and self.lane is None and not self.running and isinstance(pool, ArrayBlockPool)
                and kv.tiers is None and pool.events is None and pool.spill is None
                and isinstance(self.evictor, NoEviction) and not self.needs_tokens):
            return False
        assert isinstance(kv, PagedKV)
        self.lane = DecodeLane(kv, pool, capacity=self.cfg.max_num_seqs + 1)
        return True

    def sync(self) -> None:
        """Make every running sequence's object current (the lane holds the truth mid-run)."""
        if self.lane is not None:
            for s in self.running:
                self.lane.pull(s)

    # -- queues -----------------------------------------------------------------------------
    def new_seq(self, rs: RequestState, tokens: np.ndarray | None, next_use: np.ndarray | None = None,
                keys: list[int] | None = None, reserve: int = 0) -> Sequence:
        self._next_id += 1
        return Sequence(tokens=tokens, next_use=next_use, keys=keys, reserve=reserve, prompt_len=rs.req.prompt_len,
                        seq_id=self._next_id, rs=rs, seats=rs.req.n, num_tokens=rs.req.prompt_len,
                        out_tokens=[] if self.needs_tokens else None)

    def add(self, s: Sequence) -> None:
        self.waiting.append(s)
        self.waiting_tokens += s.num_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    def probe(self, s: Sequence) -> int:
        """Prompt tokens of a sequence not queued here that this pool caches now, changing nothing
        (Dynamo's conditional disaggregation asks the decode worker's cache: engine.disagg)."""
        if not s.built:
            self._build(s)
        return self.kv.probe_cached_tokens(s, s.num_tokens)

    def loaded(self, s: Sequence) -> None:
        """The KV a decode leg was loading has arrived (vLLM: finished_recving, then
        _update_waiting_for_remote_kv): its blocks are cached, and its prompt's last token is computed
        again by its first step, which samples its first token."""
        self.kv.loaded(s)
        s.loaded = True
        self.ready += 1

    def release(self, rs: RequestState) -> None:
        """A prefill leg's KV has been read: free the blocks it held (vLLM: finished_sending)."""
        s = self.held.pop(rs)
        self.kv.free(s)
        self.evictor.release(s)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, now_s: float) -> StepPlan:
        kv, cfg = self.kv, self.cfg
        plan = StepPlan()
        budget = cfg.max_batched_tokens
        running, lane = self.running, self.lane
        allocate, seqs, nums = kv.allocate, plan.seqs, plan.num_new  # per running sequence: bound once
        split = self._split
        if split is not None:
            kv.new_step()
        if lane is not None:
            lane.begin()
        i = 0
        while True:
            if lane is not None:  # the decodes it can take, up to the next the loop's body must
                i, budget = lane.advance(i, budget)
            if not (i < len(running) and budget > 0):
                break
            s = running[i]
            if lane is not None:
                lane.pull(s)
            num_new = s.num_tokens - s.num_kv - s.dropped
            if num_new > budget:
                num_new = budget
            if split is not None:  # a prefill chunk ends where a state must be kept
                num_new = split(s, s.num_kv, num_new)
                if not num_new:  # (vLLM: skipped this step)
                    i += 1
                    continue
            while not allocate(s, num_new):
                victim = running.pop()  # the last admitted (vLLM: self.running.pop())
                if lane is not None:
                    lane.pop(victim)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is s:
                    break
            else:
                seqs.append(s)
                nums.append(num_new)
                budget -= num_new
                i += 1
                continue
            break
        if lane is not None:
            plan.lane = lane.count
        if not plan.preempted:  # a step that preempted admits nothing new
            if cfg.admission_window:
                self._reorder_by_cached_prefix()
            self._admit(plan, budget, now_s)
        plan.running = len(running)
        return plan

    def _admit(self, plan: StepPlan, budget: int, now_s: float) -> None:
        kv, cap, full = self.kv, self.cfg.max_num_seqs, self.full_prompt
        waiting, running = self.waiting, self.running
        if self.holding:
            budget = self._admit_loaded(plan, budget)
        while waiting and budget > 0:
            s = waiting[0]
            if self.num_seats + s.seats > cap:
                break
            if not s.built:  # its token arrays are built now, not at arrival
                self._build(s)
            # the watermark keeps room for running sequences to grow; with none running, a request
            # that needs nearly the whole pool must still be admitted (vLLM: has_scheduled_reqs)
            wm = self.watermark if running else 0
            if s.remote:
                if not self._start_load(s, plan, wm, full):
                    break
                continue
            floor, available = kv.admission_floor(s, s.num_tokens, budget, full)
            if floor > available - wm:
                break  # short of memory (PagedKV: exact for an empty table): spare the lookup
            hits = kv.lookup(s, s.num_tokens)
            cached = kv.num_cached_tokens(s, hits)
            num_new = min(s.num_tokens - cached, budget)
            if self._split is not None:
                num_new = self._split(s, cached, num_new)
                if not num_new:
                    break
            if not kv.allocate(s, num_new, hits, wm, must_fit=s.num_tokens if full else 0,
                               forks=s.seats - 1):
                break
            waiting.popleft()
            self.waiting_tokens -= s.num_tokens
            rs = s.rs
            loaded = kv.last_loaded
            if loaded is not None and s.resumed:
                self.resumed_loaded_tokens += len(loaded) * kv.block_size
            elif loaded is not None:  # first admission: hits served by the tiers, per tier
                assert kv.tiers is not None  # (what loaded them)
                names, bs, th = kv.tiers.names, kv.block_size, self.tier_hit_tokens
                for i in loaded.tiers:
                    th[names[i]] += bs
                rs.loaded_tokens = len(loaded) * bs
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
            self._run(s, plan, num_new)
            budget -= num_new

    def _run(self, s: Sequence, plan: StepPlan, num_new: int) -> None:
        """An admitted sequence runs from this step, computing ``num_new`` tokens in it."""
        self.running.append(s)
        if self.lane is not None:
            self.lane.enter(s)
        self.num_seats += s.seats
        plan.seqs.append(s)
        plan.num_new.append(num_new)

    def _admit_loaded(self, plan: StepPlan, budget: int) -> int:
        """Decode legs holding blocks go first, in the order their loads started (vLLM 0.34 drains
        ``kv_holding_waiting`` before the waiting queue; one still loading is skipped): each whose KV
        has arrived runs its prompt's last token, while a seat and the token budget last. -> budget."""
        cap, holding = self.cfg.max_num_seqs, self.holding
        for s in list(holding):
            if self.num_seats + s.seats > cap or budget <= 0:
                break
            if not s.loaded:
                continue
            num_new = s.num_tokens - s.num_kv  # (1: the prompt's last token)
            if not self.kv.allocate(s, num_new):  # (within the blocks it holds: never short)
                break
            holding.remove(s)
            self.ready -= 1
            self._run(s, plan, num_new)
            budget -= num_new
        return budget

    def _start_load(self, s: Sequence, plan: StepPlan, wm: int, full: bool) -> bool:
        """A decode leg at the head of the queue: its local prefix hit is taken, and blocks for the
        rest of its prompt, which a KV connector loads from the prefill instance (vLLM 0.34
        Scheduler.schedule with ``load_kv_async``: NIXL's get_num_new_matched_tokens answers the
        prompt less the block-aligned local hit; allocate_slots with no new tokens, the external
        ones, the caching of their blocks delayed). vLLM also keeps free what the requests still
        prefilling need to finish (``reserved_blocks``, Scheduler._inflight_prefill_reserved_blocks);
        here that is always none: a request still prefilling after this step's running pass has spent
        the token budget (kvbench models no long-prefill threshold), and with none left no load is
        admitted (vLLM's ``loads_only`` then admits loads only past --max-num-inflight-kv-loads, unset
        by default). It takes no token budget and no seat until its KV has arrived. -> False when
        short of blocks (first come, first served: admission stops)."""
        kv = self.kv
        hits = kv.lookup(s, s.num_tokens)
        cached = kv.num_cached_tokens(s, hits)
        external = s.num_tokens - cached
        if not kv.allocate(s, 0, hits, wm, must_fit=s.num_tokens if full else 0,
                           external=external, load=True):
            return False
        self.waiting.popleft()
        self.waiting_tokens -= s.num_tokens
        s.remote = False  # (preempted later, it recomputes here: vLLM clears do_remote_prefill)
        self.holding.append(s)
        self.remote_query_tokens += s.num_tokens
        self.remote_hit_tokens += cached
        plan.loads.append((s, external, cached))
        return True

    def _reorder_by_cached_prefix(self) -> None:
        """Cache-aware admission (vLLM 0.34: Scheduler._reorder_waiting_by_cached_prefix, off by
        default): once the pool is ``admission_threshold`` full, the first ``admission_window`` waiting
        sequences that wait for their first admission are reordered among their own places, deepest
        cached prefix first, arrival order breaking ties; a preempted one keeps its place, and the
        queue past the window is untouched."""
        waiting, cfg = self.waiting, self.cfg
        if len(waiting) < 2 or self.kv.usage < cfg.admission_threshold:
            return
        head = [waiting[i] for i in range(min(cfg.admission_window, len(waiting)))]
        slots = [i for i, s in enumerate(head) if not s.resumed]
        if len(slots) < 2:
            return
        for i in slots:
            if not head[i].built:
                self._build(head[i])
        cached = {i: self.kv.probe_cached_tokens(head[i], head[i].num_tokens) for i in slots}
        order = sorted(slots, key=lambda i: (-cached[i], i))
        if order == slots:
            return
        moved = list(head)
        for slot, source in zip(slots, order):
            moved[slot] = head[source]
        for k, s in enumerate(moved):
            waiting[k] = s

    def _build(self, s: Sequence) -> None:
        """Give a sequence first considered for admission what it waited without: its tokens (one
        array, the prompt its first part), built from its pieces by one compiled call, and its keys as
        the pool takes them (a list of ints where the pool or the tiers keep ints)."""
        if s.pieces is not None:
            s.tokens = sequence_tokens_of(s.rs.req, s.pieces)
            s.rs.prompt = s.tokens[:int(s.pieces.prompt_lens[0])]
            s.pieces = None
        if s.waiting_keys is not None:
            s.keys = s.waiting_keys if self.kv.keys_as_arrays else s.waiting_keys.tolist()
            s.waiting_keys = None
        s.built = True

    def _preempt(self, s: Sequence) -> None:
        """Free a running sequence; it waits at the head of the queue to be recomputed."""
        s.computed_before = s.num_kv + s.dropped
        self.kv.free(s)
        self.evictor.release(s)
        s.resumed = True
        s.rs.preemptions += 1
        self.preemptions += 1
        self.num_seats -= s.seats
        self.waiting.appendleft(s)
        self.waiting_tokens += s.num_tokens

    # -- building the executor's batch ---------------------------------------------------------
    def build_batch(self, plan: StepPlan) -> StepBatch:
        batch = StepBatch(block_size=self.kv.block_size, copies=self.kv.take_copies())
        if self.kv.tiers is not None:
            batch.tier_pre, batch.tier_post = self.kv.take_tier_ops()
        self.evictor.fill_batch(batch)
        tokens = self.needs_tokens
        ids, positions, slots = batch.decode_seq_ids.append, batch.decode_positions.append, batch.decode_slots.append
        for s, n in zip(plan.seqs, plan.num_new):
            start = s.num_kv + s.dropped
            if n == 1 and start == s.num_tokens - 1 and s.num_out > 0:  # a decode
                ids(s.seq_id)
                positions(start)
                slots(s.num_kv)
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
                if s.groups is not None:
                    batch.group_tables[s.seq_id] = s.groups.tables
        if plan.lane:  # the lane's decodes, after the others
            assert self.lane is not None
            seq_ids, starts = self.lane.decodes()
            if batch.decode_seq_ids:
                batch.decode_seq_ids.extend(seq_ids)
                batch.decode_positions.extend(starts)
                batch.decode_slots.extend(starts)
            else:  # (the lists the lane made, taken as they are: the slots a copy of the positions)
                batch.decode_seq_ids, batch.decode_positions, batch.decode_slots = seq_ids, starts, starts[:]
        return batch

    def _token_ids(self, s: Sequence, start: int, n: int) -> np.ndarray:
        prompt = s.rs.prompt
        assert prompt is not None  # built with the sequence's tokens (_build), which needs_tokens takes
        if start + n <= len(prompt):
            return prompt[start:start + n]
        gen = np.asarray(s.out_tokens, dtype=np.int32)
        return np.concatenate([prompt, gen])[start:start + n]

    # -- after the executor ran ----------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now_s: float) -> list[RequestState]:
        """Commit the step (KV written, tokens sampled, forks, finishes); return finished requests."""
        emit = self._emit
        gaps = self.itl_gaps
        finished: list[RequestState] = []
        done_seqs = False
        self.kv.commit_all(plan.seqs, plan.num_new)  # (commits touch only each sequence's own tail)
        for s in plan.seqs:
            if s.num_kv + s.dropped < s.num_tokens:
                continue  # a prefill chunk that did not reach the end
            rs = s.rs
            req = rs.req
            if s.num_out:  # the gap since its last token: the inter-token latency a client sees
                gap = now_s - s.last_emit_s
                gaps[gap] = gaps.get(gap, 0) + 1
                if not gap <= rs.itl_max_s:
                    rs.itl_max_s = gap
            s.last_emit_s = now_s
            if s.out_tokens is None:  # _emit, for executors that take no tokens (the sim)
                s.num_out += 1
                s.num_tokens += 1
            else:
                emit(s)
            rs.output_tokens += 1
            if s.num_out == 1 and rs.first_token_s != rs.first_token_s:
                rs.first_token_s = now_s
                if req.n > 1:
                    self._fork(s, finished, now_s)
            if s.num_out >= req.output_len:
                self._finish(s, finished, now_s)
                s.num_tokens = -1  # marks finished for the sweep below
                done_seqs = True
        lane = self.lane
        if plan.lane:
            assert lane is not None
            lane.step(now_s, gaps)
        if done_seqs:
            self.running = [s for s in self.running if s.num_tokens >= 0]
            if lane is not None:
                lane.reorder(self.running)
        if lane is not None:  # what the Python path changed
            for s in plan.seqs:
                if s.lane >= 0:
                    lane.push(s)
        self.evictor.after_step(self.running, result, self.steps)
        self.steps += 1
        return finished

    def _emit(self, s: Sequence) -> None:
        """The step sampled the sequence's next token: the sample's own token stream supplies it
        (kvbench.trace.tokens.TokenStreams.output_tokens), so that cached blocks of generated
        tokens are the same for every executor and a resumed sample re-hits them."""
        if s.out_tokens is not None:  # only executors that take tokens need them
            tok = int(self.streams.output_tokens(s.rs.req, 1, s.num_out, s.sample)[0])
            s.last_token = tok
            s.out_tokens.append(tok)
        s.num_out += 1
        s.num_tokens += 1

    def _finish(self, s: Sequence, finished: list[RequestState], now_s: float) -> None:
        rs = s.rs
        if s.out_tokens is not None:
            if rs.samples is None:
                rs.samples = []
            rs.samples.append((s.seq_id, s.out_tokens))
        if rs.hold:  # a prefill leg: its blocks wait for the decode side's read (release)
            self.kv.trim(s)
            self.held[rs] = s
        else:
            self.kv.free(s)
            self.evictor.release(s)
        if s.lane >= 0:
            assert self.lane is not None
            self.lane.release(s)
        self.num_seats -= s.seats
        rs.live_seqs -= 1
        if rs.live_seqs == 0:
            rs.finish_s = now_s
            finished.append(rs)

    def _fork(self, parent: Sequence, finished: list[RequestState], now_s: float) -> None:
        """Parallel samples: after its first token, the parent gives each of its n - 1 other samples
        a sequence sharing its KV (paged: by refcount; slab: a copy into a slab reserved at
        admission). They share the first token; from the second on each follows its own stream."""
        rs = parent.rs
        req = rs.req
        bs = self.kv.block_size
        shared = (req.prompt_len + 1) // bs  # blocks holding only the prompt and the shared first token
        for k in range(1, req.n):
            self._next_id += 1
            tokens = None
            if parent.tokens is not None:
                assert rs.prompt is not None  # built with the parent's tokens (_build)
                tokens = sequence_tokens(req, rs.prompt, self.streams, k)
            child = Sequence(tokens=tokens, prompt_len=parent.prompt_len,
                             next_use=None if parent.next_use is None else parent.next_use[:shared],
                             keys=None if parent.keys is None else parent.keys[:shared],
                             seq_id=self._next_id, rs=rs, sample=k, num_tokens=parent.num_tokens,
                             num_out=parent.num_out, last_token=parent.last_token,
                             last_emit_s=parent.last_emit_s,
                             out_tokens=None if parent.out_tokens is None else list(parent.out_tokens))
            rs.live_seqs += 1
            rs.output_tokens += 1
            self.kv.fork(parent, child)
            if child.num_out >= req.output_len:  # a one-token answer: done as soon as forked
                self._finish(child, finished, now_s)
            else:
                self.running.append(child)
                if self.lane is not None:  # (not in the plan: update's push does not reach it)
                    self.lane.enter(child)
                    self.lane.push(child)
        # the seats reserved at admission pass to the children
        parent.seats = 1
