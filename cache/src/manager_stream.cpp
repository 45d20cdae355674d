// KVCacheManager: the FP16 stream's full blocks, which age tiers demote
// (Demotion::stream). The stream is every token outside visual windows in
// order, identical in every layer, so its block k names the same tokens
// in every layer whatever the plan.
#include <algorithm>
#include <string>

#include "manager_impl.h"

namespace mixkv {

std::int32_t KVCacheManager::Impl::stream_blocks(const Sequence& seq) const {
  const std::int64_t windows = std::int64_t{seq.prompt->plan.num_windows()} * block_size();
  return static_cast<std::int32_t>((seq.num_tokens - windows) / block_size());
}

Precision KVCacheManager::Impl::stream_precision(const Sequence& seq, std::int32_t layer, std::int32_t block) {
  if (seq.aged.empty()) return Precision::FP16;
  const auto& list = seq.aged[static_cast<std::size_t>(layer)].blocks;
  return static_cast<std::size_t>(block) < list.size() ? list[static_cast<std::size_t>(block)] : Precision::FP16;
}

std::int64_t KVCacheManager::Impl::aged_blocks(const Sequence& seq, std::int32_t layer, Precision p) {
  if (seq.aged.empty() || p == Precision::FP16) return 0;
  return seq.aged[static_cast<std::size_t>(layer)].counts[at(p)];
}

bool KVCacheManager::Impl::has_aged(const Sequence& seq) {
  return std::ranges::any_of(seq.aged, [](const detail::AgedStream& a) { return a.counts[1] + a.counts[2] > 0; });
}

// Quantized lists hold the plan's windows (in window order), then the
// demoted stream blocks (in stream order); the FP16 list holds the FP16
// windows (fp16_windows_first), then the stream's FP16 blocks in order.
// Blocks before `block` in pool p: the layer's count less those from
// `block` on, so the newest block costs O(1).
std::int32_t KVCacheManager::Impl::stream_index(const Sequence& seq, std::int32_t layer, std::int32_t block,
                                                Precision p) const {
  const auto windows = seq.prompt->plan.window_counts(layer);
  std::array<std::int32_t, kNumPrecisions> before{};
  if (!seq.aged.empty()) {
    const detail::AgedStream& a = seq.aged[static_cast<std::size_t>(layer)];
    before = a.counts;
    for (std::size_t k = static_cast<std::size_t>(block); k < a.blocks.size(); ++k) --before[at(a.blocks[k])];
  }
  if (p == Precision::FP16) {
    const std::int32_t quantized = before[1] + before[2];
    return (config.fp16_windows_first ? windows[0] : 0) + block - quantized;
  }
  return windows[at(p)] + before[at(p)];
}

std::optional<std::string> KVCacheManager::Impl::why_not_stream(const Sequence& seq, std::int32_t layer,
                                                                std::int32_t block, Precision target) const {
  const Precision current = stream_precision(seq, layer, block);
  if (bits_of(target) >= bits_of(current)) {
    return "target " + std::string(to_string(target)) + " is not below the stream block's " +
           std::string(to_string(current));
  }
  const std::int32_t fp16_windows = seq.prompt->plan.window_counts(layer)[0];
  if (!config.fp16_windows_first && fp16_windows > 0) {
    return "in prompt order the layer's " + std::to_string(fp16_windows) +
           " FP16 windows sit inside its FP16 stream (fp16_windows_first keeps them apart)";
  }
  const std::int32_t index = stream_index(seq, layer, block, current);
  const std::int32_t id = seq.table.blocks(layer, current)[static_cast<std::size_t>(index)];
  const bool cached = this->index && this->index->node_of(current, id) != nullptr;
  const std::int32_t refs = pool(current).ref_count(id) - (cached ? 1 : 0);
  if (refs != 1) {
    return "its " + std::string(to_string(current)) + " block " + std::to_string(id) + " is shared by " +
           std::to_string(refs) + " sequences (a shared block is never demoted in place)";
  }
  return std::nullopt;
}

std::int32_t KVCacheManager::stream_blocks(SequenceId id) const { return impl_->stream_blocks(impl_->find(id, "id")); }

Precision KVCacheManager::stream_precision(SequenceId id, std::int32_t layer, std::int32_t block) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.find(id, "id");
  m.require_layer(layer);
  require_index("block", block, m.stream_blocks(seq));
  return Impl::stream_precision(seq, layer, block);
}

std::int64_t KVCacheManager::aged_blocks(SequenceId id, std::int32_t layer, Precision p) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.find(id, "id");
  m.require_layer(layer);
  require_precision(p, "p");
  return Impl::aged_blocks(seq, layer, p);
}

std::optional<std::string> KVCacheManager::why_not_stream_demotable(SequenceId id, std::int32_t layer,
                                                                    std::int32_t block, Precision target) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.resident(id, "id");
  m.require_layer(layer);
  require_index("block", block, m.stream_blocks(seq));
  require_precision(target, "target");
  return m.why_not_stream(seq, layer, block, target);
}

}  // namespace mixkv
