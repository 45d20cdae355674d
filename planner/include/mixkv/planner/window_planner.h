#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "mixkv/core/cache_shape.h"
#include "mixkv/core/op_types.h"
#include "mixkv/core/precision.h"
#include "mixkv/core/precision_plan.h"
#include "mixkv/core/token_layout.h"
#include "mixkv/planner/window_rules.h"

namespace mixkv {

// WindowQuant section 1 (docs/planner.md): from a request's prompt embeddings
// to the PrecisionPlan that KVCacheManager::add_sequence() allocates. All of it
// runs before admission, so the scheduler knows a request's exact per-pool
// demand (plan_stats) before it commits memory.

// Element type of an embedding or hidden-state matrix.
enum class ElementType : std::uint8_t { F32 = 0, F16 = 1, BF16 = 2 };

// A row-major, contiguous [num_tokens, hidden] matrix owned by the caller: host
// memory for the CPU functions here, device memory for the CUDA planner
// (mixkv/planner/cuda_window_planner.h). F16 rows are IEEE binary16 (mixkv::Half,
// __half), BF16 rows the upper half of a float32 (__nv_bfloat16).
struct EmbeddingsView {
  const void* data = nullptr;
  ElementType type = ElementType::F32;
  std::int64_t num_tokens = 0;
  std::int32_t hidden = 0;
};

// Eq. 8 for every full visual window of one request: the mean cosine over all
// (text token, window token) pairs, computed exactly as
// mean_j(t_j / |t_j|) . mean_k(w_k / |w_k|). Text tokens are the tokens of the
// layout's Text segments; windows are layout.window_starts(window_size). A zero
// row counts as cosine 0 with everything (torch's cosine_similarity does the
// same). Only the rows eq. 8 reads are checked: a NaN or infinite value there
// throws InvalidArgument naming the request, row and segment kind.
// Throws InvalidArgument for window_size < 1, a layout without text tokens, or
// embeddings whose shape is not [layout.num_tokens(), hidden >= 1].
// From 128 windows on, the windows are scored on several threads (up to the
// host's cores, at least 64 windows each): the loop is bound by memory
// bandwidth, which one core does not saturate. Scores are the same as on one
// thread; of several bad windows the first is reported.
std::vector<float> window_similarity(const TokenLayout& layout, const EmbeddingsView& embeddings,
                                     std::int32_t window_size);

// The same for a batch of requests (their own frame and text counts); every
// request must share one hidden size (one model).
std::vector<std::vector<float>> window_similarity(std::span<const TokenLayout> layouts,
                                                  std::span<const EmbeddingsView> embeddings, std::int32_t window_size);

// The checks window_similarity() makes before reading any value (shapes,
// text present, one hidden size per batch): what the CUDA planner runs on the
// host before its kernels read device memory. Same errors and messages.
void validate_similarity_inputs(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings,
                                std::int32_t window_size);

// How eq. 9 reduces a [tokens, hidden] pair of hidden states to one cosine.
enum class SensitivityReduction : std::uint8_t {
  // Eq. 9 as written, on the flattened matrices: tokens with large hidden
  // states weigh more.
  Flattened = 0,
  // The mean over tokens of each token's cosine: every token weighs the same.
  TokenMean = 1,
};

// Eq. 9, batched over layers: s_l = cos(h_l, h'_l) between the hidden states
// before (before[l]) and after (after[l]) layer l's attention, all of one
// shape [tokens, hidden]. Results are clamped to [-1, 1] against rounding. A
// pair in which either side is all zeros gives 0. Layer sensitivity is a
// property of the model: measure it once on calibration prompts and pass it
// to PlannerConfig.
// Throws InvalidArgument for empty or unequal spans, a shape mismatch, or a
// NaN or infinite value.
std::vector<double> layer_sensitivity(std::span<const EmbeddingsView> before, std::span<const EmbeddingsView> after,
                                      SensitivityReduction reduction = SensitivityReduction::Flattened);

// The checks layer_sensitivity() makes before reading any value.
void validate_sensitivity_inputs(std::span<const EmbeddingsView> before, std::span<const EmbeddingsView> after,
                                 SensitivityReduction reduction);

// How a batch's plans relate.
enum class BatchPolicy : std::uint8_t {
  // Each request keeps its own plan (the default: a paged cache needs nothing else).
  PerRequest = 0,
  // The paper's option: every (layer, window position) takes the precision most
  // requests chose there (majority_vote).
  MajorityVote = 1,
};

struct PlannerConfig {
  std::int32_t window_size = 32;         // = CacheShape::block_size of the cache it feeds
  double alpha = 2.0;                    // eqs. 10-11; > 0, larger -> wider INT4 band
  std::vector<double> sensitivities;     // s_l per layer (eq. 9), each in [-1, 1]; size = layers
  std::vector<Precision> min_precision;  // empty, or the lowest precision allowed per layer
  BatchPolicy batch_policy = BatchPolicy::PerRequest;
};

// Plans requests under one configuration. Stateless after construction, so
// one planner may serve concurrent callers.
class WindowPlanner {
 public:
  // Throws InvalidArgument naming the field: window_size < 1; alpha not finite
  // or <= 0; sensitivities empty, NaN or outside [-1, 1]; min_precision neither
  // empty nor one per layer, or holding an invalid precision.
  explicit WindowPlanner(PlannerConfig config);

  const PlannerConfig& config() const { return config_; }
  std::int32_t num_layers() const { return static_cast<std::int32_t>(thresholds_.size()); }
  // T_low / T_high per layer (eqs. 10-11 after the negative-sensitivity rule).
  std::span<const LayerThresholds> thresholds() const { return thresholds_; }

  // The rule of section 1 applied to given eq. 8 scores, one per window in
  // prompt order: the plan holds them as its scores. Throws InvalidArgument
  // for a NaN or infinite score.
  PrecisionPlan plan_from_scores(std::span<const float> scores) const;
  // The same rule with a score per (layer, window): scores[l][i] decides
  // window i of layer l against layer l's thresholds. For scores a model
  // gives per layer (its own queries and keys at each layer) rather than
  // eq. 8 on input embeddings. The plan's per-window score, which orders
  // demotion, is the mean over the layers. Throws InvalidArgument unless
  // there is one row per layer, all rows of one length, all scores finite.
  PrecisionPlan plan_from_layer_scores(std::span<const std::vector<float>> scores) const;

  // Similarity, thresholds and rule for one request.
  PrecisionPlan plan(const TokenLayout& layout, const EmbeddingsView& embeddings) const;
  // For a batch, honouring config().batch_policy.
  std::vector<PrecisionPlan> plan(std::span<const TokenLayout> layouts,
                                  std::span<const EmbeddingsView> embeddings) const;

 private:
  PlannerConfig config_;
  std::vector<LayerThresholds> thresholds_;
};

// The paper's per-batch configuration: for each (layer, window position) the
// precision most plans chose, counted over the plans that have that window
// (requests may have different numbers of windows). A tie goes to the more
// precise choice, so a vote never costs accuracy to save memory. Scores stay
// each request's own. Throws InvalidArgument (and changes nothing) when the
// plans do not share one number of layers.
void majority_vote(std::span<PrecisionPlan> plans);

// What a plan costs in the cache: exactly what KVCacheManager::add_sequence()
// allocates for the prompt. Per layer, each quantized window owns one block of
// its pool; every other token (text, FP16 windows, the visual tail) is packed
// densely into FP16 blocks.
struct PlanStats {
  std::vector<BlockCounts> layer_blocks;  // [layer][pool_index]
  BlockCounts blocks{};                   // summed over layers (= KVCacheManager::demand)
  std::array<std::size_t, kNumPrecisions> pool_bytes{};
  std::size_t bytes = 0;       // all pools
  std::size_t fp16_bytes = 0;  // the same prompt with every block FP16
  // fp16_bytes / bytes: how many times smaller than an all-FP16 cache.
  double compression() const { return bytes == 0 ? 1.0 : static_cast<double>(fp16_bytes) / bytes; }
};

// Throws InvalidArgument for an invalid shape (validate(CacheShape)), or a plan
// whose layers or windows do not match shape.num_layers and
// layout.num_windows(shape.block_size).
PlanStats plan_stats(const TokenLayout& layout, const PrecisionPlan& plan, const CacheShape& shape);

}  // namespace mixkv
