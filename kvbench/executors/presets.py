"""Model shapes and GPU presets shared by the sim and model executors.

A ModelSpec (kvbench.executors.model_config) is the part of a config that decides KV memory and step
cost. It comes from a preset name or from a Hugging Face ``config.json`` (a file or a model folder).
A GPUSpec holds a datasheet's figures (memory in the vendor's unit, GB = 10^9 bytes; dense bf16 and fp8
matrix rates; memory, GPU-to-GPU and host link bandwidths); the efficiencies (the achieved fraction of
each peak) and fixed costs below, fitted to published measurements, turn them into the sim executor's
default coefficients, until a calibration file replaces them with measured ones.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

from kvbench.errors import InputError
from kvbench.executors.hf_config import read_hf_config
from kvbench.executors.model_config import DTYPE_BYTES, ModelSpec, WeightQuant

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")  # presets' config.json
# (re-exported: the executors and the CLI read these names from here)
__all__ = ["DTYPE_BYTES", "GPUS", "MODELS", "SIM_MODELS", "GPUSpec", "ModelSpec", "WeightQuant", "available_host_bytes",
           "compute_dtype", "get_gpu", "get_model"]

MODELS: dict[str, ModelSpec] = {
    # A random-initialised toy that a CPU runs in seconds; GQA 4:2 like the real ones.
    "tiny": ModelSpec("tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                      intermediate_size=344, vocab_size=32000, max_model_len=32768),
    # Llama 3 / 3.1 8B share one architecture; the preset takes 3.1's 128k context so long traces fit.
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 32768,
                            rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
                            architecture="qwen2"),
    "mistral-7b": ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768, 32768,
                            rope_theta=1000000.0, architecture="mistral"),
}
# Mixture of experts (config.json of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B): 46.7B and
# 30.5B weights held, 12.9B and 3.3B run per token.
MODELS["mixtral-8x7b"] = ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 32768,
                                   rope_theta=1000000.0, architecture="mixtral", num_experts=8,
                                   experts_per_token=2, moe_intermediate_size=14336)
MODELS["qwen3-30b-a3b"] = ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, 40960,
                                    rope_theta=1000000.0, rms_norm_eps=1e-6, architecture="qwen3_moe",
                                    num_experts=128, experts_per_token=8, moe_intermediate_size=768)
# Qwen3 dense (config.json of Qwen/Qwen3-0.6B, -8B, -14B): GQA with 8 KV heads of 128 dims, no QKV bias
# (its per-head q/k norms are left out, as every norm is); the 0.6B ties its embedding.
MODELS["qwen3-0.6b"] = ModelSpec("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936, 40960, rope_theta=1000000.0,
                                 rms_norm_eps=1e-6, tie_word_embeddings=True, architecture="qwen3")
MODELS["qwen3-8b"] = ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, 40960, rope_theta=1000000.0,
                               rms_norm_eps=1e-6, architecture="qwen3")
MODELS["qwen3-14b"] = ModelSpec("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, 40960, rope_theta=1000000.0,
                                rms_norm_eps=1e-6, architecture="qwen3")
MODELS["llama-3.1-8b"] = replace(MODELS["llama-3-8b"], name="llama-3.1-8b")
MODELS["llama-3.1-70b"] = replace(MODELS["llama-3-70b"], name="llama-3.1-70b")
# Presets only the sim runs: the models people serve with sliding-window, chunked-local and latent
# attention and quantized weights, which the model executor's dense bf16 forward refuses
# (modeling.check_runnable). Each is read from its published config.json (configs/: openai/gpt-oss-20b
# and -120b, google/gemma-3-27b-it and meta-llama/Llama-4-Scout-17B-16E-Instruct (the language model
# under text_config), deepseek-ai/DeepSeek-V3), so the parser is what they go through. Two keep most of
# their layers as recurrent state: Qwen/Qwen3-Next-80B-A3B-Instruct (Gated DeltaNet, a full-attention
# layer in four) and ibm-granite/granite-4.0-h-tiny (Mamba-2, attention at layers 5, 15, 25, 35); their
# config.json written out here from the published files' fields.
HYBRID_PRESETS = ("gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b", "llama-4-scout", "deepseek-v3", "qwen3-next-80b-a3b",
                  "granite-4.0-h-tiny")
SIM_MODELS: dict[str, ModelSpec] = {name: read_hf_config(os.path.join(CONFIGS_DIR, f"{name}.json"), name=name)
                                    for name in HYBRID_PRESETS}


# What the sim's defaults add to a datasheet, fitted to published vLLM V1 measurements (H100, B200,
# MI300X; vLLM 0.9 to 0.19; benchmarks/published_check.py --fit, its errors in benchmarks/published/fitted.json), the
# same on every preset: one share of the tensor-core peak for every matmul, one share of the memory
# bandwidth for every read, and the fixed costs a step pays beyond its operations. The defaults model
# vLLM's GPU default, decode under CUDA graphs; most of the points fitted ran before async scheduling
# became the default, so the overheads are what those runs left on the critical path (on the one
# source that measured both, async scheduling was 3-5% faster). --eager adds each layer's launches.
MATMUL_EFFICIENCY = 0.667  # linear layers, LM head: GEMM tiles and waves, fp8 scaling, the engine's kernels
# Attention is not fitted: its rate is what published FlashAttention benchmarks print for a causal prefill
# of S tokens (head dim 128, bf16), peak x ATTN_EFFICIENCY x (1 - exp(-S / ATTN_RAMP_TOKENS)). FA3 on an
# H100 (tritonbench PR #1267, B=4, H=48: 141.6 / 368.4 / 1,236.9 / 4,817.4 us at S = 1k / 2k / 4k / 8k, i.e.
# 364 / 560 / 667 / 685 TFLOP/s) is within 4% of this curve; FA4 on Blackwell (flash-attention PR #2605,
# 829 / 1,172 / 1,431 TFLOP/s at 1k / 2k / 4k) reaches the same share of its peak along the same ramp.
# Short prefills stall on the causal diagonal's half-masked tiles and too few tiles per SM; long ones
# saturate. A chunk of n tokens after s cached is priced as S = 2 s + n (the keys per query of a fresh
# causal prefill of S, doubled: S for s = 0). Decode attention is bandwidth-bound at any length.
ATTN_EFFICIENCY = 0.707  # the plateau: the softmax between QK^T and PV keeps FA3 below the GEMM peak
ATTN_RAMP_TOKENS = 1395.0
MEM_EFFICIENCY = 0.831  # weight streaming: HBM refresh and bank conflicts keep a read below the pin rate
KV_EFFICIENCY = MEM_EFFICIENCY  # KV reads and writes: 16-token blocks gathered through the block table
LINK_EFFICIENCY = 0.80  # NCCL/RCCL ring all-reduce: ~80% of the NVLink/xGMI/PCIe per-direction rate (not fitted)
STEP_OVERHEAD_S = 1.35e-3  # per step: scheduling, input copies, sampling, the sampled tokens back to the host
SEQ_OVERHEAD_S = 77.3e-6  # per scheduled sequence per step: its input rows, sampler row and output
ALLREDUCE_LATENCY_S = 31.9e-6  # per all-reduce: a small message's launch and handshake across the group
# Per layer per step without CUDA graphs (--eager): its kernels launched from Python one by one.
# Estimated (not fitted) from the one source that ran a burst under piecewise graphs (attention
# launched eagerly) and under full graphs: a lower bound for a wholly eager layer.
LAYER_OVERHEAD_S = 95e-6
# The API server's front end (vLLM's API process: HTTP, the chat template, tokenising a text prompt,
# validation; then the hops to the engine core and the first token's way back), fitted with the overheads
# above. Each request takes REQUEST_S + REQUEST_TOKEN_S x its prompt in its replica's API process, one
# request at a time (the point that pins it: 1,000 short chat requests through vLLM 0.11 took 22.7 s,
# the API process's pace), then REQUEST_LATENCY_S holding no other request; at low load TTFT is mostly
# their sum (34 ms for 500 tokens). The corpus disagrees by version here: vLLM ~0.9.2 (completions) left
# ~16 ms of a 45 ms TTFT to it, vLLM 0.11 (chat) ~50 ms of 60. Not paid with --no-front-end (vLLM's
# offline LLM class).
REQUEST_S = 22.3e-3
REQUEST_TOKEN_S = 0.69e-6  # tokenising: the long prompts leave it near nothing
REQUEST_LATENCY_S = 11.4e-3
GPU_MEMORY_UTILIZATION = 0.9  # share of device memory for weights + activations + KV (vLLM's default)


def compute_dtype(weight_dtype: str) -> str:
    """The dtype activations, the embedding and the LM head are in: bf16 under fp8 weights."""
    return "bf16" if weight_dtype == "fp8" else weight_dtype


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """A datasheet's peaks (one GPU); the sim's coefficients are these x the fitted factors above."""

    name: str
    mem_bytes: int  # device memory, as the vendor states it (GB = 10^9 bytes)
    peak_bf16_flops: float  # dense bf16 tensor-core FLOP/s (the datasheet's "with sparsity" figure / 2)
    peak_fp8_flops: float | None  # dense fp8 tensor-core FLOP/s; None: no fp8 tensor cores
    peak_mem_bw: float  # HBM/GDDR bytes/s
    peak_link_bw: float  # GPU-to-GPU bytes/s per direction (NVLink, xGMI; PCIe where there is none)
    peak_pcie_bw: float  # host<->device bytes/s per direction (KV offload)

    def matmul_rate(self, weight_dtype: str = "bf16") -> float:
        """FLOP/s of the linear layers: fp8 weights on fp8 tensor cores; without them (A100) vLLM
        multiplies fp8 weights in bf16 (weight-only FP8 Marlin kernels), at the bf16 rate."""
        fp8 = weight_dtype == "fp8" and self.peak_fp8_flops is not None
        return (self.peak_fp8_flops if fp8 else self.peak_bf16_flops) * MATMUL_EFFICIENCY

    @property
    def matmul_flops(self) -> float:
        return self.matmul_rate("bf16")

    @property
    def attn_flops(self) -> float:
        return self.peak_bf16_flops * ATTN_EFFICIENCY

    @property
    def mem_bw(self) -> float:
        return self.peak_mem_bw * MEM_EFFICIENCY

    @property
    def kv_bw(self) -> float:
        return self.peak_mem_bw * KV_EFFICIENCY

    @property
    def link_bw(self) -> float:
        return self.peak_link_bw * LINK_EFFICIENCY

    @property
    def pcie_bw(self) -> float:
        return self.peak_pcie_bw * LINK_EFFICIENCY

    @property
    def step_overhead_s(self) -> float:
        return STEP_OVERHEAD_S

    @property
    def seq_overhead_s(self) -> float:
        return SEQ_OVERHEAD_S

    @property
    def layer_overhead_s(self) -> float:
        return LAYER_OVERHEAD_S

    @property
    def allreduce_latency_s(self) -> float:
        return ALLREDUCE_LATENCY_S

    @property
    def attn_ramp_tokens(self) -> float:
        return ATTN_RAMP_TOKENS

    @property
    def request_s(self) -> float:
        return REQUEST_S

    @property
    def request_token_s(self) -> float:
        return REQUEST_TOKEN_S

    @property
    def request_latency_s(self) -> float:
        return REQUEST_LATENCY_S

    def to_dict(self) -> dict:
        return {**asdict(self), "matmul_flops": self.matmul_flops, "attn_flops": self.attn_flops,
                "mem_bw": self.mem_bw, "kv_bw": self.kv_bw, "link_bw": self.link_bw, "pcie_bw": self.pcie_bw}


GB = 10**9
TB = 10**12
GPUS: dict[str, GPUSpec] = {
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS and FP8
    # 3,958 TFLOPS with sparsity (989.5 and 1,979 dense), NVLink 900 GB/s (450 per direction), PCIe Gen5
    # 128 GB/s (64 per direction).
    "h200": GPUSpec("h200", 141 * GB, 989.5e12, 1979e12, 4.8 * TB, 450 * GB, 64 * GB),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 80 GB HBM3, 3.35 TB/s, BF16 1,979 and FP8 3,958 TFLOPS
    # with sparsity, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    "h100": GPUSpec("h100", 80 * GB, 989.5e12, 1979e12, 3.35 * TB, 450 * GB, 64 * GB),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS dense
    # (624 with sparsity), no FP8, NVLink 600 GB/s (300 per direction), PCIe Gen4 64 GB/s (32 per direction).
    "a100": GPUSpec("a100", 80 * GB, 312e12, None, 2039 * GB, 300 * GB, 32 * GB),
    # The same datasheet's 40GB SXM: 40 GB HBM2, 1,555 GB/s; rates and links as the 80 GB part.
    "a100-40gb": GPUSpec("a100-40gb", 40 * GB, 312e12, None, 1555 * GB, 300 * GB, 32 * GB),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362.05 TFLOPS dense (733 with sparsity), FP8
    # 733 dense (1,466 with sparsity), no NVLink: GPUs talk over PCIe Gen4 x16, 32 GB/s per direction.
    "l40s": GPUSpec("l40s", 48 * GB, 362.05e12, 733e12, 864 * GB, 32 * GB, 32 * GB),
    # NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS and FP8 485 TFLOPS with
    # sparsity (121 and 242.5 dense), no NVLink: PCIe Gen4 x16, 32 GB/s per direction.
    "l4": GPUSpec("l4", 24 * GB, 121e12, 242.5e12, 300 * GB, 32 * GB, 32 * GB),
    # NVIDIA DGX B200 datasheet, per GPU (of eight): 180 GB HBM3e (1,440 GB), 8 TB/s (64 TB/s), FP8
    # 9 PFLOPS with sparsity (72; 4.5 dense), BF16 half that (2.25 dense), NVLink 5 1.8 TB/s (14.4 TB/s
    # over two NVSwitches; 900 GB/s per direction), PCIe Gen5 x16 to the host (64 GB/s per direction).
    "b200": GPUSpec("b200", 180 * GB, 2250e12, 4500e12, 8 * TB, 900 * GB, 64 * GB),
    # NVIDIA H20 (HGX H20, as server vendors publish it; NVIDIA gives no public datasheet): 96 GB HBM3,
    # 4.0 TB/s, BF16 148 TFLOPS and FP8 296 TFLOPS dense, NVLink 900 GB/s, PCIe Gen5 x16.
    "h20": GPUSpec("h20", 96 * GB, 148e12, 296e12, 4.0 * TB, 450 * GB, 64 * GB),
    # AMD Instinct MI300X data sheet: 192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS and FP8 2,614.9 TFLOPS dense
    # (twice that with sparsity), seven Infinity Fabric links of 128 GB/s (64 per direction each; a ring
    # over eight GPUs of a fully connected board uses all seven: 448 per direction), PCIe Gen5 x16.
    "mi300x": GPUSpec("mi300x", 192 * GB, 1307.4e12, 2614.9e12, 5.3 * TB, 448 * GB, 64 * GB),
}


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or the shape in a Hugging Face config.json (file or model folder)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    if name_or_path in SIM_MODELS:
        return SIM_MODELS[name_or_path]
    if os.path.exists(name_or_path):
        return read_hf_config(name_or_path)
    raise InputError(f"unknown model {name_or_path!r} (presets: {', '.join(sorted([*MODELS, *SIM_MODELS]))}; "
                     "or a path to a config.json or model folder)", field="--model")


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise InputError(f"unknown GPU preset {name!r} (presets: {', '.join(GPUS)})",
                         field="--gpu") from None


def available_host_bytes() -> int | None:
    """Bytes of host memory available now (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
