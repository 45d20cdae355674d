#include "mixkv/kernels/device_page_tables.h"

#include <boost/unordered/unordered_flat_map.hpp>

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {
namespace {

struct Update {
  std::uint32_t offset;
  std::int32_t value;
};

__global__ void scatter_kernel(const Update* updates, std::int32_t count, std::int32_t* data) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) data[updates[i].offset] = updates[i].value;
}

}  // namespace

struct DevicePageTables::Impl {
  PageTableConfig config;
  std::size_t table_entries = 0;     // [layer][pool][slot][max_blocks]
  std::size_t count_entries = 0;     // [layer][pool][slot]
  std::size_t fill_entries = 0;      // [layer][slot]
  std::vector<std::int32_t> mirror;  // host copy of the whole device array
  detail::DeviceBuffer<std::int32_t> device;
  // offset -> index in `pending`: an entry edited twice is sent once.
  boost::unordered_flat_map<std::uint32_t, std::size_t> pending_index;
  std::vector<Update> pending;
  detail::PinnedBuffer<Update> staging;
  detail::DeviceBuffer<Update> device_updates;
  detail::Event staging_free;  // recorded after the copy out of `staging`

  std::size_t table_at(int slot, int layer, int pool) const {
    return ((static_cast<std::size_t>(layer) * kNumPrecisions + pool) * config.max_sequences + slot) *
           config.max_blocks_per_sequence;
  }
  std::size_t count_at(int slot, int layer, int pool) const {
    return table_entries + (static_cast<std::size_t>(layer) * kNumPrecisions + pool) * config.max_sequences + slot;
  }
  std::size_t fill_at(int slot, int layer) const {
    return table_entries + count_entries + static_cast<std::size_t>(layer) * config.max_sequences + slot;
  }

  void write(std::size_t offset, std::int32_t value) {
    if (mirror[offset] == value) return;
    mirror[offset] = value;
    const auto key = static_cast<std::uint32_t>(offset);
    const auto [it, inserted] = pending_index.try_emplace(key, pending.size());
    if (inserted) {
      pending.push_back({key, value});
    } else {
      pending[it->second].value = value;
    }
  }

  // blocks[j] of a (layer, pool) list against the pool's bound; `what()`
  // names the list, built only on failure (this runs on every sync).
  // Entries before `first` are not read (they are known to be valid).
  template <typename Name>
  void check_ids(std::string_view fn, Name&& what, int pool, std::span<const std::int32_t> blocks,
                 std::size_t first = 0) const {
    const std::int32_t bound = config.pool_blocks[pool];
    for (std::size_t j = first; j < blocks.size(); ++j) {
      if (blocks[j] < 0 || blocks[j] >= bound) {
        throw IndexOutOfRange(std::string(fn) + ": " + what() + "[" + std::to_string(j) +
                              "] = " + std::to_string(blocks[j]) + ": expected a block id in [0, " +
                              (bound == PageTableConfig::kNoBound ? std::string("2^31 - 1") : std::to_string(bound)) +
                              ") of the " + std::string(to_string(kAllPrecisions[pool])) + " pool (pool_blocks)");
      }
    }
  }

  // A sequence's page table for `slot`: its layer count, and the length
  // and ids (from entry `first` on) of its (layer, p) list.
  void check_table(std::string_view fn, int slot, const PageTable& table) const {
    check_slot_layer(fn, slot, 0);
    detail::require(table.num_layers() == config.num_layers, [&] {
      return std::string(fn) + ": table.num_layers() = " + std::to_string(table.num_layers()) +
             ": expected num_layers = " + std::to_string(config.num_layers);
    });
  }
  void check_table_list(std::string_view fn, const PageTable& table, int layer, Precision p,
                        std::size_t first = 0) const {
    const auto list = table.blocks(layer, p);
    detail::require(list.size() <= static_cast<std::size_t>(config.max_blocks_per_sequence), [&] {
      return std::string(fn) + ": table layer " + std::to_string(layer) + " holds " + std::to_string(list.size()) +
             " " + std::string(to_string(p)) +
             " blocks: expected <= max_blocks_per_sequence = " + std::to_string(config.max_blocks_per_sequence);
    });
    check_ids(
        fn, [&] { return "table.blocks(" + std::to_string(layer) + ", " + std::string(to_string(p)) + ")"; },
        pool_index(p), list, first);
  }

  void check_slot_layer(std::string_view fn, int slot, int layer) const {
    if (slot < 0 || slot >= config.max_sequences) {
      throw IndexOutOfRange(std::string(fn) + ": slot = " + std::to_string(slot) + ": expected [0, " +
                            std::to_string(config.max_sequences) + ")");
    }
    if (layer < 0 || layer >= config.num_layers) {
      throw IndexOutOfRange(std::string(fn) + ": layer = " + std::to_string(layer) + ": expected [0, " +
                            std::to_string(config.num_layers) + ")");
    }
  }
};

namespace {

void check_pool_blocks(std::string_view fn, const std::array<std::int32_t, kNumPrecisions>& pool_blocks) {
  for (int p = 0; p < kNumPrecisions; ++p) {
    detail::require(pool_blocks[p] > 0, [&] {
      return std::string(fn) + ": pool_blocks[" + std::string(to_string(kAllPrecisions[p])) +
             "] = " + std::to_string(pool_blocks[p]) + ": expected > 0 (the pool's blocks in the arena)";
    });
  }
}

// First FP16 entry sync_tail compares: the last block both lists hold may
// have been copied on write; entries before it are unchanged by appends.
std::size_t tail_start(std::int32_t mirrored, std::size_t now) {
  const std::size_t common = std::min(static_cast<std::size_t>(mirrored), now);
  return common == 0 ? 0 : common - 1;
}

PageTableConfig bound_by(PageTableConfig config, const PoolLayout& arena) {
  for (int p = 0; p < kNumPrecisions; ++p) config.pool_blocks[p] = arena.pools[p].num_blocks;
  return config;
}

}  // namespace

DevicePageTables::DevicePageTables(PageTableConfig config, const PoolLayout& arena)
    : DevicePageTables(bound_by(config, arena)) {}

DevicePageTables::DevicePageTables(const PageTableConfig& config) : impl_(std::make_unique<Impl>()) {
  const auto positive = [](const char* name, std::int32_t value) {
    detail::require(value > 0, [&] {
      return std::string("DevicePageTables: config.") + name + " = " + std::to_string(value) + ": expected > 0";
    });
  };
  positive("num_layers", config.num_layers);
  positive("max_sequences", config.max_sequences);
  positive("max_blocks_per_sequence", config.max_blocks_per_sequence);
  check_pool_blocks("DevicePageTables: config", config.pool_blocks);
  Impl& s = *impl_;
  s.config = config;
  s.table_entries = static_cast<std::size_t>(config.num_layers) * kNumPrecisions * config.max_sequences *
                    config.max_blocks_per_sequence;
  s.count_entries = static_cast<std::size_t>(config.num_layers) * kNumPrecisions * config.max_sequences;
  s.fill_entries = static_cast<std::size_t>(config.num_layers) * config.max_sequences;
  const std::size_t total = s.table_entries + s.count_entries + s.fill_entries;
  detail::require(total < (std::size_t{1} << 32), [&] {
    return "DevicePageTables: num_layers * 3 * max_sequences * "
           "max_blocks_per_sequence = " +
           std::to_string(total) + " entries: expected < 2^32";
  });
  s.mirror.assign(total, 0);
  s.device.allocate(total);
  MIXKV_CUDA_CHECK(cudaMemset(s.device.get(), 0, total * sizeof(std::int32_t)));
}

DevicePageTables::~DevicePageTables() = default;

const PageTableConfig& DevicePageTables::config() const { return impl_->config; }

void DevicePageTables::set_pool_blocks(const std::array<std::int32_t, kNumPrecisions>& pool_blocks) {
  constexpr std::string_view fn = "DevicePageTables::set_pool_blocks";
  check_pool_blocks(fn, pool_blocks);
  Impl& s = *impl_;
  for (std::int32_t layer = 0; layer < s.config.num_layers; ++layer) {
    for (int p = 0; p < kNumPrecisions; ++p) {
      for (std::int32_t slot = 0; slot < s.config.max_sequences; ++slot) {
        const std::int32_t n = s.mirror[s.count_at(slot, layer, p)];
        const std::int32_t* list = s.mirror.data() + s.table_at(slot, layer, p);
        for (std::int32_t j = 0; j < n; ++j) {
          if (list[j] >= pool_blocks[p]) {
            throw IndexOutOfRange(std::string(fn) + ": pool_blocks[" + std::string(to_string(kAllPrecisions[p])) +
                                  "] = " + std::to_string(pool_blocks[p]) + ": slot " + std::to_string(slot) +
                                  ", layer " + std::to_string(layer) + " holds block " + std::to_string(list[j]) +
                                  " at position " + std::to_string(j) + ": expected a bound above every held id");
          }
        }
      }
    }
  }
  s.config.pool_blocks = pool_blocks;
}

void DevicePageTables::set_blocks(std::int32_t slot, std::int32_t layer, Precision pool,
                                  std::span<const std::int32_t> blocks, std::int32_t last_block_len) {
  constexpr std::string_view fn = "DevicePageTables::set_blocks";
  Impl& s = *impl_;
  s.check_slot_layer(fn, slot, layer);
  const int p = pool_index(pool);
  detail::require(p >= 0 && p < kNumPrecisions,
                  [&] { return std::string(fn) + ": pool: expected FP16, INT4 or INT2"; });
  detail::require(blocks.size() <= static_cast<std::size_t>(s.config.max_blocks_per_sequence), [&] {
    return std::string(fn) + ": blocks has " + std::to_string(blocks.size()) +
           " entries: expected <= max_blocks_per_sequence = " + std::to_string(s.config.max_blocks_per_sequence);
  });
  s.check_ids(
      fn, [] { return std::string("blocks"); }, p, blocks);
  if (pool == Precision::FP16) {
    const bool ok = blocks.empty() ? last_block_len == 0 : last_block_len >= 1;
    detail::require(ok, [&] {
      return std::string(fn) + ": last_block_len = " + std::to_string(last_block_len) +
             (blocks.empty() ? ": expected 0 for an empty FP16 list" : ": expected the FP16 tail fill, >= 1");
    });
  }
  const std::size_t row = s.table_at(slot, layer, p);
  // Only entries that differ from the mirror are recorded: appending a token
  // to a full tail block changes one id and the count, not the list.
  for (std::size_t j = 0; j < blocks.size(); ++j) s.write(row + j, blocks[j]);
  s.write(s.count_at(slot, layer, p), static_cast<std::int32_t>(blocks.size()));
  if (pool == Precision::FP16) s.write(s.fill_at(slot, layer), last_block_len);
}

void DevicePageTables::sync(std::int32_t slot, const PageTable& table) {
  constexpr std::string_view fn = "DevicePageTables::sync";
  Impl& s = *impl_;
  s.check_table(fn, slot, table);
  // Validate every list first so that a throw changes nothing.
  for (std::int32_t layer = 0; layer < s.config.num_layers; ++layer) {
    for (Precision p : kAllPrecisions) s.check_table_list(fn, table, layer, p);
  }
  for (std::int32_t layer = 0; layer < s.config.num_layers; ++layer) {
    for (Precision p : kAllPrecisions) {
      const auto list = table.blocks(layer, p);
      const std::int32_t fill = p == Precision::FP16 && !list.empty() ? table.fp16_tail_fill(layer) : 0;
      set_blocks(slot, layer, p, list, fill);
    }
  }
}

bool DevicePageTables::sync_tail(std::int32_t slot, const PageTable& table) {
  constexpr std::string_view fn = "DevicePageTables::sync_tail";
  Impl& s = *impl_;
  s.check_table(fn, slot, table);
  const int fp16 = pool_index(Precision::FP16);
  // Validate every layer first so that a throw or a refusal changes nothing.
  for (std::int32_t layer = 0; layer < s.config.num_layers; ++layer) {
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      if (table.blocks(layer, p).size() != static_cast<std::size_t>(s.mirror[s.count_at(slot, layer, pool_index(p))])) {
        return false;
      }
    }
    const std::size_t start =
        tail_start(s.mirror[s.count_at(slot, layer, fp16)], table.blocks(layer, Precision::FP16).size());
    s.check_table_list(fn, table, layer, Precision::FP16, start);
  }
  for (std::int32_t layer = 0; layer < s.config.num_layers; ++layer) {
    const auto list = table.blocks(layer, Precision::FP16);
    const std::size_t start = tail_start(s.mirror[s.count_at(slot, layer, fp16)], list.size());
    const std::size_t row = s.table_at(slot, layer, fp16);
    for (std::size_t j = start; j < list.size(); ++j) s.write(row + j, list[j]);
    s.write(s.count_at(slot, layer, fp16), static_cast<std::int32_t>(list.size()));
    s.write(s.fill_at(slot, layer), list.empty() ? 0 : table.fp16_tail_fill(layer));
  }
  return true;
}

void DevicePageTables::clear(std::int32_t slot) {
  Impl& s = *impl_;
  s.check_slot_layer("DevicePageTables::clear", slot, 0);
  for (std::int32_t layer = 0; layer < s.config.num_layers; ++layer) {
    for (int p = 0; p < kNumPrecisions; ++p) s.write(s.count_at(slot, layer, p), 0);
    s.write(s.fill_at(slot, layer), 0);
  }
}

std::size_t DevicePageTables::pending_updates() const { return impl_->pending.size(); }

std::size_t DevicePageTables::upload(cudaStream_t stream) {
  Impl& s = *impl_;
  const std::size_t count = s.pending.size();
  if (count == 0) return 0;
  // The staging buffer may still feed the previous upload's copy.
  s.staging_free.synchronize();
  s.staging.reserve(count);
  s.device_updates.reserve(count);
  std::copy(s.pending.begin(), s.pending.end(), s.staging.get());
  MIXKV_CUDA_CHECK(
      cudaMemcpyAsync(s.device_updates.get(), s.staging.get(), count * sizeof(Update), cudaMemcpyHostToDevice, stream));
  s.staging_free.record(stream);
  constexpr int kThreads = 256;
  scatter_kernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      s.device_updates.get(), static_cast<std::int32_t>(count), s.device.get());
  MIXKV_CUDA_CHECK_LAUNCH("page table scatter");
  s.pending.clear();
  s.pending_index.clear();
  return count;
}

std::int32_t DevicePageTables::num_blocks(std::int32_t slot, std::int32_t layer, Precision pool) const {
  impl_->check_slot_layer("DevicePageTables::num_blocks", slot, layer);
  return impl_->mirror[impl_->count_at(slot, layer, pool_index(pool))];
}

std::int32_t DevicePageTables::fp16_fill(std::int32_t slot, std::int32_t layer) const {
  impl_->check_slot_layer("DevicePageTables::fp16_fill", slot, layer);
  return impl_->mirror[impl_->fill_at(slot, layer)];
}

std::span<const std::int32_t> DevicePageTables::blocks(std::int32_t slot, std::int32_t layer, Precision pool) const {
  const std::int32_t n = num_blocks(slot, layer, pool);
  return {impl_->mirror.data() + impl_->table_at(slot, layer, pool_index(pool)), static_cast<std::size_t>(n)};
}

DeviceTablesView DevicePageTables::device_view() const {
  const Impl& s = *impl_;
  DeviceTablesView view;
  view.blocks = s.device.get();
  view.counts = s.device.get() + s.table_entries;
  view.fp16_fill = s.device.get() + s.table_entries + s.count_entries;
  view.max_sequences = s.config.max_sequences;
  view.max_blocks = s.config.max_blocks_per_sequence;
  return view;
}

}  // namespace mixkv::gpu
