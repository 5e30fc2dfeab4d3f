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
import gc
import heapq
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvbench.engine.accounting import Accounts
from kvbench.engine.config import ReplayConfig
from kvbench.engine.issuer import FrontEnd, Issuer, dependencies_in_trace_order
from kvbench.engine.lengths import shape_lengths
from kvbench.engine.records import RunWriter, claim_run_dir, environment, holds_run, interrupt_held
from kvbench.engine.replica import Replica, Totals
from kvbench.engine.routing import Router
from kvbench.engine.setup import (
    check_fits,
    check_hybrid,
    check_model_memory,
    check_token_ids,
    kv_layout_of,
    pool_blocks,
)
from kvbench.errors import InputError, RunError
from kvbench.eviction.evictor import make_evictor
from kvbench.executors import make_executor
from kvbench.executors.presets import get_model
from kvbench.memory import make_kv
from kvbench.memory.future import next_uses
from kvbench.memory.policies import needs_future
from kvbench.memory.tiers import Tier, Tiers, TierSpec
from kvbench.provenance import Invocation, file_sha256, setting_files
from kvbench.scheduler import RequestState, Scheduler, SchedulerConfig
from kvbench.scheduler.batch import StepBatch
from kvbench.trace.format import Request
from kvbench.trace.ideal import (
    IdealCounter,
    RadixIdealCounter,
    block_expiry,
    radix_ideal_hits,
)
from kvbench.trace.keys import PrefixKeys, lookup_blocks
from kvbench.trace.stream import ListTrace, TraceIndex
from kvbench.trace.tokens import ROOT_KEY, TokenStreams


@dataclass(slots=True)
class Progress:
    requests_total: int
    requests_done: int = 0
    clock_s: float = 0.0
    output_tokens: int = 0
    steps: int = 0


def tick(prog: Progress, step: int, st: Totals, clock_s: float,
         on_progress: Callable[[Progress], None] | None, last: bool = False) -> None:
    """Progress after a step (reported every 64 steps, and once at the end: ``last``)."""
    prog.steps = step
    if on_progress is not None and (last or (step & 63) == 0):
        prog.requests_done = st.completed + st.rejected
        prog.clock_s = clock_s if last else max(prog.clock_s, clock_s)  # (the replicas' clocks interleave)
        prog.output_tokens = st.output_tokens
        on_progress(prog)


def next_replica(replicas: list[Replica]) -> Replica | None:
    """The replica whose next step starts first (one replica: that one, whenever it has work); one
    ``stalled`` (engine.disagg: nothing it can schedule until an event) waits."""
    rep: Replica | None = None
    for r in replicas:
        if r.sched.has_work() and not r.stalled and (rep is None or r.clock < rep.clock):
            rep = r
    return rep


GC_YOUNG_THRESHOLD = 50_000  # container allocations (net) between young collections during a run


@contextmanager
def steady_gc() -> Iterator[None]:
    """The cyclic garbage collector tuned for a run, and restored after it: what exists at the start
    is frozen, unless the caller froze a heap of its own (vLLM freezes its heap after start-up:
    vllm/utils/gc_utils.py, freeze_gc_heap), and the young generation is collected every
    GC_YOUNG_THRESHOLD container allocations rather than 700, so that the run's many short-lived
    objects (a trace line's segments, a step's lists) do not set off full collections of every object
    alive (the whole Mooncake trace: 797 young, 72 middle and 6 full collections, 0.68-0.83 s of an
    11-13 s replay, against ~150 young ones, 0.10 s; counted with gc.callbacks). No collection before the
    freeze, as vLLM makes once at start-up: over a caller's large heap (a test process's) it costs
    0.1-0.5 s a run; garbage frozen now is collected after the run."""
    before = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0  # (a caller that froze its own heap keeps it as it was)
    if freeze:
        gc.freeze()
    gc.set_threshold(max(before[0], GC_YOUNG_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if freeze:
            gc.unfreeze()


class Replay:
    """One replay of a trace under one configuration, writing a run directory."""

    disaggregated = False  # (engine.disagg.DisaggReplay: prefill and decode instances)

    def __init__(self, trace_path: str, cfg: ReplayConfig, out_dir: str,
                 requests: list[Request] | None = None, *, force: bool = False, unique: bool = False,
                 trace_label: str | None = None, invocation: Invocation | None = None):
        """``out_dir`` must not hold a run unless ``force``; with ``unique`` (a default name) a taken
        name gets a suffix instead (see records.claim_run_dir: ``self.out_dir`` is the one used).
        ``trace_label``: the trace's path as config.json records it, when the file read is a copy
        (a Ray task's local copy of the driver's trace)."""
        self.cfg = cfg.validate()
        if cfg.disaggregated != self.disaggregated:  # (engine.runs picks the class)
            raise RunError(f"{type(self).__name__} does not run {'dis' if cfg.disaggregated else ''}aggregated "
                           "instances: use kvbench.engine.runs.replay_class")
        self.trace_path = trace_path
        self.trace_label = trace_label or os.path.abspath(trace_path)
        self.invocation = invocation or Invocation()
        self.out_dir = out_dir
        self._force, self._unique, self._claimed = force, unique, False
        if not unique and not force and os.path.isdir(out_dir) and holds_run(out_dir):
            claim_run_dir(out_dir)  # refuses, naming --out: before the model is built
        # the trace as a stream (kvbench.trace.stream): per request a few numbers until it is issued
        self.trace: TraceIndex | ListTrace = (ListTrace(requests) if requests is not None
                                              else TraceIndex(trace_path, limit=cfg.limit))
        self.num_requests = len(self.trace)
        assert self.cfg.model is not None  # validate() names the executor's default model
        self.model = get_model(self.cfg.model)
        self.max_len = cfg.max_model_len or self.model.max_model_len
        self._shape_requests()
        # --max-requests / --max-seconds: at most ``planned`` requests are issued, none past arrival
        # position ``reach``; the rest are not this run's (its pool bound, slab size and checks)
        self.planned, reach = self._issue_bounds()
        self._admitted[reach:] = False
        self.slab_reserve_tokens = self._slab_reserve_tokens()
        self.streams = TokenStreams()
        check_model_memory(cfg, self.model)
        if cfg.executor == "model" and not self.model.is_moe:  # (the executor refuses a mixture of experts)
            check_token_ids(list(self.trace.in_trace_order()), self.model.vocab_size, self.trace_path)
        executor = make_executor(cfg, self.model)
        # the model's KV cache groups (one for a plain model; several with windows: vLLM's hybrid manager)
        self.kv_layout = kv_layout_of(cfg, executor)
        if self.kv_layout.block_size != cfg.block_size:  # recurrent state: vLLM's block size, not the one asked
            cfg = self.cfg = dataclasses.replace(cfg, block_size=self.kv_layout.block_size)
            self.slab_reserve_tokens = self._slab_reserve_tokens()
        check_hybrid(cfg, self.kv_layout, self.model.name)
        self._check_samples()
        self.num_blocks = pool_blocks(cfg, executor, kv_layout=self.kv_layout)  # per replica
        self._block_bytes = self.kv_layout.bytes_per_block * cfg.tp
        self.physical_blocks = self._physical_blocks()
        self._tier_bound = self._run_blocks() if cfg.tier_sizes() else None
        self.store: Tier | None = None  # the KV store every instance shares (--store-kv-mem)
        self.replicas = [self._replica(i, executor if i == 0 else make_executor(cfg, self.model))
                         for i in range(self._instances())]
        # the single engine's parts (replica 0), as tests and selfcheck read them
        first = self.replicas[0]
        self.kv, self.executor, self.evictor, self.sched = first.kv, first.executor, first.evictor, first.sched
        routed = self._routed()  # the instances a request's arrival is routed among
        store = self.store
        self.router = Router(cfg.router, len(routed), prefix_blocks=cfg.router_prefix_blocks,
                             cache_weight=cfg.router_cache_weight, load_weight=cfg.router_load_weight,
                             event_delay_s=cfg.router_event_delay, block_size=cfg.block_size,
                             prefill_s=lambda cached, new: routed[0].executor.recompute_s(cached, new),
                             store_match=None if store is None else lambda keys, now: store.prefix(keys, ROOT_KEY, now),
                             store_block_s=0.0 if store is None else self._block_bytes / store.bandwidth)
        if self.router.index is not None and len(routed) > 1:
            for rep in routed:  # the replicas publish KV events for the router's index
                rep.kv.enable_events()
        self.accounts = Accounts(cfg, self.replicas, self.router, num_blocks=self.num_blocks,
                                 block_bytes=self._block_bytes, num_requests=self.num_requests,
                                 truncated=self.truncated, slab_reserve_tokens=self.slab_reserve_tokens,
                                 kv_cache_groups=self.kv_layout.describe())
        self.finished: list[RequestState] | None = None  # set to [] to keep finished requests
        # set to [] to keep every step's plan: ([(request id, sample, tokens)], [preempted request ids])
        self.step_log: list | None = None
        # called after every step with (replica, start s, end s, batch, [(request id, sample) that emitted a token])
        self.step_hook: Callable[[int, float, float, StepBatch, list[tuple[str, int]]], None] | None = None
        # a staged closed loop (engine.issuer: (requests, concurrency) per stage), as a profiling run sent it
        self.stages: list[tuple[int, int]] | None = None
        self._check_all_fit()

    def _instances(self) -> int:
        """Engine instances the run builds (engine.disagg: prefill and decode ones)."""
        return self.cfg.replicas

    def _routed(self) -> list[Replica]:
        """The instances an arriving request is routed among (engine.disagg: the prefill ones)."""
        return self.replicas

    def _check_samples(self) -> None:
        """A model with recurrent state and a request of n > 1 samples is refused, naming its line:
        vLLM fans the request out into n requests that each look the prompt up, and each sibling can only
        hit the state at the prompt's last block boundary (recomputing the rest, a step later when they
        arrive together); kvbench's samples fork one prefill, which would understate that cost."""
        if not self.kv_layout.has_state:
            return
        many = np.flatnonzero((self.trace.n > 1) & self._admitted)
        if len(many):
            r = self.trace.request(int(many[0]))
            raise InputError(f"{r.n} samples of one prompt on {self.model.name}, whose recurrent state vLLM does not "
                             "share between samples (it runs n requests): not modelled; give each sample its own "
                             "request (n 1)", file=self.trace_path, line=r.line, field="n")

    def claim(self) -> str:
        """Create the run directory (``run`` does it first if nobody has): after every check, so a
        refused run writes nothing. -> the directory (with ``unique``, the name taken)."""
        if not self._claimed:
            self.out_dir = claim_run_dir(self.out_dir, force=self._force, unique=self._unique)
            self._claimed = True
        return self.out_dir

    def _replica(self, i: int, executor) -> Replica:
        cfg = self.cfg
        paged = cfg.layout == "paged"
        kv = make_kv(cfg.layout, self.num_blocks, cfg.block_size,
                     prefix_cache=cfg.prefix_cache and paged, cache_policy=cfg.cache_policy,
                     prefix_mode=cfg.prefix_mode, radix_eviction=cfg.radix_eviction,
                     physical=self.physical_blocks, kv_layout=self.kv_layout,
                     max_batched_tokens=cfg.max_batched_tokens, max_model_len=self.max_len)
        executor.bind_pool(self.physical_blocks or self.num_blocks, cfg.block_size,
                           self.kv_layout.layer_groups() if self.kv_layout.is_hybrid else None)
        if cfg.tier_sizes():
            self._attach_tiers(kv, executor, i)
        evictor = make_evictor(cfg.eviction, kv, kv_budget=cfg.kv_budget,
                               sink_tokens=cfg.sink_tokens, seed=cfg.seed,
                               kv_bytes_per_token=executor.kv_bytes_per_token(),
                               speculate=executor.speculate)
        sched = Scheduler(kv, SchedulerConfig(cfg.max_num_seqs, cfg.max_batched_tokens,
                                              cfg.admission, cfg.watermark,
                                              cfg.admission_window if cfg.prefix_cache else 0,
                                              cfg.admission_threshold),
                          needs_tokens=executor.needs_tokens, streams=self.streams, evictor=evictor)
        return Replica(i, kv, executor, evictor, sched, Totals())

    def _front_servers(self) -> int:
        """API servers requests pass before the engine sees them (one per replica)."""
        return self._instances()

    def _store_access(self, index: int) -> tuple[bool, bool]:
        """Whether instance ``index`` reads the shared store, and whether it writes to it."""
        return True, True

    def _attach_tiers(self, kv, executor, index: int) -> None:
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
        if specs and specs[-1].name == "store":  # one for the whole run, at the end of every instance's chain
            spec = specs.pop()
            if self.store is None:
                self.store = Tier(spec, self._tier_bound).share(cfg.store_delay)
        reads, writes = self._store_access(index)
        if not specs and not writes:
            return
        tiers = Tiers(specs, cfg.offload, cfg.load_policy, block_bytes=block, physical=self._tier_bound,
                      store=self.store if writes else None, reads_store=reads)
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
        bound = self._run_blocks() * len(self.kv_layout.groups)  # (every group holds a block per position)
        return bound if bound < self.num_blocks else None

    def _run_blocks(self) -> int:
        """Every block of every admitted request (each sample's prompt and output, a copied partial
        block and a spare each): no pool or tier of this run ever holds more."""
        bs, ok = self.cfg.block_size, self._admitted
        return int((self.trace.n[ok] * (-(-(self.trace.prompt_len[ok] + self._output_len[ok]) // bs) + 2)).sum())

    # -- checks before the run ----------------------------------------------------------------
    def _shape_requests(self) -> None:
        """The requests as this run's length rule shapes them, per arrival position (``--overlong``,
        engine/lengths.py: the replayed engine's rule): an admitted request's output is cut to what
        the rule lets it generate (``self.truncated`` counts them), the others are refused."""
        plen, olen = self.trace.prompt_len, self.trace.output_len
        self._admitted, self._output_len = shape_lengths(plen, olen, self.max_len, self.cfg.overlong)
        self._fits_len = self._admitted.copy()  # (_admitted also loses what the limits do not issue)
        self._cut = self._admitted & (self._output_len != olen)
        self.truncated = int(self._cut.sum())

    def _request(self, pos: int) -> Request:
        """The request at arrival position ``pos``, read from the trace and shaped as _shape_requests."""
        return self._shaped(pos, self.trace.request(pos))

    def _shaped(self, pos: int, r: Request) -> Request:
        if self._cut[pos]:
            r = dataclasses.replace(r, output_len=int(self._output_len[pos]))
        return r

    def _issue_bounds(self) -> tuple[int, int]:
        """(the most requests the limits let the run issue, the arrival positions they lie below):
        the issuer goes in arrival order, a request no earlier than its arrival time, so none due past
        --max-seconds goes; --max-requests takes the first N, in arrival order unless dependent turns
        hold some back while later ones go."""
        cfg, n = self.cfg, len(self.trace)
        due = n
        if cfg.max_seconds is not None and n:  # (the issuer's until_s: the first request's time + S)
            t = self.trace.t * cfg.time_scale
            due = int(np.searchsorted(t, t[0] + cfg.max_seconds, side="right"))
        planned = due if cfg.max_requests is None else min(due, cfg.max_requests)
        return planned, due if cfg.dependent_turns else planned

    def _admitted_in_trace_order(self, issued: np.ndarray | None = None) -> Iterator[tuple[int, Request]]:
        """(trace rank, request as shaped) of the admitted requests (those ``issued`` marks, if given),
        in trace order."""
        for rank, (pos, r) in enumerate(self.trace.positioned()):
            if self._admitted[pos] and (issued is None or issued[pos]):
                yield rank, self._shaped(pos, r)

    def _ideal_in_trace_order(self, issued: np.ndarray | None = None):
        """The ideal of the admitted requests (those ``issued`` marks, if given) in trace order, by a
        pass of its own: the block ideal lets go of keys no later request can hit (IdealCounter,
        block_expiry); a radix run's is token-granular (radix_ideal_hits)."""
        bs, chosen = self.cfg.block_size, self._admitted_in_trace_order(issued)
        if self.cfg.prefix_mode == "radix":
            return radix_ideal_hits([r for _, r in chosen], bs, self.streams)
        counter, keys_of, names = IdealCounter(bs), self._keys_of, self.trace.names
        for rank, r in chosen:
            keys, prompt_len, pieces, shareable = keys_of.with_pieces(r)
            counter.add(keys, prompt_len, shareable, block_expiry(pieces, len(keys), bs, names), at=rank)
        return counter.result()

    def _reject_reason(self, pos: int) -> str | None:
        """Why the request at arrival position ``pos`` is refused on arrival, or None."""
        if not self._fits_len[pos]:
            return "max_model_len"
        return None

    def _check_all_fit(self) -> None:
        """A request that cannot run is refused before the run, naming its line (setup.check_fits, on
        the first such request in arrival order, found over the arrays)."""
        cfg, bs = self.cfg, self.cfg.block_size
        plen, olen, n = self.trace.prompt_len, self._output_len, self.trace.n
        if cfg.layout == "slab":
            reserve = self.slab_reserve_tokens if cfg.slab_reserve == "max" else plen + olen
            need = n * (self.kv_layout.slab_blocks(reserve) if self.kv_layout.is_hybrid else -(-reserve // bs))
        else:
            need = (self.kv_layout.peak_blocks(plen + olen, cfg.max_batched_tokens, self.max_len)
                    + (n - 1) * (-(-olen // bs)) * len(self.kv_layout.groups))
        bad = np.flatnonzero(self._admitted & ((n > cfg.max_num_seqs) | (need > self.num_blocks)))
        if len(bad):
            self._check_fits(self._request(int(bad[0])))

    def _check_fits(self, r: Request) -> None:
        check_fits(r, self.cfg, self.num_blocks, self.slab_reserve_tokens, self.trace_path, self.kv_layout,
                   self.max_len)

    def _slab_reserve_tokens(self) -> int:
        """setup.slab_reserve_tokens over the arrays: --max-model-len, else the longest admitted
        request rounded up to a block."""
        if self.cfg.max_model_len is not None:
            return self.cfg.max_model_len
        bs = self.cfg.block_size
        total = self.trace.prompt_len + self._output_len
        longest = int(total[self._admitted].max()) if self._admitted.any() else bs
        return -(-longest // bs) * bs

    def _reserve(self, r: Request) -> int:
        return self.slab_reserve_tokens if self.cfg.slab_reserve == "max" else r.prompt_len + r.output_len

    # -- the loop -----------------------------------------------------------------------------
    def run(self, on_progress: Callable[[Progress], None] | None = None) -> dict:
        with steady_gc():
            return self._run(on_progress)

    def _begin(self):
        """What every run's loop starts from: the issuer, the future a belady pool reads, the ideal
        counter, the run directory's writer. -> (use_tokens, future, writer, cluster totals, progress,
        the first request's time), the issuer in ``self._issuer``, the ideal in ``self._ideal`` or
        ``self._ideal_after`` (computed before the run when arrival order is not trace order)."""
        cfg, kv, ex = self.cfg, self.kv, self.executor
        trace = self.trace
        bs = cfg.block_size
        use_tokens = kv.prefix_cache or ex.needs_tokens
        tiers = cfg.tier_sizes()
        belady = needs_future(cfg.cache_policy) or any(needs_future(getattr(cfg, f"{t}_cache_policy")) for t in tiers)
        self._limited = limited = cfg.max_requests is not None or cfg.max_seconds is not None
        deps = dependencies_in_trace_order(trace.positioned()) if cfg.dependent_turns else {}
        issuer = Issuer.of_times(trace.t, deps, cfg.time_scale, cfg.max_concurrency,
                                 max_requests=cfg.max_requests, max_seconds=cfg.max_seconds, stages=self.stages)
        self._issuer = issuer
        planned = self.planned
        if self.step_log is None and self.step_hook is None:  # they read the sequences each step
            for each in self.replicas:
                each.sched.enable_lane()
        self._issued = np.zeros(len(trace), dtype=bool)  # which arrival positions were issued
        # Belady's policy reads each block's next use: the keys of the requests that may be issued, in memory
        # (a use past those issued never decides a hit; ReplayConfig.validate refuses dependent turns here)
        future = None
        if kv.prefix_cache and belady:
            future = next_uses([self._request(p) for p in range(planned)], bs, self.streams)
        # The ideal hit rate counts the requests issued in trace order; arrival order is the same unless
        # the trace is unsorted, dependent turns wait for answers, or several front ends pass requests
        # to the engine at their own pace, and then it gets a pass of its own
        # (before the run, or after it when a limit decides which requests are issued).
        # (several API servers in front -- one per replica -- let a short prompt overtake a long one)
        in_order = not cfg.dependent_turns and trace.sorted and self._front_servers() == 1
        self._keys_of = PrefixKeys(bs, self.streams)
        self._keys_of.once = trace.names.once  # shared streams one request uses (PrefixKeys.count_once)
        # Radix runs use a token-granular ideal (spec §4): a radix tree can hit inside a block; it
        # holds the admitted requests' keys (radix_ideal_hits), the block ideal only the live ones.
        self._ideal_after = None
        self._ideal: IdealCounter | RadixIdealCounter | None = None
        if in_order:
            self._ideal = (RadixIdealCounter(bs, [r for _, r in self._admitted_in_trace_order()], self.streams)
                           if cfg.prefix_mode == "radix" else IdealCounter(bs))
        elif not limited:
            self._ideal_after = self._ideal_in_trace_order()
        self.claim()
        writer = RunWriter(self.out_dir, self._config_json(), **self._tables())
        self._writer = writer
        clock = float(trace.t[0]) * cfg.time_scale if len(trace) else 0.0
        for each in self.replicas:
            each.clock = clock
        return use_tokens, future, writer, Totals(), Progress(planned), clock

    def _tables(self) -> dict:
        """Tables a run writes beside requests and steps (RunWriter's keywords)."""
        return {}

    def _end(self, writer, st: Totals, t0_s: float, steps: int, complete: bool, wall0: float) -> dict:
        """Close the run (also when cut short): the tables, then summary.json. -> the summary."""
        replicas = self.replicas
        with interrupt_held():  # a second Ctrl-C waits until summary.json is written
            for each in replicas:
                each.sched.sync()
            end = max(r.clock for r in replicas)
            writer.close_tables()  # the summary's distributions are read back from requests.parquet
            ideal = self._ideal_after
            if ideal is None:
                ideal = self._ideal.result() if self._ideal is not None else self._ideal_in_trace_order(self._issued)
            if self._limited:  # the run's requests are those issued (also when Ctrl-C cut it first)
                acc, issuer = self.accounts, self._issuer
                acc.num_requests, acc.not_issued = issuer.issued, issuer.n - issuer.issued
                acc.truncated = int(self._cut[self._issued].sum())
            summary = self.accounts.summary(st, ideal, end - t0_s, steps, complete,
                                            time.perf_counter() - wall0, writer.requests_path)
            summary.update(self._summary_extra(summary, end - t0_s))
            writer.close(summary)
        self._end_s = end
        return summary

    def _summary_extra(self, summary: dict, duration_s: float) -> dict:
        """What a kind of run adds to summary.json (engine.disagg: its ``disagg`` section)."""
        return {}

    def _run(self, on_progress: Callable[[Progress], None] | None) -> dict:
        replicas, bs, ex = self.replicas, self.cfg.block_size, self.executor
        use_tokens, future, writer, st, prog, t0_s = self._begin()
        issuer = self._issuer
        # The servers' front end (a GPU preset's, or a live fit's): an API server per replica, each taking
        # one request at a time (a request takes the first one free); every request passes one, one
        # refused as too long included (vLLM's API process refuses it). A heap keeps them by when they
        # reach the engine.
        front = FrontEnd(*ex.front_end, servers=len(replicas))
        passing: list[tuple[float, int, float, Request]] = []  # (reaches the engine, position, issued, request)
        index = self.router.index
        loads_seen = len(replicas) > 1 and self.router.name != "round-robin"
        step = 0
        wall0 = time.perf_counter()
        complete = False
        try:
            while True:
                rep = next_replica(replicas)
                issue_s = issuer.next_time()
                if passing and (issue_s is None or passing[0][0] < issue_s) and (rep is None or passing[0][0] <= rep.clock):
                    seen_s, pos, issue_s, req = heapq.heappop(passing)  # through the servers' front end
                    self._arrive(req, pos, future, use_tokens, writer, st, issue_s, seen_s)
                    continue
                if issue_s is not None and (rep is None or issue_s <= rep.clock):
                    pos, issue_s = issuer.issue()  # arrivals up to the step's start first
                    self._issued[pos] = True
                    req = self._request(pos)
                    if front:
                        heapq.heappush(passing, (front.admit(issue_s, req.prompt_len), pos, issue_s, req))
                    else:
                        self._arrive(req, pos, future, use_tokens, writer, st, issue_s)
                    continue
                if rep is None:
                    if not issuer.done():
                        raise RunError("requests are left that can never be issued (each waits for an "
                                       "answer that does not come)")
                    break
                sched = rep.sched
                rep.kv.set_clock(rep.clock)  # the time cache policies are told (learned: seconds since a use)
                plan = sched.schedule(rep.clock)
                if loads_seen:  # what a router sees of this replica while the step runs
                    rep.snap, rep.since = rep.load(bs), [0, 0]
                if plan.empty:
                    raise RunError("the scheduler could not make progress: no running sequence "
                                   "and the next waiting one does not fit", usage=True)
                batch = sched.build_batch(plan)
                result = rep.executor.execute(batch)
                start_s = rep.clock
                rep.clock += result.duration_s
                if self.store is not None:  # what the step wrote to the shared store is found from its end
                    self.store.settle(rep.clock)
                if self.step_log is not None:
                    self.step_log.append(([(s.rs.req.id, s.sample, n) for s, n in zip(plan.seqs, plan.num_new)],
                                          [s.rs.req.id for s in plan.preempted]))
                finished = sched.update(plan, result, rep.clock)
                if self.step_hook is not None:  # the samples that emitted a token at the step's end
                    self.step_hook(rep.index, start_s, rep.clock, batch,
                                   [(s.rs.req.id, s.sample) for s in plan.seqs if s.last_emit_s == rep.clock])
                self.accounts.step(writer, rep, start_s, result, batch, plan)
                rep.steps += 1
                step += 1
                if index is not None:
                    events = rep.kv.take_events()
                    if events:
                        index.publish(rep.index, rep.clock, events)
                if self.finished is not None:
                    self.finished.extend(finished)
                for rs in finished:
                    self.accounts.request(writer, rs, rep)
                    st.completed += 1
                    st.output_tokens += rs.output_tokens
                    issuer.finished(rs.position, rep.clock)
                tick(prog, step, st, rep.clock - t0_s, on_progress)
            complete = True
        finally:
            summary = self._end(writer, st, t0_s, step, complete, wall0)
        tick(prog, step, st, self._end_s - t0_s, on_progress, last=True)
        return summary

    def _arrive(self, r: Request, index: int, future, use_tokens: bool, writer, st, arrival: float,
                seen_s: float | None = None) -> None:
        """Request ``r`` (arrival position ``index``), issued at ``arrival``, reaches the engine at
        ``seen_s`` (after a server's front end; None: at once). Latencies count from ``arrival``."""
        rs = RequestState(req=r, arrival_s=arrival, prompt=None, position=index)
        if seen_s is not None:
            arrival = seen_s
        accepted = self._accept(rs, writer, st, arrival)
        if accepted is None:
            return
        keys, prompt_len, pieces = accepted
        rep = self._route_arrival(rs, keys, prompt_len, arrival)
        self._enqueue(rep, rs, keys, pieces, None if future is None else future[index], use_tokens, arrival)

    def _accept(self, rs: RequestState, writer, st, arrival: float):
        """A request reaching the engine at ``arrival``: refused (its row written, None), or -> its
        (block keys, prompt length, pieces), counted in the ideal."""
        r, index = rs.req, rs.position
        reason = self._reject_reason(index)
        if reason is not None:
            rs.reject_reason = reason
            st.rejected += 1
            self.accounts.request(writer, rs, None)
            self._issuer.finished(index, arrival)
            return None
        keys, prompt_len, pieces, shareable = self._keys_of.with_pieces(r)
        if self._ideal is not None:  # the ceiling of the requests this run admits (in order: rank = position)
            self._ideal.add(keys, prompt_len, shareable,
                            block_expiry(pieces, len(keys), self.cfg.block_size, self.trace.names), at=index)
        return keys, prompt_len, pieces

    def _route_arrival(self, rs: RequestState, keys, prompt_len: int, arrival: float) -> Replica:
        """The instance (of ``_routed``) the router sends a request reaching the engine at ``arrival`` to."""
        replicas = self._routed()
        if len(replicas) == 1:
            return replicas[0]
        bs = self.cfg.block_size
        look = keys[:lookup_blocks(prompt_len, bs)]  # the blocks a prompt can hit
        i, expected = self.router.route(arrival, rs.req.session, look, len(look),
                                        [x.load_at(arrival, bs) for x in replicas]
                                        if self.router.name != "round-robin" else None, prompt_len)
        rep = replicas[i]
        if rep.clock > arrival:  # mid-step: the router's view of it grows by this request
            rep.since[0] += 1
            rep.since[1] += -(-prompt_len // bs)
        if self.router.index is not None:
            self.accounts.predicted[rs] = expected
        return rep

    def _enqueue(self, rep: Replica, rs: RequestState, keys, pieces, next_use, use_tokens: bool,
                 arrival: float):
        """Queue a request at instance ``rep`` as it reaches it at ``arrival``. -> its sequence."""
        seq = self._new_seq(rep, rs, keys, pieces, next_use, use_tokens)
        self._add(rep, seq, arrival)
        return seq

    def _new_seq(self, rep: Replica, rs: RequestState, keys, pieces, next_use, use_tokens: bool):
        """A request's sequence for instance ``rep``, not queued yet."""
        seq = rep.sched.new_seq(rs, None, next_use, keys=None, reserve=self._reserve(rs.req))
        if use_tokens or rep.kv.prefix_cache:  # a waiting request holds its pieces and keys, no tokens
            seq.pieces = pieces if use_tokens else None
            seq.waiting_keys = keys if rep.kv.prefix_cache else None
            seq.built = False
        return seq

    @staticmethod
    def _add(rep: Replica, seq, arrival: float) -> None:
        """Queue ``seq`` at instance ``rep`` as it reaches it at ``arrival``."""
        rep.routed += 1
        if not rep.sched.has_work():  # an idle replica starts at the arrival
            rep.clock = max(rep.clock, arrival)
        rep.sched.add(seq)

    def _config_json(self) -> dict:
        return {"settings": self.cfg.to_dict(), "max_model_len_effective": self.max_len,
                "slab_reserve_tokens": self.slab_reserve_tokens if self.cfg.layout == "slab" else None,
                "num_blocks": self.num_blocks, "model_spec": self.model.to_dict(),
                "kv_cache_groups": self.kv_layout.to_dict(),
                "trace": {"path": self.trace_label, "sha256": self.trace.sha256 or file_sha256(self.trace_path),
                          "requests": self.num_requests},
                "files": setting_files(self.cfg.to_dict()),
                "environment": environment(self.executor.device_name),
                **self.invocation.record()}


def replay(trace_path: str, cfg: ReplayConfig, out_dir: str, on_progress=None,
           requests: list[Request] | None = None, force: bool = False, trace_label: str | None = None,
           invocation: Invocation | None = None) -> dict:
    """Replay a trace under one configuration into ``out_dir``; return summary.json's contents."""
    return Replay(trace_path, cfg, out_dir, requests, force=force, trace_label=trace_label,
                  invocation=invocation).run(on_progress)
