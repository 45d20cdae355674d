#!/usr/bin/env bash
# The main job: builds mixkv and runs the WindowQuant demo (CPU backend unless
# a GPU is present).
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"
configure_and_build "$MIXKV_ROOT/build" -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF
"$MIXKV_ROOT/build/examples/mixkv-demo" "$@"
