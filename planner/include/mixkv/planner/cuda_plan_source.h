#pragma once
// The GPU planner as the scheduler's PlanSource.
#include <cuda_runtime_api.h>

#include <memory>

#include "mixkv/planner/plan_source.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv::gpu {

// A PlanSource over a CudaWindowPlanner built on the current device:
// plan() takes embeddings in device memory, runs on `stream` (a stream of
// that device, which must outlive the source) and returns once the stream
// reached the plans, with the CPU planner's decisions. Calls from several
// threads take turns, as the planner holds one batch at a time. An empty
// batch gives no plans, as the CPU source does. Throws InvalidArgument as
// WindowPlanner's constructor does.
std::shared_ptr<PlanSource> make_cuda_plan_source(PlannerConfig config, cudaStream_t stream);

}  // namespace mixkv::gpu
