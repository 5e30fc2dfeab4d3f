"""README's table of hybrid and MLA models: each preset replayed on the shipped chat trace with its KV
cache groups (vLLM's hybrid KV cache manager) and again with --disable-hybrid-kv-cache-manager (every
layer allocated as full attention, one group, the compute still windowed), at the same KV memory per GPU.

    python benchmarks/hybrid_table.py [--kv-mem-per-gpu 4GiB] [--out runs/hybrid] [--trace traces/chat.jsonl]
        [--time-scale 0.05] [--max-model-len 8192]

Prints a markdown table: the groups and their KV bytes per token, the pool in blocks, peak and mean
running sequences, prefix hit rate, preemptions and TPOT / TTFT p50 on the sim's H200 cost model. No
published measurement covers these models' latencies: they are the cost model's, unvalidated.
"""
from __future__ import annotations

import argparse
import os

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.engine.sizes import parse_size
from kvbench.errors import InputError, RunError

MODELS = (("gpt-oss-120b", 1), ("gemma-3-27b", 1), ("llama-4-scout", 4), ("deepseek-v3", 8),
          ("qwen3-next-80b-a3b", 2), ("granite-4.0-h-tiny", 1))


def run(trace: str, model: str, tp: int, kv_mem: int, disabled: bool, out: str, scale: float,
        max_len: int) -> tuple[dict, Replay]:
    cfg = ReplayConfig(executor="sim", model=model, tp=tp, kv_mem=str(kv_mem * tp), max_model_len=max_len,
                       time_scale=scale, disable_hybrid_kv_cache_manager=disabled)
    rp = Replay(trace, cfg, os.path.join(out, f"{model}{'-as-full' if disabled else ''}"), force=True)
    return rp.run(), rp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="traces/chat.jsonl")
    ap.add_argument("--kv-mem-per-gpu", default="4GiB")
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--out", default="runs/hybrid")
    a = ap.parse_args()
    per_gpu = parse_size(a.kv_mem_per_gpu)
    print(f"{a.trace} at x{1 / a.time_scale:g} arrivals, max-model-len {a.max_model_len}, "
          f"{a.kv_mem_per_gpu} of KV per GPU, H200 cost model\n")
    print("| model (GPUs) | KV cache groups (KV bytes per token per GPU) | allocated | blocks | peak / mean running "
          "| preemptions | prefix hit rate | TPOT p50 (unvalidated) | TTFT p50 (unvalidated) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, tp in MODELS:
        for disabled in (False, True):
            try:
                s, rp = run(a.trace, model, tp, per_gpu, disabled, a.out, a.time_scale, a.max_model_len)
            except InputError as e:  # a recurrent state cannot be allocated as attention
                if not disabled:
                    raise
                print(f"| {model} ({tp}) | | as full attention | not possible: {str(e).split(': ', 1)[-1]} "
                      "| | | | | |", flush=True)
                continue
            except RunError as e:  # a request too large for this pool: the row says so
                print(f"| {model} ({tp}) | | {'as full attention' if disabled else 'by group'} | refused: "
                      f"{str(e).split(': ', 1)[-1]} | | | | | |", flush=True)
                continue
            layout = rp.kv_layout
            runs: list[list] = []  # equal groups in a row as one: "3 x (mamba x 12 (...))"
            for g in layout.groups:
                text = (f"{g.kind}{' ' + str(g.window) if g.window else ''} x {len(g.layers)} "
                        + (f"({g.spec.state_bytes * len(g.layers):,} B a sequence)" if g.kind == "mamba"
                           else f"({g.spec.bytes_per_token * len(g.layers):,} B)"))
                if runs and runs[-1][0] == text:
                    runs[-1][1] += 1
                else:
                    runs.append([text, 1])
            groups = ", ".join(t if n == 1 else f"{n} x ({t})" for t, n in runs)
            if layout.has_state:
                groups += f"; block {layout.block_size} tokens"
            how = "as full attention" if disabled else ("by group" if layout.is_hybrid else "one group")
            print(f"| {model} ({tp}) | {groups} | {how} | {s['num_blocks']:,} | {s['peak_running']} / "
                  f"{s['mean_running']:.1f} | {s['preemptions']} | {s['prefix_hit_rate']:.3f} | "
                  f"{s['tpot_ms_p50']:.1f} ms | {s['ttft_ms_p50']:,.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
