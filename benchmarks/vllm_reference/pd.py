#!/usr/bin/env python3
"""Prefill/decode disaggregation (P:D = 1:1) on vLLM 0.34's own Schedulers, without a model.

    cd /tmp && VLLM_VENV/bin/python /work/main/benchmarks/vllm_reference/pd.py TRACE --limit N \
        --p-num-blocks B --d-num-blocks B --block-size 16 --out DIR/pd.steps.jsonl

Two real vLLM 0.34 `Scheduler`s, each built by drive.py's `build_scheduler` (same tiny weight-less
model, one full-attention group unless --layers, sha256 block hashing, async scheduling off) and then
rebuilt with a `KVTransferConfig` whose connector is `PDConnector`, defined here and loaded by vLLM itself through
`kv_connector_module_path="pd"` (KVConnectorFactory.get_connector_class). The prefill instance is
`kv_producer`, the decode instance `kv_consumer`. PDConnector's scheduler half answers as vLLM 0.34's
NIXL pull connector does (nixl/pull_scheduler.py, nixl/base_scheduler.py; backoff 0 as for an
attention-only model): `get_num_new_matched_tokens` = (prompt_len - block-aligned local hit, async)
for do_remote_prefill; `update_state_after_alloc` records the unhashed (not locally cached) block ids
it is given and clears do_remote_prefill; `request_finished(_all_groups)` on the producer returns
delay_free=True with remote_block_ids; `build_connector_meta` hands the recorded loads to the
"worker" (this harness) in the step's SchedulerOutput. Nothing in vLLM is patched.

The model is faked as in drive.py (sampled tokens = kvbench's TokenStreams), plus the KV link:
  * each instance has its own linear clock (0.1 ms per prefill token + 20 ms if the step decodes);
    requests arrive at the prefill instance at their trace times with max_tokens=1 and
    kv_transfer_params {do_remote_decode: True}; a prefill step ending at t hands each request it
    finished to the decode instance at t with the kv_transfer_params vLLM returned
    (do_remote_prefill, remote_block_ids, ...), max_tokens = the trace's output length;
  * a decode load starts at the start of the decode step whose schedule() allocated it
    (--load-start end: at its end, as vLLM's worker submits it in post_forward) and lasts
    latency + bytes / bandwidth, bytes = block ids the connector received x --bytes-per-block;
    transfers on the one link share its bandwidth equally (processor sharing, after the latency);
  * a load that ended by a decode step's end is in that step's KVConnectorOutput.finished_recving;
    when the decode instance schedules nothing (only loads in flight) its clock jumps to the next
    load end or handoff: an empty step (schedule() with 0 tokens, update_from_output with the
    connector output), as vLLM's engine keeps stepping while requests wait for KV;
  * the prefill side's finished_sending for a request is in the output of the first prefill step
    ending at or after its load's end (an idle prefill instance takes an empty step at that time);
    vLLM then frees the held blocks (_update_from_kv_xfer_finished -> _free_blocks).
The two instances are advanced conservatively in time order (a decode step at t only after every
handoff at <= t is known; a prefill step's output at e only once no load can start before e).

Hybrid attention models (--layers MODEL, as drive.py takes it: a hybrid.py preset such as gpt-oss-120b,
or a JSON layer list; Mamba layers refused): both Schedulers get vLLM's own KV cache groups (hybrid KV
cache manager on, HybridKVCacheCoordinator, checked against the layer list as drive.py does), and
PDConnector clips as NIXL's get_exchange_clipped_blocks does with the hybrid manager: every transfer
group's unhashed block ids, a sliding-window group's only its last cdiv(window, block) + 1 (on the
prefill side, in remote_block_ids, after remove_skipped_blocks; on the decode side the unhashed ids are
already the window's). Every clip is checked against vLLM's own NixlPullConnectorScheduler built on the
same config. A load moves sum over groups of (ids received in the group) x (the group's block bytes:
its layers' pages, from vLLM's specs); the requests file has them per group ("load_blocks_per_group"),
with the blocks each side holds ("d_held_blocks_per_group" while the load is in flight,
"p_held_blocks_per_group" while delay-freed) and the ids the prefill side offered
("p_remote_blocks_per_group", null ids included). The rules: /work/notes/vllm-pd-hybrid.md.

Output: OUT (decode steps JSONL), OUT-stem.prefill.jsonl (prefill steps), OUT-stem.requests.jsonl,
OUT-stem.summary.json (also printed). Run from outside the checkout (see drive.py / README).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import drive  # noqa: E402  (sets the offline env vars; its build_scheduler is reused)

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

INF = float("inf")


# ---------------------------------------------------------------------------------------------
# The connector (scheduler side as NIXL's pull scheduler; the worker side is this harness)
# ---------------------------------------------------------------------------------------------
class PDConnectorMetadata(KVConnectorMetadata):
    def __init__(self):
        # req_id -> (local block ids per group, num_external_tokens, local computed blocks per group,
        #            awaiting_kvs)
        self.reqs_to_recv: dict[str, tuple] = {}
        self.reqs_to_send: dict[str, float] = {}
        self.reqs_in_batch: set[str] = set()
        self.reqs_not_processed: set[str] = set()


class PDConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler-side answers of vLLM 0.34's NixlPullConnectorScheduler (attention-only model)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        from vllm.utils.math_utils import cdiv
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.engine_id = ktc.engine_id
        self.kv_lease_duration = ktc.get_from_extra_config("kv_lease_duration", 30)
        self.block_size = vllm_config.cache_config.block_size
        self._reqs_need_recv: dict[str, tuple] = {}
        self._reqs_need_send: dict[str, float] = {}
        self._reqs_in_batch: set[str] = set()
        self._reqs_not_processed: set[str] = set()
        cfg = self._kv_cache_config
        transfer = cfg.transfer_groups
        # NIXL (nixl/base_scheduler.py NixlBaseConnectorScheduler.__init__): sliding-window groups are
        # clipped only when the hybrid manager is on and some transfer group is not full attention;
        # each keeps its last cdiv(window, group block size) + 1 blocks.
        self._is_hma_required = (not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
                                 and any(not isinstance(g.kv_cache_spec, FullAttentionSpec) for g in transfer))
        self.blocks_per_sw = [cdiv(g.kv_cache_spec.sliding_window, g.kv_cache_spec.block_size) + 1
                              if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 0 for g in transfer]
        if cfg.has_mamba_layers or any(isinstance(g.kv_cache_spec, MambaSpec) for g in cfg.kv_cache_groups):
            raise NotImplementedError("pd.py: Mamba / linear-attention groups are not driven (NIXL's backoff 1, "
                                      "state-slot clipping)")
        # NIXL _prefill_backoff(): 1 with Mamba or DSV4.1 SWA bounded replay, else num_prefill_lookahead - 1.
        bounded_replay = any(g.kv_cache_spec.prefix_replay_tokens > 0 for g in cfg.kv_cache_groups)
        self.prefill_backoff = max(1 if bounded_replay else 0, vllm_config.num_prefill_lookahead_tokens - 1)
        if self.prefill_backoff:
            raise NotImplementedError(f"pd.py: NIXL's prefill backoff is {self.prefill_backoff}; only 0 is driven")
        # vLLM's own NIXL scheduler half, built on the same config: every clip below is checked against its
        # get_exchange_clipped_blocks (it needs no NIXL agent; its handshake listener starts only when
        # handshake metadata is set, which never happens here).
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
        self._nixl = NixlPullConnectorScheduler(vllm_config, self.engine_id, cfg)
        assert self._nixl.blocks_per_sw == self.blocks_per_sw, (self._nixl.blocks_per_sw, self.blocks_per_sw)
        assert self._nixl._is_hma_required == self._is_hma_required
        assert self._nixl._prefill_backoff() == self.prefill_backoff == 0
        self.clip_checks = 0

    # NIXL: NixlBaseConnector.supports_divergent_local_hybrid_hits -> True
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return True

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        # NIXL (nixl/connector.py): a transfer of the request's own blocks restores every group.
        return self._kv_cache_config.transfer_group_ids

    def _clip(self, block_ids):
        # NIXL NixlBaseConnectorScheduler.get_exchange_clipped_blocks: the transfer groups' lists; with the
        # hybrid manager, each sliding-window group keeps only its last blocks_per_sw ids (on the prefill
        # side these may include null block ids, 0: its list starts with the nulls of the blocks that left
        # the window). Full-attention groups keep every id.
        if len(block_ids) == 0:
            return block_ids
        out = [list(g) for g in self._kv_cache_config.select_transfer_block_ids(block_ids)]
        if self._is_hma_required:
            out = [g[-n:] if n else g for g, n in zip(out, self.blocks_per_sw, strict=True)]
        theirs = self._nixl.get_exchange_clipped_blocks(block_ids)
        assert [list(g) for g in theirs] == out, (out, theirs)
        self.clip_checks += 1
        return tuple(out)

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            # NIXL: _get_remote_prefill_token_count(len(prompt)) with _prefill_backoff() == 0 (no Mamba,
            # no bounded replay, no multi-module MTP): sliding-window groups back nothing off either
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        # (NIXL's do_remote_decode + remote_block_ids branch is bidirectional transfer only.)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._reqs_in_batch.add(request.request_id)
        elif params.get("do_remote_prefill"):
            if params.get("remote_block_ids"):
                unhashed = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else ()
                local_block_ids = self._clip(unhashed)
                local_num_computed_blocks = tuple(
                    len([b for b in group if b.block_hash is not None and not b.is_null])
                    for group in blocks.blocks)
                self._reqs_need_recv[request.request_id] = (
                    local_block_ids, num_external_tokens, local_num_computed_blocks,
                    num_external_tokens > 0)
            else:
                assert num_external_tokens == 0
            params["do_remote_prefill"] = False
            params["_remote_blocks_processed"] = True

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = PDConnectorMetadata()
        meta.reqs_to_recv = dict(self._reqs_need_recv)
        meta.reqs_to_send = self._reqs_need_send
        meta.reqs_in_batch = self._reqs_in_batch
        meta.reqs_not_processed = self._reqs_not_processed
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        self._reqs_in_batch = set()
        self._reqs_not_processed = set()
        return meta

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        is_p_node = bool(params.get("do_remote_decode"))
        if params.get("do_remote_prefill"):
            # aborted before scheduled: NIXL queues an empty recv to free P's blocks
            self._reqs_need_recv[request.request_id] = ((), 0, (), False)
            params["do_remote_prefill"] = False
            return False, None
        if not is_p_node:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self._reqs_not_processed.add(request.request_id)
            return False, None
        delay_free_blocks = any(len(g) > 0 for g in block_ids)
        remote_num_tokens = 0
        if delay_free_blocks:
            self._reqs_need_send[request.request_id] = time.perf_counter() + self.kv_lease_duration
            block_ids = self._clip(block_ids)
            remote_num_tokens = request.num_computed_tokens
        return delay_free_blocks, dict(
            do_remote_prefill=True, do_remote_decode=False,
            remote_block_ids=[list(g) for g in block_ids], remote_engine_id=self.engine_id,
            remote_request_id=request.request_id, remote_host="sim", remote_port=0,
            tp_size=1, remote_num_tokens=remote_num_tokens)

    # -- worker side: never called (no model, no worker) ------------------------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:
        raise NotImplementedError("pd.py has no worker")

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self):
        pass


# ---------------------------------------------------------------------------------------------
# The link: processor sharing after a fixed latency
# ---------------------------------------------------------------------------------------------
class Link:
    def __init__(self, bandwidth_bytes_per_s: float, latency_ns: float):
        self.bw = bandwidth_bytes_per_s / 1e9  # bytes per ns
        self.lat = float(latency_ns)
        self.now = 0.0
        self.lat_q: list[tuple[float, str, float]] = []  # (ready time, id, bytes)
        self.active: dict[str, float] = {}  # id -> remaining bytes
        self.done: dict[str, float] = {}  # id -> end time (float ns)
        self.max_active = 0
        self._proj: dict[str, int] | None = None

    def add(self, rid: str, t_ns: float, nbytes: float) -> None:
        self.advance(t_ns)
        self.lat_q.append((t_ns + self.lat, rid, float(nbytes)))
        self._proj = None

    def advance(self, T: float) -> None:
        while True:
            n = len(self.active)
            t_ready = min((r for r, _, _ in self.lat_q), default=INF)
            t_done = self.now + min(self.active.values()) * n / self.bw if n else INF
            t_ev = min(t_ready, t_done)
            if t_ev == INF or t_ev > T:
                if n and T != INF and T > self.now:
                    d = (T - self.now) * self.bw / n
                    for k in self.active:
                        self.active[k] -= d
                if T != INF:
                    self.now = max(self.now, T)
                return
            if n and t_done <= t_ready:
                # completion: the smallest remaining transfer(s) end now (exactly, no float residue)
                rmin = min(self.active.values())
                for k in list(self.active):
                    self.active[k] -= rmin
                    if self.active[k] <= 1e-3:  # bytes
                        del self.active[k]
                        self.done[k] = t_ev
            elif n and t_ev > self.now:
                d = (t_ev - self.now) * self.bw / n
                for k in self.active:
                    self.active[k] -= d
            self.now = max(self.now, t_ev)
            keep = []
            for r, k, b in self.lat_q:
                if r <= self.now:
                    if b <= 0:
                        self.done[k] = r
                    else:
                        self.active[k] = b
                else:
                    keep.append((r, k, b))
            self.lat_q = keep
            self.max_active = max(self.max_active, len(self.active))

    def ends(self) -> dict[str, int]:
        """End time (int ns) of every transfer added so far, assuming no more are added."""
        if self._proj is None:
            c = copy.deepcopy(self)
            c._proj = None
            c.advance(INF)
            self._proj = {k: math.ceil(v - 1e-6) for k, v in c.done.items()}
        return self._proj


# ---------------------------------------------------------------------------------------------
def build_pd_scheduler(args, role: str, num_blocks: int, max_num_seqs: int, max_batched: int,
                       inflight_cap: int | None):
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    ns = argparse.Namespace(
        block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched, max_model_len=args.max_model_len, watermark=args.watermark,
        no_reserve_full_isl=args.no_reserve_full_isl, no_prefix_caching=False,
        cache_aware_admission_window=0, cache_aware_admission_threshold=0.5, layers=args.layers,
        kv_cache_dtype=None, hash=args.hash)
    if args.layers:
        import hybrid
        _, layers, _ = hybrid.load_layers(args.layers)
        if hybrid.has_mamba(layers):
            sys.exit(f"{args.layers}: Mamba / linear-attention layers are not driven by pd.py (NIXL backs off "
                     "one prompt token and moves only the state slot there)")
    # drive.py's config, KV cache config and hasher; with --layers vLLM's own grouping (hybrid.py), the hybrid
    # KV cache manager on and the groups checked against the layer list
    plain, hasher, vcfg = drive.build_scheduler(ns)
    vcfg.kv_transfer_config = KVTransferConfig(
        kv_connector="PDConnector", kv_connector_module_path="pd", kv_role=role,
        engine_id="prefill" if role == "kv_producer" else "decode",
        kv_connector_extra_config={"kv_lease_duration": 30})
    if inflight_cap is not None:
        vcfg.scheduler_config.max_num_inflight_kv_loads = inflight_cap
    sched = Scheduler(vllm_config=vcfg, kv_cache_config=plain.kv_cache_config,
                      structured_output_manager=StructuredOutputManager(vcfg),
                      block_size=plain.block_size, hash_block_size=plain.hash_block_size,
                      include_finished_set=False, log_stats=True)
    assert type(sched.connector).__name__ == "PDConnector", type(sched.connector)
    assert sched.connector.role == KVConnectorRole.SCHEDULER
    if args.layers:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        cfg = sched.kv_cache_config
        # The same scheduler, now with the connector: the hybrid manager still on (NIXL subclasses SupportsHMA,
        # so VllmConfig would not turn it off for the connector: KVConnectorFactory.supports_hma_config), the
        # same groups, managers and coordinator, and the same block sizes with the connector configured.
        assert vcfg.scheduler_config.disable_hybrid_kv_cache_manager is False
        nixl_cfg = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id="nixl")
        assert KVConnectorFactory.supports_hma_config(nixl_cfg) and KVConnectorFactory.supports_hma_config(
            vcfg.kv_transfer_config)
        assert resolve_kv_cache_block_sizes(cfg, vcfg) == (sched.block_size, sched.hash_block_size)
        coord = sched.kv_cache_manager.coordinator
        assert type(coord).__name__ == type(plain.kv_cache_manager.coordinator).__name__ == ns.coordinator
        got = [type(m).__name__ for m in coord.single_type_managers]
        assert got == [d["manager"] for d in ns.kv_cache_groups], (got, ns.kv_cache_groups)
        assert cfg.transfer_group_ids == tuple(range(len(cfg.kv_cache_groups))), cfg.transfer_group_ids
    return sched, hasher, vcfg, ns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--p-num-blocks", type=int, default=48000, help="prefill instance's vLLM num_gpu_blocks")
    ap.add_argument("--d-num-blocks", type=int, default=48000, help="decode instance's vLLM num_gpu_blocks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="both instances (see --p-/--d-)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="both instances")
    ap.add_argument("--p-max-num-seqs", type=int, default=None)
    ap.add_argument("--d-max-num-seqs", type=int, default=None)
    ap.add_argument("--p-max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--d-max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-inflight-kv-loads", type=int, default=None,
                    help="decode SchedulerConfig.max_num_inflight_kv_loads (default None, as vLLM)")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--watermark", type=float, default=0.0)
    ap.add_argument("--no-reserve-full-isl", action="store_true")
    ap.add_argument("--hash", default="sha256")
    ap.add_argument("--link-bandwidth", type=float, default=25e9, help="bytes/s (default 25e9 = 200 Gb/s)")
    ap.add_argument("--link-latency-ms", type=float, default=1.0)
    ap.add_argument("--bytes-per-block", type=int, default=None,
                    help="KV bytes of one block (default: Llama-3-8B bf16, block 16: 2097152); with --layers "
                         "each group's own (its layers' page bytes, from vLLM's specs), not settable")
    ap.add_argument("--layers", default=None,
                    help="hybrid attention model as drive.py takes it: a preset of hybrid.py (gpt-oss-120b, "
                         "gemma-3-27b, llama-4-scout, deepseek-v3) or a JSON layer list; vLLM groups the layers "
                         "itself (hybrid KV cache manager on) on both instances. Mamba layers are refused")
    ap.add_argument("--load-start", choices=["start", "end"], default="start",
                    help="a load starts at the start (default) or end of the decode step that allocated it")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    ap.add_argument("--decode-step-ms", type=float, default=20.0)
    ap.add_argument("--out", default="pd.steps.jsonl", help="decode steps JSONL")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many decode+prefill steps")
    args = ap.parse_args(argv)

    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request as VReq
    from vllm.v1.request import RequestStatus

    from kvbench.trace.format import load_trace
    from kvbench.trace.tokens import TokenStreams

    trace = load_trace(args.trace, limit=args.limit)
    order = sorted(range(len(trace)), key=lambda i: trace[i].t)
    reqs = [trace[i] for i in order]
    by_id = {r.id: r for r in reqs}
    assert len(by_id) == len(reqs), "duplicate ids"
    for r in reqs:
        if r.n != 1:
            sys.exit(f"request {r.id}: n={r.n}; only n=1")
    streams = TokenStreams()

    if args.layers and args.bytes_per_block is not None:
        sys.exit("--bytes-per-block: with --layers a block's bytes are its group's (vLLM's page bytes)")
    P, hasher, pcfg, p_ns = build_pd_scheduler(
        args, "kv_producer", args.p_num_blocks, args.p_max_num_seqs or args.max_num_seqs,
        args.p_max_num_batched_tokens or args.max_num_batched_tokens, None)
    D, hasher_d, dcfg, d_ns = build_pd_scheduler(
        args, "kv_consumer", args.d_num_blocks, args.d_max_num_seqs or args.max_num_seqs,
        args.d_max_num_batched_tokens or args.max_num_batched_tokens, args.max_num_inflight_kv_loads)

    if args.layers:
        groups = d_ns.kv_cache_groups
        assert [(g["kind"], g["window"], g["layers"], g["group_page_bytes"]) for g in groups] == [
            (g["kind"], g["window"], g["layers"], g["group_page_bytes"]) for g in p_ns.kv_cache_groups]
        # bytes of one block of a group: its layers' pages (a block id of a group spans all its layers)
        group_bytes = [g["group_page_bytes"] for g in groups]
        args.bytes_per_block = group_bytes[0] if len(set(group_bytes)) == 1 else None
    else:
        args.bytes_per_block = args.bytes_per_block or 2097152
        group_bytes = [args.bytes_per_block]
    transfer_ids = D.kv_cache_config.transfer_group_ids
    assert transfer_ids == P.kv_cache_config.transfer_group_ids

    def real_blocks(S, rid):
        """Blocks (not the null block) the request holds in S's pool, per KV cache group."""
        return [sum(1 for b in g if not b.is_null) for g in S.kv_cache_manager.coordinator.get_blocks(rid)]

    prefill_ns = round(args.prefill_ms_per_token * 1e6)
    decode_ns = round(args.decode_step_ms * 1e6)
    arrive = [round(r.t * 1e9) for r in reqs]
    link = Link(args.link_bandwidth, args.link_latency_ms * 1e6)
    prompts: dict[str, list[int]] = {}

    def sec(ns):
        return round(ns / 1e9, 9)

    per: dict[str, dict] = {}
    stem = os.path.splitext(args.out)[0]
    fd = open(args.out, "w")
    fp = open(stem + ".prefill.jsonl", "w")

    # ---- state -----------------------------------------------------------------------------
    nxt = 0                      # next trace request to arrive at P
    p_clock = 0                  # P: next schedule time when active
    p_idle = True                # idle until the first arrival
    p_pending = None             # (out, start, end, rec, sampled)
    p_step = 0
    handoffs: list[tuple[int, str, dict]] = []  # (t, id, kv_transfer_params), in time order
    h_i = 0
    d_clock = 0
    d_idle = True
    d_step = 0
    sends_open: set[str] = set()     # handed off, finished_sending not yet reported to P
    recvs_open: set[str] = set()     # loads started on D, finished_recving not yet reported
    load_req: dict[str, str] = {}    # link transfer id -> request id
    stalled = None
    t0 = time.time()
    n_d_empty = n_p_empty = 0
    total_preempt_d = total_preempt_p = 0
    peak_inflight = 0

    def p_has_work():
        return bool(P.requests) or nxt < len(reqs)

    def send_end(rid):
        return link.ends().get(rid)

    def p_next_time():
        """P's next schedule time (when not pending), INF if it must wait for D."""
        if p_pending is not None:
            return None
        if not p_has_work():
            return INF
        if not p_idle:
            return p_clock
        c = [arrive[nxt]] if nxt < len(reqs) else []
        ends = link.ends()
        c += [ends[r] for r in sends_open if r in ends]
        return max(p_clock, min(c)) if c else INF

    def d_next_time():
        if not d_idle:
            return d_clock
        c = []
        if h_i < len(handoffs):
            c.append(handoffs[h_i][0])
        ends = link.ends()
        c += [ends[t] for t in recvs_open if t in ends]
        return max(d_clock, min(c)) if c else INF

    def p_handoff_bound():
        """Earliest time P may still hand off something not in `handoffs`."""
        if p_pending is not None:
            return p_pending[2]
        t = p_next_time()
        return INF if t == INF else t + 1

    def run_step(S, side, clock, kv_out_fn, record_fn):
        """schedule() at clock, fake the model, update_from_output at clock + dur."""
        running_before = {r.request_id: i for i, r in enumerate(S.running)}
        out = S.schedule()
        nst = out.num_scheduled_tokens
        entries, starts, sampled = [], [], []
        prefill_tokens = n_decode = 0
        for rid, n in nst.items():
            vr = S.requests[rid]
            before = vr.num_computed_tokens - n
            if n == 1 and before == vr.num_tokens - 1 and vr.num_output_tokens > 0:
                n_decode += 1
            else:
                prefill_tokens += n
            entries.append([rid, n])
            starts.append(before)
            if vr.num_computed_tokens >= vr.num_tokens:
                k = len(vr.output_token_ids)
                sampled.append([int(streams.output_tokens(by_id[rid], 1, k, 0)[0])])
            else:
                sampled.append([])
        dur = prefill_tokens * prefill_ns + (decode_ns if n_decode else 0)
        preempted = sorted(out.preempted_req_ids, key=lambda rid: -running_before.get(rid, -1))
        return out, dur, entries, starts, sampled, preempted, prefill_tokens, n_decode

    def finish_step(S, out, entries, sampled, kv_out):
        mro = ModelRunnerOutput(req_ids=[e[0] for e in entries], sampled_token_ids=sampled,
                                kv_connector_output=kv_out)
        return S.update_from_output(out, mro)

    steps_total = 0
    while True:
        if args.max_steps is not None and steps_total >= args.max_steps:
            stalled = {"reason": "max_steps"}
            break
        done_all = (not p_has_work() and p_pending is None and h_i >= len(handoffs)
                    and not D.requests)
        if done_all:
            break
        dn = d_next_time()
        # ---------------- P acts? ----------------
        p_act = None
        if p_pending is not None:
            if dn >= p_pending[2]:
                p_act = "finalize"
        else:
            pt = p_next_time()
            if pt != INF and dn >= pt:
                p_act = "schedule"
        if p_act == "schedule":
            p_clock = pt
            p_idle = False
            while nxt < len(reqs) and arrive[nxt] <= p_clock:
                r = reqs[nxt]
                nxt += 1
                prompt = [int(x) for x in streams.expand(r)]
                prompts[r.id] = prompt
                params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                          "remote_block_ids": None, "remote_host": None, "remote_port": None}
                vr = VReq(request_id=r.id, prompt_token_ids=list(prompt),
                          sampling_params=SamplingParams(max_tokens=1, ignore_eos=True, n=1,
                                                         extra_args={"kv_transfer_params": params}),
                          pooling_params=None, arrival_time=r.t, block_hasher=hasher)
                P.add_request(vr)
                per[r.id] = {"id": r.id, "t": r.t, "prompt": len(prompt), "output_len": r.output_len,
                             "p_admit_step": None, "p_cached": None, "prefill_finish": None,
                             "p_blocks_held": None, "p_remote_blocks_per_group": None,
                             "p_held_blocks_per_group": None, "p_freed_step": None, "p_freed_clock": None,
                             "load_blocks": None, "load_bytes": None, "load_blocks_per_group": None,
                             "d_held_blocks_per_group": None, "load_start": None,
                             "load_end": None, "load_reported": None, "load_reported_step": None,
                             "d_local_hit": None, "d_enter_step": None, "d_first_compute_step": None,
                             "first_token": None, "finish": None, "d_preemptions": 0, "p_preemptions": 0}
            out, dur, entries, starts, sampled, preempted, ptok, ndec = run_step(P, "p", p_clock, None, None)
            for rid, st in zip(entries, starts):
                pr = per[rid[0]]
                if pr["p_admit_step"] is None:
                    pr["p_admit_step"], pr["p_cached"] = p_step, st
            for rid in preempted:
                per[rid]["p_preemptions"] += 1
            total_preempt_p += len(preempted)
            rec = {"step": p_step, "clock": sec(p_clock), "dur": sec(dur), "sched": entries, "start": starts,
                   "preempted": preempted, "running": len(P.running),
                   "waiting": len(P.waiting) + len(P.kv_holding_waiting),
                   "held_requests": len(P.requests) - len(P.running) - len(P.waiting) - len(P.kv_holding_waiting),
                   "free_blocks": P.kv_cache_manager.block_pool.get_num_free_blocks(),
                   "empty": out.total_num_scheduled_tokens == 0}
            p_pending = (out, p_clock, p_clock + dur, rec, (entries, sampled))
            continue
        if p_act == "finalize":
            out, s, e, rec, (entries, sampled) = p_pending
            p_pending = None
            ends = link.ends()
            fin_send = sorted((r for r in sends_open if r in ends and ends[r] <= e),
                              key=lambda r: (ends[r], r))
            kv_out = KVConnectorOutput(finished_sending=set(fin_send) or None)
            eco = finish_step(P, out, entries, sampled, kv_out)
            for r in fin_send:
                sends_open.discard(r)
                per[r]["p_freed_step"], per[r]["p_freed_clock"] = p_step, sec(e)
            finished = []
            for outs in eco.values():
                for o in outs.outputs:
                    if o.finish_reason is not None:
                        assert o.kv_transfer_params and o.kv_transfer_params.get("do_remote_prefill"), o
                        finished.append(o.request_id)
                        handoffs.append((e, o.request_id, copy.deepcopy(o.kv_transfer_params)))
                        sends_open.add(o.request_id)
                        pr = per[o.request_id]
                        pr["prefill_finish"] = sec(e)
                        rb = o.kv_transfer_params["remote_block_ids"]
                        pr["p_blocks_held"] = sum(len(g) for g in rb)
                        # the clipped ids P offers, per transfer group (null ids included), and the blocks
                        # it really holds (delay-freed) until finished_sending, per group
                        pr["p_remote_blocks_per_group"] = [len(g) for g in rb]
                        pr["p_held_blocks_per_group"] = real_blocks(P, o.request_id)
            rec.update({"end": sec(e), "finished": finished, "freed": fin_send,
                        "free_blocks_after": P.kv_cache_manager.block_pool.get_num_free_blocks()})
            fp.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if rec["empty"]:
                n_p_empty += 1
            p_step += 1
            steps_total += 1
            p_clock = e
            if (rec["empty"] and not fin_send) or not P.requests:
                p_idle = True
            continue
        # ---------------- D acts? ----------------
        if dn != INF and p_handoff_bound() > dn:
            d_clock = dn
            d_idle = False
            entered = []
            while h_i < len(handoffs) and handoffs[h_i][0] <= d_clock:
                t, rid, params = handoffs[h_i]
                h_i += 1
                r = by_id[rid]
                vr = VReq(request_id=rid, prompt_token_ids=list(prompts[rid]),
                          sampling_params=SamplingParams(max_tokens=r.output_len, ignore_eos=True, n=1,
                                                         extra_args={"kv_transfer_params": params}),
                          pooling_params=None, arrival_time=t / 1e9, block_hasher=hasher_d)
                D.add_request(vr)
                entered.append(rid)
            out, dur, entries, starts, sampled, preempted, ptok, ndec = run_step(D, "d", d_clock, None, None)
            e = d_clock + dur
            meta = out.kv_connector_metadata
            started, waiting_kv = [], []
            for rid, (blocks, n_ext, local_blocks, awaiting) in meta.reqs_to_recv.items():
                # the block ids the connector was handed (unhashed, clipped), per transfer group
                per_group = [len(g) for g in blocks] if len(blocks) else [0] * len(transfer_ids)
                nblocks = sum(per_group)
                nbytes = sum(n * group_bytes[g] for n, g in zip(per_group, transfer_ids, strict=True))
                ts = d_clock if args.load_start == "start" else e
                link.add(rid, ts, nbytes)
                pr = per[rid]
                pr.update({"load_blocks": nblocks, "load_bytes": nbytes, "load_blocks_per_group": per_group,
                           "d_held_blocks_per_group": real_blocks(D, rid), "load_start": sec(ts),
                           "d_enter_step": d_step})
                vr = D.requests[rid]
                if awaiting:
                    assert vr.status == RequestStatus.WAITING_FOR_REMOTE_KVS, vr.status
                    waiting_kv.append(rid)
                    recvs_open.add(rid)
                    pr["d_local_hit"] = vr.num_computed_tokens - n_ext
                started.append([rid, nblocks, nbytes, bool(awaiting)])
            for rid, st in zip(entries, starts):
                pr = per[rid[0]]
                if pr["d_first_compute_step"] is None:
                    pr["d_first_compute_step"] = d_step
                    if pr["d_local_hit"] is None:  # admitted without a load (full local hit)
                        pr["d_local_hit"] = st
            for rid in preempted:
                per[rid]["d_preemptions"] += 1
            total_preempt_d += len(preempted)
            ends = link.ends()
            fin_recv = sorted((r for r in recvs_open if r in ends and ends[r] <= e), key=lambda r: (ends[r], r))
            for r in fin_recv:
                recvs_open.discard(r)
                per[r]["load_end"] = sec(ends[r])
                per[r]["load_reported"], per[r]["load_reported_step"] = sec(e), d_step
            for r, *_ in started:
                if r not in recvs_open and per[r]["load_end"] is None and r in ends:
                    per[r]["load_end"] = sec(ends[r])  # notif-only (no await)
            inflight = len(recvs_open) + len(fin_recv)
            peak_inflight = max(peak_inflight, inflight)
            kv_out = KVConnectorOutput(finished_recving=set(fin_recv) or None)
            rec = {"step": d_step, "clock": sec(d_clock), "dur": sec(dur), "sched": entries, "start": starts,
                   "preempted": preempted, "arrived": entered, "entered_wait_kv": waiting_kv,
                   "loads_started": started, "loads_finished": fin_recv,
                   "loads_in_flight": len(recvs_open),
                   "running": len(D.running), "waiting": len(D.waiting) + len(D.kv_holding_waiting)
                   + len(D.async_kv_waiting),
                   "free_blocks": D.kv_cache_manager.block_pool.get_num_free_blocks(),
                   "empty": out.total_num_scheduled_tokens == 0}
            eco = finish_step(D, out, entries, sampled, kv_out)
            for outs in eco.values():
                for o in outs.outputs:
                    pr = per[o.request_id]
                    if o.new_token_ids and pr["first_token"] is None:
                        pr["first_token"] = sec(e)
                    if o.finish_reason is not None:
                        pr["finish"] = sec(e)
            fd.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if rec["empty"]:
                n_d_empty += 1
            d_step += 1
            steps_total += 1
            d_clock = e
            if (rec["empty"] and not fin_recv) or not D.requests:
                # nothing ran and nothing arrived from the link: wait for a load end or a handoff
                # (vLLM spins empty steps meanwhile; with no request at all it does not step)
                d_idle = True
            continue
        # nobody can act
        stalled = {"reason": "no event", "p_requests": len(P.requests), "d_requests": len(D.requests),
                   "p_waiting": len(P.waiting), "d_waiting": len(D.waiting) + len(D.kv_holding_waiting),
                   "sends_open": len(sends_open), "recvs_open": len(recvs_open),
                   "d_next": dn, "p_next": p_next_time(),
                   "p_free_blocks": P.kv_cache_manager.block_pool.get_num_free_blocks(),
                   "d_free_blocks": D.kv_cache_manager.block_pool.get_num_free_blocks(),
                   # the decode side's queues, head first: id, status, computed tokens, tokens, blocks per group
                   "d_queues": {name: [[r.request_id, r.status.name, r.num_computed_tokens, r.num_tokens,
                                        real_blocks(D, r.request_id)] for r in list(q)[:8]]
                                for name, q in (("kv_holding_waiting", D.kv_holding_waiting),
                                                ("waiting", D.waiting), ("running", D.running))}}
        break
    fd.close()
    fp.close()

    req_out = stem + ".requests.jsonl"
    with open(req_out, "w") as f:
        for r in reqs:
            if r.id in per:
                f.write(json.dumps(per[r.id], separators=(",", ":")) + "\n")

    done = [p for p in per.values() if p["finish"] is not None]
    ttft = sorted(p["first_token"] - p["t"] for p in per.values() if p["first_token"] is not None)
    loads = [p for p in per.values() if p["load_end"] is not None and p["load_start"] is not None]
    load_s = sorted(p["load_end"] - p["load_start"] for p in loads)
    wait_start = sorted(p["load_start"] - p["prefill_finish"] for p in loads)

    def q(v, x):
        return round(v[min(len(v) - 1, int(x * len(v)))], 6) if v else None

    summary = {
        "vllm_version": drive.vllm_version(),
        "requests": len(reqs), "finished": len(done), "unfinished": len(per) - len(done) + (len(reqs) - len(per)),
        "prefill_steps": p_step, "decode_steps": d_step, "prefill_empty_steps": n_p_empty,
        "decode_empty_steps": n_d_empty, "decode_preemptions": total_preempt_d,
        "prefill_preemptions": total_preempt_p,
        "decode_local_hit_tokens": sum(p["d_local_hit"] or 0 for p in per.values()),
        "prefill_hit_tokens": sum(p["p_cached"] or 0 for p in per.values()),
        "load_bytes": sum(p["load_bytes"] or 0 for p in per.values()),
        "load_blocks_per_group": [sum((p["load_blocks_per_group"] or [0] * len(transfer_ids))[k] for p in per.values())
                                  for k in range(len(transfer_ids))],
        "peak_loads_in_flight": peak_inflight, "link_peak_active": link.max_active,
        "ttft_s": {"p50": q(ttft, 0.5), "p90": q(ttft, 0.9), "max": ttft[-1] if ttft else None},
        "load_s": {"p50": q(load_s, 0.5), "p90": q(load_s, 0.9), "max": load_s[-1] if load_s else None},
        "handoff_to_load_start_s": {"p50": q(wait_start, 0.5), "p90": q(wait_start, 0.9),
                                    "max": wait_start[-1] if wait_start else None},
        "prefill_clock_s": sec(p_clock), "decode_clock_s": sec(d_clock), "stalled": stalled,
        "config": {"p_num_blocks": args.p_num_blocks, "d_num_blocks": args.d_num_blocks,
                   "block_size": args.block_size,
                   "p_max_num_seqs": pcfg.scheduler_config.max_num_seqs,
                   "d_max_num_seqs": dcfg.scheduler_config.max_num_seqs,
                   "p_max_num_batched_tokens": pcfg.scheduler_config.max_num_batched_tokens,
                   "d_max_num_batched_tokens": dcfg.scheduler_config.max_num_batched_tokens,
                   "max_num_inflight_kv_loads": dcfg.scheduler_config.max_num_inflight_kv_loads,
                   "scheduler_reserve_full_isl": not args.no_reserve_full_isl, "watermark": args.watermark,
                   "link_bandwidth_bytes_per_s": args.link_bandwidth, "link_latency_ms": args.link_latency_ms,
                   "bytes_per_block": args.bytes_per_block, "load_start": args.load_start,
                   "prefill_ms_per_token": args.prefill_ms_per_token, "decode_step_ms": args.decode_step_ms,
                   "connector": "pd.PDConnector (NIXL pull scheduler rules, backoff 0)",
                   "kv_load_failure_policy": dcfg.kv_transfer_config.kv_load_failure_policy,
                   **({"layers": args.layers, "bytes_per_block_per_group": group_bytes} if args.layers else {})},
        "hybrid": None if not args.layers else {
            "layers": args.layers, "model": d_ns.layers_name, "num_layers": d_ns.num_layers,
            "coordinator": d_ns.coordinator,
            "disable_hybrid_kv_cache_manager": dcfg.scheduler_config.disable_hybrid_kv_cache_manager,
            "kv_cache_layout": dcfg.cache_config.kv_cache_layout,
            "prefix_cache_retention_interval": d_ns.prefix_cache_retention_interval,
            "scheduler_block_size": D.block_size, "hash_block_size": D.hash_block_size,
            "kv_cache_groups": d_ns.kv_cache_groups,
            "p_max_admission_blocks_per_request": [g["max_admission_blocks_per_request"] for g in p_ns.kv_cache_groups],
            "transfer_group_ids": list(transfer_ids),
            "nixl": {"is_hma_required": D.connector._is_hma_required, "blocks_per_sw": D.connector.blocks_per_sw,
                     "prefill_backoff": D.connector.prefill_backoff,
                     "clips_checked_against_vllm_nixl": P.connector.clip_checks + D.connector.clip_checks}},
        "decode_steps_file": os.path.abspath(args.out), "prefill_steps_file": os.path.abspath(stem + ".prefill.jsonl"),
        "requests_file": os.path.abspath(req_out), "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(summary, indent=1))
    with open(stem + ".summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if not stalled else 2


if __name__ == "__main__":
    sys.exit(main())
