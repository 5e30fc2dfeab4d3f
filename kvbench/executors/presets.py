"""Model shapes and GPU presets shared by the sim and model executors.

A ModelSpec is the part of a Llama-family config that decides KV memory and step cost. It comes from a
preset name or from a Hugging Face ``config.json`` (a file or a model folder). GPU presets hold the
datasheet memory size and *achievable* rates (roughly what a tuned GEMM and a streaming copy reach,
not peak): the sim executor's defaults until ``kvbench calibrate`` replaces them with measured ones.
"""
from __future__ import annotations

import json
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

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """K and V of one token over all layers: layers x KV heads x head dim x 2 x dtype bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * DTYPE_BYTES[dtype]

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        mlp = 3 * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + emb + h

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
MODELS["llama-3.1-8b"] = replace(MODELS["llama-3-8b"], name="llama-3.1-8b")
MODELS["llama-3.1-70b"] = replace(MODELS["llama-3-70b"], name="llama-3.1-70b")


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    mem_bytes: int
    matmul_flops: float  # achievable dense bf16 FLOP/s
    mem_bw: float  # achievable HBM bytes/s
    pcie_bw: float  # achievable host<->device bytes/s (KV offload)
    step_overhead_s: float  # per-step fixed cost: scheduling, launch, sampling

    def to_dict(self) -> dict:
        return asdict(self)


GB = 10**9
GPUS: dict[str, GPUSpec] = {
    "h200": GPUSpec("h200", 141 * GB, 700e12, 4.2e12, 50e9, 4e-3),
    "h100": GPUSpec("h100", 80 * GB, 660e12, 2.9e12, 50e9, 4e-3),
    "a100": GPUSpec("a100", 80 * GB, 250e12, 1.7e12, 24e9, 5e-3),
    "l40s": GPUSpec("l40s", 48 * GB, 250e12, 0.75e12, 24e9, 5e-3),
}


def _from_hf_config(path: str) -> ModelSpec:
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            c = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read model config: {e}", file=cfg_path) from None
    try:
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        arch = (c.get("model_type") or "llama").lower()
        return ModelSpec(
            name=os.path.basename(os.path.normpath(path)),
            num_layers=c["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or hidden // heads,
            intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
            max_model_len=c.get("max_position_embeddings", 4096),
            # transformers 5 writes rope_parameters: {rope_theta: ...}; older configs a top-level key
            rope_theta=float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
                             or 10000.0),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            qkv_bias=bool(c.get("attention_bias", arch == "qwen2")),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            architecture=arch,
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
