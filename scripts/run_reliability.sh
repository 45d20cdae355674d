#!/usr/bin/env bash
# The reliability part of the test command (docs/reliability.md), host code
# only, so it runs the same on a machine without a GPU:
#   1. the C++ suite again, built with AddressSanitizer and
#      UndefinedBehaviorSanitizer (build-asan: no CUDA, no benchmarks);
#   2. each libFuzzer target for MIXKV_FUZZ_SECONDS (30 by default) from its
#      committed seed corpus (build-fuzz, clang-14 from setup.sh), with a
#      seed that changes per run (MIXKV_FUZZ_SEED to replay one: every
#      run prints "-seed=N"); inputs that reach new coverage are merged into
#      the committed corpus (tests/fuzz/corpus/<target>/), so it grows.
# Release checks fuzz longer, 10 minutes a target (docs/reliability.md):
#   MIXKV_FUZZ_SECONDS=600 scripts/run_reliability.sh
# which passes -max_total_time=600 to each target.
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

# libFuzzer comes with clang-14 (setup.sh installs it where it can): on a
# machine without it and without a package registry the fuzzers are
# skipped, saying so, and everything else has run.
if ! command -v clang++-14 >/dev/null 2>&1; then
  echo "run_reliability.sh: SKIPPED the fuzzers: clang++-14 (libFuzzer) is not installed and could not be"
  exit 0
fi

fuzz="${MIXKV_FUZZ_BUILD:-$MIXKV_ROOT/build-fuzz}"
cmake -S "$MIXKV_ROOT" -B "$fuzz" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++-14 \
      -DMIXKV_CUDA=OFF -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF -DMIXKV_FUZZ=ON
targets=(cache_manager_fuzz scheduler_fuzz ops_fuzz)
cmake --build "$fuzz" -j "$MIXKV_JOBS" --target "${targets[@]}"
# A new seed each run explores new inputs; printed, so a failure replays
# with the same seed (and the saved crash file).
seed="${MIXKV_FUZZ_SEED:-$(( $(date +%s) % 2147483647 ))}"
echo "fuzzing with -seed=$seed (replay: MIXKV_FUZZ_SEED=$seed $0)"
for target in "${targets[@]}"; do
  # New inputs go to a scratch directory first; only those that add
  # coverage are merged into the committed corpus afterwards.
  scratch="$fuzz/corpus-$target"
  corpus="$MIXKV_ROOT/tests/fuzz/corpus/$target"
  rm -rf "$scratch" && mkdir -p "$scratch" "$corpus"
  echo "$target: -seed=$seed -max_total_time=$fuzz_seconds"
  "$fuzz/tests/fuzz/$target" "$scratch" "$corpus" \
    -seed="$seed" -max_total_time="$fuzz_seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$fuzz/$target-"
  # Edges only (-use_counters=0): an input joins the corpus for a new edge,
  # not for a new hit count, which keeps the committed corpus small.
  "$fuzz/tests/fuzz/$target" -merge=1 -use_counters=0 "$corpus" "$scratch" -rss_limit_mb=4096 -timeout=60 2>&1 | tail -n 1
done
