"""Disaggregated prefill and decode (``--disagg P:D``): a trace replayed through P prefill instances and D
decode instances, the KV of every prompt crossing a link between them, as vLLM 0.34 runs it with a KV
connector (NIXL's pull mode: ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``).

A request's life, and what kvbench follows of vLLM at each point:

1. **Prefill leg.** The router (``--router``, over the prefill instances) sends it to a prefill instance
   through that instance's API server (its front end), with ``max_tokens=1``: the instance schedules it
   as any request (prefix cache, chunked prefill, preemption), samples one token -- which is dropped --
   and finishes it, but keeps its blocks: the connector's ``request_finished`` delays the free until the
   decode side has read them (RequestState.hold; Scheduler.held).
2. **Hop.** The proxy sends it to a decode instance, the one with the fewest requests waiting, loading
   and running (ties: the most free blocks, then the lowest index), through that instance's front end.
3. **Decode admission.** In the decode instance's waiting queue, in arrival order, it looks its prompt up
   in that instance's own prefix cache; the connector answers that the rest of the prompt can be loaded
   (``get_num_new_matched_tokens``: the prompt less the block-aligned local hit), blocks are allocated
   for all of it -- the whole sequence must fit, less what requests still prefilling there need -- and
   the load starts with the step (Scheduler._start_load). It takes no token budget and no seat.
4. **Transfer.** The blocks the decode side lacks, times the bytes of a block over every layer and rank,
   cross from the prefill instance's links to the decode instance's (engine.link: a latency, then
   max-min fair sharing), from the end of the step that allocated them (the worker submits the reads
   after the forward: ``post_forward``); not layer by layer (NIXL reads a request's blocks once its
   prefill is done).
5. **Arrival.** Once the bytes have landed, the decode instance caches the loaded blocks and, at its
   next schedule, admits the request before any other waiting one (vLLM's ``kv_holding_waiting``):
   its first step computes the prompt's last token again and samples the first token. The prefill
   instance frees the held blocks (``finished_sending``) before its next schedule.
6. **Decode** as any request; one preempted here recomputes its prompt here.

TTFT is counted from the request's issue to the decode instance's first token, and split in
transfers.parquet into parts that sum to it: prefill wait (front end and queue), prefill, hop (the decode
front end), decode admission, transfer, first step. Instances are the same model, GPU and ``--tp``, each
with the run's pool and scheduler settings.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import os

import numpy as np
import pyarrow.parquet as pq

from kvbench.engine.issuer import FrontEnd
from kvbench.engine.link import LINKS, Links
from kvbench.engine.records import distribution
from kvbench.engine.replay import Progress, Replay, next_replica, tick
from kvbench.engine.replica import Replica
from kvbench.engine.setup import check_model_memory, kv_layout_of, pool_blocks
from kvbench.executors import make_executor
from kvbench.errors import InputError, RunError
from kvbench.scheduler import RequestState
from kvbench.scheduler.request import Sequence
from kvbench.trace.format import Request

INF = math.inf


@dataclass(slots=True, eq=False)
class Leg:
    """A disaggregated request between its two instances."""

    rs: RequestState  # the request as the client sees it (its row of requests.parquet)
    pre: RequestState  # its prefill leg (max_tokens 1, blocks held)
    prefill: int  # the prefill instance's index
    keys: object
    pieces: object
    prompt_len: int
    prefill_end_s: float = math.nan
    decode: int = -1
    seen_s: float = math.nan  # reached the decode instance (after its front end)
    load_start_s: float = math.nan
    load_end_s: float = math.nan
    blocks: int = 0
    nbytes: int = 0
    decode_cached: int = 0
    seq: Sequence | None = None

    held: int = 0  # blocks its finished prefill leg holds for the decode side's read (every group's)
    group_blocks: list[int] | None = None  # the blocks it moves, per KV cache group


class DisaggReplay(Replay):
    """A replay through prefill and decode instances (see the module's docstring)."""

    disaggregated = True

    def __init__(self, trace_path, cfg, *args, **kw):
        self.decode_cfg = cfg.validate().decode_config()
        self.npre = cfg.prefill_instances
        super().__init__(trace_path, cfg, *args, **kw)
        if self.kv_layout.has_state:
            raise InputError(f"{self.model.name} keeps a recurrent state per sequence (Mamba, linear attention): its "
                             "transfer is not modelled with disaggregated serving yet", field="--disagg")
        self._check_decode_fits()
        # set to [] to record (time, event, request id, instance, tokens) for every load start and end,
        # free, and decode-side step that computes a request, its tokens (tests check their order)
        self.events: list[tuple[float, str, str, int, int]] | None = None

    def _replica(self, i: int, executor) -> Replica:
        """A prefill instance as the run's settings say, a decode one as ``decode_config`` says (its own
        GPU, --tp, pool and limits)."""
        if i < self.cfg.prefill_instances:
            return super()._replica(i, executor)
        dcfg = self.decode_cfg
        try:
            executor = make_executor(dcfg, self.model)
            layout = kv_layout_of(dcfg, executor)
            if layout.block_size != self.cfg.block_size:
                raise InputError("the decode instances run another block size than the prefill ones", field="--tp")
            blocks = pool_blocks(dcfg, executor, kv_layout=layout)
            check_model_memory(dcfg, self.model)
        except InputError as e:
            raise self._decode_error(e) from None
        saved = self.cfg, self.num_blocks, self.physical_blocks, self.kv_layout
        bound = self.physical_blocks if self.physical_blocks is not None else self._run_blocks()
        self.cfg, self.num_blocks, self.kv_layout = dcfg, blocks, layout
        self.physical_blocks = bound if self.cfg.eviction == "none" and bound < blocks else None
        try:
            rep = super()._replica(i, executor)
        finally:
            self.cfg, self.num_blocks, self.physical_blocks, self.kv_layout = saved
        self.decode_blocks = blocks
        # bytes a block of each KV cache group moves, over every GPU (MLA: every decode GPU reads a whole copy)
        self.decode_group_bytes = ([g.spec.page_bytes(layout.block_size) * len(g.layers) * dcfg.tp for g in layout.groups]
                                   if layout.is_hybrid else [layout.bytes_per_block * dcfg.tp])
        return rep

    def _store_access(self, index: int) -> tuple[bool, bool]:
        """A prefill instance reads and writes the shared store; a decode instance loads its prompts
        from the prefill instance (NIXL), so it only writes -- its answers' blocks, with
        ``--store-decode`` (LMCache's save_decode_cache) -- for later turns' prefills to find."""
        if index < self.npre:
            return True, True
        return False, self.cfg.store_decode

    def _check_decode_fits(self) -> None:
        """A request that can never fit a decode instance (its pool, its limits) is refused before the
        run, naming its line, as one that cannot fit a prefill instance is: vLLM would hold its prefill's
        blocks and never start its load (the driver of tests/test_vllm_pd_golden.py stalls so)."""
        saved = self.cfg, self.num_blocks
        self.cfg, self.num_blocks = self.decode_cfg, self.decode_blocks
        try:
            self._check_all_fit()
        except InputError as e:
            raise self._decode_error(e) from None
        except RunError as e:
            text = str(e).replace("the pool holds", "a decode instance's pool holds").replace(
                "(--kv-mem, --num-blocks)", "(--decode-kv-mem, --decode-num-blocks)")
            raise RunError(text, usage=e.usage) from None
        finally:
            self.cfg, self.num_blocks = saved

    def _decode_error(self, e: InputError) -> InputError:
        """An error about a decode instance, naming its ``--decode-*`` option where it has one."""
        field = e.field
        if field is not None and field.startswith("--") and field[2:].replace("-", "_") in self.cfg.DECODE_SETTINGS:
            field = "--decode-" + field[2:]
        return InputError(f"on a decode instance: {e.reason}", file=e.file, line=e.line, field=field)

    def _front_servers(self) -> int:
        """The front ends a request passes first: the prefill instances' (the decode instances' with
        --disagg-local-prefill, which decide where it is prefilled)."""
        return self.cfg.decode_instances if self.cfg.disagg_local_prefill else self.cfg.prefill_instances

    def _instances(self) -> int:
        return self.cfg.prefill_instances + self.cfg.decode_instances

    def _routed(self) -> list[Replica]:
        return self.replicas[:self.cfg.prefill_instances]

    def _tables(self) -> dict:
        return {"transfers": True}

    def _links(self) -> Links:
        """Each instance's links: prefill instance i sends on link i, decode instance j receives on
        link P + j, at the preset's (or ``--link-gbps``) rate per GPU times its GPUs."""
        cfg, npre = self.cfg, self.cfg.prefill_instances
        spec = LINKS[cfg.link]
        per_gpu = spec.bytes_per_s if cfg.link_gbps is None else cfg.link_gbps * 1e9 / 8
        latency = spec.latency_s if cfg.link_latency_us is None else cfg.link_latency_us * 1e-6
        self.link_rates = (per_gpu * cfg.tp, per_gpu * self.decode_cfg.tp)  # (a prefill, a decode instance's)
        return Links({i: self.link_rates[i >= npre] for i in range(len(self.replicas))}, latency)

    # -- the loop -----------------------------------------------------------------------------
    def _run(self, on_progress: Callable[[Progress], None] | None) -> dict:
        cfg, ex = self.cfg, self.executor
        npre = cfg.prefill_instances
        replicas = self.replicas
        use_tokens, _, writer, st, prog, t0_s = self._begin()
        issuer = self._issuer
        front_p = FrontEnd(*ex.front_end, servers=npre)
        front_d = FrontEnd(*self.replicas[npre].executor.front_end, servers=cfg.decode_instances)
        to_prefill: list[tuple[float, int, float, Request]] = []  # (reaches the engine, position, issued, request)
        to_decode: list[tuple[float, int, Leg]] = []  # (reaches the decode instance, order, leg)
        self.links = links = self._links()
        index = self.router.index
        self.legs: dict[RequestState, Leg] = {}  # by the client's request and by its prefill leg
        self.local: dict[RequestState, int] = {}  # prefilled on their decode instance (--disagg-local-prefill)
        self.local_prefills = 0
        self._loading: dict[int, Leg] = {}  # transfer id -> leg
        self._held_blocks = [0, 0, 0.0, 0.0]  # prefill blocks held now, their peak, held x seconds, last change
        self._awaiting = [0, 0, 0.0, 0.0]  # the same of decode blocks allocated for KV still on the wire
        order = 0
        step = 0
        wall0 = time.perf_counter()
        complete = False
        try:
            while True:
                rep = next_replica(replicas)
                t_step = rep.clock if rep is not None else INF
                t_issue = issuer.next_time()
                t_issue = INF if t_issue is None else t_issue
                t_link = links.next_end()
                t_link = INF if t_link is None else t_link
                t_pre = to_prefill[0][0] if to_prefill else INF
                t_dec = to_decode[0][0] if to_decode else INF
                if t_link < INF and t_link <= min(t_issue, t_pre, t_dec, t_step):
                    for tid in links.advance(t_link):  # (a step ending then reports it: before the next)
                        self._landed(self._loading.pop(tid), t_link)
                    self._wake(t_link)
                    continue
                if t_issue < INF and t_issue <= min(t_pre, t_dec, t_step):
                    pos, issue_s = issuer.issue()
                    self._issued[pos] = True
                    req = self._request(pos)
                    front = front_d if cfg.disagg_local_prefill else front_p  # (who takes it first)
                    heapq.heappush(to_prefill, (front.admit(issue_s, req.prompt_len) if front else issue_s,
                                                pos, issue_s, req))
                    continue
                if t_pre < INF and t_pre <= min(t_dec, t_step):
                    seen_s, pos, issue_s, req = heapq.heappop(to_prefill)
                    self._to_prefill(req, pos, issue_s, seen_s, use_tokens, writer, st)
                    self._wake(seen_s)
                    continue
                if t_dec < INF and t_dec <= t_step:
                    seen_s, _, leg = heapq.heappop(to_decode)
                    self._to_decode(leg, seen_s, use_tokens)
                    self._wake(seen_s)
                    continue
                if rep is None:
                    if any(r.stalled for r in replicas):
                        raise RunError("an instance can never make progress: its next waiting request does not fit "
                                       "while nothing runs there and no transfer is in flight", usage=True)
                    if not issuer.done():
                        raise RunError("requests are left that can never be issued (each waits for an "
                                       "answer that does not come)")
                    break
                sched = rep.sched
                rep.kv.set_clock(rep.clock)
                plan = sched.schedule(rep.clock)
                if plan.empty:  # nothing to compute until a transfer or an arrival changes its state
                    for s, external, cached in plan.loads:
                        self._start(rep, s, external, cached)
                    rep.stalled = True
                    continue
                if self.step_log is not None:  # (instance, [(request id, sample, tokens)], [preempted ids])
                    self.step_log.append((rep.index, [(s.rs.req.id, s.sample, n) for s, n in zip(plan.seqs, plan.num_new)],
                                          [s.rs.req.id for s in plan.preempted]))
                if self.events is not None and rep.index >= npre:
                    self.events.extend((rep.clock, "step", s.rs.req.id, rep.index, n)
                                       for s, n in zip(plan.seqs, plan.num_new))
                batch = sched.build_batch(plan)
                result = rep.executor.execute(batch)
                start_s = rep.clock
                rep.clock += result.duration_s
                if self.store is not None:  # what the step wrote to the shared store is found from its end
                    self.store.settle(rep.clock)
                finished = sched.update(plan, result, rep.clock)
                for s, external, cached in plan.loads:  # NIXL reads once the step is done (post_forward)
                    self._start(rep, s, external, cached)
                self.accounts.step(writer, rep, start_s, result, batch, plan)
                rep.steps += 1
                step += 1
                if index is not None and rep.index < npre:  # the prefill instances' KV events, to the router
                    events = rep.kv.take_events()
                    if events:
                        index.publish(rep.index, rep.clock, events)
                for rs in finished:
                    if rs.hold:  # a prefill leg: its first token sampled, dropped; on to a decode instance
                        leg = self.legs[rs]
                        leg.prefill_end_s = rep.clock
                        order += 1
                        back = front_d if front_d and leg.decode < 0 else None  # (a decode instance waits for it)
                        heapq.heappush(to_decode, (back.admit(rep.clock, leg.prompt_len) if back else rep.clock,
                                                   order, leg))
                        # its prompt's blocks (the dropped token's KV is never written); a window's
                        # dropped ones are free already (the lane keeps a plain table its own way)
                        end = -(-leg.prompt_len // cfg.block_size)
                        leg.held = sum(rep.kv.group_blocks(sched.held[rs], 0, end)) if self.kv_layout.is_hybrid else end
                        self._hold(self._held_blocks, leg.held, rep.clock)
                        continue
                    self._done(rs, rep, writer, st)
                tick(prog, step, st, rep.clock - t0_s, on_progress)
            complete = True
        finally:
            summary = self._end(writer, st, t0_s, step, complete, wall0)
        tick(prog, step, st, self._end_s - t0_s, on_progress, last=True)
        return summary

    def _wake(self, t: float) -> None:
        """Something changed at ``t``: an instance that could not schedule tries again then."""
        for r in self.replicas:
            if r.stalled:
                r.stalled = False
                r.clock = max(r.clock, t)

    def _to_prefill(self, req: Request, pos: int, issue_s: float, seen_s: float, use_tokens: bool, writer, st) -> None:
        rs = RequestState(req=req, arrival_s=issue_s, prompt=None, position=pos)
        accepted = self._accept(rs, writer, st, seen_s)
        if accepted is None:
            return
        keys, prompt_len, pieces = accepted
        decode, seq = None, None
        if self.cfg.disagg_local_prefill:  # Dynamo: the decode worker decides, from what it caches
            decode = self._decode_instance()
            seq = self._new_seq(decode, rs, keys, pieces, None, use_tokens)
            if prompt_len - decode.sched.probe(seq) <= self.cfg.disagg_local_prefill:
                self.local[rs] = decode.index
                self._add(decode, seq, seen_s)
                return
        rep = self._route_arrival(rs, keys, prompt_len, seen_s)
        pre = RequestState(req=dataclasses.replace(req, output_len=1, n=1), arrival_s=seen_s, prompt=None,
                           position=pos, hold=True)
        leg = Leg(rs, pre, rep.index, keys, pieces, prompt_len)
        if decode is not None:  # (the decode instance that decided takes it back)
            leg.decode, leg.seq = decode.index, seq
        self.legs[pre] = self.legs[rs] = leg
        self._enqueue(rep, pre, keys, pieces, None, use_tokens, seen_s)

    def _decode_instance(self) -> Replica:
        """The decode instance a request goes to: the fewest requests waiting, loading and running,
        then the most room, then the lowest index."""
        best, key = None, None
        for r in self.replicas[self.cfg.prefill_instances:]:
            sched = r.sched
            used, cached, free, _, _ = r.kv.stats()
            k = (len(sched.waiting) + len(sched.running) + len(sched.holding), -(free + cached), r.index)
            if key is None or k < key:
                best, key = r, k
        assert best is not None
        return best

    def _to_decode(self, leg: Leg, seen_s: float, use_tokens: bool) -> None:
        """The request reaches its decode instance (``_decode_instance``, or the one that decided)."""
        rs, pre = leg.rs, leg.pre
        rs.first_sched_s = pre.first_sched_s  # (its queue time is the prefill side's)
        rs.cached_tokens = pre.cached_tokens
        leg.seen_s = seen_s
        if leg.seq is None:
            best = self._decode_instance()
            leg.decode, leg.seq = best.index, self._new_seq(best, rs, leg.keys, leg.pieces, None, use_tokens)
        leg.seq.remote = True
        self._add(self.replicas[leg.decode], leg.seq, seen_s)

    def _start(self, rep: Replica, s: Sequence, external: int, cached: int) -> None:
        """A decode instance allocated a request's blocks: the transfer of those it lacks starts."""
        leg = self.legs[s.rs]
        bs = self.cfg.block_size
        leg.load_start_s, leg.decode_cached = rep.clock, cached
        # the blocks allocated for what it lacks, group by group (a window's dropped positions hold none)
        first, end = cached // bs, -(-leg.prompt_len // bs)
        leg.group_blocks = rep.kv.group_blocks(s, first, end) if self.kv_layout.is_hybrid else [end - first]
        leg.blocks = sum(leg.group_blocks)
        leg.nbytes = sum(n * b for n, b in zip(leg.group_blocks, self.decode_group_bytes))
        tid = id(leg)
        self._loading[tid] = leg
        self.links.start(rep.clock, tid, leg.nbytes, leg.prefill, rep.index)
        self._hold(self._awaiting, leg.blocks, rep.clock)
        if self.events is not None:
            self.events.append((rep.clock, "load", s.rs.req.id, rep.index, external))

    def _landed(self, leg: Leg, t: float) -> None:
        """A transfer's bytes have landed: the decode side may run it, the prefill side frees its blocks."""
        leg.load_end_s = t
        drep, prep = self.replicas[leg.decode], self.replicas[leg.prefill]
        if not drep.sched.has_work():
            drep.clock = max(drep.clock, t)
        assert leg.seq is not None
        drep.sched.loaded(leg.seq)
        self._hold(self._held_blocks, -leg.held, t)
        self._hold(self._awaiting, -leg.blocks, t)
        prep.sched.release(leg.pre)
        if self.events is not None:
            self.events.append((t, "landed", leg.rs.req.id, leg.decode, 0))
            self.events.append((t, "free", leg.rs.req.id, leg.prefill, 0))

    @staticmethod
    def _hold(h: list, blocks: int, t: float) -> None:
        """Blocks held (``_held_blocks``: prefill-side, for reads; ``_awaiting``: decode-side, for KV on
        the wire) change by ``blocks`` at ``t``: their count, peak and integral."""
        h[2] += h[0] * max(0.0, t - h[3])
        h[3] = max(h[3], t)
        h[0] += blocks
        h[1] = max(h[1], h[0])

    def _done(self, rs: RequestState, rep: Replica, writer, st) -> None:
        """A request's decode leg finished: its rows (a transfer's, unless it was prefilled there)."""
        self.accounts.request(writer, rs, rep)
        st.completed += 1
        st.output_tokens += rs.output_tokens
        self._issuer.finished(rs.position, rep.clock)
        if self.local.pop(rs, None) is not None:
            self.local_prefills += 1
            return
        leg = self.legs.pop(rs)
        self.legs.pop(leg.pre, None)
        ms = 1e3
        assert writer.transfers is not None
        writer.transfers.add((
            rs.req.id, leg.prefill, leg.decode,
            (leg.pre.first_sched_s - rs.arrival_s) * ms, (leg.prefill_end_s - leg.pre.first_sched_s) * ms,
            (leg.seen_s - leg.prefill_end_s) * ms, (leg.load_start_s - leg.seen_s) * ms,
            (leg.load_end_s - leg.load_start_s) * ms, (rs.first_token_s - leg.load_end_s) * ms,
            (rs.first_token_s - rs.arrival_s) * ms, leg.blocks, leg.nbytes, leg.pre.cached_tokens, leg.decode_cached))

    # -- the summary --------------------------------------------------------------------------
    def _summary_extra(self, summary: dict, duration_s: float) -> dict:
        cfg = self.cfg
        npre = cfg.prefill_instances
        links = self.links
        h = self._held_blocks
        reps = self.replicas
        dec = reps[npre:]
        q = sum(r.sched.remote_query_tokens for r in dec)
        gpus = npre * cfg.tp + cfg.decode_instances * self.decode_cfg.tp
        sent = [links.busy_bytes[i] for i in range(npre)]
        recv = [links.busy_bytes[i] for i in range(npre, len(reps))]

        def util(moved: list[float], rate: float) -> float:
            return sum(moved) / (rate * duration_s * len(moved)) if duration_s > 0 else 0.0
        out: dict = {
            "prefill_instances": npre, "decode_instances": cfg.decode_instances, "gpus": gpus,
            "link": cfg.link, "link_gbps_per_instance": self.link_rates[0] * 8 / 1e9,
            "link_gbps_per_decode_instance": self.link_rates[1] * 8 / 1e9,
            "decode_num_blocks": self.decode_blocks,
            "link_latency_us": links.latency_s * 1e6,
            "transfer_bytes": links.bytes_total,
            "link_util_send": util(sent, self.link_rates[0]), "link_util_recv": util(recv, self.link_rates[1]),
            "link_util_recv_max": max(util([r], self.link_rates[1]) for r in recv),
            "prefill_held_blocks_peak": h[1],
            "prefill_held_blocks_mean": h[2] / duration_s if duration_s > 0 else 0.0,
            "decode_awaiting_blocks_peak": self._awaiting[1],
            "decode_awaiting_blocks_mean": self._awaiting[2] / duration_s if duration_s > 0 else 0.0,
            "decode_hit_rate": sum(r.sched.remote_hit_tokens for r in dec) / q if q else 0.0,
            "local_prefill_tokens": cfg.disagg_local_prefill, "local_prefills": self.local_prefills,
            "prefill_busy": float(np.mean([r.st.busy_s for r in reps[:npre]])) / duration_s if duration_s > 0 else 0.0,
            "decode_busy": float(np.mean([r.st.busy_s for r in dec])) / duration_s if duration_s > 0 else 0.0,
            "goodput_req_per_s_per_gpu": (summary["goodput_req_per_s"] / gpus
                                          if summary.get("goodput_req_per_s") is not None else None),
        }
        parts = pq.read_table(os.path.join(self.out_dir, "transfers.parquet")).to_pandas()
        for name in ("bytes", "prefill_wait_ms", "prefill_ms", "hop_ms", "admit_ms", "transfer_ms", "first_step_ms"):
            out.update(distribution(name, parts[name].to_numpy(dtype=np.float64)))
        return {"disagg": out}

