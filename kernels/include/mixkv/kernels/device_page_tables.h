#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include <cuda_runtime_api.h>

#include "mixkv/core/page_table.h"
#include "mixkv/core/precision.h"

namespace mixkv::gpu {

struct PageTableConfig {
  std::int32_t num_layers = 0;
  std::int32_t max_sequences = 0;             // sequence slots (the batch capacity)
  std::int32_t max_blocks_per_sequence = 0;   // per (layer, pool): longest page list
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
  // Throws InvalidArgument naming the field for a non-positive size.
  explicit DevicePageTables(const PageTableConfig& config);
  ~DevicePageTables();
  DevicePageTables(const DevicePageTables&) = delete;
  DevicePageTables& operator=(const DevicePageTables&) = delete;

  const PageTableConfig& config() const;

  // Sets the page list of (slot, layer, pool). `last_block_len` is the FP16
  // tail fill (1..block_size when the FP16 list is non-empty, else 0); it is
  // ignored for quantized pools. Throws IndexOutOfRange for slot/layer and
  // InvalidArgument for a list longer than max_blocks_per_sequence or a
  // negative block id; nothing changes then.
  void set_blocks(std::int32_t slot, std::int32_t layer, Precision pool, std::span<const std::int32_t> blocks,
                  std::int32_t last_block_len = 0);
  // Every (layer, pool) list of one sequence's page table into `slot`
  // (KVCacheManager::page_table(id)). InvalidArgument when the table's
  // layer count differs or a list is longer than max_blocks_per_sequence;
  // nothing changes then.
  void sync(std::int32_t slot, const PageTable& table);
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
