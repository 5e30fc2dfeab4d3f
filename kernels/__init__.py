"""Paged-KV kernels (Triton) and their torch references, behind one dispatch layer.

Callers use the functions re-exported here; each picks Triton on CUDA and the torch reference on
CPU unless ``backend`` says otherwise (see dispatch.py). Layout: per layer K and V
``[num_blocks, block_size, num_kv_heads, head_dim]``, int32 block tables ``[num_seqs, max_blocks]``,
int64 slot mappings (slot = block * block_size + offset). Launch parameters (warps, stages, the
decode's split plan) are in tuning.py; aot.py compiles every kernel for GPU targets without a GPU.
"""
from kvbench.kernels.dispatch import (BACKENDS, attention_weights, copy_blocks, decode_attention,
                                      prefill_attention, use_triton, write_kv)

__all__ = ["BACKENDS", "attention_weights", "copy_blocks", "decode_attention", "prefill_attention",
           "use_triton", "write_kv"]
