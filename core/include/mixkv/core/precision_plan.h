#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "mixkv/core/precision.h"

namespace mixkv {

// The precision of every (layer, visual window) of one request, with the
// similarity score that chose it (kept so that demotion under memory pressure
// can pick the least similar windows first). Tokens outside full windows are
// FP16 and are not part of the plan.
class PrecisionPlan {
 public:
  PrecisionPlan() = default;
  // All windows at `fill`; scores 0. Throws InvalidArgument for num_layers < 1
  // or num_windows < 0.
  PrecisionPlan(std::int32_t num_layers, std::int32_t num_windows, Precision fill = Precision::FP16);

  std::int32_t num_layers() const { return num_layers_; }
  std::int32_t num_windows() const { return num_windows_; }

  // Throw IndexOutOfRange naming "layer" or "window".
  Precision at(std::int32_t layer, std::int32_t window) const;
  void set(std::int32_t layer, std::int32_t window, Precision precision);
  // The precisions of one layer's windows, [window], for loops over a
  // layer (at() checks both indices on every call). IndexOutOfRange naming
  // "layer".
  std::span<const Precision> layer(std::int32_t layer) const;
  float score(std::int32_t window) const;
  void set_score(std::int32_t window, float score);

  // Windows of one layer at each precision, indexed by pool_index().
  std::array<std::int32_t, kNumPrecisions> window_counts(std::int32_t layer) const;

  friend bool operator==(const PrecisionPlan&, const PrecisionPlan&) = default;

 private:
  std::int32_t num_layers_ = 0;
  std::int32_t num_windows_ = 0;
  std::vector<Precision> precisions_;  // [layer][window]
  std::vector<float> scores_;          // [window]
};

}  // namespace mixkv
