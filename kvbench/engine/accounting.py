"""What a replay records and sums up: one row per step and per request (steps.parquet,
requests.parquet) as they happen, the replicas' time integrals and peaks, and summary.json at the end
(spec §3 and §4: every metric's definition is here, and docs/metrics.md says it in words).

Nothing here grows with the trace: the latency distributions are read back from requests.parquet once
it is closed (the rows the run wrote, in the order it wrote them), and the inter-token gaps are counted
per distinct value -- exactly while there are fewer than ITL_EXACT of them, to the microsecond past
that (a sim's gaps are its step durations: a million-request run has millions)."""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pyarrow.parquet as pq

from kvbench.engine.config import ReplayConfig
from kvbench.engine.records import (
    RunWriter,
    column_numpy,
    distribution,
    goodput,
    itl_summary,
    parse_slo,
)
from kvbench.engine.replica import Replica, Totals
from kvbench.engine.routing import Router, jain, max_over_mean
from kvbench.memory.tiers import TIER_NAMES, op_bytes
from kvbench.scheduler import RequestState
from kvbench.scheduler.batch import StepBatch, StepResult
from kvbench.scheduler.scheduler import StepPlan

ITL_EXACT = 1 << 18  # distinct gaps counted exactly; past it, gaps are counted to the microsecond
LATENCY_COLUMNS = ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "itl_ms_max")
SLO_COLUMNS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "itl": "itl_ms_max"}  # --slo name -> column


class Accounts:
    """The records and sums of one replay over its replicas (a router's predictions included)."""

    def __init__(self, cfg: ReplayConfig, replicas: list[Replica], router: Router, *, num_blocks: int,
                 block_bytes: int, num_requests: int, truncated: int, slab_reserve_tokens: int,
                 kv_cache_groups: str = ""):
        self.cfg, self.replicas, self.router = cfg, replicas, router
        self.kv_cache_groups = kv_cache_groups  # the layout's description: 'sliding 128 x 18, full x 18 (...)'
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.num_requests, self.truncated, self.slab_reserve_tokens = num_requests, truncated, slab_reserve_tokens
        self.not_issued = 0  # requests --max-requests / --max-seconds kept from being issued
        self.prompt_tokens_done = 0
        self.itl_binned: dict[int, int] = {}  # gap (whole microseconds) -> count, once the exact counts grew too many
        self.predicted: dict[RequestState, int] = {}  # the blocks a router expected each request to hit
        self.routing = [0, 0, 0]  # router: blocks predicted to hit, blocks hit, |difference| summed

    def step(self, writer: RunWriter, rep: Replica, start_s: float, result: StepResult, batch: StepBatch,
             plan: StepPlan) -> None:
        """One step: its row of steps.parquet, and the replica's time integrals and peaks."""
        sched, st = rep.sched, rep.st
        dur_s = result.duration_s
        used, cached, free, slots, live = rep.kv.stats()
        running = plan.running  # the sequences the step held, those that finished in it included
        frag = 1.0 - live / slots if slots else 0.0
        util = live / rep.kv.capacity_tokens
        loaded = stored = 0
        if batch.tier_pre or batch.tier_post:
            moved = op_bytes(batch.tier_pre, self.block_bytes)
            for name, (ld, sd) in op_bytes(batch.tier_post, self.block_bytes).items():
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
        if (rep.steps & 4095) == 0 and len(sched.itl_gaps) > ITL_EXACT:
            self._bin_gaps(sched.itl_gaps)

    def _bin_gaps(self, gaps: dict[float, int]) -> None:
        """Move a scheduler's exact gap counts into the microsecond bins."""
        binned = self.itl_binned
        for g, n in gaps.items():
            us = round(g * 1e6)
            binned[us] = binned.get(us, 0) + n
        gaps.clear()

    def request(self, writer: RunWriter, rs: RequestState, rep: Replica | None) -> None:
        """A finished or rejected request: its row of requests.parquet, and the latencies summed later."""
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
            assert rep is not None  # a completed request ran on a replica
            self.prompt_tokens_done += r.prompt_len
            rep.st.completed += 1
            rep.st.output_tokens += rs.output_tokens
            expected = self.predicted.pop(rs, None)
            if expected is not None:
                hit = rs.cached_tokens // self.cfg.block_size
                self.routing[0] += expected
                self.routing[1] += hit
                self.routing[2] += abs(expected - hit)

    def summary(self, st: Totals, ideal, duration_s: float, steps: int, complete: bool, wall_s: float,
                requests_parquet: str) -> dict:
        """summary.json (spec §3, §4) from the cluster's totals ``st``, every replica's, and the
        completed requests' rows of ``requests_parquet`` (closed)."""
        reps = self.replicas
        lat, replica_of, out_tokens, rejected = self._rows(requests_parquet)
        written = None
        if not complete:  # cut short: every count is that of the rows written, not of the counters
            written = self._written(requests_parquet, replica_of, out_tokens, len(reps))
            steps = int(written["steps"].sum())
            st = dataclasses.replace(st, completed=len(out_tokens), rejected=rejected, output_tokens=int(out_tokens.sum()))
        tot = Totals(peak=0)  # the replicas' step figures: time integrals summed, peaks the largest
        for r in reps:
            for name in ("busy_s", "slots_t", "live_t", "running_t", "util_t", "pcie_s"):
                setattr(tot, name, getattr(tot, name) + getattr(r.st, name))
            tot.peak, tot.peak_slots = max(tot.peak, r.st.peak), max(tot.peak_slots, r.st.peak_slots)
            tot.peak_live = max(tot.peak_live, r.st.peak_live)
        s: dict = {"complete": complete, "requests": self.num_requests, "completed": st.completed,
             "rejected": st.rejected, "truncated": self.truncated, "not_issued": self.not_issued,
             "duration_s": duration_s,
             "output_tok_per_s": st.output_tokens / duration_s if duration_s > 0 else 0.0,
             "total_tok_per_s": (st.output_tokens + self.prompt_tokens_done) / duration_s if duration_s > 0 else 0.0,
             "req_per_s": st.completed / duration_s if duration_s > 0 else 0.0}
        for name in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
            s.update(distribution(name, lat[name]))
        s.update(itl_summary([r.sched.itl_gaps for r in reps]
                             + ([{us / 1e6: n for us, n in self.itl_binned.items()}] if self.itl_binned else [])))
        s.update(goodput({slo: lat[c] for slo, c in SLO_COLUMNS.items()}, parse_slo(self.cfg.slo), duration_s))

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
            **merge_evictors([r.evictor for r in reps]), "pcie_s": tot.pcie_s,
            "peak_slots_allocated": tot.peak_slots, "peak_tokens_live": tot.peak_live,
            "output_tokens": st.output_tokens, "steps": steps,
            "num_blocks": self.num_blocks, "block_size": self.cfg.block_size,
            "kv_capacity_tokens": self.replicas[0].kv.capacity_tokens,
            "kv_bytes_per_token": self.replicas[0].executor.kv_bytes_per_token(),
            "kv_bytes_per_block": self.block_bytes, "kv_cache_groups": self.kv_cache_groups,
            "cache_evictions": total(lambda r: r.kv.cache_evictions),
            "cow_copies": total(lambda r: r.kv.cow_copies),
            "slab_reserve_tokens": self.slab_reserve_tokens if self.cfg.layout == "slab" else None,
            "partial_hit_tokens": total(lambda r: r.kv.partial_hit_tokens),
            **self._tiers(q),
            "wall_s": wall_s,
        })
        if len(reps) > 1:
            s.update(self._cluster(duration_s, lat, replica_of, written))
        return s

    @staticmethod
    def _rows(requests_parquet: str) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, int]:
        """({LATENCY_COLUMNS name: float64 ms}, int64 replica, int64 output tokens) of the completed
        requests, in the order they were written, and the number of rejected rows. Read one column at
        a time: a million-request run holds one column's copies at once, not the table's."""
        f = pq.ParquetFile(requests_parquet)
        done = column_numpy(f.read(columns=["rejected"]).column(0).is_null())

        def column(name: str, dtype) -> np.ndarray:
            return np.asarray(column_numpy(f.read(columns=[name]).column(0))[done], dtype=dtype)
        lat = {c: column(c, np.float64) for c in LATENCY_COLUMNS}
        return lat, column("replica", np.int64), column("output_tokens", np.int64), int(len(done) - done.sum())

    @staticmethod
    def _written(requests_parquet: str, replica_of: np.ndarray, out_tokens: np.ndarray, replicas: int) -> dict:
        """A cut-short run's per-replica counts from the rows it wrote: the completed requests' output
        tokens, and the steps (steps.parquet beside ``requests_parquet``)."""
        steps = pq.read_table(os.path.join(os.path.dirname(requests_parquet), "steps.parquet"), columns=["replica"])
        return {"output_tokens": np.bincount(replica_of, weights=out_tokens, minlength=replicas).astype(np.int64),
                "steps": np.bincount(column_numpy(steps.column("replica")).astype(np.int64), minlength=replicas)}

    def _tiers(self, query_tokens: int) -> dict:
        """Per-tier hits and traffic (spec §3): hit_rate_gpu + hit_rate_cpu + hit_rate_disk =
        prefix_hit_rate; a tier the run does not have is null."""
        reps = self.replicas
        present = self.cfg.tier_sizes()
        hits = {name: sum(r.sched.tier_hit_tokens.get(name, 0) for r in reps) for name in TIER_NAMES}
        tier_bytes = {name: [sum(r.st.tier_bytes.get(name, [0, 0])[k] for r in reps) for k in (0, 1)]
                      for name in TIER_NAMES}
        q = query_tokens
        gpu = sum(r.sched.hit_tokens for r in reps) - sum(hits.values())
        out: dict[str, float | None] = {"hit_rate_gpu": gpu / q if q else 0.0}
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
            # (the shared store is one Tier in every instance's chain: counted once)
            out[f"{name}_evictions"] = (sum({id(t): t.evicted_blocks for r in reps if r.kv.tiers is not None
                                             for t in r.kv.tiers.tiers if t.name == name}.values()) if on else None)
        out["tier_declined_tokens"] = (sum(r.kv.tiers.declined_tokens for r in reps if r.kv.tiers is not None)
                                       if present else None)
        out["resumed_loaded_tokens"] = sum(r.sched.resumed_loaded_tokens for r in reps) if present else None
        return out

    def _cluster(self, duration_s: float, lat_all: dict[str, np.ndarray], replica_of: np.ndarray,
                 written: dict | None = None) -> dict:
        """Balance and the router's prediction (spec §3), and each replica's own figures (``written``:
        a cut-short run's counts from its rows, ``_written``)."""
        reps = self.replicas
        per = []
        for r in reps:
            mine = replica_of == r.index
            q = r.sched.query_tokens
            completed, steps, out = (r.st.completed, r.steps, r.st.output_tokens) if written is None else (
                int(mine.sum()), int(written["steps"][r.index]), int(written["output_tokens"][r.index]))
            row = {"replica": r.index, "requests": r.routed, "completed": completed,
                   "prefix_hit_rate": r.sched.hit_tokens / q if q else 0.0,
                   "busy_s": r.st.busy_s, "steps": steps,
                   "mean_running": r.st.running_t / r.st.busy_s if r.st.busy_s else 0.0,
                   "peak_running": r.st.peak, "preemptions": r.sched.preemptions,
                   "output_tok_per_s": out / duration_s if duration_s > 0 else 0.0}
            for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
                d = distribution(name, lat_all[name][mine])
                row.update({f"{name}_p50": d[f"{name}_p50"], f"{name}_p99": d[f"{name}_p99"]})
            per.append(row)
        routed = [r.routed for r in reps]
        busy = [r.st.busy_s for r in reps]
        predicted, hit, wrong = self.routing
        return {"replicas": len(reps), "router": self.cfg.router,
                "balance_requests_max_over_mean": max_over_mean(routed),
                "balance_busy_max_over_mean": max_over_mean(busy),
                "jain_requests": jain(routed), "jain_busy": jain(busy),
                "router_predicted_blocks": predicted if self.router.index is not None else None,
                "router_hit_blocks": hit if self.router.index is not None else None,
                "router_mispredicted_blocks": wrong if self.router.index is not None else None,
                "per_replica": per}


def merge_evictors(evictors: list) -> dict:
    """The replicas' token-eviction figures as one: counts summed, peaks the largest, the attention
    mass kept averaged over every measurement of every replica."""
    summaries = [e.summary() for e in evictors]
    if len(summaries) == 1:
        return summaries[0]
    out: dict[str, float | None] = {}
    for key in summaries[0]:
        vals = [s[key] for s in summaries if s.get(key) is not None]
        if not vals:
            out[key] = None
        elif key == "attention_mass_kept":
            n = sum(e.mass_n for e in evictors)
            out[key] = sum(e.mass_sum for e in evictors) / n if n else None
        elif key.startswith("peak_") or "_max_" in key:
            out[key] = max(vals)
        else:
            out[key] = sum(vals)
    return out
