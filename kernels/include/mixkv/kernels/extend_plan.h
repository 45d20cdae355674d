#pragma once
#include <cstdint>
#include <memory>
#include <span>

#include <cuda_runtime_api.h>

#include "mixkv/core/dtype.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"

namespace mixkv::gpu {

struct ExtendPlanConfig {
  std::int32_t num_layers = 0;
  std::int32_t num_q_heads = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;    // 64, 128, 256 (the built instances)
  std::int32_t block_size = 0;  // 16, 32, 64 (the built instances)
  std::int32_t max_batch = 0;
  std::int32_t max_rows = 0;  // new rows of one step at most (qo_indptr's last entry)
  // Multiprocessors to plan for; 0 = those of the current device.
  std::int32_t num_sms = 0;
  // Work items one layer may hold; 0 = num_kv_heads * (tiles of max_rows +
  // max_batch) + 2 waves of resident CTAs. The partial-state workspace
  // holds as many split pieces, or 2 waves when this is 0.
  std::int32_t max_items_per_layer = 0;
  // Split-KV pieces per tile; 0 = chosen from the step: one a tile when the
  // tiles fill a wave of resident CTAs, else each tile cut by its units
  // into its share of a wave (at least 4 units a piece). Tests force
  // other splits.
  std::int32_t chunks_per_tile = 0;
};

// q, k, v and out are of the cache's 16-bit type (the pools' format.dtype,
// FP16 or BF16), which `dtype` states.
struct ExtendRunArgs {
  std::int32_t layer = 0;
  const void* q = nullptr;  // device [rows][num_q_heads][head_dim]
  const void* k = nullptr;  // device [rows][num_kv_heads][head_dim]: the new rows' keys, not in the cache yet
  const void* v = nullptr;  // device [rows][num_kv_heads][head_dim]: their values
  void* out = nullptr;      // device [rows][num_q_heads][head_dim]
  float* lse = nullptr;     // optional device [rows][num_q_heads], natural log
  float sm_scale = 0.0f;    // usually 1/sqrt(head_dim)
  DevicePools pools{};
  cudaStream_t stream = nullptr;
  // Launch grids sized for the plan's capacity rather than this step's
  // items, so that a captured CUDA graph stays valid across re-plans.
  bool fixed_grid = false;
  DType dtype = DType::F16;  // of q, k, v and out
};

// Paged extend (chunked-prefill) attention: the semantics of
// cpu::extend_attention (mixkv/cpu/extend_attention.h). A batch of
// sequences, sequence i bringing n_i >= 1 new rows (rows qo_indptr[i] ..
// qo_indptr[i + 1] of q, k, v, out); new row j attends to every cached
// token of its sequence in the FP16, INT4 and INT2 page lists (no mask) and
// causally to the new rows j' <= j, read from k and v. GQA: query head h
// reads KV head h / (num_q_heads / num_kv_heads).
//
// plan() runs on the host once a step: from the host mirror of the page
// tables it cuts every (sequence, KV head) of every layer into tiles of 64
// rows (new row, query head of the group), each over its units (cached
// blocks FP16 | INT4 | INT2, then the new rows it sees), split into pieces
// when the tiles do not fill the GPU, and uploads them with one
// asynchronous copy into fixed-capacity device buffers. run() launches,
// per layer, one FlashAttention-2 kernel over all items (tensor cores,
// dequantization fused through shared memory) and, when pieces were split,
// one merge kernel. run() never synchronizes and is CUDA-graph capturable
// (fixed_grid); the layers of a plan share one workspace, so runs of the
// same plan are ordered on one stream.
class ExtendPlan {
 public:
  // Throws InvalidArgument naming the field for a bad shape, "Unsupported
  // head_dim: N" / "Unsupported block_size: N" for shapes without a built
  // kernel.
  ExtendPlan(const ExtendPlanConfig& config, const DevicePageTables& tables);
  ~ExtendPlan();
  ExtendPlan(const ExtendPlan&) = delete;
  ExtendPlan& operator=(const ExtendPlan&) = delete;

  // `slots[i]` is the page-table slot of batch entry i, `qo_indptr` its
  // rows ([batch + 1], 0 first, strictly increasing). Throws
  // InvalidArgument naming the argument for a batch over max_batch, a slot
  // out of range, a malformed qo_indptr, rows over max_rows or an FP16 fill
  // over block_size in the tables, and OutOfMemory when a layer needs more
  // items than its capacity; a call that throws leaves the previous plan
  // (every layer) as it was. `fp16_exclude`, when given ([batch]), leaves
  // the last fp16_exclude[i] tokens of entry i's FP16 lists unread in every
  // layer: rows already appended to the cache (speculative verification
  // appends its drafts first), which k and v bring again; InvalidArgument
  // naming fp16_exclude[i] when a list holds fewer tokens.
  void plan(std::span<const std::int32_t> slots, std::span<const std::int32_t> qo_indptr, cudaStream_t stream,
            std::span<const std::int32_t> fp16_exclude = {});
  // Throws InvalidArgument naming the argument (no plan, layer, a null
  // pointer, sm_scale, pools that do not match, a dtype other than the
  // pools', a BF16 cache at a shape without a BF16 instance) before
  // launching anything.
  void run(const ExtendRunArgs& args) const;

  const ExtendPlanConfig& config() const;
  std::int32_t batch_size() const;
  std::int32_t num_rows() const;
  std::int32_t num_items(std::int32_t layer) const;
  // Tiles of the layer split into pieces (each merged by the merge kernel).
  std::int32_t num_split_tiles(std::int32_t layer) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv::gpu
