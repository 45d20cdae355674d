#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mixkv/core/precision.h"
#include "mixkv/core/precision_plan.h"
#include "mixkv/core/token_layout.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv {

// Where the scheduler gets the plans of requests that come with embeddings
// instead of a plan. One interface for the CPU planner (make_cpu_plan_source)
// and the GPU planner (gpu::make_cuda_plan_source), so an engine picks where
// planning runs without the scheduler knowing.
class PlanSource {
 public:
  virtual ~PlanSource() = default;

  // The configuration the plans follow: its window_size must equal the
  // cache's block_size and its sensitivities give the layer count; its
  // min_precision (empty or one per layer) bounds demotion too.
  virtual const PlannerConfig& config() const = 0;

  // One plan per request, in order, honouring config().batch_policy.
  // `embeddings` are in the memory this source reads (host memory for the
  // CPU source, device memory for the CUDA one). Throws InvalidArgument as
  // WindowPlanner::plan does, naming the request; nothing is kept from a
  // failed call.
  virtual std::vector<PrecisionPlan> plan(std::span<const TokenLayout> layouts,
                                          std::span<const EmbeddingsView> embeddings) = 0;
};

// The CPU WindowPlanner as a PlanSource (host embeddings). Throws
// InvalidArgument as WindowPlanner's constructor does.
std::shared_ptr<PlanSource> make_cpu_plan_source(PlannerConfig config);

}  // namespace mixkv
