#pragma once
// WindowQuant section 1 on the GPU (docs/planner.md): eq. 8 similarity through
// normalized means, eqs. 10-11 thresholds and the precision rule, batched over
// requests, with the same decisions as the CPU WindowPlanner.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mixkv/core/precision_plan.h"
#include "mixkv/core/token_layout.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv::gpu {

// Plans a batch of requests whose embeddings live in device memory
// (EmbeddingsView::data is a device pointer; F32, F16 or BF16, one type and
// one hidden size per batch). Three steps so that a caller can overlap them
// with other work and time the device part alone:
//   prepare(): validates and uploads the batch's small work list;
//   launch():  enqueues similarity + plan (+ majority vote), whose
//              kernels also write scores and precisions to mapped
//              pinned host memory;
//   finish():  waits for the stream, reports NaN / infinite embeddings,
//              returns one PrecisionPlan per request.
// plan() does all three. One batch at a time per planner: prepare() while a
// batch is in flight throws. Results are deterministic (no atomics in any
// sum) and equal the CPU planner's up to float rounding of the scores.
// gpu::make_cuda_plan_source (cuda_plan_source.h) serves it to the scheduler.
class CudaWindowPlanner {
 public:
  // Validates `config` as WindowPlanner does and uploads its per-layer
  // thresholds (so that a score gets the CPU planner's decision bit for bit)
  // and minimum precisions (synchronously, once).
  explicit CudaWindowPlanner(PlannerConfig config);
  ~CudaWindowPlanner();
  CudaWindowPlanner(const CudaWindowPlanner&) = delete;
  CudaWindowPlanner& operator=(const CudaWindowPlanner&) = delete;

  const PlannerConfig& config() const;
  std::int32_t num_layers() const;

  // Throws InvalidArgument as window_similarity() does for shapes, missing
  // text and mismatched batches, plus: element types that differ within the
  // batch, a hidden size over 49,152 (the text mean lives in shared memory),
  // and a call while a batch is in flight.
  void prepare(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings, cudaStream_t stream);
  void launch(cudaStream_t stream);
  // Throws InvalidArgument naming the request and row of a NaN or infinite
  // value (only rows eq. 8 reads are checked), DeviceError for a failed CUDA
  // call. Either way the planner is ready for the next prepare().
  std::vector<PrecisionPlan> finish(cudaStream_t stream);

  std::vector<PrecisionPlan> plan(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings,
                                  cudaStream_t stream);

  // Device results of the last launch(), valid in stream order after it:
  // scores [num_windows()] of all requests' windows in batch order, and
  // precisions (Precision as uint8) of each request as [layer][window],
  // requests one after another.
  const float* device_scores() const;
  const std::uint8_t* device_precisions() const;
  std::int64_t num_windows() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Eq. 9 on the device, batched over layers, as mixkv::layer_sensitivity()
// (device pointers in the views). Returns after synchronizing `stream`.
std::vector<double> layer_sensitivity(std::span<const EmbeddingsView> before, std::span<const EmbeddingsView> after,
                                      SensitivityReduction reduction, cudaStream_t stream);

}  // namespace mixkv::gpu
