#include "mixkv/cpu/demote.h"

#include <vector>

#include "detail.h"

namespace mixkv::cpu {

void demote(std::span<const DemoteOp> ops, const PoolViews& pools) {
  constexpr std::string_view fn = "demote";
  detail::check_pools(fn, pools);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const DemoteOp& op = ops[i];
    const bool pair_ok = (op.src_precision == Precision::FP16 && is_quantized(op.dst_precision) &&
                          pool_index(op.dst_precision) < kNumPrecisions) ||
                         (op.src_precision == Precision::INT4 && op.dst_precision == Precision::INT2);
    if (!pair_ok) {
      detail::invalid(fn, ": ops[", i, "]: (src_precision, dst_precision) = (", pool_index(op.src_precision), ", ",
                      pool_index(op.dst_precision), "): expected (FP16, INT4), (FP16, INT2) or (INT4, INT2)");
    }
    if (op.src_block < 0) detail::invalid(fn, ": ops[", i, "].src_block = ", op.src_block, ": expected >= 0");
    if (op.dst_block < 0) detail::invalid(fn, ": ops[", i, "].dst_block = ", op.dst_block, ": expected >= 0");
  }
  const BlockFormat& ref = pools[0].format;
  const std::size_t values = static_cast<std::size_t>(ref.block_size) * ref.head_dim;
  std::vector<float> k(values);
  std::vector<float> v(values);
  for (const DemoteOp& op : ops) {
    const PoolView& src = pools[static_cast<std::size_t>(pool_index(op.src_precision))];
    const PoolView& dst = pools[static_cast<std::size_t>(pool_index(op.dst_precision))];
    for (int head = 0; head < ref.num_kv_heads; ++head) {
      detail::read_head_unchecked(src.format, src.block(op.src_block) + src.format.head_offset(head), k.data(),
                                  v.data());
      detail::quantize_head_floats(dst.format, k.data(), v.data(), dst.block(op.dst_block) + dst.format.head_offset(head));
    }
  }
}

}  // namespace mixkv::cpu
