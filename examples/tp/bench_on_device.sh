#!/usr/bin/env bash
# Tensor parallelism on a machine with two GPUs, in one go: builds mixkv's
# Python package with CUDA (staged in build-python-gpu/stage), runs
# tests/python/test_tp.py (the NCCL tests included), then the benchmark of
# docs/tensor-parallel.md: examples/tp/run.py with Llama-3-8B's attention
# shape (32 query / 8 KV heads of 128, 8 layers, float16 weights) at a
# fixed KV budget per GPU, tp = 1 and tp = 2, FP16 and WindowQuant plans,
# the step digest compared every step and not at all.
# Results go to $OUT (./device-out by default): test_tp.log, one JSON per
# run (tp<N>_<plan>[_nocheck].json) and bench.log.
# Usage: examples/tp/bench_on_device.sh [--arena-mib 1024] [--requests 64] [--new-tokens 64] [--skip-tests]
# Needs torch with CUDA and two visible GPUs; pybind11, pytest and numpy
# as tests/python/run_gpu_tests.sh finds them.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
ARENA=1024 REQUESTS=64 NEW=64 TESTS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --arena-mib) ARENA="$2"; shift ;;
    --requests) REQUESTS="$2"; shift ;;
    --new-tokens) NEW="$2"; shift ;;
    --skip-tests) TESTS=0 ;;
    *) echo "unknown flag $1 (see the usage at the top of $0)"; exit 2 ;;
  esac
  shift
done
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "bench_on_device.sh: needs 2 CUDA GPUs, $gpus visible"; exit 1; fi

# --- the package, with CUDA
CMAKE_ARGS=()
if [ ! -f /usr/include/boost/unordered/unordered_flat_map.hpp ] && [ -d .devdeps ]; then
  CMAKE_ARGS+=("-DBoost_DIR=$ROOT/.devdeps/lib/cmake/Boost")
fi
[ -d .devdeps/include ] && export CPATH=$ROOT/.devdeps/include${CPATH:+:$CPATH}
if ! cmake -S . -B build-python-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMIXKV_CUDA=ON -DMIXKV_PYTHON=ON \
  -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
  "${CMAKE_ARGS[@]}" >"$OUT/build.log" 2>&1 ||
  ! cmake --build build-python-gpu -j "$(nproc)" --target mixkv_python >>"$OUT/build.log" 2>&1; then
  echo "build failed: $OUT/build.log"
  tail -20 "$OUT/build.log"
  exit 1
fi
STAGE=$ROOT/build-python-gpu/stage
rm -rf "$STAGE" && mkdir -p "$STAGE"
cp -r bindings/python/mixkv "$STAGE/"
cp build-python-gpu/bindings/_*.so "$STAGE/mixkv/"
export PYTHONPATH=$STAGE
python3 -c "import mixkv; assert mixkv.built_with_cuda, 'mixkv built without CUDA'" || exit 1

status=0
if [ "$TESTS" = 1 ]; then
  echo "== tests/python/test_tp.py"
  timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_tp.py 2>&1 | tee "$OUT/test_tp.log"
  status=${PIPESTATUS[0]}
fi

echo "== benchmark: $ARENA MiB of KV memory a GPU, $REQUESTS requests, $NEW new tokens each"
: >"$OUT/bench.log"
for plan in fp16 mixed; do
  for tp in 1 2; do
    for check in check nocheck; do
      name=tp${tp}_${plan}$([ "$check" = nocheck ] && echo _nocheck)
      flags=()
      [ "$check" = nocheck ] && flags+=(--no-check)
      timeout 300 python3 examples/tp/run.py --tp "$tp" --backend cuda --dist-backend nccl --model llama8b-shape \
        --plan "$plan" --arena-mib "$ARENA" --requests "$REQUESTS" --new-tokens "$NEW" --frames 16 \
        --max-num-seqs "$REQUESTS" --step-tokens 8192 --bench "$OUT/$name.json" "${flags[@]}" \
        >>"$OUT/bench.log" 2>&1 || { echo "$name failed (bench.log)"; status=1; }
    done
  done
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':22}{'tokens at FP16/GPU':>20}{'tokens/s':>10}{'step ms':>9}{'messages ms':>13}")
for path in sorted(out.glob("tp*.json")):
    r = json.loads(path.read_text())
    print(f"{path.stem:22}{r['capacity']['tokens_at_fp16']:>20,}{r['generated_tokens_per_s']:>10.0f}"
          f"{r['step_ms']:>9.2f}{r['control_ms_per_step']:>13.2f}")
EOF
exit "$status"
