#include "mixkv/planner/plan_source.h"

#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace mixkv {
namespace {

// WindowPlanner is stateless after construction, so this source is too: one
// instance may serve several schedulers.
class CpuPlanSource final : public PlanSource {
 public:
  explicit CpuPlanSource(PlannerConfig config) : planner_(std::move(config)) {}

  const PlannerConfig& config() const override { return planner_.config(); }

  std::vector<PrecisionPlan> plan(std::span<const TokenLayout> layouts,
                                  std::span<const EmbeddingsView> embeddings) override {
    return planner_.plan(layouts, embeddings);
  }

 private:
  WindowPlanner planner_;
};

}  // namespace

std::shared_ptr<PlanSource> make_cpu_plan_source(PlannerConfig config) {
  return std::make_shared<CpuPlanSource>(std::move(config));
}

}  // namespace mixkv
