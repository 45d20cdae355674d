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

// What codes are computed with: the reciprocal of the stored scale, 0 for a
// zero scale (a constant group). Codes multiply by it rather than divide:
// one correctly rounded reciprocal per group instead of a division per value,
// which on the GPU costs ~10 instructions each.
MIXKV_HOST_DEVICE inline float quant_inverse_step(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// Code of x given the stored (FP16-rounded, widened) minimum and
// quant_inverse_step of the stored scale. A constant group encodes as 0.
MIXKV_HOST_DEVICE inline int quant_code(float x, float inverse_step, float min, int max_code) {
  if (!(inverse_step > 0.0f)) return 0;
  const float q = floorf((x - min) * inverse_step + 0.5f);
  return q < 0.0f ? 0 : (q > static_cast<float>(max_code) ? max_code : static_cast<int>(q));
}

MIXKV_HOST_DEVICE inline float dequant(int code, float scale, float min) {
  return min + scale * static_cast<float>(code);
}

}  // namespace mixkv
