#include "mixkv/core/precision_plan.h"

#include <cmath>
#include <string>

#include "mixkv/core/checks.h"
#include "mixkv/core/errors.h"

namespace mixkv {
using detail::require_index;
using detail::require_precision;

PrecisionPlan::PrecisionPlan(std::int32_t num_layers, std::int32_t num_windows, Precision fill) {
  if (num_layers < 1) throw InvalidArgument("num_layers = " + std::to_string(num_layers) + ", expected >= 1");
  if (num_windows < 0) throw InvalidArgument("num_windows = " + std::to_string(num_windows) + ", expected >= 0");
  require_precision(fill, "fill");
  num_layers_ = num_layers;
  num_windows_ = num_windows;
  precisions_.assign(static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_windows), fill);
  scores_.assign(static_cast<std::size_t>(num_windows), 0.0f);
}

Precision PrecisionPlan::at(std::int32_t layer, std::int32_t window) const {
  require_index("layer", layer, num_layers_);
  require_index("window", window, num_windows_);
  return precisions_[static_cast<std::size_t>(layer) * num_windows_ + window];
}

std::span<const Precision> PrecisionPlan::layer(std::int32_t layer) const {
  require_index("layer", layer, num_layers_);
  return std::span<const Precision>(precisions_)
      .subspan(static_cast<std::size_t>(layer) * num_windows_, static_cast<std::size_t>(num_windows_));
}

void PrecisionPlan::set(std::int32_t layer, std::int32_t window, Precision precision) {
  require_index("layer", layer, num_layers_);
  require_index("window", window, num_windows_);
  require_precision(precision, "precision");
  precisions_[static_cast<std::size_t>(layer) * num_windows_ + window] = precision;
}

float PrecisionPlan::score(std::int32_t window) const {
  require_index("window", window, num_windows_);
  return scores_[static_cast<std::size_t>(window)];
}

void PrecisionPlan::set_score(std::int32_t window, float score) {
  require_index("window", window, num_windows_);
  if (!std::isfinite(score)) {
    throw InvalidArgument("score = " + std::to_string(score) + " for window " + std::to_string(window) +
                          ", expected a finite similarity");
  }
  scores_[static_cast<std::size_t>(window)] = score;
}

std::array<std::int32_t, kNumPrecisions> PrecisionPlan::window_counts(std::int32_t layer) const {
  require_index("layer", layer, num_layers_);
  std::array<std::int32_t, kNumPrecisions> counts{};
  const std::size_t begin = static_cast<std::size_t>(layer) * num_windows_;
  for (std::size_t i = begin; i < begin + static_cast<std::size_t>(num_windows_); ++i) {
    ++counts[static_cast<std::size_t>(pool_index(precisions_[i]))];
  }
  return counts;
}

}  // namespace mixkv
