#include "mixkv/cpu/demote.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "detail.h"

namespace mixkv::cpu {

void demote(std::span<const DemoteOp> ops, const PoolViews& pools) {
  constexpr std::string_view fn = "demote";
  detail::check_pools(fn, pools);
  // (pool, block) of every source and destination: the ops must not depend
  // on their order (the device runs them at once), so no block is written
  // twice and no written block is also read.
  std::vector<std::pair<int, std::int32_t>> sources;
  std::vector<std::pair<int, std::int32_t>> destinations;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const DemoteOp& op = ops[i];
    const bool pair_ok = (op.src_precision == Precision::FP16 && is_quantized(op.dst_precision) &&
                          pool_index(op.dst_precision) < kNumPrecisions) ||
                         (op.src_precision == Precision::INT4 && op.dst_precision == Precision::INT2);
    if (!pair_ok) {
      detail::invalid(fn, ": ops[", i, "]: (src_precision, dst_precision) = (", pool_index(op.src_precision), ", ",
                      pool_index(op.dst_precision), "): expected (FP16, INT4), (FP16, INT2) or (INT4, INT2)");
    }
    const int src = pool_index(op.src_precision);
    const int dst = pool_index(op.dst_precision);
    detail::check_block(fn, op.src_block, pools[src], detail::pool_name(op.src_precision), "ops[", i, "].src_block");
    detail::check_block(fn, op.dst_block, pools[dst], detail::pool_name(op.dst_precision), "ops[", i, "].dst_block");
    sources.emplace_back(src, op.src_block);
    destinations.emplace_back(dst, op.dst_block);
  }
  std::sort(sources.begin(), sources.end());
  std::vector<std::pair<int, std::int32_t>> sorted = destinations;
  std::sort(sorted.begin(), sorted.end());
  if (const auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
    detail::invalid(fn, ": ops[].dst_block holds ", to_string(kAllPrecisions[twice->first]), " block ", twice->second,
                    " twice: expected distinct destinations");
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (std::binary_search(sources.begin(), sources.end(), destinations[i])) {
      detail::invalid(fn, ": ops[", i, "].dst_block = ", ops[i].dst_block,
                      " is also a src_block of its pool: expected destinations that no op reads");
    }
  }

  const BlockFormat& ref = pools[0].format;
  const std::size_t values = static_cast<std::size_t>(ref.block_size) * ref.head_dim;
  std::vector<float> k(values);
  std::vector<float> v(values);
  // A source holding NaN, inf or values whose group FP16 cannot describe is
  // a corrupt block (stale op, or bytes written through the arena view):
  // rejected before anything is written, never quantized into garbage.
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const DemoteOp& op = ops[i];
    const PoolView& src = pools[static_cast<std::size_t>(pool_index(op.src_precision))];
    const PoolView& dst = pools[static_cast<std::size_t>(pool_index(op.dst_precision))];
    for (int head = 0; head < ref.num_kv_heads; ++head) {
      detail::read_head_unchecked(src.format, src.block(op.src_block) + src.format.head_offset(head), k.data(),
                                  v.data());
      const std::string why = detail::unquantizable_floats(dst.format, k.data(), v.data());
      if (!why.empty()) {
        detail::invalid(fn, ": ops[", i, "]: ", to_string(op.src_precision), " block ", op.src_block, " head ", head,
                        ": ", why, ": expected a block of finite values (a corrupt or stale source block)");
      }
    }
  }
  for (const DemoteOp& op : ops) {
    const PoolView& src = pools[static_cast<std::size_t>(pool_index(op.src_precision))];
    const PoolView& dst = pools[static_cast<std::size_t>(pool_index(op.dst_precision))];
    for (int head = 0; head < ref.num_kv_heads; ++head) {
      detail::read_head_unchecked(src.format, src.block(op.src_block) + src.format.head_offset(head), k.data(),
                                  v.data());
      detail::quantize_head_floats(dst.format, k.data(), v.data(),
                                   dst.block(op.dst_block) + dst.format.head_offset(head));
    }
  }
}

}  // namespace mixkv::cpu
