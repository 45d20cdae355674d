#!/usr/bin/env bash
# The main job: builds mixkv and runs, on the CPU backend unless a GPU is
# present,
#   1. mixkv-demo: synthetic video-QA requests under WindowQuant plans (seconds;
#      the CUDA backend when mixkv was built with it and a GPU is present);
#   2. the real-model check: SmolLM2-135M with mixkv holding its KV cache
#      (scripts/run_real_model.sh, docs/real-model.md; minutes).
# MIXKV_DEMO_SYNTHETIC_ONLY=1 stops after the first.
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"
configure_and_build "$MIXKV_ROOT/build" -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF
"$MIXKV_ROOT/build/examples/mixkv-demo"
if [ "${MIXKV_DEMO_SYNTHETIC_ONLY:-0}" != 1 ]; then
  echo
  "$MIXKV_ROOT/scripts/run_real_model.sh" "$@"
fi
