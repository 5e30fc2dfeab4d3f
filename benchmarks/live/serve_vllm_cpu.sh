#!/usr/bin/env bash
# Start a CPU vLLM OpenAI-compatible server on the tiny random Llama and wait until it answers.
#
#   benchmarks/live/serve_vllm_cpu.sh [PORT] [extra vllm args...]
#
# Settings come from the environment (defaults in brackets):
#   VLLM_VENV [.venv-vllm]              venv made by setup_vllm_cpu.sh
#   MODEL_DIR [/tmp/kvbench-tiny-llama] model folder made by setup_vllm_cpu.sh
#   BLOCK_SIZE [32]                     must be a multiple of 32 on CPU
#   NUM_GPU_BLOCKS [256]                --num-gpu-blocks-override (the KV pool, in blocks)
#   MAX_NUM_SEQS [128]  MAX_NUM_BATCHED_TOKENS [2048]  MAX_MODEL_LEN [4096]
#   PREFIX_CACHING [1]                  1: --enable-prefix-caching, 0: --no-enable-prefix-caching
#   DTYPE [auto]                        auto = bfloat16 on CPU (vLLM downcasts float32 weights)
#   KV_SPACE_GIB [1]                    VLLM_CPU_KVCACHE_SPACE (GiB, integer); must hold NUM_GPU_BLOCKS
#   PIN_CPUS [1]                        taskset CPU list for the whole server (empty: no taskset);
#                                       the OpenMP threads are bound to the same list
#   API_CPUS []                         once it is up, move the API server process (HTTP, request
#                                       parsing, streaming; not the engine core or its worker) to
#                                       this CPU list, as a GPU server's API process runs on host
#                                       cores of its own (empty: it stays on PIN_CPUS, taking CPU
#                                       time from the engine's steps)
#   LOG [/tmp/vllm-cpu-PORT.log]  PIDFILE [/tmp/vllm-cpu-PORT.pid]  WAIT_S [300]
#
# Prints the server's PID (also its process group: stop it with `kill -- -PID`) on the last line.
set -euo pipefail

PORT="${1:-8000}"
shift || true
VLLM_VENV="${VLLM_VENV:-.venv-vllm}"
export -n VLLM_VENV  # vLLM warns about unknown VLLM_* variables in its environment
MODEL_DIR="${MODEL_DIR:-/tmp/kvbench-tiny-llama}"
BLOCK_SIZE="${BLOCK_SIZE:-32}"
NUM_GPU_BLOCKS="${NUM_GPU_BLOCKS:-256}"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-128}"
MAX_NUM_BATCHED_TOKENS="${MAX_NUM_BATCHED_TOKENS:-2048}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"
PREFIX_CACHING="${PREFIX_CACHING:-1}"
DTYPE="${DTYPE:-auto}"
KV_SPACE_GIB="${KV_SPACE_GIB:-1}"
PIN_CPUS="${PIN_CPUS-1}"
API_CPUS="${API_CPUS-}"
LOG="${LOG:-/tmp/vllm-cpu-$PORT.log}"
PIDFILE="${PIDFILE:-/tmp/vllm-cpu-$PORT.pid}"
WAIT_S="${WAIT_S:-300}"

[ -d "$VLLM_VENV" ] && VLLM_VENV="$(cd "$VLLM_VENV" && pwd)"
[ -d "$MODEL_DIR" ] && MODEL_DIR="$(cd "$MODEL_DIR" && pwd)"
PY="$VLLM_VENV/bin/python"
[ -x "$PY" ] || { echo "no python at $PY: run benchmarks/live/setup_vllm_cpu.sh first" >&2; exit 2; }
[ -f "$MODEL_DIR/config.json" ] || { echo "no model at $MODEL_DIR: run setup_vllm_cpu.sh" >&2; exit 2; }
if (( BLOCK_SIZE % 32 )); then echo "BLOCK_SIZE must be a multiple of 32 on CPU" >&2; exit 2; fi
if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    echo "something already answers on port $PORT" >&2; exit 2
fi

if [ "$PREFIX_CACHING" = 1 ]; then PC=--enable-prefix-caching; else PC=--no-enable-prefix-caching; fi
args=(-m vllm.entrypoints.openai.api_server
      --host 127.0.0.1 --port "$PORT"
      --model "$MODEL_DIR" --skip-tokenizer-init --dtype "$DTYPE"
      --block-size "$BLOCK_SIZE" --num-gpu-blocks-override "$NUM_GPU_BLOCKS"
      --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS"
      --max-model-len "$MAX_MODEL_LEN" "$PC" --enable-prompt-tokens-details
      "$@")

export VLLM_CPU_KVCACHE_SPACE="$KV_SPACE_GIB"
# `python -m` puts the working directory first on sys.path, and this repo's top-level kernels/ package
# then shadows Hugging Face's `kernels` that transformers imports: start from / with safe paths.
export PYTHONSAFEPATH=1
pin=()
if [ -n "$PIN_CPUS" ]; then
    pin=(taskset -c "$PIN_CPUS")
    # vLLM's auto binding wants one core reserved beside the worker; pinned to one core there is none
    # to spare, so bind the worker's OpenMP threads to the pinned list ourselves.
    export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$PIN_CPUS}"
    export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
fi

echo "starting: ${pin[*]} $PY ${args[*]}" >&2
echo "  VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto} log: $LOG" >&2
t0=$(date +%s)
case "$LOG" in /*) ;; *) LOG="$PWD/$LOG" ;; esac
case "$PIDFILE" in /*) ;; *) PIDFILE="$PWD/$PIDFILE" ;; esac
(cd / && exec setsid "${pin[@]}" "$PY" "${args[@]}" >"$LOG" 2>&1 < /dev/null) &
pid=$!
echo "$pid" >"$PIDFILE"

while :; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "server exited during start-up; last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 \
       && curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1; then
        break
    fi
    if (( $(date +%s) - t0 > WAIT_S )); then
        echo "server not up after ${WAIT_S}s; stopping it. Last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2
        kill -- "-$pid" 2>/dev/null || true
        exit 1
    fi
    sleep 1
done
if [ -n "$API_CPUS" ]; then
    # every process of the server's group but the engine core and its worker (named VLLM::...), all threads
    for p in $(pgrep -g "$pid"); do
        case "$(cat "/proc/$p/comm" 2>/dev/null)" in VLLM::*) ;; *) taskset -a -p -c "$API_CPUS" "$p" >/dev/null ;; esac
    done
    echo "  API server on CPU(s) $API_CPUS, the engine on ${PIN_CPUS:-any}" >&2
fi
echo "vLLM up on http://127.0.0.1:$PORT after $(( $(date +%s) - t0 ))s (stop: kill -- -$pid)" >&2
echo "$pid"
