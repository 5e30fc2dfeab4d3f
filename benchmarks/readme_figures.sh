#!/usr/bin/env bash
# Re-measure the figures README.md quotes from the engine (its tables of layouts, token eviction and
# routing), with the very commands README shows; prints markdown tables.
#   bash benchmarks/readme_figures.sh            # ~6 minutes on 2 cores (the Mooncake routing table: +10)
#   ROUTING=0 bash benchmarks/readme_figures.sh  # without the whole-Mooncake routing table
# Runs go to runs/readme (git ignores runs/). Other README tables have their own scripts:
# benchmarks/bench_replay.py, bench_whatif.py, bench_ideal.py, bench_block_pool.py, kernel_resources.py,
# sim_decode_table.py, published_check.py; the tiers table is README's own sweep command.
set -euo pipefail
cd "$(dirname "$0")/.."
R=runs/readme
rm -rf "$R"; mkdir -p "$R"
SIM=(--executor sim --model llama-3-8b)

echo "## layouts: chat, max-model-len 8192, 4,096 blocks, arrivals 20x"
for layout in slab paged; do
  kvbench replay traces/chat.jsonl "${SIM[@]}" --layout $layout \
    --max-model-len 8192 --num-blocks 4096 --time-scale 0.05 --no-prefix-cache --out $R/chat-$layout --json >/dev/null
done
for mode in hash radix; do
  kvbench replay traces/chat.jsonl "${SIM[@]}" --max-model-len 8192 \
    --num-blocks 4096 --time-scale 0.05 --prefix-mode $mode --out $R/chat-paged-$mode --json >/dev/null
done

echo "## token eviction: 100 long single-turn chats, 3,000 blocks, budget 0.2"
kvbench trace gen chat --requests 100 --rate 20 --seed 4 --output-len 1500 --turns 1 --system-len 300 -o $R/long.jsonl
kvbench sweep $R/long.jsonl "${SIM[@]}" --num-blocks 3000 --kv-budget 0.2 \
    --eviction none,streaming,h2o,infinigen --out $R/long-eviction -j 2 >/dev/null

echo "## hybrid and MLA models: chat at 20x, 4 GiB of KV per GPU; the Mooncake slice, 16 GiB per GPU"
python benchmarks/hybrid_table.py --out $R/hybrid-chat
python benchmarks/hybrid_table.py --trace traces/mooncake_slice.jsonl --time-scale 1 --max-model-len 131072 \
    --kv-mem-per-gpu 16GiB --out $R/hybrid-mooncake

echo "## attention mass kept: tiny model on the CPU, first 8 requests"
for t in agent chat; do
  kvbench sweep traces/$t.jsonl --executor model --device cpu --limit 8 \
      --eviction none,streaming,h2o,infinigen --kv-budget 0.2 --out $R/$t-eviction-model -j 2 >/dev/null
done

python - "$R" <<'EOF'
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
s = lambda d: json.loads((d / "summary.json").read_text())
print("\n| layout | internal fragmentation | KV utilisation | mean / peak running | output tok/s | TTFT p50 | TTFT p99 | hit rate |")
print("|---|---|---|---|---|---|---|---|")
def ms(v):
    return f"{v / 1e3:.1f} s" if v >= 1000 else f"{v:.0f} ms"
for name, label in (("chat-slab", "slab"), ("chat-paged", "paged, no prefix cache"),
                    ("chat-paged-hash", "paged, prefix cache (hash)"), ("chat-paged-radix", "paged, prefix cache (radix)")):
    x = s(R / name)
    print(f"| {label} | {x['internal_frag']:.4f} | {x['kv_util']:.3f} | {x['mean_running']:.1f} / {x['peak_running']} "
          f"| {x['output_tok_per_s']:,.0f} | {ms(x['ttft_ms_p50'])} | {ms(x['ttft_ms_p99'])} | {x['prefix_hit_rate']:.3f} (ideal {x['ideal_hit_rate']:.3f}) |")
print(f"slab reservation: {s(R / 'chat-slab')['slab_reserve_tokens']} tokens")
print("\n| eviction | mean / peak running | preemptions | output tok/s | E2E p50 | evicted / recalled tokens |")
print("|---|---|---|---|---|---|")
for d in sorted((R / "long-eviction").iterdir()):
    if d.is_dir():
        x = s(d)
        print(f"| {d.name} | {x['mean_running']:.1f} / {x['peak_running']} | {x['preemptions']} | {x['output_tok_per_s']:,.0f} "
              f"| {x['e2e_ms_p50'] / 1e3:.1f} s | {x['evicted_tokens']:,} / {x['recalled_tokens']:,} |")
print("\n| trace | run | attention mass kept | recalled / offloaded |")
print("|---|---|---|---|")
for t in ("agent", "chat"):
    for d in sorted((R / f"{t}-eviction-model").iterdir()):
        if d.is_dir():
            x = s(d)
            m = x.get("attention_mass_kept")
            print(f"| {t} | {d.name} | {'-' if m is None else f'{m:.3f}'} | {x['recalled_tokens']:,} / {x['offloaded_tokens']:,} |")
EOF

if [ "${ROUTING:-1}" != 0 ]; then
  echo "## routing: whole Mooncake conversation trace, 4 replicas"
  python benchmarks/bench_routing.py --replicas 4 --routers least-loaded,kv-aware,kv-aware:16,round-robin,prefix:64,prefix
fi
