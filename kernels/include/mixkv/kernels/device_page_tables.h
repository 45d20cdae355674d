#pragma once
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include <cuda_runtime_api.h>

#include "mixkv/core/page_table.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/core/precision.h"

namespace mixkv::gpu {

struct PageTableConfig {
  // pool_blocks' value when the bound is not given: ids are then checked
  // only for >= 0. Tables filled by hand should know the arena's bound
  // (the constructor taking a PoolLayout, or set_pool_blocks).
  static constexpr std::int32_t kNoBound = INT32_MAX;

  std::int32_t num_layers = 0;
  std::int32_t max_sequences = 0;            // sequence slots (the batch capacity)
  std::int32_t max_blocks_per_sequence = 0;  // per (layer, pool): longest page list
  // Per pool (pool_index): block ids in [0, pool_blocks[p]) are accepted,
  // the blocks of that pool in the arena (PoolView::num_blocks), so that
  // decode never reads outside it.
  std::array<std::int32_t, kNumPrecisions> pool_blocks{kNoBound, kNoBound, kNoBound};

  bool bounded() const {
    for (const std::int32_t b : pool_blocks) {
      if (b != kNoBound) return true;
    }
    return false;
  }
};

// Device addresses of the tables, for the kernels.
struct DeviceTablesView {
  const std::int32_t* blocks = nullptr;     // [layer][pool][slot][max_blocks] block ids
  const std::int32_t* counts = nullptr;     // [layer][pool][slot] blocks in the list
  const std::int32_t* fp16_fill = nullptr;  // [layer][slot] valid tokens in the last FP16 block
  std::int32_t max_sequences = 0;
  std::int32_t max_blocks = 0;
};

// Device-resident page tables, vLLM style: one padded row of block ids per
// (layer, pool, sequence slot), plus a block count per row and the FP16 tail
// fill per (layer, slot). The host keeps a mirror; edits record only the
// entries that differ from it, and upload() sends exactly those (one copy of
// (offset, value) pairs and one scatter launch on the caller's stream), so a
// decode step that appends a token costs O(changed entries), not O(blocks).
//
// The planner (DecodePlan) reads the host mirror; kernels read the device
// copy. Uploads are ordered on the stream passed to upload().
class DevicePageTables {
 public:
  // Throws InvalidArgument naming the field for a non-positive size or
  // pool_blocks entry.
  explicit DevicePageTables(const PageTableConfig& config);
  // The same with config.pool_blocks taken from the arena's pools
  // (KVCacheManager::arena_layout(): each pool's num_blocks).
  DevicePageTables(PageTableConfig config, const PoolLayout& arena);
  ~DevicePageTables();
  DevicePageTables(const DevicePageTables&) = delete;
  DevicePageTables& operator=(const DevicePageTables&) = delete;

  const PageTableConfig& config() const;

  // Sets the bound of every pool (each > 0, InvalidArgument otherwise).
  // IndexOutOfRange naming the slot, layer, pool and entry when a list
  // already holds an id the new bound excludes; nothing changes then.
  void set_pool_blocks(const std::array<std::int32_t, kNumPrecisions>& pool_blocks);

  // Sets the page list of (slot, layer, pool). `last_block_len` is the FP16
  // tail fill (1..block_size when the FP16 list is non-empty, else 0); it is
  // ignored for quantized pools. Throws IndexOutOfRange for slot/layer and
  // for a block id outside [0, config().pool_blocks[pool]) (naming
  // blocks[j] and the bound), InvalidArgument for a list longer than
  // max_blocks_per_sequence; nothing changes then.
  void set_blocks(std::int32_t slot, std::int32_t layer, Precision pool, std::span<const std::int32_t> blocks,
                  std::int32_t last_block_len = 0);
  // Every (layer, pool) list of one sequence's page table into `slot`
  // (KVCacheManager::page_table(id)). InvalidArgument when the table's
  // layer count differs or a list is longer than max_blocks_per_sequence,
  // IndexOutOfRange for a block id outside the pool's bound; every list is
  // checked first, so nothing changes then.
  void sync(std::int32_t slot, const PageTable& table);
  // The same for a table that changed only at the end of its FP16 lists
  // since `slot` was last synced from it (tokens appended, the tail block
  // copied on write, blocks appended since truncated): each layer's FP16
  // list is compared from its last mirrored block on, so a decode step
  // costs O(num_layers) a sequence, not O(blocks). Returns false, changing
  // nothing, when a quantized list's length differs from the mirror (the
  // table changed otherwise: call sync()); throws as sync() does.
  bool sync_tail(std::int32_t slot, const PageTable& table);
  // Empties every list of `slot` (a finished sequence).
  void clear(std::int32_t slot);

  // Entries changed since the last upload.
  std::size_t pending_updates() const;
  // Sends the pending entries to the device on `stream` (asynchronous; the
  // staging buffer is reused only after the previous upload's copy has
  // finished). Returns the number of entries sent.
  std::size_t upload(cudaStream_t stream);

  // Host mirror.
  std::int32_t num_blocks(std::int32_t slot, std::int32_t layer, Precision pool) const;
  std::int32_t fp16_fill(std::int32_t slot, std::int32_t layer) const;
  std::span<const std::int32_t> blocks(std::int32_t slot, std::int32_t layer, Precision pool) const;

  DeviceTablesView device_view() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv::gpu
