#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-quantize` (a peer for `jaxbatch bench serve`) from
# the llama.cpp tree vendored in PyPI's `llama-cpp-python` source package, and converts a Hugging
# Face checkpoint to a bf16 GGUF and its Q4_K_M.
#
#   bash scripts/setup_llama_cpp.sh                        # build only, into .llama.cpp/
#   bash scripts/setup_llama_cpp.sh hf_export/SmolLM2-135M-Instruct   # build, then convert
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bash scripts/setup_llama_cpp.sh
#   LLAMA_CPP_NO_AMX=1 bash scripts/setup_llama_cpp.sh    # AVX512 (VNNI, BF16) without AMX
#
# LLAMA_CPP_NO_AMX: on the KVM guest with AMX where the benchmarks ran, the native build's
# llama-server died with SIGILL loading a Q4_K_M model (ggml's AMX repack; bf16 ran);
# a build without the AMX kernels runs both.
#
# Then serve one GGUF the way the benchmarks compare engines (16 slots, both cores):
#   .llama.cpp/build/bin/llama-server -m MODEL-bf16.gguf -c 32768 -np 16 -t 2 --port 8200
#   .venv/bin/jaxbatch bench serve --target llama=http://127.0.0.1:8200/v1 ...
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${LLAMA_CPP_DIR:-$REPO/.llama.cpp}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
mkdir -p "$DEST"

if [ ! -x "$DEST/build/bin/llama-server" ]; then
    # pip cannot download this sdist without building it, so ask PyPI's JSON API for its URL.
    "$PYTHON" - "$DEST" "${LLAMA_CPP_PYTHON_VERSION:-}" <<'EOF'
import json, sys, tarfile, urllib.request
dest, version = sys.argv[1], sys.argv[2]
url = f"https://pypi.org/pypi/llama-cpp-python/{version + '/' if version else ''}json"
meta = json.load(urllib.request.urlopen(url))
sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
path = f"{dest}/{sdist['filename']}"
urllib.request.urlretrieve(urllib.request.urljoin(url, sdist["url"]), path)
with tarfile.open(path) as tar:
    tar.extractall(dest, filter="data")
print("llama-cpp-python", meta["info"]["version"])
EOF
    SRC="$(ls -d "$DEST"/llama_cpp_python-*/vendor/llama.cpp | tail -1)"
    CPU_FLAGS=(-DGGML_NATIVE=ON)
    if [ -n "${LLAMA_CPP_NO_AMX:-}" ]; then
        CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
                   -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
    fi
    cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build "$DEST/build" -j "$(nproc)" --target llama-server llama-quantize
fi

if [ $# -ge 1 ]; then
    MODEL="$1"
    NAME="$(basename "$MODEL")"
    SRC="$(ls -d "$DEST"/llama_cpp_python-*/vendor/llama.cpp | tail -1)"
    # The converter needs the tree's own gguf-py (newer than PyPI's gguf), torch, transformers
    # and sentencepiece (imported even for a tokenizer.json model): the project's venv with
    # the test extra has the first two.
    "$PYTHON" -c "import sentencepiece" 2>/dev/null || "$PYTHON" -m pip install -q sentencepiece
    PYTHONPATH="$SRC/gguf-py" "$PYTHON" "$SRC/convert_hf_to_gguf.py" "$MODEL" \
        --outtype bf16 --outfile "$DEST/$NAME-bf16.gguf"
    "$DEST/build/bin/llama-quantize" "$DEST/$NAME-bf16.gguf" "$DEST/$NAME-Q4_K_M.gguf" Q4_K_M
    ls -la "$DEST"/*.gguf
fi
