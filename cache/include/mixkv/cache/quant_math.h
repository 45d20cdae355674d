#pragma once
// The rounding rules of asymmetric min-max quantization (windowquant.md,
// eqs. 14-16), shared by the host reference and the CUDA kernels so that both
// produce the same codes bit for bit. All arithmetic is IEEE float; the
// stored scale and minimum are FP16, and codes are computed against the
// FP16-rounded values actually stored, so dequantization error stays within
// half a step of the stored scale.
#include <cmath>

#include "mixkv/cache/host_device.h"

namespace mixkv {

// Step of a group whose values span [lo, hi], before FP16 rounding.
MIXKV_HOST_DEVICE inline float quant_step(float lo, float hi, int max_code) {
  return (hi - lo) / static_cast<float>(max_code);
}

// Code of x given the stored (FP16-rounded, widened) scale and minimum.
// A zero scale (constant group) encodes everything as 0.
MIXKV_HOST_DEVICE inline int quant_code(float x, float scale, float min, int max_code) {
  if (!(scale > 0.0f)) return 0;
  const float q = floorf((x - min) / scale + 0.5f);
  return q < 0.0f ? 0 : (q > static_cast<float>(max_code) ? max_code : static_cast<int>(q));
}

MIXKV_HOST_DEVICE inline float dequant(int code, float scale, float min) {
  return min + scale * static_cast<float>(code);
}

}  // namespace mixkv
