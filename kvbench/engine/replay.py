"""Layer 6, the replay loop: admit arrivals up to the engine clock, schedule, execute, account, record.

The clock advances by each step's duration (measured by the model executor, modelled by sim); when
nothing is running or waiting it jumps to the next arrival, so a replay never sleeps. The same loop
serves every layout, cache policy, eviction policy and executor: they are picked by name from
registries, and the loop never branches on them.

With ``--replicas N`` the engine is N replicas (each its own pool, scheduler and executor) on one
engine clock: the replica whose next step starts first takes it, and an arrival is routed (engine.routing)
before any step that starts at or after it. One replica is exactly the single engine.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from kvbench.engine.config import ReplayConfig
from kvbench.errors import InputError, RunError
from kvbench.eviction.evictor import make_evictor
from kvbench.executors import make_executor
from kvbench.memory import make_kv
from kvbench.memory.future import next_uses
from kvbench.memory.tiers import TIER_NAMES, Tiers, TierSpec, op_bytes
from kvbench.executors.presets import available_host_bytes, get_model
from kvbench.provenance import Invocation, file_sha256, setting_files
from kvbench.engine.issuer import Issuer
from kvbench.engine.records import (RunWriter, claim_run_dir, distribution, environment, goodput, holds_run,
                                    itl_summary, parse_slo)
from kvbench.engine.routing import Router, jain, max_over_mean
from kvbench.scheduler import RequestState, Scheduler, SchedulerConfig
from kvbench.trace.format import Request, load_trace
from kvbench.trace.ideal import (IdealCounter, PrefixKeys, RadixIdealCounter, ideal_hits, lookup_blocks,
                                 radix_ideal_hits, sequence_tokens_of)
from kvbench.trace.tokens import TOKEN_HI, TokenStreams

KV_MEM_FRACTION = 0.9  # share of free device memory given to the KV pool when no size is asked


@dataclass(slots=True)
class Progress:
    requests_total: int
    requests_done: int = 0
    clock_s: float = 0.0
    output_tokens: int = 0
    steps: int = 0


def pool_blocks(cfg: ReplayConfig, executor, model) -> int:
    """Blocks in the KV pool: --num-blocks (no memory check: a pool of any size, for experiments),
    else --kv-mem (refused by an executor that knows its devices cannot hold it: check_kv_bytes), else
    the devices' memory after weights and activations."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    per_block = executor.kv_bytes_per_token() * cfg.block_size
    if cfg.kv_mem_bytes is not None:
        nbytes = cfg.kv_mem_bytes
        check = getattr(executor, "check_kv_bytes", None)
        if check is not None:
            check(nbytes)
    else:
        nbytes = executor.default_kv_bytes()
    n = int(nbytes // per_block)
    if n < 1:
        msg = (f"a KV pool of {nbytes} bytes holds no block of {per_block} bytes ({cfg.block_size} tokens "
               f"x {executor.kv_bytes_per_token()} bytes)")
        if cfg.kv_mem_bytes is not None:
            raise InputError(msg, field="--kv-mem")
        raise RunError(msg, usage=True)
    return n


@dataclass(slots=True, eq=False)
class _Replica:
    """One engine instance: its pool, scheduler, executor and token evictor, its clock and counters."""

    index: int
    kv: object
    executor: object
    evictor: object
    sched: Scheduler
    st: "_Totals"
    clock: float = 0.0
    steps: int = 0
    routed: int = 0
    lat: list = None  # (ttft, tpot, e2e, queue) ms of its finished requests
    snap: tuple | None = None  # its load as its current step started (what a router sees during it)
    since: list = None  # [requests, blocks] routed to it since that step started

    def load(self, bs: int) -> tuple[int, int, int]:
        """What the replica reports to a router: sequences waiting + running, blocks it can hand
        out, blocks active (held by running sequences, plus what the waiting ones need). O(1)."""
        sched = self.sched
        used, cached, free, _, _ = self.kv.stats()
        return (len(sched.waiting) + len(sched.running), free + cached,
                used + -(-sched.waiting_tokens // bs))

    def load_at(self, t_s: float, bs: int) -> tuple[int, int, int]:
        """The load at ``t_s``: during a step (which the loop has already run to its end), the load
        it started with plus what was routed to the replica since; otherwise the current one."""
        if self.snap is not None and self.clock > t_s:
            n, free, active = self.snap
            return n + self.since[0], free, active + self.since[1]
        return self.load(bs)


def check_model_memory(cfg: ReplayConfig, model) -> None:
    """The model executor holds the weights and the KV pool on one device: what cannot fit is refused
    before a byte is allocated (InputError naming --model or --kv-mem), not met as an out-of-memory
    crash minutes later. The sim models GPUs it does not hold (its own check_kv_bytes)."""
    if cfg.executor != "model":
        return
    import torch

    from kvbench.executors.model import resolve_device
    from kvbench.executors.modeling import default_dtype

    dev = resolve_device(cfg.device)
    dtype = "fp32" if default_dtype(dev) == torch.float32 else "bf16"
    if dev.type == "cuda":
        avail, _ = torch.cuda.mem_get_info(dev)
        where = f"the {avail / 1e9:.1f} GB free on {torch.cuda.get_device_name(dev)}"
    else:
        avail = available_host_bytes()
        where = f"the {avail / 1e9:.1f} GB of host memory available" if avail is not None else ""
    if avail is None:
        return
    weights = model.weight_bytes(dtype)
    kv = cfg.kv_mem_bytes or 0
    if weights + kv > avail:
        pool = f" and a {kv / 1e9:.1f} GB KV pool (--kv-mem)" if kv else ""
        raise InputError(f"{model.name}'s weights ({weights / 1e9:.1f} GB in {dtype}){pool} do not fit in {where}: "
                         "use a smaller model or --kv-mem, another device, or --executor sim",
                         field="--kv-mem" if kv and weights <= avail else "--model")


def check_token_ids(requests: list[Request], vocab_size: int, trace_path: str) -> None:
    """The model executor embeds every token id: one outside the model's vocabulary is refused up
    front (InputError naming the trace line, or --model when the ids kvbench draws for shared and
    unique segments do not fit), not met as an IndexError in the middle of a run."""
    drawn = any(seg.kind in ("shared", "unique") for r in requests for seg in r.prompt) or any(
        r.output_len > 1 for r in requests)  # generated tokens are drawn too
    if drawn and vocab_size < TOKEN_HI:
        raise InputError(f"the model's vocabulary has {vocab_size:,} tokens; kvbench draws the ids of shared, "
                         f"unique and generated tokens below {TOKEN_HI:,}: use a model with a vocabulary of at "
                         f"least {TOKEN_HI:,}", field="--model")
    for r in requests:
        for j, seg in enumerate(r.prompt):
            if seg.kind == "tokens" and max(seg.tokens) >= vocab_size:
                raise InputError(f"token id {max(seg.tokens)} is outside the model's vocabulary of {vocab_size:,}",
                                 file=trace_path, line=r.line, field=f"prompt[{j}].tokens")


def slab_reserve_tokens(requests: list[Request], cfg: ReplayConfig, max_len: int) -> int:
    """The slab baseline's reservation per sequence (``--slab-reserve max``): --max-model-len when
    given, else the longest request this run admits (prompt + output) rounded up to a block, so a
    slab is as long as the trace needs, not the model's whole context."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    bs = cfg.block_size
    longest = max((r.prompt_len + r.output_len for r in requests if r.prompt_len + r.output_len <= max_len),
                  default=bs)
    return -(-longest // bs) * bs


def check_fits(r: Request, cfg: ReplayConfig, num_blocks: int, slab_reserve: int, trace_path: str) -> None:
    """A request that cannot fit in the empty pool would stall the replay: say so up front (RunError,
    a usage error naming the trace line). So would a request with more samples than --max-num-seqs:
    kvbench forks a request's n samples in one admission, and n counts against the cap."""
    if r.n > cfg.max_num_seqs:
        raise RunError(f"{trace_path}:{r.line}: field 'n': request {r.id!r} has n={r.n} samples but "
                       f"--max-num-seqs is {cfg.max_num_seqs}: kvbench runs a request's samples together, "
                       f"so raise --max-num-seqs to {r.n} (vLLM would fan it out into {r.n} child requests "
                       "instead)", usage=True)
    bs = cfg.block_size
    if cfg.layout == "slab":  # a slab for each sample, reserved at admission
        reserve = slab_reserve if cfg.slab_reserve == "max" else r.prompt_len + r.output_len
        need = r.n * -(-reserve // bs)
    else:
        need = -(-(r.prompt_len + r.output_len) // bs) + (r.n - 1) * (-(-r.output_len // bs))
    if need > num_blocks:
        samples = f" with n={r.n} samples" if r.n > 1 else ""
        where = f"{trace_path}:{r.line}: " + ("field 'n': " if r.n > 1 else "")
        raise RunError(
            f"{where}request {r.id!r}{samples} needs {need:,} KV blocks of {bs} tokens but the pool "
            f"holds {num_blocks:,}: give more memory (--kv-mem, --num-blocks) "
            "or lower --max-model-len", usage=True)


def fit_overlong(requests: list[Request], max_len: int, overlong: str) -> tuple[list[Request], int]:
    """``--overlong truncate``: a request whose prompt fits ``max_len`` but whose prompt and output do
    not generates only up to the length (vLLM's OpenAI server: get_max_tokens caps max_tokens at
    max_model_len - prompt length); ``reject`` leaves it to be refused. -> (requests, how many cut)."""
    if overlong != "truncate":
        return requests, 0
    out, cut = [], 0
    for r in requests:
        if r.prompt_len < max_len < r.prompt_len + r.output_len:
            r = dataclasses.replace(r, output_len=max_len - r.prompt_len)
            cut += 1
        out.append(r)
    return out, cut


def check_trace_fits(requests: list[Request], cfg: ReplayConfig, num_blocks: int, max_len: int,
                     trace_path: str) -> None:
    """check_fits for every request a run of ``cfg`` admits (the first ``--limit`` of them)."""
    reqs = requests if cfg.limit is None else requests[:cfg.limit]
    reqs, _ = fit_overlong(reqs, max_len, cfg.overlong)
    reserve = slab_reserve_tokens(reqs, cfg, max_len)
    for r in reqs:
        if r.prompt_len + r.output_len <= max_len:
            check_fits(r, cfg, num_blocks, reserve, trace_path)


class Replay:
    """One replay of a trace under one configuration, writing a run directory."""

    def __init__(self, trace_path: str, cfg: ReplayConfig, out_dir: str,
                 requests: list[Request] | None = None, *, force: bool = False, unique: bool = False,
                 trace_label: str | None = None, invocation: Invocation | None = None):
        """``out_dir`` must not hold a run unless ``force``; with ``unique`` (a default name) a taken
        name gets a suffix instead (see records.claim_run_dir: ``self.out_dir`` is the one used).
        ``trace_label``: the trace's path as config.json records it, when the file read is a copy
        (a Ray task's local copy of the driver's trace)."""
        self.cfg = cfg.validate()
        self.trace_path = trace_path
        self.trace_label = trace_label or os.path.abspath(trace_path)
        self.invocation = invocation or Invocation()
        self.out_dir = out_dir
        self._force, self._unique, self._claimed = force, unique, False
        if not unique and not force and os.path.isdir(out_dir) and holds_run(out_dir):
            claim_run_dir(out_dir)  # refuses, naming --out: before the model is built
        self.requests = requests if requests is not None else load_trace(trace_path, limit=cfg.limit)
        # arrival order (stable: ties keep trace order)
        self.requests = sorted(self.requests, key=lambda r: r.t)
        self.model = get_model(cfg.model)
        self.max_len = cfg.max_model_len or self.model.max_model_len
        self.requests, self.truncated = fit_overlong(self.requests, self.max_len, cfg.overlong)
        self.slab_reserve_tokens = self._slab_reserve_tokens()
        self.streams = TokenStreams()
        check_model_memory(cfg, self.model)
        if cfg.executor == "model" and not self.model.is_moe:  # (the executor refuses a mixture of experts)
            check_token_ids(self.requests, self.model.vocab_size, self.trace_path)
        executor = make_executor(cfg, self.model)
        self.num_blocks = pool_blocks(cfg, executor, self.model)  # per replica
        self._block_bytes = executor.kv_bytes_per_token() * cfg.block_size
        self.physical_blocks = self._physical_blocks()
        self._tier_bound = self._run_blocks() if cfg.tier_sizes() else None
        self.replicas = [self._replica(i, executor if i == 0 else make_executor(cfg, self.model))
                         for i in range(cfg.replicas)]
        # the single engine's parts (replica 0), as tests and selfcheck read them
        first = self.replicas[0]
        self.kv, self.executor, self.evictor, self.sched = first.kv, first.executor, first.evictor, first.sched
        self.router = Router(cfg.router, cfg.replicas, prefix_blocks=cfg.router_prefix_blocks,
                             cache_weight=cfg.router_cache_weight, load_weight=cfg.router_load_weight,
                             event_delay_s=cfg.router_event_delay)
        if self.router.index is not None and cfg.replicas > 1:
            for rep in self.replicas:  # the replicas publish KV events for the router's index
                pool = getattr(rep.kv, "pool", None)
                if pool is not None and rep.kv.prefix_cache:
                    pool.events = []
        self._lat: list[tuple[float, ...]] = []  # ttft, tpot, e2e, queue, longest gap (ms) of finished requests
        self._prompt_tokens_done = 0
        self._routing = [0, 0, 0]  # router: blocks predicted to hit, blocks hit, |difference| summed
        self._predicted: dict[RequestState, int] = {}
        self.finished: list[RequestState] | None = None  # set to [] to keep finished requests
        # set to [] to keep every step's plan: ([(request id, sample, tokens)], [preempted request ids])
        self.step_log: list | None = None
        for r in self.requests:  # a request that cannot run is refused before the run, naming its line
            if self._reject_reason(r) is None:
                self._check_fits(r)

    def claim(self) -> str:
        """Create the run directory (``run`` does it first if nobody has): after every check, so a
        refused run writes nothing. -> the directory (with ``unique``, the name taken)."""
        if not self._claimed:
            self.out_dir = claim_run_dir(self.out_dir, force=self._force, unique=self._unique)
            self._claimed = True
        return self.out_dir

    def _replica(self, i: int, executor) -> _Replica:
        cfg = self.cfg
        paged = cfg.layout == "paged"
        kv = make_kv(cfg.layout, self.num_blocks, cfg.block_size,
                     prefix_cache=cfg.prefix_cache and paged, cache_policy=cfg.cache_policy,
                     prefix_mode=cfg.prefix_mode, radix_eviction=cfg.radix_eviction,
                     physical=self.physical_blocks)
        executor.bind_pool(self.physical_blocks or self.num_blocks, cfg.block_size)
        if cfg.tier_sizes():
            self._attach_tiers(kv, executor)
        evictor = make_evictor(cfg.eviction, kv, kv_budget=cfg.kv_budget,
                               sink_tokens=cfg.sink_tokens, seed=cfg.seed,
                               kv_bytes_per_token=executor.kv_bytes_per_token(),
                               speculate=getattr(executor, "speculate", None))
        sched = Scheduler(kv, SchedulerConfig(cfg.max_num_seqs, cfg.max_batched_tokens,
                                              cfg.admission, cfg.watermark),
                          needs_tokens=executor.needs_tokens, streams=self.streams, evictor=evictor)
        return _Replica(i, kv, executor, evictor, sched, _Totals(peak=0), lat=[], since=[0, 0])

    def _attach_tiers(self, kv, executor) -> None:
        """The tiers behind a replica's pool (--cpu-kv-mem, --disk-kv-mem), each as many blocks as
        its bytes hold, and no more state than the run's blocks can fill."""
        cfg = self.cfg
        bs, block = cfg.block_size, self._block_bytes
        specs = []
        for name, nbytes in cfg.tier_sizes().items():
            n = nbytes // block
            if n < 1:
                raise InputError(f"a {name} tier of {nbytes} bytes holds no block of {block} bytes "
                                 f"({bs} tokens x {executor.kv_bytes_per_token()} bytes)", field=f"--{name}-kv-mem")
            specs.append(TierSpec(name, n, getattr(cfg, f"{name}_bw") * 1e9, getattr(cfg, f"{name}_cache_policy")))
        tiers = Tiers(specs, cfg.offload, cfg.load_policy, block_bytes=block, physical=self._tier_bound)
        tiers.recompute_s = executor.recompute_s
        kv.attach_tiers(tiers)
        executor.bind_tiers({t.name: t.bandwidth for t in tiers.tiers}, {t.name: t.slots for t in tiers.tiers})

    def _physical_blocks(self) -> int | None:
        """The most blocks this run can ever take, when the pool is larger: a pool that holds every
        block of every admitted request at once (each sample's prompt and output, a copied partial
        block and a spare each) never preempts or evicts, so the rest of it need not exist (the
        sim's default pool of a small model is millions of blocks). None: the whole pool. Paged
        layout without token eviction only (eviction compacts into blocks of its own)."""
        cfg = self.cfg
        if cfg.layout != "paged" or cfg.eviction != "none":
            return None
        bound = self._run_blocks()
        return bound if bound < self.num_blocks else None

    def _run_blocks(self) -> int:
        """Every block of every admitted request (each sample's prompt and output, a copied partial
        block and a spare each): no pool or tier of this run ever holds more."""
        bs = self.cfg.block_size
        return sum(r.n * (-(-(r.prompt_len + r.output_len) // bs) + 2)
                   for r in self.requests if self._reject_reason(r) is None)

    # -- checks before the run ----------------------------------------------------------------
    def _reject_reason(self, r: Request) -> str | None:
        if r.prompt_len + r.output_len > self.max_len:
            return "max_model_len"
        return None

    def _check_fits(self, r: Request) -> None:
        check_fits(r, self.cfg, self.num_blocks, self.slab_reserve_tokens, self.trace_path)

    def _slab_reserve_tokens(self) -> int:
        return slab_reserve_tokens(self.requests, self.cfg, self.max_len)

    def _reserve(self, r: Request) -> int:
        return self.slab_reserve_tokens if self.cfg.slab_reserve == "max" else r.prompt_len + r.output_len

    # -- the loop -----------------------------------------------------------------------------
    def run(self, on_progress: Callable[[Progress], None] | None = None) -> dict:
        cfg, kv, ex = self.cfg, self.kv, self.executor
        reqs = self.requests
        replicas = self.replicas
        bs = cfg.block_size
        use_tokens = kv.prefix_cache or ex.needs_tokens
        tiers = cfg.tier_sizes()
        belady = cfg.cache_policy == "belady" or any(getattr(cfg, f"{t}_cache_policy") == "belady" for t in tiers)
        future = next_uses(reqs, bs, self.streams) if kv.prefix_cache and belady else None
        # The ideal hit rate counts requests in trace order; arrival order is the same unless the
        # trace is unsorted, or dependent turns wait for answers, and then it gets a pass of its own.
        in_order = not cfg.dependent_turns and all(reqs[i].index < reqs[i + 1].index for i in range(len(reqs) - 1))
        issuer = Issuer(reqs, cfg.time_scale, cfg.max_concurrency, cfg.dependent_turns)
        self._issuer = issuer
        self._keys_of = PrefixKeys(bs, self.streams)
        self._keys_of.count_once(r for r in reqs if self._reject_reason(r) is None)
        # Radix runs use a token-granular ideal (spec §4): a radix tree can hit inside a block.
        admitted = sorted((r for r in reqs if self._reject_reason(r) is None), key=lambda r: r.index)
        if cfg.prefix_mode == "radix":
            self._ideal = RadixIdealCounter(bs, admitted, self.streams) if in_order else None
            ideal = None if in_order else radix_ideal_hits(admitted, bs, self.streams)
        else:
            self._ideal = IdealCounter(bs) if in_order else None
            ideal = None if in_order else ideal_hits(admitted, bs, self.streams)
        self.claim()
        writer = RunWriter(self.out_dir, self._config_json())
        self._writer = writer
        st = _Totals(peak=0)  # the cluster's: requests and tokens (steps are counted per replica)
        self._st = st
        prog = Progress(len(reqs))
        complete = False
        clock = reqs[0].t * cfg.time_scale if reqs else 0.0
        t0_s = clock
        for rep in replicas:
            rep.clock = clock
        index = self.router.index
        loads_seen = len(replicas) > 1 and self.router.name != "round-robin"
        step = 0
        wall0 = time.perf_counter()
        try:
            while True:
                # the replica whose next step starts first (one replica: that one, whenever it has work)
                rep = None
                for r in replicas:
                    if r.sched.has_work() and (rep is None or r.clock < rep.clock):
                        rep = r
                issue_s = issuer.next_time()
                if issue_s is not None and (rep is None or issue_s <= rep.clock):
                    pos, issue_s = issuer.issue()  # arrivals up to the step's start first
                    self._arrive(reqs[pos], pos, future, use_tokens, writer, st, issue_s)
                    continue
                if rep is None:
                    if not issuer.done():
                        raise RunError("requests are left that can never be issued (each waits for an "
                                       "answer that does not come)")
                    break
                sched = rep.sched
                pool = getattr(rep.kv, "pool", None)
                if pool is not None:  # the time cache policies are told (learned: seconds since a use)
                    pool.clock = rep.clock
                    if rep.kv.tiers is not None:
                        rep.kv.tiers.clock = rep.clock
                plan = sched.schedule(rep.clock)
                if loads_seen:  # what a router sees of this replica while the step runs
                    rep.snap, rep.since = rep.load(bs), [0, 0]
                if not plan.seqs:
                    raise RunError("the scheduler could not make progress: no running sequence "
                                   "and the next waiting one does not fit", usage=True)
                batch = sched.build_batch(plan)
                result = rep.executor.execute(batch)
                start_s = rep.clock
                rep.clock += result.duration_s
                if self.step_log is not None:
                    self.step_log.append(([(s.rs.req.id, s.sample, n) for s, n in zip(plan.seqs, plan.num_new)],
                                          [s.rs.req.id for s in plan.preempted]))
                finished = sched.update(plan, result, rep.clock)
                self._record_step(writer, rep, start_s, result, batch, plan)
                rep.steps += 1
                step += 1
                if index is not None and pool is not None and pool.events:  # a slab has no pool to index
                    index.publish(rep.index, rep.clock, pool.events)
                    pool.events = []
                if self.finished is not None:
                    self.finished.extend(finished)
                for rs in finished:
                    self._record_request(writer, rs, rep)
                    st.completed += 1
                    st.output_tokens += rs.output_tokens
                    issuer.finished(rs.position, rep.clock)
                prog.steps = step
                if on_progress is not None and (step & 63) == 0:
                    prog.requests_done = st.completed + st.rejected
                    prog.clock_s = max(prog.clock_s, rep.clock - t0_s)  # the replicas' clocks interleave
                    prog.output_tokens = st.output_tokens
                    on_progress(prog)
            complete = True
        finally:
            end = max(r.clock for r in replicas)
            summary = self._summary(st, ideal or self._ideal.result(), end - t0_s, step, complete,
                                    time.perf_counter() - wall0)
            writer.close(summary)
        if on_progress is not None:
            prog.requests_done, prog.clock_s, prog.output_tokens = st.completed + st.rejected, end - t0_s, st.output_tokens
            on_progress(prog)
        return summary

    def _arrive(self, r: Request, index: int, future, use_tokens: bool, writer, st, arrival: float) -> None:
        rs = RequestState(req=r, arrival_s=arrival, prompt=None, position=index)
        reason = self._reject_reason(r)
        if reason is not None:
            rs.reject_reason = reason
            st.rejected += 1
            self._record_request(writer, rs, None)
            self._issuer.finished(index, arrival)
            return
        keys, prompt_len, pieces = self._keys_of.with_pieces(r)
        if self._ideal is not None:  # the ceiling of the requests this run admits
            self._ideal.add(keys, prompt_len, self._keys_of.shareable_blocks(r))
        replicas = self.replicas
        if len(replicas) == 1:
            rep, expected = replicas[0], None
        else:
            bs = self.cfg.block_size
            look = keys[:lookup_blocks(prompt_len, bs)]  # the blocks a prompt can hit
            i, expected = self.router.route(arrival, r.session, look, len(look),
                                            [x.load_at(arrival, bs) for x in replicas]
                                            if self.router.name != "round-robin" else None)
            rep = replicas[i]
            if rep.clock > arrival:  # mid-step: the router's view of it grows by this request
                rep.since[0] += 1
                rep.since[1] += -(-prompt_len // bs)
            if self.router.index is not None:
                self._predicted[rs] = expected
        rep.routed += 1
        if not rep.sched.has_work():  # an idle replica starts at the arrival
            rep.clock = max(rep.clock, arrival)
        seq = rep.sched.new_seq(rs, None, None if future is None else future[index], keys=None,
                                reserve=self._reserve(r))
        if use_tokens or rep.kv.prefix_cache:  # a waiting request holds its pieces and keys, no tokens
            seq.pending = partial(_admitted, r, pieces if use_tokens else None, prompt_len,
                                  keys if rep.kv.prefix_cache else None,
                                  rep.kv.prefix_cache and not rep.kv.keys_as_arrays)
        rep.sched.add(seq)

    # -- records ------------------------------------------------------------------------------
    def _record_step(self, writer, rep: _Replica, start_s, result, batch, plan) -> None:
        sched, st = rep.sched, rep.st
        dur_s = result.duration_s
        used, cached, free, slots, live = rep.kv.stats()
        running = plan.running  # the sequences the step held, those that finished in it included
        frag = 1.0 - live / slots if slots else 0.0
        util = live / rep.kv.capacity_tokens
        loaded = stored = 0
        if batch.tier_pre or batch.tier_post:
            moved = op_bytes(batch.tier_pre, self._block_bytes)
            for name, (ld, sd) in op_bytes(batch.tier_post, self._block_bytes).items():
                moved.setdefault(name, [0, 0])[1] += sd
            for name, (ld, sd) in moved.items():
                acc = st.tier_bytes.setdefault(name, [0, 0])
                acc[0] += ld
                acc[1] += sd
                loaded += ld
                stored += sd
            st.tier_s += result.tier_s
            st.tier_post_s += result.tier_post_s
        th = sched.tier_hit_tokens
        writer.steps.add((rep.steps, rep.index, start_s, dur_s * 1e3, batch.num_prefill_tokens, batch.num_decodes,
                          running, len(sched.waiting), self.num_blocks, used, cached, free, slots,
                          live, frag, util, sched.hit_tokens, sched.query_tokens, th.get("cpu", 0), th.get("disk", 0),
                          loaded, stored, result.tier_s * 1e3))
        st.busy_s += dur_s
        st.pcie_s += result.pcie_s
        st.slots_t += slots * dur_s
        st.live_t += live * dur_s
        st.running_t += running * dur_s
        st.util_t += util * dur_s
        if running > st.peak:
            st.peak = running
        if slots > st.peak_slots:
            st.peak_slots = slots
        if live > st.peak_live:
            st.peak_live = live

    def _record_request(self, writer, rs: RequestState, rep: _Replica | None) -> None:
        r = rs.req
        nan = math.nan
        done = rs.reject_reason is None
        ttft = (rs.first_token_s - rs.arrival_s) * 1e3 if done else nan
        e2e = (rs.finish_s - rs.arrival_s) * 1e3 if done else nan
        tpot = ((rs.finish_s - rs.first_token_s) * 1e3 / (r.output_len - 1)
                if done and r.output_len > 1 else nan)
        queue = (rs.first_sched_s - rs.arrival_s) * 1e3 if done else nan
        itl_max = rs.itl_max_s * 1e3
        writer.requests.add((r.id, r.session, None if rep is None else rep.index, rs.arrival_s,
                             rs.first_token_s, rs.finish_s,
                             r.prompt_len, rs.cached_tokens, rs.output_tokens, r.n, ttft, tpot, e2e,
                             queue, rs.preemptions, rs.recomputed_tokens, rs.evicted_tokens,
                             rs.recalled_tokens, rs.loaded_tokens, rs.reject_reason, itl_max))
        if done:
            self._lat.append((ttft, tpot, e2e, queue, itl_max))
            self._prompt_tokens_done += r.prompt_len
            rep.lat.append((ttft, tpot, e2e, queue))
            rep.st.completed += 1
            rep.st.output_tokens += rs.output_tokens
            expected = self._predicted.pop(rs, None)
            if expected is not None:
                hit = rs.cached_tokens // self.cfg.block_size
                self._routing[0] += expected
                self._routing[1] += hit
                self._routing[2] += abs(expected - hit)

    def _summary(self, st, ideal, duration_s, steps, complete, wall_s) -> dict:
        reps = self.replicas
        tot = _Totals(peak=0)  # the replicas' step figures: time integrals summed, peaks the largest
        for r in reps:
            for name in ("busy_s", "slots_t", "live_t", "running_t", "util_t", "pcie_s"):
                setattr(tot, name, getattr(tot, name) + getattr(r.st, name))
            tot.peak, tot.peak_slots = max(tot.peak, r.st.peak), max(tot.peak_slots, r.st.peak_slots)
            tot.peak_live = max(tot.peak_live, r.st.peak_live)
        lat = np.array(self._lat, dtype=np.float64).reshape(-1, 5)
        s = {"complete": complete, "requests": len(self.requests), "completed": st.completed,
             "rejected": st.rejected, "truncated": self.truncated, "duration_s": duration_s,
             "output_tok_per_s": st.output_tokens / duration_s if duration_s > 0 else 0.0,
             "total_tok_per_s": (st.output_tokens + self._prompt_tokens_done) / duration_s if duration_s > 0 else 0.0,
             "req_per_s": st.completed / duration_s if duration_s > 0 else 0.0}
        for k, name in enumerate(("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms")):
            s.update(distribution(name, lat[:, k]))
        s.update(itl_summary([r.sched.itl_gaps for r in reps]))
        s.update(goodput(dict(zip(("ttft", "tpot", "e2e", "itl"), lat[:, [0, 1, 2, 4]].T)),
                         parse_slo(self.cfg.slo), duration_s))

        def total(get):
            return sum(get(r) for r in reps)
        q, rq = total(lambda r: r.sched.query_tokens), total(lambda r: r.sched.resumed_query_tokens)
        s.update({
            "prefix_hit_rate": total(lambda r: r.sched.hit_tokens) / q if q else 0.0,
            "ideal_hit_rate": ideal.hit_rate,
            "resumed_hit_rate": total(lambda r: r.sched.resumed_hit_tokens) / rq if rq else 0.0,
            "internal_frag": 1.0 - tot.live_t / tot.slots_t if tot.slots_t else 0.0,
            "kv_util": tot.util_t / tot.busy_s if tot.busy_s else 0.0,
            "busy_s": tot.busy_s,
            "peak_running": tot.peak,
            "mean_running": tot.running_t / tot.busy_s if tot.busy_s else 0.0,
            "preemptions": total(lambda r: r.sched.preemptions),
            "recomputed_tokens": total(lambda r: r.sched.recomputed_tokens),
            **_merge_evictors([r.evictor for r in reps]), "pcie_s": tot.pcie_s,
            "peak_slots_allocated": tot.peak_slots, "peak_tokens_live": tot.peak_live,
            "output_tokens": st.output_tokens, "steps": steps,
            "num_blocks": self.num_blocks, "block_size": self.cfg.block_size,
            "kv_capacity_tokens": self.kv.capacity_tokens,
            "kv_bytes_per_token": self.executor.kv_bytes_per_token(),
            "cache_evictions": total(lambda r: getattr(getattr(r.kv, "pool", None), "evictions", 0)),
            "cow_copies": total(lambda r: getattr(r.kv, "cow_copies", 0)),
            "slab_reserve_tokens": self.slab_reserve_tokens if self.cfg.layout == "slab" else None,
            "partial_hit_tokens": total(lambda r: getattr(r.kv, "partial_hit_tokens", 0)),
            **self._tier_summary(q),
            "wall_s": wall_s,
        })
        if len(reps) > 1:
            s.update(self._cluster_summary(duration_s))
        return s

    def _tier_summary(self, query_tokens: int) -> dict:
        """Per-tier hits and traffic (spec §3): hit_rate_gpu + hit_rate_cpu + hit_rate_disk =
        prefix_hit_rate; a tier the run does not have is null."""
        reps = self.replicas
        present = self.cfg.tier_sizes()
        hits = {name: sum(r.sched.tier_hit_tokens.get(name, 0) for r in reps) for name in TIER_NAMES}
        tier_bytes = {name: [sum(r.st.tier_bytes.get(name, [0, 0])[k] for r in reps) for k in (0, 1)]
                      for name in TIER_NAMES}
        q = query_tokens
        gpu = sum(r.sched.hit_tokens for r in reps) - sum(hits.values())
        out = {"hit_rate_gpu": gpu / q if q else 0.0}
        for name in TIER_NAMES:
            on = name in present
            out[f"hit_rate_{name}"] = (hits[name] / q if q else 0.0) if on else None
        out["bytes_loaded"] = sum(b[0] for b in tier_bytes.values())
        out["bytes_stored"] = sum(b[1] for b in tier_bytes.values())
        out["load_s"] = sum(r.st.tier_s for r in reps)
        out["store_s"] = sum(r.st.tier_post_s for r in reps)
        for name in TIER_NAMES:
            on = name in present
            out[f"bytes_loaded_{name}"] = tier_bytes[name][0] if on else None
            out[f"bytes_stored_{name}"] = tier_bytes[name][1] if on else None
            out[f"{name}_evictions"] = (sum(t.evicted_blocks for r in reps for t in r.kv.tiers.tiers if t.name == name)
                                        if on else None)
        out["tier_declined_tokens"] = (sum(r.kv.tiers.declined_tokens for r in reps) if present else None)
        out["resumed_loaded_tokens"] = sum(r.sched.resumed_loaded_tokens for r in reps) if present else None
        return out

    def _cluster_summary(self, duration_s: float) -> dict:
        """Balance and the router's prediction (spec §3), and each replica's own figures."""
        reps = self.replicas
        per = []
        for r in reps:
            lat = np.array(r.lat, dtype=np.float64).reshape(-1, 4)
            q = r.sched.query_tokens
            row = {"replica": r.index, "requests": r.routed, "completed": r.st.completed,
                   "prefix_hit_rate": r.sched.hit_tokens / q if q else 0.0,
                   "busy_s": r.st.busy_s, "steps": r.steps,
                   "mean_running": r.st.running_t / r.st.busy_s if r.st.busy_s else 0.0,
                   "peak_running": r.st.peak, "preemptions": r.sched.preemptions,
                   "output_tok_per_s": r.st.output_tokens / duration_s if duration_s > 0 else 0.0}
            for k, name in enumerate(("ttft_ms", "tpot_ms", "e2e_ms")):
                d = distribution(name, lat[:, k])
                row.update({f"{name}_p50": d[f"{name}_p50"], f"{name}_p99": d[f"{name}_p99"]})
            per.append(row)
        routed = [r.routed for r in reps]
        busy = [r.st.busy_s for r in reps]
        predicted, hit, wrong = self._routing
        return {"replicas": len(reps), "router": self.cfg.router,
                "balance_requests_max_over_mean": max_over_mean(routed),
                "balance_busy_max_over_mean": max_over_mean(busy),
                "jain_requests": jain(routed), "jain_busy": jain(busy),
                "router_predicted_blocks": predicted if self.router.index is not None else None,
                "router_hit_blocks": hit if self.router.index is not None else None,
                "router_mispredicted_blocks": wrong if self.router.index is not None else None,
                "per_replica": per}

    def _config_json(self) -> dict:
        return {"settings": self.cfg.to_dict(), "max_model_len_effective": self.max_len,
                "slab_reserve_tokens": self.slab_reserve_tokens if self.cfg.layout == "slab" else None,
                "num_blocks": self.num_blocks, "model_spec": self.model.to_dict(),
                "trace": {"path": self.trace_label, "sha256": file_sha256(self.trace_path),
                          "requests": len(self.requests)},
                "files": setting_files(self.cfg.to_dict()),
                "environment": environment(getattr(self.executor, "device_name", None)),
                **self.invocation.record()}


@dataclass(slots=True)
class _Totals:
    peak: int = 0
    peak_slots: int = 0
    peak_live: int = 0
    completed: int = 0
    rejected: int = 0
    output_tokens: int = 0
    busy_s: float = 0.0
    slots_t: float = 0.0
    live_t: float = 0.0
    running_t: float = 0.0
    util_t: float = 0.0
    pcie_s: float = 0.0
    tier_s: float = 0.0  # tier transfers before forwards (loads, write-backs)
    tier_post_s: float = 0.0  # write-through stores
    tier_bytes: dict = None  # tier name -> [bytes loaded from it, bytes stored into it]

    def __post_init__(self):
        if self.tier_bytes is None:
            self.tier_bytes = {}


def _admitted(req: Request, pieces: tuple | None, prompt_len: int, keys: np.ndarray | None, as_list: bool,
              seq) -> None:
    """What a waiting sequence goes without until the scheduler first considers it: its tokens (one
    array, the prompt its first part), built from its pieces by one compiled call, and its keys as
    the pool takes them (BlockPool: a list of ints, 36 bytes a block more than the array)."""
    if pieces is not None:
        seq.tokens = sequence_tokens_of(req, pieces)
        seq.rs.prompt = seq.tokens[:prompt_len]
    if keys is not None:
        seq.keys = keys.tolist() if as_list else keys


def _merge_evictors(evictors: list) -> dict:
    """The replicas' token-eviction figures as one: counts summed, peaks the largest, the attention
    mass kept averaged over every measurement of every replica."""
    summaries = [e.summary() for e in evictors]
    if len(summaries) == 1:
        return summaries[0]
    out = {}
    for key in summaries[0]:
        vals = [s[key] for s in summaries if s.get(key) is not None]
        if not vals:
            out[key] = None
        elif key == "attention_mass_kept":
            n = sum(getattr(e, "mass_n", 0) for e in evictors)
            out[key] = sum(getattr(e, "mass_sum", 0.0) for e in evictors) / n if n else None
        elif key.startswith("peak_") or "_max_" in key:
            out[key] = max(vals)
        else:
            out[key] = sum(vals)
    return out


def replay(trace_path: str, cfg: ReplayConfig, out_dir: str, on_progress=None,
           requests: list[Request] | None = None, force: bool = False, trace_label: str | None = None,
           invocation: Invocation | None = None) -> dict:
    """Replay a trace under one configuration into ``out_dir``; return summary.json's contents."""
    return Replay(trace_path, cfg, out_dir, requests, force=force, trace_label=trace_label,
                  invocation=invocation).run(on_progress)
