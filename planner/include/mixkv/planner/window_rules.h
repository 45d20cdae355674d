#pragma once
// The per-window arithmetic of WindowQuant section 1 (eqs. 10-11 and the
// precision rule), shared by the CPU planner and the CUDA plan kernel so both
// make the same decision for the same score. No validation here: callers
// (WindowPlanner) check their inputs first.
#include <cmath>

#include "mixkv/core/host_device.h"
#include "mixkv/core/precision.h"

namespace mixkv {

// f2 of eq. 11, (exp(-a s) - 1) / (exp(-a) - 1), for s in [0, 1], a > 0.
// expm1 keeps it exact for tiny a and finite for huge a.
MIXKV_HOST_DEVICE inline double window_threshold_high(double s, double alpha) {
  return expm1(-alpha * s) / expm1(-alpha);
}

// f1 of eq. 10, (exp(a s) - 1) / (exp(a) - 1), written as exp(a (s - 1)) * f2(s)
// so that it cannot overflow for large a (exp(a) alone is inf past a ~ 709).
// The factor exp(a (s - 1)) <= 1 also shows f1 <= f2 on [0, 1].
MIXKV_HOST_DEVICE inline double window_threshold_low(double s, double alpha) {
  return exp(alpha * (s - 1.0)) * window_threshold_high(s, alpha);
}

// T_low <= T_high of one layer, as the floats scores are compared against.
struct LayerThresholds {
  float low = 0.0f;
  float high = 0.0f;
  friend bool operator==(const LayerThresholds&, const LayerThresholds&) = default;
};

// Thresholds of a layer with sensitivity s in [-1, 1]. Negative s (attention
// turns the hidden state away from its input) is clamped to 0, the most
// sensitive point of the paper's scale: eqs. 10-11 are only defined on [0, 1]
// and, used as written below 0, they cross (T_high < T_low) and T_high falls
// under -1. docs/planner.md gives the full argument.
MIXKV_HOST_DEVICE inline LayerThresholds layer_thresholds(double sensitivity, double alpha) {
  const double s = sensitivity > 0.0 ? sensitivity : 0.0;
  return {static_cast<float>(window_threshold_low(s, alpha)), static_cast<float>(window_threshold_high(s, alpha))};
}

// The more precise of two precisions (more bits).
MIXKV_HOST_DEVICE constexpr Precision max_precision(Precision a, Precision b) {
  return bits_of(a) >= bits_of(b) ? a : b;
}

// The rule of section 1 for one (layer, window): score above T_high -> FP16,
// below T_low -> INT2, otherwise INT4 (ties stay INT4); then raised to the
// layer's minimum; window 0 of a request is always FP16 (attention sinks).
MIXKV_HOST_DEVICE inline Precision window_precision(float score, LayerThresholds t, Precision minimum,
                                                    bool first_window) {
  if (first_window) return Precision::FP16;
  const Precision chosen = score > t.high ? Precision::FP16 : (score < t.low ? Precision::INT2 : Precision::INT4);
  return max_precision(chosen, minimum);
}

}  // namespace mixkv
