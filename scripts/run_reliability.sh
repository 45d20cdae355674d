#!/usr/bin/env bash
# The reliability part of the test command (docs/reliability.md), host code
# only, so it runs the same on a machine without a GPU:
#   1. the C++ suite again, built with AddressSanitizer and
#      UndefinedBehaviorSanitizer (build-asan: no CUDA, no benchmarks);
#   2. each libFuzzer target for MIXKV_FUZZ_SECONDS (30 by default) from its
#      committed seed corpus (build-fuzz, clang-14 from setup.sh).
# Any sanitizer report, test failure or fuzzer finding fails the run.
# MIXKV_ASAN_BUILD / MIXKV_FUZZ_BUILD override the two build directories.
set -euo pipefail
source "$(dirname "$0")/common.sh"
fuzz_seconds="${MIXKV_FUZZ_SECONDS:-30}"

# Leaks are errors too; every report stops the run with a stack trace.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

asan="${MIXKV_ASAN_BUILD:-$MIXKV_ROOT/build-asan}"
cmake -S "$MIXKV_ROOT" -B "$asan" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMIXKV_CUDA=OFF \
      -DMIXKV_TESTS=ON -DMIXKV_BENCHMARKS=OFF -DMIXKV_SANITIZERS=ON
cmake --build "$asan" -j "$MIXKV_JOBS"
ctest --test-dir "$asan" --output-on-failure -j "$MIXKV_JOBS"

fuzz="${MIXKV_FUZZ_BUILD:-$MIXKV_ROOT/build-fuzz}"
cmake -S "$MIXKV_ROOT" -B "$fuzz" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++-14 \
      -DMIXKV_CUDA=OFF -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF -DMIXKV_FUZZ=ON
cmake --build "$fuzz" -j "$MIXKV_JOBS" --target cache_manager_fuzz scheduler_fuzz
for target in cache_manager_fuzz scheduler_fuzz; do
  # New inputs go to a scratch directory; the committed corpus is only read.
  # A fixed seed makes every run try the same inputs in the same order (a
  # faster machine just gets further), so a failure here is reproducible.
  scratch="$fuzz/corpus-$target"
  rm -rf "$scratch" && mkdir -p "$scratch"
  "$fuzz/tests/fuzz/$target" "$scratch" "$MIXKV_ROOT/tests/fuzz/corpus/$target" \
    -seed=1 -max_total_time="$fuzz_seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$fuzz/$target-"
done
