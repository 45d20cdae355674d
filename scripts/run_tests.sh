#!/usr/bin/env bash
# Every test: builds mixkv (CUDA code included whenever nvcc exists) and runs
# the whole suite: C++ under ctest, the sanitizer builds and the fuzzers, then
# the Python package (pip install .) under pytest. On a machine with a GPU the
# package is built with the CUDA backend, so the Python GPU tests run too;
# without one, every GPU test skips, saying so.
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$MIXKV_ROOT/scripts/setup.sh"
configure_and_build "$MIXKV_ROOT/build-test" -DMIXKV_TESTS=ON -DMIXKV_BENCHMARKS=ON
ctest --test-dir "$MIXKV_ROOT/build-test" --output-on-failure -j "$MIXKV_JOBS"
# The C++ suite under ASan + UBSan, and each fuzzer for 30 s (docs/reliability.md).
"$MIXKV_ROOT/scripts/run_reliability.sh"

# The Python package, built and installed as a user would (pip install .).
# Without a GPU the CPU backend alone: the C++ suite above already compiled
# the CUDA code, and the Python GPU tests would skip. --no-build-isolation
# uses the build tools setup.sh installed instead of fetching them again.
install_mixkv_package
# pytest exits 5 when it collected nothing: a failure here, like any other.
status=0
python3 -m pytest -q -rs "$MIXKV_ROOT/tests/python" || status=$?
if [ "$status" -eq 5 ]; then echo "run_tests.sh: pytest collected no tests" >&2; fi
exit "$status"
