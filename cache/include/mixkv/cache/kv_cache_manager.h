#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mixkv/cache/block_format.h"
#include "mixkv/cache/cache_shape.h"
#include "mixkv/cache/pool_view.h"
#include "mixkv/cache/precision.h"
#include "mixkv/cache/precision_plan.h"
#include "mixkv/cache/token_layout.h"

namespace mixkv {

using SequenceId = std::int64_t;

struct CacheConfig {
  CacheShape shape;
  std::size_t arena_bytes = 0;            // total KV memory, all pools together
  std::size_t slab_bytes = 2u << 20;      // unit in which memory moves between pools
};

// Blocks per pool, indexed by pool_index().
using BlockCounts = std::array<std::int64_t, kNumPrecisions>;

struct PoolStats {
  std::size_t block_bytes = 0;
  std::int32_t blocks_per_slab = 0;
  std::int32_t slabs = 0;          // slabs this pool holds now
  std::int64_t used_blocks = 0;    // blocks owned by at least one page table
  std::int64_t free_blocks = 0;    // free blocks inside this pool's slabs
};

// One quantized window to store: the block it owns and the row of its first
// token in the K/V rows handed to store_prefill (its S tokens follow it).
struct WindowSlot {
  std::int32_t block_id = 0;
  std::int32_t first_row = 0;
};

// Where each K/V row of a prefill goes for one layer (vLLM's slot mapping,
// extended to quantized windows). Rows are the prompt tokens of one or more
// sequences, concatenated.
struct StoreMapping {
  // Per row: FP16 slot = block_id * block_size + offset, or -1 when the row
  // belongs to a quantized window.
  std::vector<std::int32_t> fp16_slots;
  std::vector<WindowSlot> int4_windows;
  std::vector<WindowSlot> int2_windows;

  // Appends `other`, whose rows follow this mapping's rows.
  void append(const StoreMapping& other);
};

struct BlockCopy {
  std::int32_t src = 0;  // FP16 block ids
  std::int32_t dst = 0;
};

struct AppendResult {
  // [layer][i]: FP16 slot of sequence i's new token in that layer.
  std::vector<std::vector<std::int32_t>> slots;
  // Copy-on-write of shared, partly filled FP16 tail blocks: the caller
  // copies these (ops::copy_blocks) before writing the new tokens.
  std::vector<BlockCopy> copies;
};

// The page lists of a batch for one (layer, pool) in CSR form, the shape
// FlashInfer's paged_kv_t uses.
struct PagedPoolTable {
  std::vector<std::int32_t> indptr;          // [batch + 1]
  std::vector<std::int32_t> indices;         // block ids, indptr[i]..indptr[i+1] for sequence i
  std::vector<std::int32_t> last_block_len;  // [batch]: valid tokens in the last block (0 if none)
};

struct DecodeMetadata {
  std::int32_t batch_size = 0;
  // [layer][pool_index]
  std::vector<std::array<PagedPoolTable, kNumPrecisions>> layers;
};

// Owns the bookkeeping of the KV cache: the arena's slabs, the three pools,
// every sequence's page tables. It never touches KV bytes: the ops (CPU
// reference or CUDA) read and write blocks through pool_view(), so one
// manager serves the host and the device backend alike.
//
// Every public call validates its input and throws a typed error naming the
// argument (errors.h); a call that throws leaves the manager unchanged.
class KVCacheManager {
 public:
  explicit KVCacheManager(CacheConfig config);
  ~KVCacheManager();
  KVCacheManager(const KVCacheManager&) = delete;
  KVCacheManager& operator=(const KVCacheManager&) = delete;

  const CacheConfig& config() const;
  BlockFormat format(Precision p) const;
  PoolView pool_view(Precision p, std::byte* arena_base) const;
  PoolStats pool_stats(Precision p) const;
  std::int32_t total_slabs() const;
  std::int32_t free_slabs() const;

  // Blocks a prompt needs per pool, over all layers.
  BlockCounts demand(const TokenLayout& layout, const PrecisionPlan& plan) const;
  // Whether `blocks` more blocks per pool could be allocated now, counting
  // free slabs and empty slabs other pools could give back.
  bool can_allocate(const BlockCounts& blocks) const;

  // Registers a sequence and allocates the blocks of its whole prompt under
  // `plan` (plan.num_layers() == num_layers, plan.num_windows() ==
  // layout.num_windows(block_size)). OutOfMemory leaves nothing allocated.
  void add_sequence(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan);
  bool contains(SequenceId id) const;
  std::vector<SequenceId> sequence_ids() const;  // ascending
  std::int32_t num_tokens(SequenceId id) const;  // prompt + appended
  const TokenLayout& layout(SequenceId id) const;
  const PrecisionPlan& plan(SequenceId id) const;

  // Where the prompt rows of `id` go in `layer`.
  StoreMapping prefill_mapping(SequenceId id, std::int32_t layer) const;

  // One decode token for each sequence (distinct ids), FP16 in every layer.
  // All or nothing: OutOfMemory leaves every sequence as it was.
  AppendResult append_tokens(std::span<const SequenceId> ids);

  // `child` shares every block of `parent` (ref counts); the partly filled
  // FP16 tail is copied on the first append to either.
  void fork(SequenceId parent, SequenceId child);
  void free_sequence(SequenceId id);

  // Block ids of (sequence, layer, pool) in order, and the FP16 tail's fill.
  std::span<const std::int32_t> blocks(SequenceId id, std::int32_t layer, Precision p) const;
  std::int32_t fp16_tail_fill(SequenceId id, std::int32_t layer) const;
  std::int32_t ref_count(Precision p, std::int32_t block_id) const;

  DecodeMetadata decode_metadata(std::span<const SequenceId> ids) const;

  // Throws InvariantViolation describing the first broken invariant.
  void check_invariants() const;
  // Canonical text of all bookkeeping (slabs, free lists in order, ref
  // counts, page tables): equal texts mean equal states.
  std::string describe_state() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv
