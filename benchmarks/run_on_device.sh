#!/usr/bin/env bash
# Build, test, memcheck and benchmark the CUDA backend on the device machine
# (one H200). Results go to $OUT (the device tool fetches them):
#   ctest.log, memcheck.log, decode_bench.json, sdpa_bench.json, bench.log,
#   flashinfer_decode_bench.json, flashinfer_decode.log, flashinfer_jit.log,
#   decode.json (the three merged, every ratio from this one run: summarize.py)
# Usage: benchmarks/run_on_device.sh [--bench-only] [--tests-only]
#          [--skip-sanitizer] [--skip-sdpa] [--quick] [--filter GTEST_FILTER]
#          [--mine]  (build only mixkv_cuda_tests + mixkv_decode_bench, no ctest)
#          [--contexts LIST] (decode bench contexts only, e.g. 19600)
#          [--validate] (GPU checks of every area: mixkv_cuda_tests and planner_cuda_test,
#                     the GPU planner bench (with --ncu: its kernels under Nsight Compute),
#                     the whole Python suite with CUDA tensors, memcheck and racecheck on a
#                     reduced filter; add --bench for the decode bench too)
#          [--flush read|write] (how the decode and SDPA benches evict L2; default read)
#          [--shapes] (other models' head shapes, mixkv and SDPA, into shapes/)
#          [--ncu]   (Nsight Compute sections of the decode kernel: batch 64 x 19,600 INT2
#                     and batch 1 x 19,600 mixed, into ncu.log)
#          [--decode] (the decode comparison alone, ~3-4 minutes: builds only
#                     mixkv_decode_bench; runs it (with its batch-invariant variants), SDPA and
#                     FlashInfer's paged decode; no tests)
#          [--skip-flashinfer] (no FlashInfer decode beside the bench)
#          [--engine GTEST_FILTER] (builds only engine_test and runs it with that filter into
#                     engine_test.log, e.g. 'EngineCuda.BatchInvariant*:EngineCpu.*BatchInvariant*')
# FlashInfer 0.7.2.post1's paged decode (benchmarks/flashinfer_decode_bench.py,
# FP16 and FP8 KV, tensor-core path) runs with every decode bench: it needs
# .whl/ (scripts/pack_flashinfer.sh: the flashinfer-python wheel and
# apache-tvm-ffi) carried along, is installed from it offline and
# JIT-compiles its two modules in the background while mixkv builds
# (~25-60 s; nothing is timed while anything compiles). Without .whl/ or a
# working install it is skipped with a message and the mixkv part still runs.
# Boost, GoogleTest and Google Benchmark are taken from the system when
# present, else from .devdeps/, carried along and made on the build machine:
#   Google Benchmark: /usr/include/benchmark -> .devdeps/include/, and
#     /usr/lib/x86_64-linux-gnu/{libbenchmark*,cmake/benchmark} -> .devdeps/lib/x86_64-linux-gnu/
#     (its CMake config finds the prefix four levels up);
#   GoogleTest: /usr/src/googletest -> .devdeps/googletest (built here).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
TESTS=1 SANITIZER=1 BENCH=1 SDPA=1 QUICK="" FILTER="*" MINE=0 NCU=0 VALIDATE=0 CONTEXTS=() FLUSH=read SHAPES=0
WANT_BENCH=0 DECODE=0 FI=1 ENGINE_FILTER=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bench-only) TESTS=0; SANITIZER=0 ;;
    --tests-only) BENCH=0; SDPA=0 ;;
    --skip-sanitizer) SANITIZER=0 ;;
    --skip-sdpa) SDPA=0 ;;
    --quick) QUICK=--quick ;;
    --mine) MINE=1 ;;
    --ncu) NCU=1 ;;
    --validate) VALIDATE=1; BENCH=0; SDPA=0; TESTS=0; SANITIZER=0 ;;
    --bench) WANT_BENCH=1 ;;
    --decode) DECODE=1; TESTS=0; SANITIZER=0; BENCH=1; SDPA=1 ;;
    --skip-flashinfer) FI=0 ;;
    --engine) ENGINE_FILTER="$2"; TESTS=0; SANITIZER=0; [ "$DECODE" = 1 ] || { BENCH=0; SDPA=0; }; shift ;;
    --shapes) SHAPES=1 ;;
    --flush) FLUSH="$2"; shift ;;
    --filter) FILTER="$2"; shift ;;
    --contexts) CONTEXTS=(--contexts "$2"); shift ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
[ "$WANT_BENCH" = 1 ] && BENCH=1 && SDPA=1
ROOT=$PWD
# Build from a snapshot of the last commit (.devsnap, made with `git archive
# HEAD`) with this tree's CUDA-backend files laid over it, so that other
# areas' uncommitted work in the shared tree cannot break the device build.
if [ -d .devsnap ]; then
  # A snapshot older than HEAD validates old code under the current kernels:
  # name what differs (expected only where this tree has uncommitted work).
  stale=$(for area in cache scheduler bindings tests benchmarks examples; do
            diff -rq --exclude=cuda --exclude=__pycache__ --exclude=decode_bench.cpp --exclude=sdpa_bench.py \
              --exclude=summarize.py --exclude=flashinfer_decode_bench.py "$area" ".devsnap/$area" 2>&1
          done | sed -nE -e 's/^Files ([^ ]+) and .*/\1/p' -e 's/^Only in ([^.][^:]*): (.*)/\1\/\2/p' | sort -u)
  if [ -n "$stale" ]; then
    echo "WARNING: .devsnap differs from this tree in:" $stale
    echo "WARNING: refresh it (rm -rf .devsnap; mkdir .devsnap; git archive HEAD | tar -x -C .devsnap) unless that is uncommitted work"
  fi
  cp -r kernels/. .devsnap/kernels/
  cp -r tests/cuda/. .devsnap/tests/cuda/
  cp benchmarks/decode_bench.cpp benchmarks/sdpa_bench.py benchmarks/summarize.py \
    benchmarks/flashinfer_decode_bench.py .devsnap/benchmarks/
  cd .devsnap
fi
JOBS=$(nproc)
BUILD=build-device
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv

# --- dependencies
CMAKE_ARGS=()
if [ -d "$ROOT/.devdeps/lib/cmake/Boost" ] && [ ! -f /usr/include/boost/unordered/unordered_flat_map.hpp ]; then
  CMAKE_ARGS+=("-DBoost_DIR=$ROOT/.devdeps/lib/cmake/Boost")
fi
if [ -d "$ROOT/.devdeps/lib" ] &&
  ! ls /usr/lib/x86_64-linux-gnu/cmake/benchmark /usr/lib/cmake/benchmark /usr/local/lib/cmake/benchmark >/dev/null 2>&1; then
  CMAKE_ARGS+=("-Dbenchmark_DIR=$ROOT/.devdeps/lib/x86_64-linux-gnu/cmake/benchmark")
fi
if [ -d "$ROOT/.devdeps/googletest" ] &&
  ! ls /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake \
    /usr/local/lib/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1; then
  if [ ! -f /tmp/gtest/lib/cmake/GTest/GTestConfig.cmake ]; then
    cmake -S "$ROOT/.devdeps/googletest" -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
      -DCMAKE_INSTALL_PREFIX=/tmp/gtest >/tmp/gtest.log 2>&1 &&
      cmake --build /tmp/gtest-build -j"$JOBS" >>/tmp/gtest.log 2>&1 &&
      cmake --install /tmp/gtest-build >>/tmp/gtest.log 2>&1 || { tail -20 /tmp/gtest.log; exit 1; }
  fi
  CMAKE_ARGS+=("-DGTest_DIR=/tmp/gtest/lib/cmake/GTest")
fi

# --- FlashInfer: install the carried wheels, start its JIT build in the background
T_START=$(date +%s)
FI_PID=""
[ "$BENCH" = 1 ] || FI=0
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ "$FI" = 1 ]; then
  if ! ls "$ROOT"/.whl/flashinfer_python-*.whl >/dev/null 2>&1; then
    echo "FlashInfer decode SKIPPED: no .whl/flashinfer_python-*.whl (run scripts/pack_flashinfer.sh and carry .whl)"
    FI=0
  elif python3 -m pip show flashinfer-python 2>/dev/null | grep -q "^Version: 0.7.2.post1$" &&
    python3 -m pip show apache-tvm-ffi >/dev/null 2>&1; then
    echo "flashinfer-python 0.7.2.post1 already installed"
  else
    python3 -m pip install --no-deps --no-index "$ROOT"/.whl/*.whl >"$OUT/pip.log" 2>&1 ||
      python3 -m pip install --no-deps --no-index --break-system-packages "$ROOT"/.whl/*.whl >>"$OUT/pip.log" 2>&1 ||
      { tail -5 "$OUT/pip.log"; echo "FlashInfer decode SKIPPED: pip install failed (pip.log)"; FI=0; }
  fi
fi
if [ "$FI" = 1 ]; then
  # --compile-only makes itself a process-group leader, so that the deadline ends ninja and nvcc with it.
  PYTHONUNBUFFERED=1 python3 benchmarks/flashinfer_decode_bench.py --compile-only >"$OUT/flashinfer_jit.log" 2>&1 &
  FI_PID=$!
  echo "FlashInfer JIT build started in the background (flashinfer_jit.log)"
fi

# --- build (keep going: a broken target of another area must not hide ours)
t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMIXKV_CUDA=ON -DMIXKV_TESTS=ON \
  -DMIXKV_BENCHMARKS=ON "${CMAKE_ARGS[@]}" >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
if [ "$VALIDATE" = 1 ]; then
  if ! python3 -c "import pybind11, pytest" 2>/dev/null; then
    python3 -m pip install --quiet --no-index --find-links "$ROOT/build-wheels" pybind11 pytest >>"$OUT/build.log" 2>&1
  fi
  cmake "$BUILD" -DMIXKV_PYTHON=ON -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >>"$OUT/build.log" 2>&1
  cmake --build "$BUILD" -j"$JOBS" --target mixkv_cuda_tests planner_cuda_test gpu_planner_bench mixkv_python \
    mixkv_decode_bench -- -k 0 >>"$OUT/build.log" 2>&1
elif [ -n "$ENGINE_FILTER" ] || [ "$DECODE" = 1 ]; then
  targets=()
  [ -n "$ENGINE_FILTER" ] && targets+=(engine_test)
  [ "$DECODE" = 1 ] && targets+=(mixkv_decode_bench)
  cmake --build "$BUILD" -j"$JOBS" --target "${targets[@]}" -- -k 0 >>"$OUT/build.log" 2>&1
elif [ "$MINE" = 1 ]; then
  cmake --build "$BUILD" -j"$JOBS" --target mixkv_cuda_tests mixkv_decode_bench -- -k 0 >>"$OUT/build.log" 2>&1
else
  cmake --build "$BUILD" -j"$JOBS" -- -k 0 >>"$OUT/build.log" 2>&1
fi
echo "build: rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "error|FAILED" "$OUT/build.log" | head -20

# --- benchmarks first: their numbers must survive a later timeout
# FlashInfer's JIT modules must be built before anything is timed.
if [ -n "$FI_PID" ]; then
  JIT_DEADLINE=${JIT_DEADLINE:-150}  # seconds since the start
  while kill -0 "$FI_PID" 2>/dev/null && [ $(( $(date +%s) - T_START )) -lt "$JIT_DEADLINE" ]; do sleep 2; done
  if kill -0 "$FI_PID" 2>/dev/null; then
    echo "FlashInfer JIT build past its deadline (${JIT_DEADLINE} s): stopped; its variants are skipped"
    kill -TERM -- "-$FI_PID" 2>/dev/null
    sleep 2
    kill -KILL -- "-$FI_PID" 2>/dev/null
  fi
  wait "$FI_PID" 2>/dev/null
  echo "FlashInfer JIT: rc=$? at $(( $(date +%s) - T_START )) s"; grep -E "flashinfer JIT|skipped|Error|error:" "$OUT/flashinfer_jit.log" | head -8
fi
if [ "$NCU" = 1 ] && [ "$VALIDATE" = 0 ]; then
  BENCHBIN="$BUILD/benchmarks/mixkv_decode_bench"
  {
    timeout 150 ncu --clock-control none -k regex:paged_decode -c 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
      "$BENCHBIN" --batches 64 --contexts 19600 --plans int2 --reps 1 --out /tmp/ncu1.json
    timeout 100 ncu --clock-control none -k regex:paged_decode -c 1 --section SpeedOfLight \
      --section LaunchStats "$BENCHBIN" --batches 1 --contexts 19600 --plans mixed --reps 1 --out /tmp/ncu2.json
    timeout 100 ncu --clock-control none -k regex:store_prefill -c 1 --section SpeedOfLight --section WarpStateStats \
      --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
      "$BENCHBIN" --batches 1 --contexts 19600 --plans int4 --reps 5 --out /tmp/ncu3.json
  } >"$OUT/ncu.log" 2>&1
  echo "ncu: rc=$?"; grep -E "Duration|Warp Cycles Per Issued|Issued Warp|No Eligible|Achieved Occupancy|Registers|Stall|Memory Throughput|Compute \(SM\)" "$OUT/ncu.log" | head -40
fi
if [ "$BENCH" = 1 ]; then
  timeout 180 "$BUILD/benchmarks/mixkv_decode_bench" --out "$OUT/decode_bench.json" --flush "$FLUSH" $QUICK ${CONTEXTS[@]+"${CONTEXTS[@]}"} 2>&1 | tee "$OUT/bench.log"
fi
if [ "$SDPA" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout 100 python3 benchmarks/sdpa_bench.py --out "$OUT/sdpa_bench.json" --flush "$FLUSH" $QUICK ${CONTEXTS[@]+"${CONTEXTS[@]}"} 2>&1
fi
if [ "$FI" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout 100 python3 benchmarks/flashinfer_decode_bench.py --out "$OUT/flashinfer_decode_bench.json" \
    --flush "$FLUSH" --require-built $QUICK ${CONTEXTS[@]+"${CONTEXTS[@]}"} 2>&1 |
    grep -v "^\s*warnings.warn\|UserWarning" | tee "$OUT/flashinfer_decode.log"
  echo "flashinfer_decode_bench: rc=${PIPESTATUS[0]}"
fi
# Other models' decode shapes (one GPU's heads): mixkv and SDPA at batch 1
# and 64 x 19,600 tokens, JSON in $OUT/shapes/ (benchmarks/plot_shapes.py).
if [ "$SHAPES" = 1 ]; then
  mkdir -p "$OUT/shapes"
  while read -r name heads dim; do
    timeout 120 "$BUILD/benchmarks/mixkv_decode_bench" --heads "$heads" --head-dim "$dim" --batches 1,64 \
      --contexts 19600 --reps 30 --flush "$FLUSH" --out "$OUT/shapes/$name.json" >"$OUT/shapes/$name.log" 2>&1
    echo "shape $name ($heads heads, head_dim $dim): mixkv rc=$?"
    PYTHONUNBUFFERED=1 timeout 60 python3 benchmarks/sdpa_bench.py --heads "$heads" --head-dim "$dim" --batches 1,64 \
      --contexts 19600 --reps 30 --flush "$FLUSH" --out "$OUT/shapes/${name}_sdpa.json" >>"$OUT/shapes/$name.log" 2>&1
    echo "shape $name: sdpa rc=$?"
  done <<'EOF'
llama3_8b 32/8 128
qwen3_235b 64/4 128
mistral_large2 96/8 128
gemma2_9b 16/8 256
smollm2_135m 9/3 64
EOF
fi
# --- tests
if [ "$TESTS" = 1 ]; then
  t0=$(date +%s)
  if [ "$MINE" = 0 ]; then
    timeout 240 ctest --test-dir "$BUILD" -j8 --output-on-failure --timeout 200 >"$OUT/ctest.log" 2>&1
    echo "ctest: rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "tests passed|tests failed|\(Failed\)|Not Run|Timeout" "$OUT/ctest.log" | head -30
  else
    timeout "${TEST_TIMEOUT:-300}" "$BUILD/tests/mixkv_cuda_tests" --gtest_filter="$FILTER" >"$OUT/cuda_tests.log" 2>&1
    echo "mixkv_cuda_tests: rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|error" "$OUT/cuda_tests.log" | head -40
  fi
fi
if [ -n "$ENGINE_FILTER" ]; then
  timeout "${TEST_TIMEOUT:-300}" "$BUILD/tests/engine_test" --gtest_filter="$ENGINE_FILTER" >"$OUT/engine_test.log" 2>&1
  echo "engine_test: rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|differ|error" "$OUT/engine_test.log" | head -40
fi
if [ "$SANITIZER" = 1 ]; then
  t0=$(date +%s)
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 "$BUILD/tests/mixkv_cuda_tests" \
    --gtest_filter='-*19600*:*LargeBatch*:*rows19600*' >"$OUT/memcheck.log" 2>&1
  echo "memcheck: rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | tail -5
fi
if [ "$VALIDATE" = 1 ]; then
  for t in mixkv_cuda_tests planner_cuda_test; do
    timeout 120 "$BUILD/tests/$t" >"$OUT/$t.log" 2>&1
    echo "$t: rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|Actual" "$OUT/$t.log" | head -20
  done
  timeout 60 "$BUILD/benchmarks/gpu_planner_bench" "$OUT/gpu_planner_bench.json" 2>&1 | tail -12
  if [ "$NCU" = 1 ]; then
    timeout 90 ncu --clock-control none -k regex:'window_|text_|majority' -c 8 --section SpeedOfLight \
      --section LaunchStats --section Occupancy "$BUILD/benchmarks/gpu_planner_bench" /tmp/ncu_planner.json \
      >"$OUT/ncu_planner.log" 2>&1
    echo "ncu planner: rc=$?"; grep -E "window_|text_|majority|Duration|Memory Throughput|Achieved Occ" "$OUT/ncu_planner.log" | head -40
  fi
  STAGE="$BUILD/python-stage"
  rm -rf "$STAGE" && mkdir -p "$STAGE" && cp -r bindings/python/mixkv "$STAGE/" && cp "$BUILD"/bindings/_core*.so "$STAGE/mixkv/"
  PYTHONPATH="$PWD/$STAGE" timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/python \
    >"$OUT/pytest.log" 2>&1
  echo "pytest tests/python: rc=$?"; tail -15 "$OUT/pytest.log"
  # The sanitizers slow kernels 10-100x: the long-context and dense cases stay out.
  declare -A filters=([memcheck]='*-*19600*:*LargeBatch*:*rows19600*'
                      [racecheck]='*DecodeCuda*:*MergeStates*:*StorePrefill*-*19600*:*LargeBatch*:*rows19600*')
  for tool in memcheck racecheck; do
    timeout 75 compute-sanitizer --tool $tool --error-exitcode 1 "$BUILD/tests/mixkv_cuda_tests" \
      --gtest_filter="${filters[$tool]}" >"$OUT/$tool.log" 2>&1
    echo "$tool mixkv_cuda_tests: rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests ran|PASSED|FAILED" "$OUT/$tool.log" | tail -4
  done
fi
if [ -f "$OUT/decode_bench.json" ]; then
  python3 benchmarks/summarize.py "$OUT/decode_bench.json" "$OUT/sdpa_bench.json" \
    --flashinfer "$OUT/flashinfer_decode_bench.json" --out "$OUT/decode.json" || true
fi
