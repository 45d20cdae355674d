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
