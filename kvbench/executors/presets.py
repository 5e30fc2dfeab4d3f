"""Model shapes and GPU presets shared by the sim and model executors.

A ModelSpec is the part of a Llama-family config that decides KV memory and step cost, mixture-of-experts
(Mixtral, Qwen MoE) included. It comes from a preset name or from a Hugging Face ``config.json`` (a file
or a model folder). A GPUSpec holds a datasheet's figures (memory in the vendor's unit, GB = 10^9 bytes;
dense bf16 and fp8 matrix rates; memory, GPU-to-GPU and host link bandwidths); the efficiencies (the
achieved fraction of each peak) and fixed costs below, fitted to published measurements, turn them into
the sim executor's default coefficients, until a calibration file replaces them with measured ones.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

from kvbench.errors import InputError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    tie_word_embeddings: bool = False
    architecture: str = "llama"  # llama | qwen2 | mistral (all the same block for our purposes)
    # Mixture of experts (0 = dense): every layer's MLP is num_experts experts of moe_intermediate_size,
    # experts_per_token of them run per token, plus an always-on shared expert (Qwen2-MoE) when
    # shared_expert_intermediate_size > 0. intermediate_size is then unused.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """K and V of one token over all layers: layers x KV heads x head dim x 2 x dtype bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * DTYPE_BYTES[dtype]

    def mlp_params(self, active: bool = False) -> int:
        """One layer's MLP weights: dense gate/up/down (3 x hidden x intermediate); MoE: every expert
        (``active``: the experts_per_token a token runs), the shared expert and its gate, the router."""
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        return experts * 3 * h * self.moe_intermediate_size + shared + h * self.num_experts

    @property
    def num_params(self) -> int:
        """Every weight (all experts of a MoE), embedding and LM head included."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + self.mlp_params() + 2 * h) + emb + h

    def weight_bytes(self, dtype: str = "bf16") -> int:
        return self.num_params * DTYPE_BYTES[dtype]

    def to_dict(self) -> dict:
        return asdict(self)


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
MODELS["llama-3.1-8b"] = replace(MODELS["llama-3-8b"], name="llama-3.1-8b")
MODELS["llama-3.1-70b"] = replace(MODELS["llama-3-70b"], name="llama-3.1-70b")


# What the sim's defaults add to a datasheet, fitted to published vLLM V1 measurements (H100, B200,
# MI300X; benchmarks/published_check.py --fit, its errors in benchmarks/published/fitted.json), the
# same on every preset: one share of the tensor-core peak for every matmul, one share of the memory
# bandwidth for every read, and the fixed costs a step pays beyond its operations. The defaults model
# vLLM's GPU default, decode under CUDA graphs; most of the points fitted ran before async scheduling
# became the default, so the overheads are what those runs left on the critical path (on the one
# source that measured both, async scheduling was 3-5% faster). --eager adds each layer's launches.
MATMUL_EFFICIENCY = 0.462  # linear layers, LM head: GEMM tiles and waves, fp8 scaling, the engine's kernels
ATTN_EFFICIENCY = MATMUL_EFFICIENCY  # attention: the softmax between QK^T and PV stalls the tensor cores
MEM_EFFICIENCY = 0.884  # weight streaming: HBM refresh and bank conflicts keep a read below the pin rate
KV_EFFICIENCY = MEM_EFFICIENCY  # KV reads and writes: 16-token blocks gathered through the block table
LINK_EFFICIENCY = 0.80  # NCCL/RCCL ring all-reduce: ~80% of the NVLink/xGMI/PCIe per-direction rate (not fitted)
STEP_OVERHEAD_S = 1.83e-3  # per step: scheduling, input copies, sampling, the sampled tokens back to the host
SEQ_OVERHEAD_S = 72.7e-6  # per scheduled sequence per step: its input rows, sampler row and output
ALLREDUCE_LATENCY_S = 34.3e-6  # per all-reduce: a small message's launch and handshake across the group
# Per layer per step without CUDA graphs (--eager): its kernels launched from Python one by one.
# Estimated (not fitted) from the one source that ran a burst under piecewise graphs (attention
# launched eagerly) and under full graphs: a lower bound for a wholly eager layer.
LAYER_OVERHEAD_S = 114e-6
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


_POSITIVE_INT_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                        "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size")
_MAY_BE_ZERO = ("num_local_experts", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size")


def _positive_float(v, cfg_path: str, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InputError(f"must be a positive number, got {v!r}", file=cfg_path, field=field)
    return float(v)


def _from_hf_config(path: str) -> ModelSpec:
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            c = json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 text
        raise InputError(f"cannot read model config: {e}", file=cfg_path) from None
    if not isinstance(c, dict):
        raise InputError("must be a JSON object", file=cfg_path)
    for key in _POSITIVE_INT_FIELDS:
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if key in _MAY_BE_ZERO else 1)):
            raise InputError(f"must be a positive integer, got {v!r}", file=cfg_path, field=key)
    try:
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        arch = (c.get("model_type") or "llama").lower()
        # Mixtral names its experts num_local_experts, each of intermediate_size; Qwen MoE num_experts,
        # each of moe_intermediate_size, plus a shared expert.
        experts = c.get("num_local_experts") or c.get("num_experts") or 0
        per_token = (c.get("num_experts_per_tok") or 0) if experts else 0
        head_dim = c.get("head_dim") or hidden // heads
        if head_dim < 1:
            raise InputError(f"hidden_size {hidden} over {heads} heads leaves no head dimension: give head_dim",
                             file=cfg_path, field="hidden_size")
        if experts and not 1 <= per_token <= experts:
            raise InputError(f"must be in [1, {experts}] for a model of {experts} experts, got {per_token!r}",
                             file=cfg_path, field="num_experts_per_tok")
        return ModelSpec(
            name=os.path.basename(os.path.normpath(path)),
            num_layers=c["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,  # absent or null: one per query head
            head_dim=head_dim,
            intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
            max_model_len=c.get("max_position_embeddings", 4096),
            # transformers 5 writes rope_parameters: {rope_theta: ...}; older configs a top-level key
            rope_theta=_positive_float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
                                       or 10000.0, cfg_path, "rope_theta"),
            rms_norm_eps=_positive_float(c.get("rms_norm_eps", 1e-6), cfg_path, "rms_norm_eps"),
            qkv_bias=bool(c.get("attention_bias", arch == "qwen2")),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            architecture=arch,
            num_experts=experts, experts_per_token=per_token,
            moe_intermediate_size=(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0,
            shared_expert_intermediate_size=(c.get("shared_expert_intermediate_size") or 0) if experts else 0,
        )
    except KeyError as e:
        raise InputError("required field missing", file=cfg_path, field=e.args[0]) from None


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or the shape in a Hugging Face config.json (file or model folder)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    if os.path.exists(name_or_path):
        return _from_hf_config(name_or_path)
    raise InputError(f"unknown model {name_or_path!r} (presets: {', '.join(sorted(MODELS))}; "
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
