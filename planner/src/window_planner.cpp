#include "mixkv/planner/window_planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mixkv/core/block_format.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/half.h"

// MIXKV_PLANNER_PORTABLE builds only the portable row loop: what a non-x86
// host runs, and how the tests check that loop on x86.
#if defined(__x86_64__) && !defined(MIXKV_PLANNER_PORTABLE)
#define MIXKV_PLANNER_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace mixkv {
namespace {

std::size_t element_bytes(ElementType type) { return type == ElementType::F32 ? 4 : 2; }

float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t x = static_cast<std::uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &x, sizeof value);
  return value;
}

float load_element(const void* row, ElementType type, std::int32_t c) {
  switch (type) {
    case ElementType::F32: return static_cast<const float*>(row)[c];
    case ElementType::F16: return half_to_float(static_cast<const Half*>(row)[c]);
    case ElementType::BF16: return bf16_to_float(static_cast<const std::uint16_t*>(row)[c]);
  }
  return 0.0f;
}

const void* row_pointer(const EmbeddingsView& view, std::int64_t row) {
  return static_cast<const std::byte*>(view.data) +
         static_cast<std::size_t>(row) * static_cast<std::size_t>(view.hidden) * element_bytes(view.type);
}

// Sums a row needs: u . v and |v|^2.
struct RowSums {
  double dot = 0.0;
  double squares = 0.0;
};

// Float accumulation in 32 independent lanes (the AVX2 path's 4 x 8), so each
// partial sum covers hidden / 32 terms: far inside eq. 8's 1e-6 budget.
// Portable fallback of row_sums_avx2, identical in structure.
RowSums row_sums_generic(const float* u, const void* row, ElementType type, std::int32_t hidden) {
  constexpr int kLanes = 32;
  float dot[kLanes] = {};
  float squares[kLanes] = {};
  std::int32_t c = 0;
  for (; c + kLanes <= hidden; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float x = load_element(row, type, c + l);
      dot[l] += u[c + l] * x;
      squares[l] += x * x;
    }
  }
  RowSums sums;
  for (; c < hidden; ++c) {
    const float x = load_element(row, type, c);
    sums.dot += static_cast<double>(u[c]) * x;
    sums.squares += static_cast<double>(x) * x;
  }
  for (int l = 0; l < kLanes; ++l) {
    sums.dot += dot[l];
    sums.squares += squares[l];
  }
  return sums;
}

#if defined(MIXKV_PLANNER_X86)
// F16 rows need F16C (vcvtph2ps) to be converted at memory speed; GCC does
// not vectorize scalar half conversions, so this path is written out.
template <ElementType kType>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const void* row, std::int32_t c) {
  if constexpr (kType == ElementType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + c);
  } else if constexpr (kType == ElementType::F16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(row) + c)));
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(row) + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
}

// How far ahead of its loads a row loop asks for cache lines. Windows are
// read as one stream (a window's rows are consecutive, and so are the
// windows of a thread's range), but on the 2-core CI VM the hardware
// prefetcher did not keep that stream ahead: 4 KiB of software prefetch took
// the planner from 11.4-13.6 to 7.7-9.5 ms (F16, alternating runs on that
// machine; docs/planner.md). Prefetches past the end of the embeddings are
// hints and cannot fault.
constexpr std::uintptr_t kPrefetchBytes = 4096;

template <ElementType kType>
__attribute__((target("avx2,fma,f16c"))) RowSums row_sums_avx2_typed(const float* u, const void* row,
                                                                     std::int32_t hidden) {
  constexpr std::int32_t kElementBytes = kType == ElementType::F32 ? 4 : 2;
  // An address, not a pointer: it may lie past the end of the embeddings.
  const std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(row) + kPrefetchBytes;
  __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
  __m256 s0 = d0, s1 = d0, s2 = d0, s3 = d0;
  std::int32_t c = 0;
  for (; c + 32 <= hidden; c += 32) {
    // 32 elements span one 64-byte line (16-bit) or two (F32).
    const std::uintptr_t line = ahead + static_cast<std::uintptr_t>(c * kElementBytes);
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    if constexpr (kElementBytes == 4) _mm_prefetch(reinterpret_cast<const char*>(line + 64), _MM_HINT_T0);
    const __m256 x0 = load8<kType>(row, c);
    const __m256 x1 = load8<kType>(row, c + 8);
    const __m256 x2 = load8<kType>(row, c + 16);
    const __m256 x3 = load8<kType>(row, c + 24);
    d0 = _mm256_fmadd_ps(_mm256_loadu_ps(u + c), x0, d0);
    d1 = _mm256_fmadd_ps(_mm256_loadu_ps(u + c + 8), x1, d1);
    d2 = _mm256_fmadd_ps(_mm256_loadu_ps(u + c + 16), x2, d2);
    d3 = _mm256_fmadd_ps(_mm256_loadu_ps(u + c + 24), x3, d3);
    s0 = _mm256_fmadd_ps(x0, x0, s0);
    s1 = _mm256_fmadd_ps(x1, x1, s1);
    s2 = _mm256_fmadd_ps(x2, x2, s2);
    s3 = _mm256_fmadd_ps(x3, x3, s3);
  }
  alignas(32) float dot[8];
  alignas(32) float squares[8];
  _mm256_store_ps(dot, _mm256_add_ps(_mm256_add_ps(d0, d1), _mm256_add_ps(d2, d3)));
  _mm256_store_ps(squares, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  RowSums sums;
  for (; c < hidden; ++c) {
    const float x = load_element(row, kType, c);
    sums.dot += static_cast<double>(u[c]) * x;
    sums.squares += static_cast<double>(x) * x;
  }
  for (int l = 0; l < 8; ++l) {
    sums.dot += dot[l];
    sums.squares += squares[l];
  }
  return sums;
}

RowSums row_sums_avx2(const float* u, const void* row, ElementType type, std::int32_t hidden) {
  switch (type) {
    case ElementType::F32: return row_sums_avx2_typed<ElementType::F32>(u, row, hidden);
    case ElementType::F16: return row_sums_avx2_typed<ElementType::F16>(u, row, hidden);
    case ElementType::BF16: return row_sums_avx2_typed<ElementType::BF16>(u, row, hidden);
  }
  return {};
}
#endif

using RowSumsFn = RowSums (*)(const float*, const void*, ElementType, std::int32_t);

RowSumsFn pick_row_sums() {
#if defined(MIXKV_PLANNER_X86)
  __builtin_cpu_init();
  // F16C from CPUID leaf 1 (ECX bit 29): clang before 16 has no "f16c" for
  // __builtin_cpu_supports.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return row_sums_avx2;
  }
#endif
  return row_sums_generic;
}

const RowSumsFn row_sums_fast = pick_row_sums();

// Double accumulation, for rows the float path cannot settle (NaN, inf,
// overflowed or underflowed sums) and for the few text rows. `u` may be null
// (norm only).
RowSums row_sums_exact(const double* u, const void* row, ElementType type, std::int32_t hidden) {
  RowSums sums;
  for (std::int32_t c = 0; c < hidden; ++c) {
    const double x = load_element(row, type, c);
    if (u != nullptr) sums.dot += u[c] * x;
    sums.squares += x * x;
  }
  return sums;
}

// Below this a float sum of squares may have lost digits to underflow.
constexpr float kSmallestTrustedSquares = 1e-30f;

[[noreturn]] void throw_not_finite(const std::string& name, std::int64_t row, const std::string& what) {
  throw InvalidArgument(name + " row " + std::to_string(row) + " (" + what +
                        ") holds a NaN or infinite value, expected finite embeddings");
}

void validate_view(const EmbeddingsView& view, const std::string& name, std::int64_t expected_tokens) {
  if (view.type != ElementType::F32 && view.type != ElementType::F16 && view.type != ElementType::BF16) {
    throw InvalidArgument(name + ".type = " + std::to_string(static_cast<int>(view.type)) +
                          ", expected F32 (0), F16 (1) or BF16 (2)");
  }
  if (view.hidden < 1) {
    throw InvalidArgument(name + ".hidden = " + std::to_string(view.hidden) + ", expected >= 1");
  }
  if (view.num_tokens != expected_tokens) {
    throw InvalidArgument(name + ".num_tokens = " + std::to_string(view.num_tokens) + ", expected " +
                          std::to_string(expected_tokens));
  }
  if (view.data == nullptr) throw InvalidArgument(name + ".data is null, expected a [tokens, hidden] matrix");
}

void validate_window_size(std::int32_t window_size) {
  if (window_size < 1) {
    throw InvalidArgument("window_size = " + std::to_string(window_size) + ", expected >= 1");
  }
}

void validate_request(const TokenLayout& layout, const EmbeddingsView& view, const std::string& layout_name,
                      const std::string& view_name) {
  validate_view(view, view_name, layout.num_tokens());
  bool has_text = false;
  for (const Segment& s : layout.segments()) has_text = has_text || s.kind == TokenKind::Text;
  if (!has_text) {
    throw InvalidArgument(layout_name +
                          " has no text tokens, expected at least one (eq. 8 compares windows "
                          "with the text prompt)");
  }
}

// The window loop reads every visual row once and is bound by memory
// bandwidth, which one core of a host does not saturate: windows are split
// into contiguous ranges over the host's cores (ranges of at least
// kMinWindowsPerThread, so that small requests stay on the caller's thread).
// Each window is computed exactly as on one thread, so scores do not depend
// on the split; when windows fail, the first in window order is reported.
constexpr std::size_t kMinWindowsPerThread = 64;

template <typename ScoreWindow>
void for_each_window_in_parallel(std::size_t num_windows, ScoreWindow score_window) {
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t workers = std::clamp<std::size_t>(num_windows / kMinWindowsPerThread, 1, cores);
  std::vector<std::exception_ptr> errors(workers);
  auto run = [&](std::size_t w) {
    try {
      for (std::size_t i = num_windows * w / workers; i < num_windows * (w + 1) / workers; ++i) score_window(i);
    } catch (...) {
      errors[w] = std::current_exception();
    }
  };
  {
    std::vector<std::jthread> threads;
    threads.reserve(workers - 1);
    for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(run, w);
    run(0);
  }  // joins the others
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

// Eq. 8 for one validated request.
std::vector<float> similarity_of(const TokenLayout& layout, const EmbeddingsView& view, std::int32_t window_size,
                                 const std::string& name) {
  const std::int32_t hidden = view.hidden;

  // mean_j(t_j / |t_j|) in double; a zero text row adds nothing but still counts.
  std::vector<double> text_mean(static_cast<std::size_t>(hidden), 0.0);
  std::int64_t num_text = 0;
  std::int64_t position = 0;
  for (const Segment& s : layout.segments()) {
    if (s.kind == TokenKind::Text) {
      for (std::int64_t r = position; r < position + s.length; ++r) {
        const void* row = row_pointer(view, r);
        const double squares = row_sums_exact(nullptr, row, view.type, hidden).squares;
        if (!std::isfinite(squares)) throw_not_finite(name, r, "text");
        if (squares > 0.0) {
          const double inverse = 1.0 / std::sqrt(squares);
          for (std::int32_t c = 0; c < hidden; ++c) text_mean[c] += load_element(row, view.type, c) * inverse;
        }
      }
      num_text += s.length;
    }
    position += s.length;
  }
  std::vector<float> text_mean_f(static_cast<std::size_t>(hidden));
  for (std::int32_t c = 0; c < hidden; ++c) {
    text_mean[c] /= static_cast<double>(num_text);
    text_mean_f[c] = static_cast<float>(text_mean[c]);
  }

  // sim_i = mean_k (u . w_k) / |w_k|, with u the text mean.
  const std::vector<std::int32_t> starts = layout.window_starts(window_size);
  std::vector<float> scores(starts.size());
  auto score_window = [&](std::size_t i) {
    double sum = 0.0;
    for (std::int64_t r = starts[i]; r < starts[i] + static_cast<std::int64_t>(window_size); ++r) {
      const void* row = row_pointer(view, r);
      RowSums sums = row_sums_fast(text_mean_f.data(), row, view.type, hidden);
      if (!std::isfinite(sums.dot) || !std::isfinite(sums.squares) || sums.squares < kSmallestTrustedSquares) {
        sums = row_sums_exact(text_mean.data(), row, view.type, hidden);
        if (!std::isfinite(sums.dot) || !std::isfinite(sums.squares)) {
          throw_not_finite(name, r, "visual window " + std::to_string(i));
        }
      }
      if (sums.squares > 0.0) sum += sums.dot / std::sqrt(sums.squares);
    }
    scores[i] = static_cast<float>(sum / window_size);
  };
  for_each_window_in_parallel(starts.size(), score_window);
  return scores;
}

std::string indexed(const char* name, std::size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

// Section 1's rule for every (layer, window) of `plan`, from
// score_of(layer, window): window 0 FP16, else by the layer's thresholds
// and no lower than the layer's minimum precision.
template <typename ScoreOf>
void apply_rule(PrecisionPlan& plan, std::span<const LayerThresholds> thresholds,
                const std::vector<Precision>& min_precision, ScoreOf score_of) {
  for (std::int32_t l = 0; l < plan.num_layers(); ++l) {
    const Precision minimum = min_precision.empty() ? Precision::INT2 : min_precision[static_cast<std::size_t>(l)];
    for (std::int32_t i = 0; i < plan.num_windows(); ++i) {
      plan.set(l, i, window_precision(score_of(l, i), thresholds[static_cast<std::size_t>(l)], minimum, i == 0));
    }
  }
}

}  // namespace

std::vector<float> window_similarity(const TokenLayout& layout, const EmbeddingsView& embeddings,
                                     std::int32_t window_size) {
  validate_window_size(window_size);
  validate_request(layout, embeddings, "layout", "embeddings");
  return similarity_of(layout, embeddings, window_size, "embeddings");
}

void validate_similarity_inputs(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings,
                                std::int32_t window_size) {
  validate_window_size(window_size);
  if (layouts.size() != embeddings.size()) {
    throw InvalidArgument("embeddings holds " + std::to_string(embeddings.size()) +
                          " requests, expected one per layout (" + std::to_string(layouts.size()) + ")");
  }
  for (std::size_t i = 0; i < layouts.size(); ++i) {
    validate_request(layouts[i], embeddings[i], indexed("layouts", i), indexed("embeddings", i));
    if (embeddings[i].hidden != embeddings[0].hidden) {
      throw InvalidArgument(indexed("embeddings", i) + ".hidden = " + std::to_string(embeddings[i].hidden) +
                            ", expected " + std::to_string(embeddings[0].hidden) +
                            " as embeddings[0] (one batch, one model)");
    }
  }
}

std::vector<std::vector<float>> window_similarity(std::span<const TokenLayout> layouts,
                                                  std::span<const EmbeddingsView> embeddings,
                                                  std::int32_t window_size) {
  validate_similarity_inputs(layouts, embeddings, window_size);
  std::vector<std::vector<float>> scores;
  scores.reserve(layouts.size());
  for (std::size_t i = 0; i < layouts.size(); ++i) {
    scores.push_back(similarity_of(layouts[i], embeddings[i], window_size, indexed("embeddings", i)));
  }
  return scores;
}

void validate_sensitivity_inputs(std::span<const EmbeddingsView> before, std::span<const EmbeddingsView> after,
                                 SensitivityReduction reduction) {
  if (before.empty()) throw InvalidArgument("before is empty, expected one hidden-state matrix per layer");
  if (after.size() != before.size()) {
    throw InvalidArgument("after holds " + std::to_string(after.size()) + " layers, expected " +
                          std::to_string(before.size()) + " as before");
  }
  if (reduction != SensitivityReduction::Flattened && reduction != SensitivityReduction::TokenMean) {
    throw InvalidArgument("reduction = " + std::to_string(static_cast<int>(reduction)) +
                          ", expected Flattened (0) or TokenMean (1)");
  }
  if (before[0].num_tokens < 1) {
    throw InvalidArgument("before[0].num_tokens = " + std::to_string(before[0].num_tokens) + ", expected >= 1");
  }
  for (std::size_t l = 0; l < before.size(); ++l) {
    validate_view(before[l], indexed("before", l), before[0].num_tokens);
    validate_view(after[l], indexed("after", l), before[0].num_tokens);
    if (before[l].hidden != before[0].hidden || after[l].hidden != before[0].hidden) {
      throw InvalidArgument(indexed(before[l].hidden != before[0].hidden ? "before" : "after", l) +
                            ".hidden differs from before[0].hidden = " + std::to_string(before[0].hidden) +
                            ", expected one shape for every layer");
    }
  }
}

std::vector<double> layer_sensitivity(std::span<const EmbeddingsView> before, std::span<const EmbeddingsView> after,
                                      SensitivityReduction reduction) {
  validate_sensitivity_inputs(before, after, reduction);
  const std::int64_t tokens = before[0].num_tokens;
  const std::int32_t hidden = before[0].hidden;
  std::vector<double> sensitivities(before.size());
  for (std::size_t l = 0; l < before.size(); ++l) {
    double dot = 0.0, squares_before = 0.0, squares_after = 0.0, cosine_sum = 0.0;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const void* a = row_pointer(before[l], t);
      const void* b = row_pointer(after[l], t);
      double d = 0.0, na = 0.0, nb = 0.0;
      for (std::int32_t c = 0; c < hidden; ++c) {
        const double x = load_element(a, before[l].type, c);
        const double y = load_element(b, after[l].type, c);
        d += x * y;
        na += x * x;
        nb += y * y;
      }
      if (!std::isfinite(na)) throw_not_finite(indexed("before", l), t, "hidden state");
      if (!std::isfinite(nb)) throw_not_finite(indexed("after", l), t, "hidden state");
      dot += d;
      squares_before += na;
      squares_after += nb;
      if (na > 0.0 && nb > 0.0) cosine_sum += d / std::sqrt(na * nb);
    }
    double s = 0.0;
    if (reduction == SensitivityReduction::TokenMean) {
      s = cosine_sum / static_cast<double>(tokens);
    } else if (squares_before > 0.0 && squares_after > 0.0) {
      s = dot / std::sqrt(squares_before * squares_after);
    }
    sensitivities[l] = std::clamp(s, -1.0, 1.0);
  }
  return sensitivities;
}

WindowPlanner::WindowPlanner(PlannerConfig config) {
  validate_window_size(config.window_size);
  if (!std::isfinite(config.alpha) || config.alpha <= 0.0) {
    throw InvalidArgument("alpha = " + std::to_string(config.alpha) + ", expected a finite value > 0");
  }
  if (config.sensitivities.empty()) {
    throw InvalidArgument("sensitivities is empty, expected one s_l in [-1, 1] per layer");
  }
  if (config.sensitivities.size() > static_cast<std::size_t>(INT32_MAX)) {
    throw InvalidArgument("sensitivities holds too many layers, expected at most 2^31 - 1");
  }
  for (std::size_t l = 0; l < config.sensitivities.size(); ++l) {
    const double s = config.sensitivities[l];
    if (!(s >= -1.0 && s <= 1.0)) {  // also rejects NaN
      throw InvalidArgument(indexed("sensitivities", l) + " = " + std::to_string(s) + ", expected a cosine in [-1, 1]");
    }
  }
  if (!config.min_precision.empty() && config.min_precision.size() != config.sensitivities.size()) {
    throw InvalidArgument("min_precision holds " + std::to_string(config.min_precision.size()) +
                          " layers, expected 0 or " + std::to_string(config.sensitivities.size()) +
                          " (one per sensitivity)");
  }
  for (std::size_t l = 0; l < config.min_precision.size(); ++l) {
    const int p = pool_index(config.min_precision[l]);
    if (p < 0 || p >= kNumPrecisions) {
      throw InvalidArgument(indexed("min_precision", l) + " = " + std::to_string(p) +
                            ", expected FP16 (0), INT4 (1) or INT2 (2)");
    }
  }
  if (config.batch_policy != BatchPolicy::PerRequest && config.batch_policy != BatchPolicy::MajorityVote) {
    throw InvalidArgument("batch_policy = " + std::to_string(static_cast<int>(config.batch_policy)) +
                          ", expected PerRequest (0) or MajorityVote (1)");
  }
  thresholds_.reserve(config.sensitivities.size());
  for (const double s : config.sensitivities) thresholds_.push_back(layer_thresholds(s, config.alpha));
  config_ = std::move(config);
}

PrecisionPlan WindowPlanner::plan_from_scores(std::span<const float> scores) const {
  if (scores.size() > static_cast<std::size_t>(INT32_MAX)) {
    throw InvalidArgument("scores holds too many windows, expected at most 2^31 - 1");
  }
  for (std::size_t i = 0; i < scores.size(); ++i) {
    if (!std::isfinite(scores[i])) {
      throw InvalidArgument(indexed("scores", i) + " = " + std::to_string(scores[i]) +
                            ", expected a finite similarity");
    }
  }
  PrecisionPlan plan(num_layers(), static_cast<std::int32_t>(scores.size()));
  for (std::int32_t i = 0; i < plan.num_windows(); ++i) plan.set_score(i, scores[i]);
  apply_rule(plan, thresholds_, config_.min_precision, [&](std::int32_t, std::int32_t i) { return scores[i]; });
  return plan;
}

PrecisionPlan WindowPlanner::plan_from_layer_scores(std::span<const std::vector<float>> scores) const {
  if (scores.size() != static_cast<std::size_t>(num_layers())) {
    throw InvalidArgument("scores.size() = " + std::to_string(scores.size()) + ", expected one row per layer (" +
                          std::to_string(num_layers()) + ")");
  }
  const std::size_t windows = scores[0].size();
  if (windows > static_cast<std::size_t>(INT32_MAX)) {
    throw InvalidArgument("scores[0] holds too many windows, expected at most 2^31 - 1");
  }
  for (std::size_t l = 0; l < scores.size(); ++l) {
    if (scores[l].size() != windows) {
      throw InvalidArgument(indexed("scores", l) + ".size() = " + std::to_string(scores[l].size()) + ", expected " +
                            std::to_string(windows) + " as scores[0]");
    }
    for (std::size_t i = 0; i < windows; ++i) {
      if (!std::isfinite(scores[l][i])) {
        throw InvalidArgument(indexed("scores", l) + "[" + std::to_string(i) + "] = " + std::to_string(scores[l][i]) +
                              ", expected a finite similarity");
      }
    }
  }
  PrecisionPlan plan(num_layers(), static_cast<std::int32_t>(windows));
  for (std::int32_t i = 0; i < plan.num_windows(); ++i) {
    double sum = 0.0;
    for (const std::vector<float>& row : scores) sum += row[static_cast<std::size_t>(i)];
    plan.set_score(i, static_cast<float>(sum / num_layers()));
  }
  apply_rule(plan, thresholds_, config_.min_precision,
             [&](std::int32_t l, std::int32_t i) { return scores[l][static_cast<std::size_t>(i)]; });
  return plan;
}

PrecisionPlan WindowPlanner::plan(const TokenLayout& layout, const EmbeddingsView& embeddings) const {
  return plan_from_scores(window_similarity(layout, embeddings, config_.window_size));
}

std::vector<PrecisionPlan> WindowPlanner::plan(std::span<const TokenLayout> layouts,
                                               std::span<const EmbeddingsView> embeddings) const {
  const std::vector<std::vector<float>> scores = window_similarity(layouts, embeddings, config_.window_size);
  std::vector<PrecisionPlan> plans;
  plans.reserve(scores.size());
  for (const std::vector<float>& s : scores) plans.push_back(plan_from_scores(s));
  if (config_.batch_policy == BatchPolicy::MajorityVote) majority_vote(plans);
  return plans;
}

void majority_vote(std::span<PrecisionPlan> plans) {
  std::int32_t max_windows = 0;
  for (std::size_t r = 0; r < plans.size(); ++r) {
    if (plans[r].num_layers() != plans[0].num_layers()) {
      throw InvalidArgument(indexed("plans", r) + ".num_layers() = " + std::to_string(plans[r].num_layers()) +
                            ", expected " + std::to_string(plans[0].num_layers()) + " as plans[0]");
    }
    max_windows = std::max(max_windows, plans[r].num_windows());
  }
  if (plans.empty()) return;
  for (std::int32_t l = 0; l < plans[0].num_layers(); ++l) {
    for (std::int32_t i = 0; i < max_windows; ++i) {
      std::array<std::int32_t, kNumPrecisions> votes{};
      for (const PrecisionPlan& p : plans) {
        if (i < p.num_windows()) ++votes[static_cast<std::size_t>(pool_index(p.at(l, i)))];
      }
      // kAllPrecisions runs from most to least precise, so ties go up.
      Precision winner = Precision::FP16;
      std::int32_t best = -1;
      for (const Precision p : kAllPrecisions) {
        if (votes[static_cast<std::size_t>(pool_index(p))] > best) {
          best = votes[static_cast<std::size_t>(pool_index(p))];
          winner = p;
        }
      }
      for (PrecisionPlan& p : plans) {
        if (i < p.num_windows()) p.set(l, i, winner);
      }
    }
  }
}

PlanStats plan_stats(const TokenLayout& layout, const PrecisionPlan& plan, const CacheShape& shape) {
  validate(shape);
  if (plan.num_layers() != shape.num_layers) {
    throw InvalidArgument("plan.num_layers() = " + std::to_string(plan.num_layers()) + ", expected " +
                          std::to_string(shape.num_layers) + " (shape.num_layers)");
  }
  const std::int32_t windows = layout.num_windows(shape.block_size);
  if (plan.num_windows() != windows) {
    throw InvalidArgument("plan.num_windows() = " + std::to_string(plan.num_windows()) + ", expected " +
                          std::to_string(windows) +
                          " (layout.num_windows(block_size = " + std::to_string(shape.block_size) + "))");
  }
  const std::int64_t block_size = shape.block_size;
  const auto blocks_for = [&](std::int64_t tokens) { return (tokens + block_size - 1) / block_size; };

  PlanStats stats;
  stats.layer_blocks.resize(static_cast<std::size_t>(shape.num_layers));
  for (std::int32_t l = 0; l < shape.num_layers; ++l) {
    const std::array<std::int32_t, kNumPrecisions> counts = plan.window_counts(l);
    BlockCounts& blocks = stats.layer_blocks[static_cast<std::size_t>(l)];
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      blocks[static_cast<std::size_t>(pool_index(p))] = counts[static_cast<std::size_t>(pool_index(p))];
    }
    const std::int64_t quantized_tokens = block_size * (blocks[static_cast<std::size_t>(pool_index(Precision::INT4))] +
                                                        blocks[static_cast<std::size_t>(pool_index(Precision::INT2))]);
    blocks[static_cast<std::size_t>(pool_index(Precision::FP16))] = blocks_for(layout.num_tokens() - quantized_tokens);
    for (std::size_t p = 0; p < kNumPrecisions; ++p) stats.blocks[p] += blocks[p];
  }
  for (const Precision p : kAllPrecisions) {
    const auto index = static_cast<std::size_t>(pool_index(p));
    const std::size_t block_bytes = BlockFormat{p, shape.num_kv_heads, shape.head_dim, shape.block_size}.block_bytes();
    stats.pool_bytes[index] = static_cast<std::size_t>(stats.blocks[index]) * block_bytes;
    stats.bytes += stats.pool_bytes[index];
  }
  stats.fp16_bytes = static_cast<std::size_t>(shape.num_layers) *
                     static_cast<std::size_t>(blocks_for(layout.num_tokens())) *
                     BlockFormat{Precision::FP16, shape.num_kv_heads, shape.head_dim, shape.block_size}.block_bytes();
  return stats;
}

}  // namespace mixkv
