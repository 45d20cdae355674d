#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"
#include "mixkv/kernels/store.h"

// DeviceStoreMapping: a StoreMapping validated on the host and copied to the
// device for store_prefill (store.cu holds the kernels).
namespace mixkv::gpu {

using detail::require;

struct DeviceStoreMapping::Impl {
  std::int32_t rows = 0;
  std::int32_t num_fp16_rows = 0;
  std::int32_t num_windows[2] = {0, 0};
  std::array<std::int32_t, kNumPrecisions> max_block_ids{-1, -1, -1};
  std::vector<RowSlot> staged_rows;  // the host side of fp16_rows, reused
  detail::DeviceBuffer<RowSlot> fp16_rows;
  detail::DeviceBuffer<WindowSlot> windows[2];

  void upload(const StoreMapping& mapping, std::int32_t block_size, const PoolLayout* arena, cudaStream_t stream);
};

DeviceStoreMapping::DeviceStoreMapping() : impl_(std::make_unique<Impl>()) {}
DeviceStoreMapping::~DeviceStoreMapping() = default;

void DeviceStoreMapping::upload(const StoreMapping& mapping, std::int32_t block_size, cudaStream_t stream) {
  impl_->upload(mapping, block_size, nullptr, stream);
}

void DeviceStoreMapping::upload(const StoreMapping& mapping, const PoolLayout& arena, cudaStream_t stream) {
  impl_->upload(mapping, arena.pools[0].format.block_size, &arena, stream);
}

void DeviceStoreMapping::Impl::upload(const StoreMapping& mapping, std::int32_t block_size, const PoolLayout* arena,
                                      cudaStream_t stream) {
  constexpr const char* fn = "DeviceStoreMapping::upload";
  require(block_size >= 16,
          [&] { return std::string(fn) + ": block_size = " + std::to_string(block_size) + ": expected >= 16"; });
  require(mapping.fp16_slots.size() <= static_cast<std::size_t>(INT32_MAX), [&] {
    return std::string(fn) + ": mapping.fp16_slots has " + std::to_string(mapping.fp16_slots.size()) +
           " rows: expected <= 2^31 - 1";
  });
  // Ids accepted per pool: [0, limit); without the arena only the sign is known.
  std::array<std::int64_t, kNumPrecisions> limit{INT32_MAX, INT32_MAX, INT32_MAX};
  if (arena != nullptr) {
    for (int p = 0; p < kNumPrecisions; ++p) limit[p] = arena->pools[p].num_blocks;
  }
  const std::int64_t slot_limit = arena != nullptr ? limit[0] * block_size : std::int64_t{INT32_MAX} + 1;
  const auto rows = static_cast<std::int32_t>(mapping.fp16_slots.size());
  std::array<std::int32_t, kNumPrecisions> max_ids{-1, -1, -1};
  std::vector<int> covered(rows, 0);
  for (std::int32_t r = 0; r < rows; ++r) {
    const std::int32_t slot = mapping.fp16_slots[r];
    require(slot >= -1, [&] {
      return std::string(fn) + ": mapping.fp16_slots[" + std::to_string(r) + "] = " + std::to_string(slot) +
             ": expected a slot >= 0, or -1 for a quantized row";
    });
    if (slot >= slot_limit) {
      throw IndexOutOfRange(std::string(fn) + ": mapping.fp16_slots[" + std::to_string(r) +
                            "] = " + std::to_string(slot) + ": expected a slot in [0, " + std::to_string(slot_limit) +
                            ") of the FP16 pool (" + std::to_string(limit[0]) + " blocks of " +
                            std::to_string(block_size) + " tokens), or -1 for a quantized row");
    }
    if (slot >= 0) max_ids[0] = std::max(max_ids[0], slot / block_size);
  }
  const std::vector<WindowSlot>* lists[2] = {&mapping.int4_windows, &mapping.int2_windows};
  const char* names[2] = {"mapping.int4_windows", "mapping.int2_windows"};
  for (int which = 0; which < 2; ++which) {
    const int pool = which + 1;
    for (std::size_t w = 0; w < lists[which]->size(); ++w) {
      const WindowSlot& s = (*lists[which])[w];
      const auto at = [&] { return std::string(fn) + ": " + names[which] + "[" + std::to_string(w) + "]"; };
      if (s.block_id < 0 || s.block_id >= limit[pool]) {
        throw IndexOutOfRange(at() + ".block_id = " + std::to_string(s.block_id) + ": expected a block id in [0, " +
                              std::to_string(limit[pool]) + ") of the " + std::string(to_string(kAllPrecisions[pool])) +
                              " pool");
      }
      max_ids[pool] = std::max(max_ids[pool], s.block_id);
      require(s.first_row >= 0 && s.first_row <= rows - block_size, [&] {
        return at() + ".first_row = " + std::to_string(s.first_row) + ": expected a row in [0, rows - block_size]";
      });
      for (std::int32_t r = s.first_row; r < s.first_row + block_size; ++r) {
        require(mapping.fp16_slots[r] == -1 && ++covered[r] == 1, [&] {
          return at() + " covers row " + std::to_string(r) + ": expected rows with fp16_slots -1 covered once";
        });
      }
    }
  }
  for (std::int32_t r = 0; r < rows; ++r) {
    require(mapping.fp16_slots[r] != -1 || covered[r] == 1, [&] {
      return std::string(fn) + ": mapping.fp16_slots[" + std::to_string(r) + "] = -1 but no window covers row " +
             std::to_string(r);
    });
  }
  staged_rows.clear();
  for (std::int32_t r = 0; r < rows; ++r) {
    if (mapping.fp16_slots[r] >= 0) staged_rows.push_back({r, mapping.fp16_slots[r]});
  }
  const auto n_fp16 = static_cast<std::int32_t>(staged_rows.size());
  // Grow every buffer before the first copy, so that an allocation failure
  // leaves the previous upload whole.
  fp16_rows.reserve(std::max(n_fp16, 1));
  for (int which = 0; which < 2; ++which) {
    windows[which].reserve(std::max<std::size_t>(lists[which]->size(), 1));
  }
  if (n_fp16 > 0) {
    MIXKV_CUDA_CHECK(
        cudaMemcpyAsync(fp16_rows.get(), staged_rows.data(), n_fp16 * sizeof(RowSlot), cudaMemcpyHostToDevice, stream));
  }
  for (int which = 0; which < 2; ++which) {
    const auto n = static_cast<std::int32_t>(lists[which]->size());
    if (n > 0) {
      MIXKV_CUDA_CHECK(cudaMemcpyAsync(windows[which].get(), lists[which]->data(), n * sizeof(WindowSlot),
                                       cudaMemcpyHostToDevice, stream));
    }
    num_windows[which] = n;
  }
  this->rows = rows;
  num_fp16_rows = n_fp16;
  max_block_ids = max_ids;
  // Pageable source memory: cudaMemcpyAsync returns once it is staged, so
  // `mapping` may be released right after this call, and staged_rows
  // rewritten by the next upload.
}

void DeviceStoreMapping::fill(StorePrefillArgs& args) const {
  const Impl& s = *impl_;
  args.rows = s.rows;
  args.fp16_rows = s.fp16_rows.get();
  args.num_fp16_rows = s.num_fp16_rows;
  args.int4_windows = s.windows[0].get();
  args.num_int4_windows = s.num_windows[0];
  args.int2_windows = s.windows[1].get();
  args.num_int2_windows = s.num_windows[1];
  args.max_block_ids = s.max_block_ids;
}

}  // namespace mixkv::gpu
