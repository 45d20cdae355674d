#!/usr/bin/env bash
# The main job: builds mixkv and runs, on the CPU backend unless a GPU is
# present,
#   1. mixkv-demo: synthetic video-QA requests under WindowQuant plans (seconds;
#      the CUDA backend when mixkv was built with it and a GPU is present);
#   2. the real-model check: SmolLM2-135M with mixkv holding its KV cache
#      (scripts/run_real_model.sh, docs/real-model.md; minutes);
#   3. on a machine with a GPU only: a short end-to-end serving benchmark
#      (benchmarks/serving_bench.py --quick, docs/serving.md; a few minutes):
#      SmolLM2 in torch on the GPU served through mixkv's plans (and
#      FlashInfer's paged attention where flashinfer is installed), with a
#      progress bar; results in build-serving/.
# MIXKV_DEMO_SYNTHETIC_ONLY=1 stops after the first.
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"
configure_and_build "$MIXKV_ROOT/build" -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF
"$MIXKV_ROOT/build/examples/mixkv-demo"
if [ "${MIXKV_DEMO_SYNTHETIC_ONLY:-0}" != 1 ]; then
  echo
  "$MIXKV_ROOT/scripts/run_real_model.sh" "$@"
  if gpu_present && [ "$MIXKV_CUDA" = ON ]; then
    echo
    # run_real_model.sh installed the mixkv package with its CUDA backend; the model runs in torch.
    python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet --root-user-action=ignore torch
    mkdir -p "$MIXKV_ROOT/build-serving"
    python3 "$MIXKV_ROOT/benchmarks/serving_bench.py" --quick --json "$MIXKV_ROOT/build-serving/serving.json" \
      --md "$MIXKV_ROOT/build-serving/serving.md" --png "$MIXKV_ROOT/build-serving/serving.png"
  fi
fi
