"""The sim's decode step on a GPU preset as context grows: step time, its operations, and the memory
bandwidth it implies (the README's table). Nothing is timed: these are the cost model's figures.

    python benchmarks/sim_decode_table.py [--model llama-3-8b] [--gpu h200] [--tp 1] [--batch 64]
        [--contexts 1024,4096,16384] [--calibration FILE]

Bytes moved per step = weights read (linear layers + LM head) + KV read (every decode's context) + KV
and embedding rows written. Achieved bandwidth = bytes moved / step time, per GPU; its share of the
datasheet peak is below the derating factor by the time the step spends on FLOPs, all-reduces and
the fixed overhead.
"""
from __future__ import annotations

import argparse

from kvbench.executors.presets import get_gpu, get_model
from kvbench.executors.sim import make_sim
from kvbench.scheduler.batch import StepBatch


def decode_batch(batch: int, context: int) -> StepBatch:
    """``batch`` sequences each decoding its token ``context`` (attending to ``context`` keys)."""
    b = StepBatch(block_size=16)
    b.decode_seq_ids.extend(range(batch))
    b.decode_positions.extend([context - 1] * batch)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--calibration", default=None)
    a = ap.parse_args()
    gpu = get_gpu(a.gpu)
    ex = make_sim(get_model(a.model), gpu, a.calibration, tp=a.tp)
    print(f"{a.model} on {a.tp} x {a.gpu} ({'calibration ' + a.calibration if a.calibration else 'preset'}), "
          f"decode batch {a.batch}; per GPU, bf16")
    print(f"{'context':>8} {'KV read GB':>11} {'weights GB':>11} {'step ms':>8} {'attn ms':>8} "
          f"{'linear ms':>10} {'tok/s':>8} {'achieved TB/s':>14} {'of peak':>8}")
    pool = ex.default_kv_bytes()
    for ctx in (int(c) for c in a.contexts.split(",")):
        b = decode_batch(a.batch, ctx)
        w, ops = ex.work(b), ex.breakdown(b)
        step_s = sum(ops.values())
        moved = w.linear_bytes + w.lm_head_bytes + w.decode_bytes + w.kv_write_bytes
        bw = moved / step_s
        print(f"{ctx:>8,} {w.decode_bytes / 1e9:>11.2f} {(w.linear_bytes + w.lm_head_bytes) / 1e9:>11.2f} "
              f"{step_s * 1e3:>8.2f} {ops['decode'] * 1e3:>8.2f} {ops['linear'] * 1e3:>10.2f} "
              f"{a.batch / step_s:>8,.0f} {bw / 1e12:>14.2f} {bw / gpu.peak_mem_bw:>8.0%}"
              + ("  *" if w.decode_bytes * a.tp > pool else ""))
    if any(a.batch * int(c) * ex.kv_bytes_per_token() > pool for c in a.contexts.split(",")):
        print(f"* more KV than the default pool holds ({pool / 1e9:.1f} GB over {a.tp} GPU(s)): a replay "
              "would run fewer of these sequences at once")


if __name__ == "__main__":
    main()
