// KVCacheManager: the host swap pool (swap_out, swap_in, the swap buffer layout).
#include "manager_impl.h"

#include <algorithm>
#include <vector>

namespace mixkv {

BlockCounts KVCacheManager::free_swap_slots() const {
  BlockCounts free{};
  for (const Precision p : kAllPrecisions) free[at(p)] = static_cast<std::int64_t>(impl_->swap[at(p)].free.size());
  return free;
}

std::size_t KVCacheManager::swap_bytes() const {
  std::size_t bytes = 0;
  for (const Precision p : kAllPrecisions) {
    bytes += static_cast<std::size_t>(impl_->config.swap_blocks[at(p)]) * impl_->pool(p).format().block_bytes();
  }
  return bytes;
}

PoolView KVCacheManager::swap_view(Precision p, std::byte* host_base) const {
  require_precision(p, "p");
  if (host_base == nullptr) throw InvalidArgument("host_base = nullptr, expected the host swap buffer's first byte");
  return swap_layout().at(host_base)[at(p)];
}

PoolLayout KVCacheManager::swap_layout() const {
  PoolLayout layout;
  std::size_t offset = 0;
  for (const Precision p : kAllPrecisions) {
    const BlockFormat f = impl_->pool(p).format();
    const std::int64_t count = impl_->config.swap_blocks[at(p)];
    // All slots of the pool form one "slab", so block(slot) = base + slot * block_bytes.
    const auto slots = static_cast<std::int32_t>(std::max<std::int64_t>(count, 1));
    layout.offsets[at(p)] = offset;
    layout.pools[at(p)] = PoolView{nullptr, static_cast<std::size_t>(slots) * f.block_bytes(), slots, f,
                                   static_cast<std::int32_t>(count)};
    offset += static_cast<std::size_t>(count) * f.block_bytes();
  }
  layout.bytes = offset;
  return layout;
}

bool KVCacheManager::is_swapped(SequenceId id) const { return impl_->find(id, "id").swapped; }

std::vector<SwapCopy> KVCacheManager::swap_out(SequenceId id) {
  Impl& m = *impl_;
  Sequence& seq = m.resident(id, "id");
  const BlockCounts held = blocks_held(id);
  for (const Precision p : kAllPrecisions) {
    const auto free = static_cast<std::int64_t>(m.swap[at(p)].free.size());
    if (held[at(p)] > free) {
      throw OutOfMemory("swap_out(id = " + std::to_string(id) + "): out of host swap memory: the " +
                        std::string(to_string(p)) + " swap pool has " + std::to_string(free) + " free slots of " +
                        std::to_string(m.config.swap_blocks[at(p)]) + ", the sequence holds " +
                        std::to_string(held[at(p)]) + " " + std::string(to_string(p)) + " blocks");
    }
  }
  // Prepare the host memory (the copies, the host-slot table at its final
  // size), then commit: nothing below allocates or throws.
  std::vector<SwapCopy> copies;
  copies.reserve(static_cast<std::size_t>(held[0] + held[1] + held[2]));
  PageTable host(m.num_layers(), m.block_size());
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) host.reserve(layer, p, seq.table.blocks(layer, p).size());
  }
  const std::int32_t bs = m.block_size();
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      const auto blocks = seq.table.blocks(layer, p);
      SwapPool& sp = m.swap[at(p)];
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const std::int32_t slot = sp.free.back();
        sp.free.pop_back();
        sp.used[static_cast<std::size_t>(slot)] = 1;
        copies.push_back({p, blocks[i], slot});
        const bool tail = p == Precision::FP16 && i + 1 == blocks.size();
        host.push_block(layer, p, slot, tail ? seq.table.fp16_tail_fill(layer) : bs);
      }
    }
  }
  // Released only now: the copies above read the blocks before anyone reuses them.
  for (const SwapCopy& c : copies) {
    if (!m.pool(c.pool).release(c.device_block)) m.holders_changed(c.pool, c.device_block);
  }
  seq.table = std::move(host);
  seq.swapped = true;
  return copies;
}

std::vector<SwapCopy> KVCacheManager::swap_in(SequenceId id) {
  Impl& m = *impl_;
  Sequence& seq = m.find(id, "id");
  if (!seq.swapped) {
    throw InvalidArgument("id = " + std::to_string(id) + " is not swapped out, expected a swapped-out sequence");
  }
  const BlockCounts held = blocks_held(id);
  // Prepare the host memory (the copies, the device table at its final
  // size, the block ids, slab records), then commit: nothing below
  // take_blocks() allocates or throws.
  std::vector<SwapCopy> copies;
  copies.reserve(static_cast<std::size_t>(held[0] + held[1] + held[2]));
  PageTable device(m.num_layers(), m.block_size());
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) device.reserve(layer, p, seq.table.blocks(layer, p).size());
  }
  BlockIds ids;
  m.prepare_blocks(held, "swap_in(id = " + std::to_string(id) + ")", ids);
  m.take_blocks(held, ids);
  const std::int32_t bs = m.block_size();
  std::array<std::size_t, kNumPrecisions> next{};
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      const auto slots = seq.table.blocks(layer, p);
      for (std::size_t i = 0; i < slots.size(); ++i) {
        const std::int32_t block = ids[at(p)][next[at(p)]++];
        copies.push_back({p, block, slots[i]});
        const bool tail = p == Precision::FP16 && i + 1 == slots.size();
        device.push_block(layer, p, block, tail ? seq.table.fp16_tail_fill(layer) : bs);
      }
    }
  }
  // In reverse, so the host pool hands the slots out again in the same order.
  for (auto c = copies.rbegin(); c != copies.rend(); ++c) {
    SwapPool& sp = m.swap[at(c->pool)];
    sp.used[static_cast<std::size_t>(c->host_slot)] = 0;
    sp.free.push_back(c->host_slot);
  }
  seq.table = std::move(device);
  seq.swapped = false;
  return copies;
}

}  // namespace mixkv
