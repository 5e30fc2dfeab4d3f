"""The ``model`` executor: a real Llama-family forward per engine step, over a KV pool of real tensors.

Each step: copy-on-write block copies, one forward over the step's prefill chunks and decodes
(modeling.py), greedy sampling, and the step's measured duration (CUDA events on GPU, perf_counter on
CPU), which advances the engine clock. On a GPU, decode-only steps replay a CUDA graph captured for
their batch-size bucket (DecodeGraphs), so kernel launch overhead is not charged to TPOT as it would
not be in vLLM. With ``collect_attention`` it also records each decode's query and log-sum-exp, and
(``attention_scores``) returns, per decoding sequence, the attention weight on each cached position,
recomputed in a second pass (what H2O accumulates): inside the step's time when the eviction policy
consumes it ("policy"), after the clock stops when it is only a measurement ("measure").

Token eviction: before the forward it carries out the batch's KV traffic (kvbench.scheduler.batch
StepBatch: offload to host, slot moves, recall, release), timing the host<->device part as the
step's PCIe time (a measurement-only shadow offload is done outside the timed step); after it,
the attention mass kept is measured (kvbench.executors.attention_mass; not timed). ``speculate`` is
InfiniGen's look-ahead (kvbench.executors.speculation), between steps; its time is added to the next
step.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from kvbench import kernels
from kvbench.errors import InputError
from kvbench.eviction.evictor import CPU_POOL_FACTOR, EVICTION_POLICIES
from kvbench.eviction.host_kv import PARTIAL_DIMS, HostKV
from kvbench.executors.attention_mass import MassMeter
from kvbench.executors.modeling import (
    AttentionMetadata,
    ForwardInputs,
    PagedLlama,
    build_inputs,
    build_model,
    decode_attention_stats,
    decode_attention_totals,
    default_dtype,
    make_kv_pool,
)
from kvbench.executors.presets import ModelSpec, available_host_bytes, get_model
from kvbench.executors.speculation import speculate
from kvbench.kernels.tuning import device_sms, graph_max_splits
from kvbench.scheduler.batch import StepBatch, StepResult

# KV pool on CPU when none is asked: zeros are committed memory, so stay modest (1M slots of `tiny`).
CPU_DEFAULT_KV_BYTES = 1 << 30


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("no CUDA device is available", field="--device")
    return torch.device(device)


def move_slots(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy KV slot src[i] to dst[i] in every plane, reading every source before writing: sources
    and destinations may overlap (compaction fills holes with slots it also vacates).
    pool: [2L, NB, BS, Hkv, D]; src, dst: int64 [n] pool slots (block * BS + offset)."""
    flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [2L, NB*BS, Hkv, D], a view
    flat[:, dst] = flat[:, src]  # advanced indexing on the right gathers into a new tensor first


# Below this hidden size a CPU forward is dominated by per-op overhead, and torch's thread pool only
# adds synchronisation (the `tiny` model runs ~5x faster on one thread on a shared 2-core machine).
SMALL_MODEL_HIDDEN = 512


class _Timer:
    """Step duration: CUDA events on GPU (device time of the step), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


# ---------------------------------------------------------------------------------------------
# Decode under CUDA graphs

# Batch sizes a decode graph is captured for (vLLM's capture sizes up to 256): a step replays the
# smallest bucket that holds its decodes, the rest of the rows padding.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_GRAPH_TABLE_WIDTH = 64  # block-table columns of a first capture; doubled when a step needs more


def cuda_capture(fn, mem_pool):
    """Capture ``fn()`` into a CUDA graph after one warm-up run on a side stream (which compiles the
    Triton kernels and sets up cuBLAS) -> (replay, the captured call's output tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mem_pool):
        out = fn()
    return graph.replay, out


def eager_capture(fn, mem_pool):
    """cuda_capture's stand-in off the GPU (tests): a "replay" recomputes ``fn()`` into the same output."""
    out = fn()

    def replay():
        with torch.inference_mode():  # the forward's output is an inference tensor
            out.copy_(fn())
    return replay, out


class _DecodeGraph:
    """One captured decode forward over static inputs of ``bucket`` rows and ``width`` table columns,
    with slots, tables and a split plan for each of ``groups`` KV cache groups (one: a plain model).
    Padding rows write nowhere (slot -1) and attend to one position of block 0 with one split."""

    def __init__(self, net: PagedLlama, pool: torch.Tensor, bucket: int, width: int, max_splits: int,
                 capture, mem_pool, groups: int = 1):
        dev, i32, i64 = pool.device, torch.int32, torch.int64
        self.bucket, self.width, self.max_splits = bucket, width, max_splits
        self.input_ids = torch.zeros(bucket, dtype=i64, device=dev)  # [B]
        self.positions = torch.zeros(bucket, dtype=i64, device=dev)  # [B]
        self.seq_lens = torch.ones(bucket, dtype=i32, device=dev)  # [B]
        self.slots = [torch.full((bucket,), -1, dtype=i64, device=dev) for _ in range(groups)]  # [B] each
        self.tables = [torch.zeros(bucket, width, dtype=i32, device=dev) for _ in range(groups)]  # [B, W] each
        self.splits = [torch.ones(bucket, dtype=i32, device=dev) for _ in range(groups)]  # [B] each
        empty = torch.zeros(0, dtype=i32, device=dev)
        metas = [AttentionMetadata(
            slot_mapping=slots, num_prefill_tokens=0, prefill_cu_seqlens=torch.zeros(1, dtype=i32, device=dev),
            prefill_starts=empty, prefill_block_tables=torch.zeros(0, 1, dtype=i32, device=dev), max_prefill_len=0,
            decode_block_tables=tables, decode_seq_lens=self.seq_lens, max_decode_len=width * pool.shape[2],
            sample_indices=torch.arange(bucket, device=dev), decode_num_splits=splits, max_decode_splits=max_splits)
            for slots, tables, splits in zip(self.slots, self.tables, self.splits)]
        inputs = ForwardInputs(self.input_ids, self.positions, metas[0],
                               group_metas=metas if net.layer_groups is not None else None)
        self.replay, self.out = capture(lambda: net.hidden(inputs, pool), mem_pool)  # out: [B, hidden]

    def run(self, inputs: ForwardInputs) -> torch.Tensor:
        """A decode-only step's inputs (D <= bucket rows) -> final hidden states [D, hidden]."""
        d = inputs.input_ids.shape[0]
        self.input_ids[:d].copy_(inputs.input_ids)
        self.positions[:d].copy_(inputs.positions)
        self.seq_lens[:d].copy_(inputs.meta.decode_seq_lens)
        for meta, slots, tables, splits in zip(inputs.group_metas or [inputs.meta], self.slots, self.tables,
                                               self.splits, strict=True):
            slots[:d].copy_(meta.slot_mapping)
            tables[:d, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
            splits[:d].copy_(meta.decode_num_splits.clamp(max=self.max_splits))
            if d < self.bucket:
                slots[d:] = -1
                splits[d:] = 1
        if d < self.bucket:  # rows a larger step filled before: padding again
            self.input_ids[d:] = 0
            self.positions[d:] = 0
            self.seq_lens[d:] = 1
        self.replay()
        return self.out[:d]


class DecodeGraphs:
    """Decode-only steps replayed from CUDA graphs, one per (batch-size bucket, block size), captured on
    a bucket's first step before the step's clock starts (vLLM captures them at start-up; lazily, only
    the buckets a trace reaches are paid for). The graphs share one memory pool: they never run at once.
    A model bound to KV cache groups replays with each group's tables, slots and splits (its sliding
    layers' windows are the layers' own). Steps with prefill chunks, kept masks (token eviction) or
    recorded attention run eagerly."""

    def __init__(self, net: PagedLlama, capture=cuda_capture, mem_pool=None):
        self.net, self.capture, self.mem_pool = net, capture, mem_pool
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}

    @staticmethod
    def bucket(n: int) -> int | None:
        return next((b for b in GRAPH_BUCKETS if b >= n), None)

    def wants(self, batch: StepBatch) -> bool:
        n = len(batch.decode_seq_ids)
        return (n > 0 and not batch.prefill_seq_ids and self.bucket(n) is not None
                and not any(batch.kept_masks.get(s) is not None for s in batch.decode_seq_ids))

    def prepare(self, batch: StepBatch, pool: torch.Tensor) -> _DecodeGraph:
        """The graph for ``batch`` (decode-only, wants() true), captured now if it is missing or its
        block table is too narrow."""
        bucket = self.bucket(len(batch.decode_seq_ids))
        grouped = self.net.layer_groups is not None
        width = max(len(t) for s in batch.decode_seq_ids
                    for t in (batch.group_tables[s] if grouped else (batch.block_tables[s],)))
        key = (bucket, batch.block_size)
        g = self.graphs.get(key)
        if g is None or g.width < width:
            self.graphs.pop(key, None)  # free the narrower graph's buffers first
            spec = self.net.spec
            g = _DecodeGraph(self.net, pool, bucket, max(MIN_GRAPH_TABLE_WIDTH, 1 << (width - 1).bit_length()),
                             graph_max_splits(bucket, spec.num_kv_heads, device_sms(pool.device)),
                             self.capture, self.mem_pool, len(self.net.group_windows) if grouped else 1)
            self.graphs[key] = g
        return g


class ModelExecutor:
    name = "model"
    needs_tokens = True
    front_end = (0.0, 0.0, 0.0)  # the executor is the engine: a request reaches the scheduler when issued

    def check_kv_bytes(self, nbytes: int) -> None:
        """Checked before the executor is built, weights and pool together (engine.setup.check_model_memory)."""

    def __init__(self, model: str | ModelSpec = "tiny", device: str = "auto", seed: int = 0,
                 attention: str = "auto", collect_attention: bool = False, attention_scores: str | None = None,
                 cuda_graphs: bool | None = None):
        """``attention_scores`` (with collect_attention): "policy" (the eviction policy consumes the
        scores: computed inside the step's time), "measure" (after the clock stops; the default) or
        "off". ``cuda_graphs``: decode steps under CUDA graphs; default on a GPU with the Triton
        kernels."""
        spec = model if isinstance(model, ModelSpec) else get_model(model)
        if spec.is_moe:  # the forward here is dense: it would run, and time, the wrong model
            raise InputError(f"{spec.name} is a mixture of experts; the model executor runs dense models only: "
                             "use --executor sim", field="--model")
        self.device = resolve_device(device)
        self.dtype = default_dtype(self.device)
        self.net = build_model(model, self.device, seed, attention, self.dtype)
        self.spec: ModelSpec = self.net.spec
        self.collect_attention = collect_attention
        self.attention_scores = attention_scores or ("measure" if collect_attention else "off")
        if self.attention_scores not in ("policy", "measure", "off"):
            raise ValueError(f"attention_scores {self.attention_scores!r}: policy, measure or off")
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and kernels.use_triton(attention, self.device)
        self.graphs = DecodeGraphs(self.net, mem_pool=torch.cuda.graph_pool_handle()) if cuda_graphs else None
        self.host = HostKV()
        if self.device.type == "cpu" and self.spec.hidden_size <= SMALL_MODEL_HIDDEN:
            torch.set_num_threads(1)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.pool: torch.Tensor | None = None  # [2L, NB, BS, Hkv, D]
        self.block_size = 0
        # The last step's metadata, pool view and decode seq ids, for decode_attention_by_group.
        self._last: tuple[AttentionMetadata, torch.Tensor, list[int]] | None = None
        self.logits_log: dict[int, list[np.ndarray]] | None = None  # set to {} to keep sampled logits
        self._pending_s = 0.0  # speculation time, charged to the next step
        # device bytes InfiniGen's partial keys may reach, as a share of the KV pool's (set for infinigen)
        self.partial_key_share = 0.0
        self.mass = MassMeter(self.host, self.net.model.layers[0].self_attn.scale)
        self.tiers: dict[str, torch.Tensor] = {}  # tier name -> [slots, 2L, BS, Hkv, D] (bind_tiers)
        self._tier_files: list[str] = []
        self._prefill = [0.0, 0]  # seconds and tokens of the steps that prefilled (recompute_s)

    def kv_bytes_per_token(self) -> int:
        return self.spec.kv_bytes_per_token("fp32" if self.dtype == torch.float32 else "bf16")

    def kv_layers(self) -> list:
        """Each layer's KV on this one device, at the dtype the forward caches in."""
        return self.spec.kv_layers("fp32" if self.dtype == torch.float32 else "bf16", 1)

    def default_kv_bytes(self) -> int:
        """GPU: 90% of the memory free after the weights, less what InfiniGen's partial keys may take
        (``partial_key_share`` of the pool's bytes at most); CPU: CPU_DEFAULT_KV_BYTES."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9 / (1.0 + self.partial_key_share))
        return CPU_DEFAULT_KV_BYTES

    def bind_pool(self, num_blocks: int, block_size: int, layer_groups: list[int] | None = None) -> None:
        """A pool of ``num_blocks``; with KV cache groups (``layer_groups``: each layer's), laid out as
        vLLM's hybrid pool (modeling.kv_planes: a block holds the largest group's layers), each layer
        reading its group's table of a batch (StepBatch.group_tables)."""
        self.pool = None  # free the old pool before allocating the new one
        if self.graphs is not None:
            self.graphs.graphs.clear()  # captured over the old pool
        self.net.bind_kv_groups(layer_groups)
        self.pool = make_kv_pool(self.spec, num_blocks, block_size, self.device, self.dtype, layer_groups)
        self.block_size = block_size

    def bind_tiers(self, bandwidth: dict[str, float], slots: dict[str, int], disk_dir: str | None = None) -> None:
        """Storage for the tiers behind the pool (kvbench.memory.tiers): the ``cpu`` tier in host
        memory (pinned when the pool is on a GPU, so copies are DMA), the ``disk`` tier in a file
        mapped into memory (in ``disk_dir``, default the system's temporary directory; removed at
        exit). One slot holds one block of every layer's K and V. ``bandwidth`` is not used: the
        copies are timed."""
        import atexit
        import tempfile

        if self.pool is None:
            raise RuntimeError("bind_pool() must be called before bind_tiers()")
        planes, _, bs, hkv, d = self.pool.shape
        shape = (planes, bs, hkv, d)
        per_slot = planes * bs * hkv * d * self.pool.element_size()
        for name, n in slots.items():
            if name == "cpu":
                need = n * per_slot
                avail = available_host_bytes()
                if avail is not None and need > avail:
                    raise InputError(f"a cpu tier of {n:,} blocks takes {need / 1e9:.1f} GB of host memory; "
                                     f"{avail / 1e9:.1f} GB are available", field="--cpu-kv-mem")
                self.tiers[name] = torch.empty((n, *shape), dtype=self.dtype,
                                               pin_memory=self.device.type == "cuda")
            else:
                fd, path = tempfile.mkstemp(prefix="kvbench-disk-tier-", suffix=".kv", dir=disk_dir)
                os.close(fd)
                self._tier_files.append(path)
                atexit.register(_remove, path)
                try:
                    os.truncate(path, n * per_slot)
                    self.tiers[name] = torch.from_file(path, shared=True, size=n * planes * bs * hkv * d,
                                                       dtype=self.dtype).view(n, *shape)
                except OSError as e:
                    raise InputError(f"cannot map a {n * per_slot / 1e9:.1f} GB disk tier in {os.path.dirname(path)} "
                                     f"({e.strerror or e})", field="--disk-kv-mem") from None

    def _tier_copies(self, pool: torch.Tensor, ops: list[tuple]) -> None:
        """Carry out tier transfers in order: (src tier, index, dst tier, index), "gpu" being the pool."""
        tiers = self.tiers
        for src, i, dst, j in ops:
            if dst == "gpu":
                pool[:, j].copy_(tiers[src][i], non_blocking=True)
            elif src == "gpu":
                tiers[dst][j].copy_(pool[:, i])
            else:
                tiers[dst][j].copy_(tiers[src][i])

    def recompute_s(self, start: int, n: int, rest: int = 0) -> float:
        """Seconds to prefill ``n`` tokens, at the rate the run's prefill steps have shown so far (all
        their work per prefill token: an upper bound); infinite before any, so tiers load."""
        secs, toks = self._prefill
        return n * secs / toks if toks else float("inf")

    def _pool_for(self, block_size: int) -> torch.Tensor:
        """The pool viewed with the batch's block size: a slab batch names slab-sized blocks over the
        same memory (block_size = slab length), which is only a different view of the slots."""
        if self.pool is None:
            raise RuntimeError("bind_pool() must be called before execute()")
        if block_size == self.block_size:
            return self.pool
        planes, nb, bs, hkv, d = self.pool.shape
        if (nb * bs) % block_size:
            raise ValueError(f"batch block_size {block_size} does not tile the pool of {nb * bs} slots")
        return self.pool.view(planes, nb * bs // block_size, block_size, hkv, d)

    def execute(self, batch: StepBatch) -> StepResult:
        pool = self._pool_for(batch.block_size)
        if batch.offload and not batch.offload_is_transfer:  # measurement shadow: not the step's work
            self.host.offload(pool, batch.offload)
        graph = None
        if self.graphs is not None and not self.collect_attention and self.graphs.wants(batch):
            graph = self.graphs.prepare(batch, pool)  # a capture, if any, is not the step's work
        attention = None
        tier_s = tier_post_s = 0.0
        with _Timer(self.device) as timer:
            if batch.tier_pre:
                tier_s = self._timed(self._tier_copies, pool, batch.tier_pre)
            pcie_s = self._kv_traffic(pool, batch)
            if batch.copies:
                pairs = torch.tensor(batch.copies, dtype=torch.int64, device=self.device)  # [P, 2]
                kernels.copy_blocks(pool, pairs, backend=self.net.model.layers[0].self_attn.backend)
            inputs = self.inputs_for(batch)
            # logits: [N, vocab]
            logits = self.net.logits(graph.run(inputs)) if graph is not None else self.net(inputs, pool)
            tokens = logits.argmax(-1).tolist()
            if batch.tier_post:
                tier_post_s = self._timed(self._tier_copies, pool, batch.tier_post)
            if self.attention_scores == "policy":
                attention = self._attention(inputs.meta, pool, batch.decode_seq_ids)
        if self.attention_scores == "measure":
            attention = self._attention(inputs.meta, pool, batch.decode_seq_ids)
        order = [s for s, last in zip(batch.prefill_seq_ids, batch.prefill_last) if last] + list(batch.decode_seq_ids)
        if self.logits_log is not None:  # selfcheck: every sampled row, per sequence, in order
            for sid, row in zip(order, logits.float().cpu().numpy()):
                self.logits_log.setdefault(sid, []).append(row)
        self._last = (inputs.meta, pool, list(batch.decode_seq_ids))
        mass = None
        duration_s, self._pending_s = timer.seconds + self._pending_s, 0.0
        if batch.prefill_lens:
            self._prefill[0] += timer.seconds
            self._prefill[1] += batch.num_prefill_tokens
        if self.collect_attention and batch.decode_seq_ids and inputs.meta.decode_records:
            mass = self.mass.measure(inputs.meta.decode_records, list(batch.decode_seq_ids))
        return StepResult(duration_s=duration_s, sampled=dict(zip(order, tokens)), attention=attention,
                          mass_kept=mass, pcie_s=pcie_s, tier_s=tier_s, tier_post_s=tier_post_s)

    def _timed(self, fn, *args) -> float:
        """Seconds ``fn(*args)`` takes, the device synchronised before and after (host<->device copies)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        fn(*args)
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def speculate(self, items: list[tuple[int, int, int, np.ndarray]]) -> dict[int, np.ndarray]:
        """InfiniGen's look-ahead for the coming step (kvbench.executors.speculation); its time is
        charged to the next step."""
        t0 = time.perf_counter()
        scores = speculate(self.net, self.host, self._last, items)
        if scores is None:
            return {}
        self._pending_s += time.perf_counter() - t0
        return scores

    def _kv_traffic(self, pool: torch.Tensor, batch: StepBatch) -> float:
        """Offload, slot moves, recall, release (in that order); returns the host<->device seconds."""
        pcie_s = 0.0
        if batch.offload and batch.offload_is_transfer:
            t0 = time.perf_counter()
            self.host.offload(pool, batch.offload, keep_partial=True)  # .to("cpu") synchronises
            pcie_s += time.perf_counter() - t0
        if batch.pool_dropped:
            self.host.drop_partial(batch.pool_dropped)
        if batch.slot_moves is not None:
            src, dst = (torch.as_tensor(a, device=self.device) for a in batch.slot_moves)
            move_slots(pool, src, dst)
        if batch.recall:
            pcie_s += self._timed(self.host.recall, pool, batch.recall)
        if batch.host_release:
            self.host.release(batch.host_release)
        return pcie_s

    def inputs_for(self, batch: StepBatch) -> ForwardInputs:
        """The flattened forward inputs of a StepBatch (decode positions give each context length); bound
        to KV cache groups, each group's tables (batch.group_tables)."""
        tables, kept = batch.block_tables, batch.kept_masks
        grouped = self.net.layer_groups is not None
        by_group = batch.group_tables if grouped else {}
        inputs = build_inputs(
            batch.block_size, self.device,
            prefill_tokens=batch.prefill_tokens, prefill_starts=batch.prefill_starts,
            prefill_tables=[] if grouped else [tables[s] for s in batch.prefill_seq_ids],
            prefill_sample=batch.prefill_last,
            decode_tokens=batch.decode_tokens, decode_positions=batch.decode_positions,
            decode_tables=[] if grouped else [tables[s] for s in batch.decode_seq_ids], decode_slots=batch.decode_slots,
            prefill_kept=[kept.get(s) for s in batch.prefill_seq_ids],
            decode_kept=[kept.get(s) for s in batch.decode_seq_ids], num_kv_heads=self.spec.num_kv_heads,
            group_windows=self.net.group_windows,
            prefill_group_tables=[by_group[s] for s in batch.prefill_seq_ids] if grouped else (),
            decode_group_tables=[by_group[s] for s in batch.decode_seq_ids] if grouped else ())
        if self.collect_attention:
            inputs.meta.decode_records = []
        return inputs

    def _attention(self, meta: AttentionMetadata, pool: torch.Tensor, seq_ids: list[int]) -> dict[int, np.ndarray]:
        """seq_id -> float32 [context] attention weight per cached position: summed over all query
        heads, averaged over layers (so each step adds num_heads of mass per sequence)."""
        if not seq_ids:
            return {}
        total = decode_attention_totals(self.net, pool, meta).cpu().numpy()  # [D, max_len]
        lens = meta.decode_seq_lens.tolist()
        return {sid: total[i, :lens[i]] for i, sid in enumerate(seq_ids)}

    def decode_attention_by_group(self, seq_ids: list[int] | None = None) -> dict[int, np.ndarray]:
        """For the last step's decodes (run with collect_attention): seq_id -> float32 [L, Hkv, context],
        the attention weight per cached position summed over each KV group's query heads."""
        if self._last is None or self._last[0].decode_records is None:
            raise RuntimeError("no decode attention recorded: set collect_attention before execute()")
        meta, pool, ids = self._last
        lens = meta.decode_seq_lens.tolist()
        want = set(ids if seq_ids is None else seq_ids)
        out = {}
        for i, sid in enumerate(ids):  # one row at a time, so memory stays one row's
            if sid in want:
                w = decode_attention_stats(self.net, pool, meta, slice(i, i + 1))  # [L, 1, Hkv, max_len]
                out[sid] = w[:, 0, :, :lens[i]].cpu().numpy()
        return out


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def make_model_executor(cfg, model: ModelSpec) -> ModelExecutor:
    """The executor for a ReplayConfig: a model folder's own weights, or the preset random-initialised."""
    source = cfg.model if os.path.isdir(cfg.model) else model
    kv_dtype = getattr(cfg, "kv_dtype", "auto")
    if kv_dtype != "auto":
        want = {torch.float32: "fp32", torch.bfloat16: "bf16"}[default_dtype(resolve_device(cfg.device))]
        if kv_dtype != want:
            raise InputError(f"the model executor keeps KV in the dtype it computes in ({want} on this "
                             f"device); {kv_dtype} KV is modelled by --executor sim", field="--kv-dtype")
    # Scores are the policy's work only for a policy that accumulates them (H2O, InfiniGen); streaming
    # only needs the recorded lse for the attention mass kept.
    if cfg.eviction != "none" and "sliding" in model.kinds:
        raise InputError(f"{model.name} has sliding-window layers; token eviction packs a sequence's kept "
                         "tokens into slots that no longer follow positions, which a window counts in: not "
                         "modelled", field="--eviction")
    scored = cfg.eviction != "none" and EVICTION_POLICIES[cfg.eviction].scored
    ex = ModelExecutor(source, cfg.device, cfg.seed, cfg.attention, collect_attention=cfg.eviction != "none",
                       attention_scores="policy" if scored else "off")
    if cfg.eviction == "infinigen":  # the CPU pool's partial keys: PARTIAL_DIMS of K for each pooled token
        ex.partial_key_share = CPU_POOL_FACTOR * PARTIAL_DIMS * 0.5
    return ex

