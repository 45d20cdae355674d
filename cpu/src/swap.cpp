#include "mixkv/cpu/swap.h"

#include <cstring>

#include "detail.h"

namespace mixkv::cpu {

void swap_blocks(std::span<const SwapCopy> copies, SwapDirection direction, const PoolViews& device,
                 const PoolViews& host) {
  constexpr std::string_view fn = "swap_blocks";
  detail::check_pools(fn, device);
  detail::check_pools(fn, host);
  for (std::size_t i = 0; i < copies.size(); ++i) {
    const int p = pool_index(copies[i].pool);
    if (p < 0 || p >= kNumPrecisions) detail::invalid(fn, ": copies[", i, "].pool = ", p, ": expected FP16, INT4 or INT2");
    if (copies[i].device_block < 0 || copies[i].host_slot < 0) {
      detail::invalid(fn, ": copies[", i, "]: device_block = ", copies[i].device_block,
                      ", host_slot = ", copies[i].host_slot, ": expected >= 0");
    }
  }
  for (const SwapCopy& c : copies) {
    const auto p = static_cast<std::size_t>(pool_index(c.pool));
    std::byte* on_device = device[p].block(c.device_block);
    std::byte* on_host = host[p].block(c.host_slot);
    const std::size_t bytes = device[p].format.block_bytes();
    if (direction == SwapDirection::DeviceToHost) {
      std::memcpy(on_host, on_device, bytes);
    } else {
      std::memcpy(on_device, on_host, bytes);
    }
  }
}

}  // namespace mixkv::cpu
