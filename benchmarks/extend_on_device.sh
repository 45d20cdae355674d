#!/usr/bin/env bash
# Extend attention on the GPU machine, in one go (about 4-6 minutes on one
# H200 with 16 cores; every stage has a deadline so that the whole stays
# under 10): mixkv's ExtendPlan (mixkv_extend_bench) beside FlashInfer
# 0.7.2.post1's paged prefill and torch SDPA (flashinfer_prefill_bench.py),
# then the report. Results go to $OUT:
#   extend_bench.json, extend_bench.log        mixkv (benchmarks/extend_bench.cpp)
#   flashinfer_prefill_bench.json, flashinfer.log, flashinfer_jit.log
#   extend.md, extend.png                      side by side, against the issue's targets
#   build.log, pip.log
# Needs .whl/ (scripts/pack_flashinfer.sh: a trimmed flashinfer-python wheel
# and apache-tvm-ffi for the device's Python) carried along; FlashInfer
# JIT-compiles its prefill modules into $FLASHINFER_WORKSPACE_BASE
# (/tmp/fi-ws), at the same time as mixkv builds. Nothing is timed while
# anything compiles.
# Usage: benchmarks/extend_on_device.sh [--quick] [--reps N] [--no-fa3] [--no-sdpa]
#          [--page-sizes 16,32] [--layouts HND,NHD] [--flush read|write]
#          [--skip-mixkv] [--skip-flashinfer]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
QUICK="" REPS=20 FI_VARIANTS="fp16_fa2,fp16_fa3,fp8_fa2,sdpa" PAGES=16 LAYOUTS=HND FLUSH=read
MIXKV=1 FI=1
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=--quick; REPS=5 ;;
    --reps) REPS="$2"; shift ;;
    --no-fa3) FI_VARIANTS=${FI_VARIANTS/fp16_fa3,/} ;;
    --no-sdpa) FI_VARIANTS=${FI_VARIANTS/,sdpa/} ;;
    --page-sizes) PAGES="$2"; shift ;;
    --layouts) LAYOUTS="$2"; shift ;;
    --flush) FLUSH="$2"; shift ;;
    --skip-mixkv) MIXKV=0 ;;
    --skip-flashinfer) FI=0 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
# Deadlines, in seconds since the start (the device call allows 600 in all).
BUILD_DEADLINE=${BUILD_DEADLINE:-240}  # mixkv configure + build
JIT_DEADLINE=${JIT_DEADLINE:-300}      # FlashInfer's JIT modules (built in the background from the start)
MIXKV_TIMEOUT=${MIXKV_TIMEOUT:-120}
FI_TIMEOUT=${FI_TIMEOUT:-150}

JOBS=$(nproc)
BUILD=build-bench
export PATH=/usr/local/cuda/bin:$PATH
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
stage() { echo "== [$(elapsed) s] $*"; }
until_deadline() { local left=$(($1 - $(elapsed))); echo $((left > 10 ? left : 10)); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

# --- FlashInfer: install the carried wheels, start its JIT build in the background
FI_PID=""
if [ "$FI" = 1 ]; then
  stage "install FlashInfer from .whl/"
  if ! ls .whl/flashinfer_python-*.whl >/dev/null 2>&1; then
    echo "no .whl/flashinfer_python-*.whl: run scripts/pack_flashinfer.sh and carry .whl; FlashInfer skipped"
    FI=0
  elif python3 -m pip show flashinfer-python 2>/dev/null | grep -q "^Version: 0.7.2.post1$" &&
    python3 -m pip show apache-tvm-ffi >/dev/null 2>&1; then
    echo "flashinfer-python 0.7.2.post1 already installed"
  else
    python3 -m pip install --no-deps --no-index .whl/*.whl >"$OUT/pip.log" 2>&1 ||
      python3 -m pip install --no-deps --no-index --break-system-packages .whl/*.whl >>"$OUT/pip.log" 2>&1 ||
      { tail -5 "$OUT/pip.log"; echo "pip install failed: FlashInfer skipped"; FI=0; }
  fi
fi
if [ "$FI" = 1 ]; then
  stage "FlashInfer JIT build in the background (log: flashinfer_jit.log)"
  # --compile-only makes itself a process-group leader, so that a deadline ends ninja and nvcc with it.
  python3 benchmarks/flashinfer_prefill_bench.py --compile-only --variants "$FI_VARIANTS" \
    >"$OUT/flashinfer_jit.log" 2>&1 &
  FI_PID=$!
fi

# --- mixkv: configure and build only mixkv_extend_bench
if [ "$MIXKV" = 1 ]; then
  stage "build mixkv_extend_bench"
  CMAKE_ARGS=()
  if [ ! -f /usr/include/boost/unordered/unordered_flat_map.hpp ]; then
    CMAKE_ARGS+=("-DBoost_DIR=$ROOT/.devdeps/lib/cmake/Boost")
  fi
  if ! ls /usr/lib/x86_64-linux-gnu/cmake/benchmark /usr/lib/cmake/benchmark /usr/local/lib/cmake/benchmark \
    >/dev/null 2>&1; then
    CMAKE_ARGS+=("-Dbenchmark_DIR=$ROOT/.devdeps/lib/x86_64-linux-gnu/cmake/benchmark")
  fi
  timeout "$(until_deadline "$BUILD_DEADLINE")" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMIXKV_CUDA=ON -DMIXKV_BENCHMARKS=ON \
    -DMIXKV_TESTS=OFF ${CMAKE_ARGS[@]+"${CMAKE_ARGS[@]}"} >"$OUT/build.log" 2>&1 &&
    timeout "$(until_deadline "$BUILD_DEADLINE")" cmake --build "$BUILD" -j"$JOBS" --target mixkv_extend_bench \
      >>"$OUT/build.log" 2>&1
  rc=$?
  echo "build: rc=$rc at $(elapsed) s"
  if [ "$rc" != 0 ]; then
    grep -E "error|FAILED|Error" "$OUT/build.log" | head -20
    MIXKV=0
  fi
fi

# --- wait for the JIT build (nothing may compile while anything is timed)
if [ -n "$FI_PID" ]; then
  stage "waiting for FlashInfer's JIT build (deadline ${JIT_DEADLINE} s)"
  while kill -0 "$FI_PID" 2>/dev/null && [ "$(elapsed)" -lt "$JIT_DEADLINE" ]; do sleep 2; done
  if kill -0 "$FI_PID" 2>/dev/null; then
    echo "FlashInfer JIT build past its deadline: stopped; the modules not built are skipped"
    kill -TERM -- "-$FI_PID" 2>/dev/null
    sleep 2
    kill -KILL -- "-$FI_PID" 2>/dev/null
  fi
  wait "$FI_PID" 2>/dev/null
  echo "JIT: rc=$? at $(elapsed) s"
  grep -E "flashinfer JIT|Error|error:" "$OUT/flashinfer_jit.log" | head -12
fi

# --- benchmarks, one after the other
if [ "$MIXKV" = 1 ]; then
  stage "mixkv_extend_bench"
  timeout "$MIXKV_TIMEOUT" "$BUILD/benchmarks/mixkv_extend_bench" --out "$OUT/extend_bench.json" --reps "$REPS" \
    --flush "$FLUSH" $QUICK 2>&1 | tee "$OUT/extend_bench.log"
  echo "mixkv_extend_bench: rc=${PIPESTATUS[0]} at $(elapsed) s"
fi
if [ "$FI" = 1 ]; then
  stage "flashinfer_prefill_bench.py"
  timeout "$FI_TIMEOUT" python3 benchmarks/flashinfer_prefill_bench.py --out "$OUT/flashinfer_prefill_bench.json" \
    --reps "$REPS" --flush "$FLUSH" --variants "$FI_VARIANTS" --page-sizes "$PAGES" --layouts "$LAYOUTS" \
    --require-built $QUICK 2>&1 | grep -v "^\s*warnings.warn\|UserWarning" | tee "$OUT/flashinfer.log"
  echo "flashinfer_prefill_bench: rc=${PIPESTATUS[0]} at $(elapsed) s"
fi

# --- report
stage "report"
if python3 -c "import matplotlib" 2>/dev/null; then
  echo "matplotlib present: plotting $OUT/extend.png"
else
  echo "matplotlib not installed: no plot, the markdown report only"
fi
timeout 60 python3 benchmarks/plot_extend.py "$OUT/extend_bench.json" "$OUT/flashinfer_prefill_bench.json" \
  --md "$OUT/extend.md" --png "$OUT/extend.png" 2>&1 | sed -n '/## Against the targets/,$p'
stage "done"
