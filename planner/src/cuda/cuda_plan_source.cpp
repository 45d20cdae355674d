#include "mixkv/planner/cuda_plan_source.h"

#include <mutex>
#include <utility>
#include <vector>

#include "mixkv/planner/cuda_window_planner.h"

namespace mixkv::gpu {
namespace {

class CudaPlanSource final : public PlanSource {
 public:
  CudaPlanSource(PlannerConfig config, cudaStream_t stream) : planner_(std::move(config)), stream_(stream) {}

  const PlannerConfig& config() const override { return planner_.config(); }

  std::vector<PrecisionPlan> plan(std::span<const TokenLayout> layouts,
                                  std::span<const EmbeddingsView> embeddings) override {
    // The CUDA planner rejects an empty batch; the CPU planner plans it as
    // nothing, and both sources answer alike.
    if (layouts.empty() && embeddings.empty()) return {};
    const std::lock_guard<std::mutex> lock(mutex_);
    return planner_.plan(layouts, embeddings, stream_);
  }

 private:
  std::mutex mutex_;  // CudaWindowPlanner holds one batch at a time
  CudaWindowPlanner planner_;
  cudaStream_t stream_;
};

}  // namespace

std::shared_ptr<PlanSource> make_cuda_plan_source(PlannerConfig config, cudaStream_t stream) {
  return std::make_shared<CudaPlanSource>(std::move(config), stream);
}

}  // namespace mixkv::gpu
