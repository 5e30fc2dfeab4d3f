"""Write a random-weight Llama matching kvbench's `tiny` preset (no tokenizer) for vLLM to serve.

Run with the vLLM venv's python: python make_tiny_llama.py OUT_DIR [--dtype float32|bfloat16] [--seed 0]
"""
import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# kvbench/executors/presets.py MODELS["tiny"]: 2 layers, hidden 128, 4 heads, 2 KV heads, head_dim 64,
# intermediate 344, vocab 32000, max_model_len 32768, rope_theta 5e5, rms_norm_eps 1e-5, untied.
TINY = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=344, vocab_size=32000, max_position_embeddings=32768,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(**TINY)
    model = LlamaForCausalLM(cfg).to(getattr(torch, a.dtype))
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {a.out}: LlamaForCausalLM {n} params, dtype {a.dtype}, seed {a.seed}")
    print(json.dumps({k: v for k, v in cfg.to_dict().items() if k in TINY or k == "rope_parameters"}))


if __name__ == "__main__":
    main()
