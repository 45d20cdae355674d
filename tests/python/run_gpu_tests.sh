#!/usr/bin/env bash
# The Python GPU tests on a machine with a GPU and torch (the device machine):
# builds the extension with CUDA into build-python-gpu/, stages the package
# next to it and runs pytest on tests/python (test_cuda.py included; the CPU
# tests run too). pybind11 and pytest come from PyPI, or, offline, from the
# wheels in build-wheels/ (made beforehand with
#   python3 -m pip download pybind11 pytest --only-binary=:all: \
#       --python-version 3.12 --platform manylinux2014_x86_64 -d build-wheels
# and carried along). Boost headers: the system's, else .devdeps/ as
# benchmarks/run_on_device.sh uses them.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
export PATH=/usr/local/cuda/bin:$PATH
if ! python3 -c "import pybind11, pytest, numpy" 2>/dev/null; then
  python3 -m pip install --quiet --no-index --find-links build-wheels pybind11 pytest numpy ||
    python3 -m pip install --quiet pybind11 pytest numpy
fi
CMAKE_ARGS=()
if [ ! -f /usr/include/boost/unordered/unordered_flat_map.hpp ] && [ -d .devdeps ]; then
  CMAKE_ARGS+=("-DBoost_DIR=$ROOT/.devdeps/lib/cmake/Boost")
fi
cmake -S . -B build-python-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMIXKV_CUDA=ON -DMIXKV_PYTHON=ON \
      -DMIXKV_TESTS=OFF -DMIXKV_BENCHMARKS=OFF -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
      "${CMAKE_ARGS[@]}" >/dev/null
cmake --build build-python-gpu -j "$(nproc)" --target mixkv_python
STAGE=build-python-gpu/stage
rm -rf "$STAGE" && mkdir -p "$STAGE"
cp -r bindings/python/mixkv "$STAGE/"
cp build-python-gpu/bindings/_core*.so "$STAGE/mixkv/"
PYTHONPATH="$ROOT/$STAGE" python3 -m pytest -q -rs -p no:cacheprovider tests/python "$@"
