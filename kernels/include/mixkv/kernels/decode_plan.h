#pragma once
#include <cstdint>
#include <memory>
#include <span>

#include <cuda_runtime_api.h>

#include "mixkv/core/dtype.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"

namespace mixkv::gpu {

// Whether layers share work items (DecodePlanConfig::layer_sharing).
enum class LayerSharing : std::int32_t {
  kAuto,    // from a batch of as many (sequence, KV head) pairs as SMs
  kNever,   // every layer planned on its own, with its lead page ids
  kAlways,  // at any batch
};

struct DecodePlanConfig {
  std::int32_t num_layers = 0;
  std::int32_t num_q_heads = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;    // 64, 128, 256 (the built instances)
  std::int32_t block_size = 0;  // 16, 32, 64 (the built instances)
  std::int32_t max_batch = 0;
  // Work items one layer may hold; 0 = P + 12 * SMs (+ P * chunks_per_sequence
  // when that is set, + P * the chunks of the longest page lists with
  // batch_invariant_blocks), P = max_batch * num_kv_heads * the head tiles.
  std::int32_t max_items_per_layer = 0;
  // Multiprocessors to plan for; 0 = those of the current device.
  std::int32_t num_sms = 0;
  // Split-KV chunks per (sequence, KV head); 0 = chosen from the batch:
  // with fewer (sequence, KV head) pairs than SMs, chunks filling whole
  // waves of 2 resident CTAs an SM; with more, the layer's work cut into
  // one equal share per resident CTA, pairs cut where a share ends, except
  // where equal pairs fill at least 2 CTAs on every SM evenly and their
  // work waits on memory or is short: then one piece a pair. At least 8
  // blocks a piece either way (tests force other splits).
  std::int32_t chunks_per_sequence = 0;
  // Batch-invariant decode: > 0 cuts each (sequence, KV head) into
  // ceil(blocks / batch_invariant_blocks) chunks of equal work by its own
  // page lists alone (no shares, no whole pairs), so a sequence's output is
  // bitwise the same whatever else is in the batch and in whatever order
  // (with the same config: max_batch fixes the head tiles). 0 = off; not
  // with chunks_per_sequence.
  std::int32_t batch_invariant_blocks = 0;
  // Query heads one work item computes at most: 8 (one MMA n-tile) or 16
  // (two, each dequantized block feeding both; needs that instance). 0 =
  // 16 where it is built and max_batch * num_kv_heads >= 16, else 8 (a
  // smaller batch's short split chunks run faster as twice the items). A
  // KV head's larger group is cut into equal head tiles, an item each.
  // Fixed for the plan's life, so a captured run() stays valid.
  std::int32_t max_heads_per_item = 0;
  // A layer whose every sequence has the same FP16, INT4 and INT2 list
  // lengths and FP16 fill as an earlier layer's runs that layer's work
  // items, planned and uploaded once (an FP16-only batch plans one layer).
  // Shared items carry no lead page ids (a layer's own), so their CTAs look
  // their first blocks up in the page table: kAuto shares only where that
  // load is a small part of a layer's launch (decode_heuristics.h). The
  // outputs are bitwise the same either way.
  LayerSharing layer_sharing = LayerSharing::kAuto;
};

// q and out are of the cache's 16-bit type (the pools' format.dtype, FP16
// or BF16), which `dtype` states.
struct DecodeRunArgs {
  std::int32_t layer = 0;
  const void* q = nullptr;  // device [batch][num_q_heads][head_dim]
  void* out = nullptr;      // device [batch][num_q_heads][head_dim]
  float* lse = nullptr;     // optional device [batch][num_q_heads], natural log; -inf when empty
  float sm_scale = 0.0f;    // usually 1/sqrt(head_dim)
  DevicePools pools{};
  cudaStream_t stream = nullptr;
  // Launch grids sized for the plan's capacity rather than this step's
  // items, so that a captured CUDA graph stays valid across re-plans.
  bool fixed_grid = false;
  DType dtype = DType::F16;  // of q and out
};

// Paged decode attention, FlashInfer's plan/run split.
// plan() runs on the host once per decode step: from the host mirror of the
// page tables it cuts every (sequence, KV head) of every layer into work
// items over the concatenation of its FP16, INT4 and INT2 page lists
// (split-KV chunks balanced by bytes when the batch is too small to fill
// the GPU), once for all layers of equal list lengths (layer_sharing), and
// uploads them with one asynchronous copy into fixed-capacity device
// buffers. run() launches, per layer, ONE kernel over all work items
// (every pool, every chunk; dequantization fused, tensor cores with the
// query-head group as the N dimension); split chunks are merged by the last
// CTAs to finish them, inside the same kernel.
// run() never synchronizes and is CUDA-graph capturable (fixed_grid).
// GQA: any num_q_heads that is a multiple of num_kv_heads. An item
// computes a KV head's group as the MMAs' N dimension: up to 8 query heads,
// or 16 (two n-tiles sharing each dequantized block) where that instance is
// built (head_dim 128, block 32 by default; every shape but head_dim 256
// with MIXKV_ALL_KERNEL_INSTANCES). A larger group runs as equal tiles of
// at most that many heads (32 as 2 x 16; 16 as 2 x 8 without the two-tile
// instance), an item per tile, the tiles of a piece launched side by side
// so that all but the first read its blocks from L2.
class DecodePlan {
 public:
  // Throws InvalidArgument naming the field for a bad shape, "Unsupported
  // head_dim: N" / "Unsupported block_size: N" for shapes without a built
  // kernel.
  DecodePlan(const DecodePlanConfig& config, const DevicePageTables& tables);
  ~DecodePlan();
  DecodePlan(const DecodePlan&) = delete;
  DecodePlan& operator=(const DecodePlan&) = delete;

  // `slots[i]` is the page-table slot of batch entry i. Throws
  // InvalidArgument for a batch over max_batch or a slot out of range, and
  // OutOfMemory when a layer needs more items than its capacity; a call
  // that throws leaves the previous plan (every layer) as it was.
  void plan(std::span<const std::int32_t> slots, cudaStream_t stream);
  // Throws InvalidArgument naming the argument (no plan, layer, a null
  // pointer, sm_scale, pools that do not match, a dtype other than the
  // pools', a BF16 cache at a shape without a BF16 instance) before
  // launching anything.
  void run(const DecodeRunArgs& args) const;

  const DecodePlanConfig& config() const;
  std::int32_t batch_size() const;
  // Per layer; IndexOutOfRange naming `layer` outside [0, num_layers).
  std::int32_t num_items(std::int32_t layer) const;
  std::int32_t num_split_items(std::int32_t layer) const;
  // Bytes one run() of `layer` must read from HBM: K/V codes, parameters
  // and FP16 rows actually visited (once, also when head tiles share
  // them), plus page-table entries and queries.
  std::int64_t bytes_read(std::int32_t layer) const;
  // The layer whose work items `layer` runs: itself, or the first layer of
  // the same list lengths when it shares that layer's (-1 before a plan).
  std::int32_t planned_layer(std::int32_t layer) const;
  // Layers the current plan planned, i.e. its distinct sets of work items
  // (0 before a plan).
  std::int32_t num_planned_layers() const;
  // Work items a layer of `slots` takes under batch_invariant_blocks (the
  // most over layers, from the page tables as they are now): what
  // max_items_per_layer must hold for plan(slots) to fit; 0 without
  // batch_invariant_blocks. IndexOutOfRange naming slots[i] for a slot
  // outside the tables.
  std::int64_t invariant_items_needed(std::span<const std::int32_t> slots) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv::gpu
