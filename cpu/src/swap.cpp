#include "mixkv/cpu/swap.h"

#include <cstring>
#include <string>

#include "detail.h"

namespace mixkv::cpu {

void swap_blocks(std::span<const SwapCopy> copies, SwapDirection direction, const PoolViews& device,
                 const PoolViews& host) {
  constexpr std::string_view fn = "swap_blocks";
  detail::check_pools(fn, device);
  detail::check_pools(fn, host);
  if (direction != SwapDirection::DeviceToHost && direction != SwapDirection::HostToDevice) {
    detail::invalid(fn, ": direction = ", static_cast<int>(direction),
                    ": expected DeviceToHost (0) or HostToDevice (1)");
  }
  for (std::size_t i = 0; i < copies.size(); ++i) {
    const int p = pool_index(copies[i].pool);
    if (p < 0 || p >= kNumPrecisions)
      detail::invalid(fn, ": copies[", i, "].pool = ", p, ": expected FP16, INT4 or INT2");
    const std::string pool(to_string(copies[i].pool));
    if (!device[p].contains(copies[i].device_block)) {
      detail::check_block(fn, copies[i].device_block, device[p], "device[" + pool + "]", "copies[", i,
                          "].device_block");
    }
    // A cache without a swap pool has host num_blocks 0: every copy is refused.
    if (!host[p].contains(copies[i].host_slot)) {
      detail::check_block(fn, copies[i].host_slot, host[p], "host[" + pool + "]", "copies[", i, "].host_slot");
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
