#!/usr/bin/env bash
# Regenerate reports/example from the shipped traces (run it whenever the report's output changes):
#   bash reports/make_example.sh
# KVBENCH_EXAMPLE_RUNS and KVBENCH_EXAMPLE_OUT put the runs and the report elsewhere (the slow test
# in tests/test_report.py renders it into a temporary directory).
# Sim sweeps (Llama-3-8B on an H200 cost model, memory small enough to bind), model-executor runs, then
# the report, which draws one section per comparable group of runs:
#  - chat: block size 8,16,32,64 x layout paged,slab x prefix cache on,off at 10x the trace's rate
#    in 4 GiB of KV: slab fits 4 sequences of 8192 slots, paged fits what the tokens need. Its
#    headline figure, chat-overview.png, is the README's first image.
#  - agent: block size 16,64 x cache policy lru,fifo,lfu,belady in 3 GiB, where cached agent
#    scaffolds must be reclaimed and the policy decides which; token eviction none,streaming,h2o,
#    infinigen at a 20% KV budget in the same group (same trace, model, GPU and pool).
#  - agent and chat, tiny model on the CPU, first 8 requests: token eviction with the attention mass
#    each policy keeps measured (groups of their own: another model, executor and request count).
#  - chat: the cache what-if curve (hit rate against KV budget and policy).
#  - chat at 20x on 1, 2 and 4 replicas, three routers: the routing chart.
#  - chat at 10x in 2 GiB with a CPU tier of 0, 4 or 16 GiB, write-through or write-back: the tiers chart.
# The run directories (about 20 MB of parquet) go to runs/example, which git ignores.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${KVBENCH_EXAMPLE_RUNS:-runs/example}
OUT=${KVBENCH_EXAMPLE_OUT:-reports/example}
JOBS=${JOBS:-2}
SIM=(--executor sim --model llama-3-8b --gpu h200)
rm -rf "$RUNS" "$OUT"

kvbench sweep traces/chat.jsonl "${SIM[@]}" --max-model-len 8192 --kv-mem 4GiB --time-scale 0.1 \
    --layout paged,slab --block-size 8,16,32,64 --prefix-cache on,off -j "$JOBS" --out "$RUNS/chat"
kvbench sweep traces/agent.jsonl "${SIM[@]}" --max-model-len 16384 --kv-mem 3GiB \
    --layout paged,slab --block-size 16,64 --cache-policy lru,fifo,lfu,belady -j "$JOBS" --out "$RUNS/agent"
# token eviction on the agent trace at a 20% budget, and the what-if curve of the chat trace
kvbench sweep traces/agent.jsonl "${SIM[@]}" --max-model-len 16384 --kv-mem 3GiB \
    --eviction none,streaming,h2o,infinigen --kv-budget 0.2 -j "$JOBS" --out "$RUNS/agent-eviction"
# the same on the real model executor (tiny model, CPU, 8 requests): attention mass kept is measured
kvbench sweep traces/agent.jsonl --executor model --device cpu --limit 8 \
    --eviction none,streaming,h2o,infinigen --kv-budget 0.2 -j "$JOBS" --out "$RUNS/agent-eviction-model"
kvbench sweep traces/chat.jsonl --executor model --device cpu --limit 8 \
    --eviction none,streaming,h2o,infinigen --kv-budget 0.2 -j "$JOBS" --out "$RUNS/chat-eviction-model"
kvbench trace whatif traces/chat.jsonl --block-size 16 --model llama-3-8b \
    --budgets 256MiB,512MiB,1GiB,2GiB,4GiB --out "$RUNS/chat-whatif"
# routing: the chat trace at 20x its rate on 1, 2 and 4 replicas of 2 GiB each, three routers
kvbench sweep traces/chat.jsonl "${SIM[@]}" --max-model-len 8192 --kv-mem 2GiB --time-scale 0.05 \
    --replicas 1,2,4 --router round-robin,least-loaded,kv-aware -j "$JOBS" --out "$RUNS/chat-routing"
# prefix-cache tiers: a CPU tier of 4 or 16 GiB behind a 2 GiB pool, written through or back: the tiers chart
kvbench sweep traces/chat.jsonl "${SIM[@]}" --max-model-len 8192 --kv-mem 2GiB --time-scale 0.1 \
    --cpu-kv-mem 0,4GiB,16GiB --offload write-through,write-back -j "$JOBS" --out "$RUNS/chat-tiers"
kvbench report "$RUNS/chat" "$RUNS/agent" "$RUNS/agent-eviction" "$RUNS/agent-eviction-model" \
    "$RUNS/chat-eviction-model" "$RUNS/chat-whatif" "$RUNS/chat-routing" "$RUNS/chat-tiers" --out "$OUT" \
    --title "kvbench example: paged vs slab, block size, prefix caching (sim, Llama-3-8B, H200)"
