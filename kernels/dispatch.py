"""Chooses, per call, the Triton kernel or its torch reference, so callers never branch on the device.

``backend``: "triton", "torch", or "auto" (Triton on CUDA tensors, torch elsewhere). Triton modules
are imported on first use: `triton.jit` decides at decoration time whether to build GPU kernels or
the CPU interpreter (``TRITON_INTERPRET=1``), so importing them early would freeze that choice.
Triton on CPU tensors therefore needs TRITON_INTERPRET=1 set before the first Triton call.
"""
from __future__ import annotations

import os

import torch

from kvbench.kernels import reference as ref

BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, device: torch.device) -> bool:
    """Resolve a backend name for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "torch":
        return False
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before they are used")
        return True
    return device.type == "cuda"


def check_kv_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Attention runs in the query's dtype over a cache of that dtype. An fp8 cache would need its
    scales applied before tl.dot (a bf16 x fp8 dot does not compile): refused here, on every backend,
    rather than failing inside the compiler on the first GPU (fp8 KV is modelled by the sim executor)."""
    if k_cache.dtype != q.dtype:
        raise ValueError(f"KV cache dtype {k_cache.dtype} differs from the query dtype {q.dtype}: the paged "
                         "attention kernels need KV in the compute dtype (fp8 KV with scales is not implemented; "
                         "--executor sim models its bytes)")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str = "auto") -> None:
    """k, v: [T, Hkv, D] -> their slots (int64 [T], -1 = skip) of k_cache, v_cache [NB, BS, Hkv, D]."""
    if use_triton(backend, k.device):
        from kvbench.kernels import cache_ops
        cache_ops.write_kv(k_cache, v_cache, k, v, slot_mapping)
    else:
        ref.write_kv_ref(k_cache, v_cache, k, v, slot_mapping)


def copy_blocks(pool: torch.Tensor, pairs: torch.Tensor, backend: str = "auto") -> None:
    """Copy blocks (src, dst) in every plane. pool: [planes, NB, ...]; pairs: int64 [P, 2]."""
    if use_triton(backend, pool.device):
        from kvbench.kernels import cache_ops
        cache_ops.copy_blocks(pool, pairs)
    else:
        ref.copy_blocks_ref(pool, pairs)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, starts: torch.Tensor, scale: float, max_q_len: int,
                      kept: torch.Tensor | None = None, backend: str = "auto", window: int = 0) -> torch.Tensor:
    """q: [T, Hq, D] of chunks starting at ``starts`` -> out [T, Hq, D] (causal over cache, GQA; a query at
    p sees p - window + 1 .. p under a sliding window, window > 0; what lies before is never read)."""
    check_kv_dtype(q, k_cache)
    if use_triton(backend, q.device):
        from kvbench.kernels import paged_attention
        return paged_attention.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, starts,
                                                 scale, max_q_len, kept, window=window)
    return ref.prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, starts, scale, kept, window)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                     num_splits: int | torch.Tensor | None = None, kept: torch.Tensor | None = None,
                     backend: str = "auto", max_splits: int | None = None,
                     window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [S, Hq, D] at positions seq_lens-1 -> out [S, Hq, D], lse f32 [S, Hq] (the last ``window``
    positions only under a sliding window, window > 0).
    num_splits / max_splits: the split-KV plan (paged_attention.decode_attention); torch ignores it."""
    check_kv_dtype(q, k_cache)
    if use_triton(backend, q.device):
        from kvbench.kernels import paged_attention
        return paged_attention.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                max_seq_len, num_splits, kept, max_splits=max_splits, window=window)
    return ref.decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, kept, window)


def attention_weights(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      lse: torch.Tensor, scale: float, max_len: int, kept: torch.Tensor | None = None,
                      backend: str = "auto") -> torch.Tensor:
    """Second pass after decode: probabilities per position summed per KV group -> f32 [S, Hkv, max_len]."""
    check_kv_dtype(q, k_cache)
    if use_triton(backend, q.device):
        from kvbench.kernels import paged_attention
        return paged_attention.attention_weights(q, k_cache, block_tables, seq_lens, lse, scale, max_len, kept)
    return ref.attention_weights_ref(q, k_cache, block_tables, seq_lens, lse, scale, max_len, kept)
