# Shared by the run and test scripts: where the build goes and whether CUDA
# is compiled (it is whenever nvcc exists, GPU or not).
if [ -d /usr/local/cuda/bin ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
MIXKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIXKV_JOBS="${MIXKV_JOBS:-$(nproc)}"
if command -v nvcc >/dev/null 2>&1; then MIXKV_CUDA=ON; else MIXKV_CUDA=OFF; fi

# configure_and_build BUILD_DIR [extra cmake args...]
configure_and_build() {
  local dir="$1"; shift
  cmake -S "$MIXKV_ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DMIXKV_CUDA="$MIXKV_CUDA" "$@"
  cmake --build "$dir" -j "$MIXKV_JOBS"
}

# Whether a CUDA GPU is visible (nvidia-smi lists one).
gpu_present() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

# Whether python3 imports every module named.
py_has() {
  python3 -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))" "$@" \
    2>/dev/null
}

# The mixkv Python package built and installed from this checkout, with the
# CUDA backend when nvcc and a GPU are present (scripts/run_tests.sh builds
# it the same way).
install_mixkv_package() {
  local cuda=OFF
  if [ "$MIXKV_CUDA" = ON ] && gpu_present; then cuda=ON; fi
  echo "Python package with MIXKV_CUDA=$cuda"
  pip_install --no-build-isolation "$MIXKV_ROOT" -C cmake.define.MIXKV_CUDA="$cuda"
}

# pip install into the python3 on PATH, quietly; a Python that is marked
# externally managed (PEP 668) takes --break-system-packages, as the
# machine's own tools are what this checkout builds against.
pip_install() {
  local extra=()
  if python3 -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))" 2>/dev/null; then
    extra+=(--break-system-packages)
  fi
  python3 -m pip install --quiet --root-user-action=ignore "${extra[@]}" "$@"
}

# Exit status of a script whose downloads failed (no network): callers that
# treat that step as optional report it as skipped.
MIXKV_UNAVAILABLE=3
