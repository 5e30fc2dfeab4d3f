"""Triton kernels that move KV without attending: writing new K/V into slots, and copying whole blocks
for copy-on-write. References: kernels/reference.py (write_kv_ref, copy_blocks_ref).

Offsets are computed in int64: a real pool holds far more than 2**31 elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ct, stride_ch, block_size,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per new token: all its KV heads at once ([BLOCK_H, BLOCK_D] tile).
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # The slot test is broadcast in int64 first: the interpreter mishandles a scalar bool in a mask.
    valid = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0
    ok = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & valid
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache, v_cache: [NB, BS, Hkv, D] (last dim contiguous); k, v: [T, Hkv, D]; slot_mapping: int64 [T]."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        NUM_KV_HEADS=hkv, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d))


@triton.jit
def _copy_blocks_kernel(pool_ptr, pairs_ptr, stride_plane, stride_block, block_elems,
                        BLOCK: tl.constexpr):
    # Grid (pair, plane, chunk): a block of a slab-sized table can be tens of MB, so chunk it.
    p = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(pairs_ptr + 2 * p).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * p + 1).to(tl.int64)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < block_elems
    base = pool_ptr + plane * stride_plane
    x = tl.load(base + src * stride_block + offs, mask=ok)
    tl.store(base + dst * stride_block + offs, x, mask=ok)


def copy_blocks(pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """pool: [planes, num_blocks, *block_shape], each block contiguous; pairs: int64 [P, 2] (src, dst)."""
    if pairs.numel() == 0:
        return
    block_elems = pool[0, 0].numel()
    assert pool.stride(1) == block_elems and pool[0, 0].is_contiguous() and pairs.is_contiguous()
    block = min(4096, triton.next_power_of_2(block_elems))
    grid = (pairs.shape[0], pool.shape[0], triton.cdiv(block_elems, block))
    _copy_blocks_kernel[grid](pool, pairs, pool.stride(0), pool.stride(1), block_elems, BLOCK=block)
