#!/usr/bin/env bash
# Installs what mixkv builds and tests with, on a fresh Debian machine.
# Each need is checked as a capability first (a tool on PATH, a header or a
# CMake package the build can find), so a machine that already has them
# (pip's cmake and ninja, Boost from another package, no network) installs
# nothing; only what is missing goes to one `apt-get update` and one
# `apt-get install`.
# clang-14 and its sanitizer runtimes (the fuzzers) are optional: when they
# cannot be installed (no network), the fuzzers are skipped with a message
# (scripts/run_reliability.sh) and everything else still runs.
set -euo pipefail
source "$(dirname "$0")/common.sh"

missing=()
optional=()
need() { missing+=("$@"); }
want() { optional+=("$@"); }

# version_at_least HAVE WANT: dotted versions compared field by field.
version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# A header the compiler finds on its default include path.
has_header() { printf '#include <%s>\n' "$1" | ${CXX:-c++} -std=c++20 -x c++ -fsyntax-only - >/dev/null 2>&1; }

# The CMake packages the build finds (find_package in CONFIG mode, as the
# build does), probed with a throwaway project: prints the missing names.
missing_cmake_packages() {
  local probe
  probe="$(mktemp -d)"
  cat >"$probe/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(probe LANGUAGES CXX)
foreach(spec "Boost 1.81" GTest benchmark)
  separate_arguments(args UNIX_COMMAND "${spec}")
  list(GET args 0 name)
  find_package(${args} CONFIG QUIET)
  if(NOT ${name}_FOUND)
    message(STATUS "missing:${name}")
  endif()
endforeach()
CMAKE
  cmake -S "$probe" -B "$probe/build" 2>/dev/null | sed -n 's/^-- missing://p'
  rm -rf "$probe"
}

have_cmake=1
if ! command -v cmake >/dev/null || ! version_at_least "$(cmake --version | sed -n 's/^cmake version //p')" 3.25; then
  need cmake
  have_cmake=0
fi
command -v ninja >/dev/null || need ninja-build
command -v "${CXX:-c++}" >/dev/null || need g++
if [ "$have_cmake" = 1 ]; then
  for name in $(missing_cmake_packages); do
    case "$name" in
      Boost) need libboost1.81-dev ;;
      GTest) need libgtest-dev libgmock-dev ;;
      benchmark) need libbenchmark-dev ;;
    esac
  done
else
  has_header boost/unordered/unordered_flat_map.hpp || need libboost1.81-dev
  has_header gtest/gtest.h || need libgtest-dev libgmock-dev
  has_header benchmark/benchmark.h || need libbenchmark-dev
fi
# The Python bindings' DLPack header (bindings/src/dlpack.h), found by the
# compiler's include path either way.
has_header dlpack/dlpack.h || need libdlpack-dev
command -v python3 >/dev/null || need python3
python3 -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
  2>/dev/null || need python3-dev
python3 -m pip --version >/dev/null 2>&1 || need python3-pip
command -v clang++-14 >/dev/null || want clang-14
compgen -G "/usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-*.a" >/dev/null || want libclang-rt-14-dev

if ((${#missing[@]} + ${#optional[@]})); then
  echo "setup.sh: installing ${missing[*]} ${optional[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  if ! { $SUDO apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
           "${missing[@]}" "${optional[@]}"; }; then
    if ((${#missing[@]})); then
      echo "setup.sh: could not install ${missing[*]}, which the build needs" >&2
      exit 1
    fi
    echo "setup.sh: could not install ${optional[*]}: the fuzzers will be skipped" >&2
  fi
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
