"""Launch parameters of the attention kernels: warps and pipeline stages per kernel, head dim, GQA group
and GPU target, and the split-KV plan of a decode batch.

A table, not an autotuner: an autotuner times candidates at the first launch of each shape, which
would land inside a timed engine step and inside CUDA-graph capture; a table is deterministic and can
be compiled ahead of time for every target (tests/test_kernel_compile.py checks each entry for spills
and shared memory). The values are a priori (FlashAttention-2 / Triton tutorial practice for these
tile shapes) until a GPU run times the alternatives (benchmarks/bench_kernels_gpu.py, "launch
table" section) and they are revised from its figures.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

# Targets the kernels are compiled for ahead of time, and their shared memory per block (bytes, the
# opt-in maximum: A100 164 KiB - 1 KiB reserved; H100/H200 and B200 228 KiB - 1 KiB).
SMEM_LIMIT = {80: 166912, 90: 232448, 100: 232448}

# (kernel, arch family, largest head dim) -> (num_warps, num_stages, maxnreg); arch family = compute
# capability major x 10 (8.6/8.9 take sm_80's entries, 12.x sm_100's). Chosen from ahead-of-time
# compiles of the whole grid (tests/test_kernel_compile.py) for no register spills. Triton 3.9 runs
# ptxas with --regAllocOptLevel=2, under which ptxas held the decode kernels near 80 registers and
# spilled a few bytes at some shapes whatever the warps and stages (4 or 8, 1-3 stages); an explicit
# register budget (maxnreg 128, a .maxnreg directive) removes every spill (decode <= 118 registers:
# 2 programs of 8 warps per SM, ample loads in flight for a bandwidth-bound kernel). The prefill at 4
# warps spilled at head dim 128 (255 registers) and, with a kept mask, at head dim 64 on sm_80; at 8
# warps it does not (<= 186). merge: a [splits, D] float32 reduction, nothing to pipeline.
# Timings on a GPU may revise them: benchmarks/bench_kernels_gpu.py times the alternatives.
_BY_KERNEL = {
    ("decode", 64): (8, 2, 128), ("decode", 256): (8, 2, 128),
    ("weights", 64): (8, 2, 128), ("weights", 256): (8, 2, 128),
    ("prefill", 64): (8, 2, None), ("prefill", 256): (8, 2, None),
    ("merge", 64): (4, 1, None), ("merge", 256): (4, 1, None),
}
_TABLE = {(kernel, family, d): v for (kernel, d), v in _BY_KERNEL.items() for family in (80, 90, 100)}

# Split-KV decode: no split shorter than this many tokens (a split costs a partial result and a merge
# read), at most MAX_SPLITS splits per sequence (the merge kernel's tile), and about PROGRAMS_PER_SM
# programs per SM in all (one wave at the decode kernel's ~4-5 resident programs per SM).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4
DEFAULT_SMS = 132  # H100/H200, used off-GPU (interpreter, ahead-of-time plans)

# Ahead-of-time compilation sets the target a CPU tensor stands for (kernels/aot.py); None: interpreter.
_aot_arch: int | None = None


def set_aot_arch(arch: int | None) -> None:
    global _aot_arch
    _aot_arch = arch


@functools.lru_cache(maxsize=16)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def device_arch(device: torch.device) -> int | None:
    """Compute capability as an int (90 for 9.0) of a CUDA device; the AOT target, or None, elsewhere."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return _aot_arch


def launch_options(kernel: str, head_dim: int, device: torch.device) -> dict:
    """num_warps, num_stages (and maxnreg) for a launch on ``device`` ({} in the interpreter, which
    ignores them)."""
    arch = device_arch(device)
    if arch is None:
        return {}
    family = max(80, min(100, arch // 10 * 10))
    warps, stages, maxnreg = _TABLE[(kernel, family, 64 if head_dim <= 64 else 256)]
    return {"num_warps": warps, "num_stages": stages} | ({"maxnreg": maxnreg} if maxnreg else {})


@functools.lru_cache(maxsize=16)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_SMS


def attended_lens(ctx_lens, window: int) -> list[int]:
    """What each decode attends to: its context, or at most ``window`` positions of it (0: no window)."""
    return [min(int(n), window) for n in ctx_lens] if window > 0 else [int(n) for n in ctx_lens]


def plan_decode_splits(ctx_lens, num_kv_heads: int, num_sms: int = DEFAULT_SMS, block_n: int = 64,
                       max_splits: int = MAX_SPLITS) -> np.ndarray:
    """Splits per sequence for a decode batch: int32 [S] from context lengths [S].

    Each sequence is cut into splits of about the same number of tokens, so one long sequence in a
    batch of short ones runs as many programs as its length calls for instead of one straggler. The
    split length fills the GPU (about PROGRAMS_PER_SM x SMs programs for the whole batch) but is no
    longer than the mean context (a big batch of short sequences already fills it, and a long
    sequence among them is then cut to their length) and no shorter than MIN_SPLIT_TOKENS."""
    ctx = np.maximum(np.asarray(ctx_lens, dtype=np.int64), 1)
    if ctx.size == 0:
        return np.zeros(0, dtype=np.int32)
    fill = math.ceil(int(ctx.sum()) * num_kv_heads / (PROGRAMS_PER_SM * num_sms))
    split_len = max(MIN_SPLIT_TOKENS, min(fill, math.ceil(float(ctx.mean()))))
    splits = np.minimum(-(-ctx // split_len), -(-ctx // block_n))  # never a split under one tile
    return np.clip(splits, 1, max_splits).astype(np.int32)


def graph_max_splits(batch: int, num_kv_heads: int, num_sms: int = DEFAULT_SMS) -> int:
    """The split grid a decode CUDA graph is captured with for ``batch`` rows (a graph's grid is fixed;
    plans are clamped to it). Four times the uniform batch's need, so a long sequence among short ones
    still gets several splits, while a program past its sequence's splits costs only its launch
    (a 256-row graph of an 8-KV-head model launches 256 x 8 x 4 programs, ~1/4 of them working)."""
    uniform = math.ceil(PROGRAMS_PER_SM * num_sms / max(1, batch * num_kv_heads))
    return max(1, min(MAX_SPLITS, 4 * uniform))
