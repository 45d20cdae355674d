#!/usr/bin/env bash
# Every test: builds mixkv (CUDA code included whenever nvcc exists) and runs
# the whole suite; GPU tests skip, saying so, on a machine without a GPU.
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"
configure_and_build "$MIXKV_ROOT/build-test" -DMIXKV_TESTS=ON -DMIXKV_BENCHMARKS=ON
ctest --test-dir "$MIXKV_ROOT/build-test" --output-on-failure -j "$MIXKV_JOBS"
