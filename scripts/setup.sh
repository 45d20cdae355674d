#!/usr/bin/env bash
# Installs what mixkv builds and tests with, on a fresh Debian 12 machine.
# Idempotent: skips apt-get entirely when every package is already there.
set -euo pipefail

packages=(cmake ninja-build g++ libboost1.81-dev libgtest-dev libgmock-dev libbenchmark-dev
          python3-dev python3-pip
          clang-14 libclang-rt-14-dev)  # libFuzzer and the sanitizer runtimes (run_reliability.sh)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Python package (bindings/, pyproject.toml) and its tests, for the python3
# on PATH: scikit-build-core drives CMake; the bindings need pybind11 >= 3.
if ! python3 - 2>/dev/null <<'PY'
import sys
import numpy, pybind11, pytest, scikit_build_core
sys.exit(pybind11.version_info[0] < 3)
PY
then
  python3 -m pip install --quiet --root-user-action=ignore "scikit-build-core>=0.10" "pybind11>=3.0" numpy pytest
fi
