"""The ``model`` executor: a real Llama-family forward per engine step, over a KV pool of real tensors.

Each step: copy-on-write block copies, one forward over the step's prefill chunks and decodes
(modeling.py), greedy sampling, and the step's measured duration (CUDA events on GPU, perf_counter on
CPU), which advances the engine clock. With ``collect_attention`` it also returns, per decoding
sequence, the attention weight on each cached position, recomputed from the decode's log-sum-exp in a
second pass (what H2O accumulates).

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
from kvbench.eviction.evictor import CPU_POOL_FACTOR
from kvbench.eviction.host_kv import PARTIAL_DIMS, HostKV
from kvbench.executors.attention_mass import MassMeter
from kvbench.executors.modeling import (AttentionMetadata, ForwardInputs, build_inputs, build_model,
                                        decode_attention_stats, default_dtype, make_kv_pool)
from kvbench.executors.presets import ModelSpec
from kvbench.executors.speculation import speculate
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


class ModelExecutor:
    name = "model"
    needs_tokens = True

    def __init__(self, model: str | ModelSpec = "tiny", device: str = "auto", seed: int = 0,
                 attention: str = "auto", collect_attention: bool = False):
        self.device = resolve_device(device)
        self.dtype = default_dtype(self.device)
        self.net = build_model(model, self.device, seed, attention, self.dtype)
        self.spec: ModelSpec = self.net.spec
        self.collect_attention = collect_attention
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

    def kv_bytes_per_token(self) -> int:
        return self.spec.kv_bytes_per_token("fp32" if self.dtype == torch.float32 else "bf16")

    def default_kv_bytes(self) -> int:
        """GPU: 90% of the memory free after the weights, less what InfiniGen's partial keys may take
        (``partial_key_share`` of the pool's bytes at most); CPU: CPU_DEFAULT_KV_BYTES."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9 / (1.0 + self.partial_key_share))
        return CPU_DEFAULT_KV_BYTES

    def bind_pool(self, num_blocks: int, block_size: int) -> None:
        self.pool = None  # free the old pool before allocating the new one
        self.pool = make_kv_pool(self.spec, num_blocks, block_size, self.device, self.dtype)
        self.block_size = block_size

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
        with _Timer(self.device) as timer:
            pcie_s = self._kv_traffic(pool, batch)
            if batch.copies:
                pairs = torch.tensor(batch.copies, dtype=torch.int64, device=self.device)  # [P, 2]
                kernels.copy_blocks(pool, pairs, backend=self.net.model.layers[0].self_attn.backend)
            inputs = self.inputs_for(batch)
            logits = self.net(inputs, pool)  # [N, vocab]
            tokens = logits.argmax(-1).tolist()
            attention = self._attention(inputs.meta, pool, batch.decode_seq_ids) if self.collect_attention else None
        order = [s for s, last in zip(batch.prefill_seq_ids, batch.prefill_last) if last] + list(batch.decode_seq_ids)
        if self.logits_log is not None:  # selfcheck: every sampled row, per sequence, in order
            for sid, row in zip(order, logits.float().cpu().numpy()):
                self.logits_log.setdefault(sid, []).append(row)
        self._last = (inputs.meta, pool, list(batch.decode_seq_ids))
        mass = None
        duration_s, self._pending_s = timer.seconds + self._pending_s, 0.0
        if self.collect_attention and batch.decode_seq_ids and inputs.meta.decode_records:
            mass = self.mass.measure(inputs.meta.decode_records, list(batch.decode_seq_ids))
        return StepResult(duration_s=duration_s, sampled=dict(zip(order, tokens)), attention=attention,
                          mass_kept=mass, pcie_s=pcie_s)

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
        cuda = self.device.type == "cuda"
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
            if cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self.host.recall(pool, batch.recall)
            if cuda:
                torch.cuda.synchronize(self.device)
            pcie_s += time.perf_counter() - t0
        if batch.host_release:
            self.host.release(batch.host_release)
        return pcie_s

    def inputs_for(self, batch: StepBatch) -> ForwardInputs:
        """The flattened forward inputs of a StepBatch (decode positions give each context length)."""
        tables, kept = batch.block_tables, batch.kept_masks
        inputs = build_inputs(
            batch.block_size, self.device,
            prefill_tokens=batch.prefill_tokens, prefill_starts=batch.prefill_starts,
            prefill_tables=[tables[s] for s in batch.prefill_seq_ids], prefill_sample=batch.prefill_last,
            decode_tokens=batch.decode_tokens, decode_positions=batch.decode_positions,
            decode_tables=[tables[s] for s in batch.decode_seq_ids], decode_slots=batch.decode_slots,
            prefill_kept=[kept.get(s) for s in batch.prefill_seq_ids],
            decode_kept=[kept.get(s) for s in batch.decode_seq_ids])
        if self.collect_attention:
            inputs.meta.decode_records = []
        return inputs

    def _attention(self, meta: AttentionMetadata, pool: torch.Tensor, seq_ids: list[int]) -> dict[int, np.ndarray]:
        """seq_id -> float32 [context] attention weight per cached position: summed over all query
        heads, averaged over layers (so each step adds num_heads of mass per sequence)."""
        if not seq_ids:
            return {}
        w = decode_attention_stats(self.net, pool, meta)  # [L, D, Hkv, max_len]
        total = w.sum(2).mean(0).cpu().numpy()  # [D, max_len]
        lens = meta.decode_seq_lens.tolist()
        return {sid: total[i, :lens[i]] for i, sid in enumerate(seq_ids)}

    def decode_attention_by_group(self, seq_ids: list[int] | None = None) -> dict[int, np.ndarray]:
        """For the last step's decodes (run with collect_attention): seq_id -> float32 [L, Hkv, context],
        the attention weight per cached position summed over each KV group's query heads."""
        if self._last is None or self._last[0].decode_records is None:
            raise RuntimeError("no decode attention recorded: set collect_attention before execute()")
        meta, pool, ids = self._last
        w = decode_attention_stats(self.net, pool, meta)  # [L, D, Hkv, max_len]
        lens = meta.decode_seq_lens.tolist()
        want = set(ids if seq_ids is None else seq_ids)
        return {sid: w[:, i, :, :lens[i]].cpu().numpy() for i, sid in enumerate(ids) if sid in want}


def make_model_executor(cfg, model: ModelSpec) -> ModelExecutor:
    """The executor for a ReplayConfig: a model folder's own weights, or the preset random-initialised."""
    source = cfg.model if os.path.isdir(cfg.model) else model
    kv_dtype = getattr(cfg, "kv_dtype", "auto")
    if kv_dtype != "auto":
        want = {torch.float32: "fp32", torch.bfloat16: "bf16"}[default_dtype(resolve_device(cfg.device))]
        if kv_dtype != want:
            raise InputError(f"the model executor keeps KV in the dtype it computes in ({want} on this "
                             f"device); {kv_dtype} KV is modelled by --executor sim", field="--kv-dtype")
    ex = ModelExecutor(source, cfg.device, cfg.seed, cfg.attention, collect_attention=cfg.eviction != "none")
    if cfg.eviction == "infinigen":  # the CPU pool's partial keys: PARTIAL_DIMS of K for each pooled token
        ex.partial_key_share = CPU_POOL_FACTOR * PARTIAL_DIMS * 0.5
    return ex

