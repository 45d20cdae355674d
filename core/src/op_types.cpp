#include "mixkv/core/op_types.h"

namespace mixkv {

void StoreMapping::append(const StoreMapping& other) {
  const auto offset = static_cast<std::int32_t>(fp16_slots.size());
  fp16_slots.insert(fp16_slots.end(), other.fp16_slots.begin(), other.fp16_slots.end());
  for (WindowSlot w : other.int4_windows) int4_windows.push_back({w.block_id, w.first_row + offset});
  for (WindowSlot w : other.int2_windows) int2_windows.push_back({w.block_id, w.first_row + offset});
}

}  // namespace mixkv
