#pragma once
// The rounding rules of asymmetric min-max quantization (windowquant.md,
// eqs. 14-16), shared by the host reference and the CUDA kernels so that both
// produce the same codes bit for bit. All arithmetic is IEEE float; the
// stored scale and minimum are of the cache's 16-bit type (FP16 below, or
// BF16), and codes are computed against the rounded values actually stored,
// so dequantization error stays within half a step of the stored scale
// (plus the slack bounded at quant_code).
#include <cmath>

#include "mixkv/core/host_device.h"

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

// The per-group constant of quant_code: 0.5 - min * inverse_step rounded
// once (an FMA), so that a code costs one FMA instead of a subtraction, a
// multiplication and an addition. A constant group (inverse_step 0) gets
// exactly 0.5.
MIXKV_HOST_DEVICE inline float quant_bias(float min, float inverse_step) { return fmaf(-min, inverse_step, 0.5f); }

// Code of x given quant_inverse_step of the stored scale and quant_bias of
// the stored (FP16-rounded, widened) minimum: floor(fma(x, inverse_step,
// bias)), clamped to [0, max_code]. fmaf is one IEEE rounding on both
// backends (std::fma semantics on the host, FFMA on the device), so the
// codes agree bit for bit.
//
// Why this is still round-to-nearest of y = (x - min) / scale + 0.5 (u =
// 2^-24): with inverse_step = (1 / scale)(1 + d1), bias = 0.5 - min *
// inverse_step + e_b and the FMA's own rounding d2, the computed value is
// y + ((x - min) / scale) d1 + e_b + (fma result) d2, where |e_b| <= u (|min|
// * inverse_step + 0.5) and, for every code not clamped to max_code, the
// other two terms are below u (max_code + 2) each. So the code is floor(y)
// unless y lies within u (|min| / scale + 2 max_code + 5) of an integer,
// where it may be either neighbour, and dequantization stays within half a
// step plus that much of a step. Only the bias's term grows, with the
// group's minimum against its step (the bias carries its integer bits): for
// FP16 input |min| / scale <= 2^15 at INT4 (reached by min = -2^-7 with the
// maximum one FP16 ulp above: the step rounds to the subnormal scale 2^-22)
// and 2^13 at INT2 (exhaustive over FP16 pairs), so the bias keeps >= 8
// fraction bits and the slack is < 2^-9 of a step; for ordinary groups
// (|min| a few times the range) it is ~2^-20, as with the three separately
// rounded operations (x - min) * inverse_step + 0.5 used before.
// In a BF16 cache (BlockFormat::dtype) min and scale are stored as
// bfloat16 instead: two distinct bfloat16 values differ by at least 2^-8
// of the larger, so |min| / scale < 2^12 (INT4; 2^10 at INT2, the
// subnormal scales included), the bias keeps >= 11 fraction bits and the
// slack stays < 2^-11 of a step; no group overflows (bfloat16 has float's
// range).
// A constant group (inverse_step 0): fma(x, 0, 0.5) = 0.5, code 0. The low
// clamp: for FP16 input min is the group's lowest value exactly, so y >= 0.5
// and the result >= 0.5 - 2^-9: it never fires; for float input (demotion)
// min is the FP16 rounding of the lowest value and may lie above it. The
// high clamp fires where the scale rounded down by more than the rounding
// slack, i.e. for FP16 scales in the subnormal range (up to y = 22.5 at
// INT4), and for float input.
// NaN (a NaN input, or inf * 0 from an infinite input or minimum) codes as
// 0: a float-to-int conversion of NaN is undefined, so it never reaches one.
// The ops reject such input before quantizing (store: NaN/inf K/V; demote: a
// source block whose group min or step FP16 cannot hold); this is the last
// line, for any caller that does not.
MIXKV_HOST_DEVICE inline int quant_code(float x, float inverse_step, float bias, int max_code) {
  const float q = floorf(fmaf(x, inverse_step, bias));
  return !(q >= 0.0f) ? 0 : (q > static_cast<float>(max_code) ? max_code : static_cast<int>(q));
}

MIXKV_HOST_DEVICE inline float dequant(int code, float scale, float min) {
  return min + scale * static_cast<float>(code);
}

}  // namespace mixkv
