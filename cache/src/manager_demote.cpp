// KVCacheManager: demotion of windows to a lower precision under memory pressure.
#include "manager_impl.h"

#include <algorithm>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace mixkv {

// FP16 rank (position among the layer's FP16 tokens) of the first token of
// `window`, an FP16 window of `layer`.
std::int64_t KVCacheManager::Impl::fp16_rank(const Prompt& prompt, std::int32_t layer, std::int32_t window) const {
  const std::int32_t bs = block_size();
  const std::span<const Precision> row = prompt.plan.layer(layer);
  std::int64_t rank = 0;
  if (config.fp16_windows_first) {
    return std::int64_t{bs} * std::count(row.begin(), row.begin() + window, Precision::FP16);
  }
  std::int32_t w = 0;
  for (const Segment& segment : prompt.layout.segments()) {
    if (segment.kind == TokenKind::Text) {
      rank += segment.length;
      continue;
    }
    const std::int32_t full = segment.length / bs;
    for (std::int32_t i = 0; i < full; ++i, ++w) {
      if (w == window) return rank;
      rank += row[static_cast<std::size_t>(w)] == Precision::FP16 ? bs : 0;
    }
    rank += segment.length - full * bs;
  }
  return rank;
}

// Position of (layer, window)'s block in the list of the window's pool, or
// -1 for an FP16 window whose tokens start inside a block (FP16 rank of its
// first token in `rank`).
std::int32_t KVCacheManager::Impl::block_index(const Prompt& prompt, std::int32_t layer, std::int32_t window,
                                               std::int64_t& rank) const {
  const Precision current = prompt.plan.at(layer, window);
  if (current == Precision::FP16) {
    rank = fp16_rank(prompt, layer, window);
    return rank % block_size() == 0 ? static_cast<std::int32_t>(rank / block_size()) : -1;
  }
  const std::span<const Precision> row = prompt.plan.layer(layer);
  return static_cast<std::int32_t>(std::count(row.begin(), row.begin() + window, current));
}

std::optional<std::string> KVCacheManager::Impl::why_not(const Sequence& seq, std::int32_t layer, std::int32_t window,
                                                         Precision target, bool leave_shared) const {
  const PrecisionPlan& plan = seq.prompt->plan;
  const Precision current = plan.at(layer, window);
  if (bits_of(target) >= bits_of(current)) {
    return "target " + std::string(to_string(target)) + " is not below the window's " + std::string(to_string(current));
  }
  std::int64_t rank = 0;
  const std::int32_t index = block_index(*seq.prompt, layer, window, rank);
  if (index < 0) {
    return "its FP16 tokens start at FP16 rank " + std::to_string(rank) + ", inside a block of " +
           std::to_string(block_size()) + " (they share blocks with other tokens; fp16_windows_first avoids this)";
  }
  const std::int32_t block = seq.table.blocks(layer, current)[static_cast<std::size_t>(index)];
  // The prefix index keeps its reference to the original, whose bytes the
  // demotion only reads: the sequence moves to the copy.
  const bool cached = this->index && this->index->node_of(current, block) != nullptr;
  const std::int32_t refs = pool(current).ref_count(block) - (cached ? 1 : 0);
  if (refs != 1 && !leave_shared) {
    return "its " + std::string(to_string(current)) + " block " + std::to_string(block) + " is shared by " +
           std::to_string(refs) + " sequences (a shared block is never demoted in place)";
  }
  return std::nullopt;
}

std::optional<std::string> KVCacheManager::why_not_demotable(SequenceId id, std::int32_t layer, std::int32_t window,
                                                             Precision target, bool leave_shared) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.resident(id, "id");
  m.require_layer(layer);
  require_index("window", window, seq.prompt->plan.num_windows());
  require_precision(target, "target");
  if (window == 0) return std::string("window 0 (the first visual window) always stays FP16");
  return m.why_not(seq, layer, window, target, leave_shared);
}

std::vector<DemoteOp> KVCacheManager::demote(std::span<const Demotion> demotions) {
  Impl& m = *impl_;
  // Validate everything first: a throwing call changes nothing.
  std::vector<Sequence*> seqs;
  seqs.reserve(demotions.size());
  BlockCounts need{};
  std::vector<std::tuple<SequenceId, std::int32_t, std::int32_t, std::size_t>> keys;
  keys.reserve(demotions.size());
  for (std::size_t i = 0; i < demotions.size(); ++i) {
    const Demotion& d = demotions[i];
    const std::string name = "demotions[" + std::to_string(i) + "]";
    const auto it = m.sequences.find(d.id);
    if (it == m.sequences.end()) {
      throw UnknownId(name + ".id = " + std::to_string(d.id) + " is not a sequence of this cache");
    }
    Sequence& seq = it->second;
    if (seq.swapped) {
      throw InvalidArgument(name + ".id = " + std::to_string(d.id) +
                            " is swapped out, expected a sequence in device memory");
    }
    require_index(name + ".layer", d.layer, m.num_layers());
    require_precision(d.target, name + ".target");
    if (d.stream) {
      require_index(name + ".window", d.window, m.stream_blocks(seq));
      if (auto reason = m.why_not_stream(seq, d.layer, d.window, d.target)) {
        throw InvalidArgument(name + " (id " + std::to_string(d.id) + ", layer " + std::to_string(d.layer) +
                              ", stream block " + std::to_string(d.window) + ") cannot be demoted: " + *reason);
      }
      keys.emplace_back(d.id, d.layer, -1 - d.window, i);  // stream blocks apart from windows
      ++need[at(d.target)];
      seqs.push_back(&seq);
      continue;
    }
    require_index(name + ".window", d.window, seq.prompt->plan.num_windows());
    if (d.window == 0) {
      throw InvalidArgument(name + ".window = 0: the first visual window always stays FP16, expected >= 1");
    }
    if (auto reason = m.why_not(seq, d.layer, d.window, d.target, d.leave_shared)) {
      throw InvalidArgument(name + " (id " + std::to_string(d.id) + ", layer " + std::to_string(d.layer) + ", window " +
                            std::to_string(d.window) + ") cannot be demoted: " + *reason);
    }
    keys.emplace_back(d.id, d.layer, d.window, i);
    ++need[at(d.target)];
    seqs.push_back(&seq);
  }
  std::sort(keys.begin(), keys.end());
  for (std::size_t k = 1; k < keys.size(); ++k) {
    if (std::get<0>(keys[k]) == std::get<0>(keys[k - 1]) && std::get<1>(keys[k]) == std::get<1>(keys[k - 1]) &&
        std::get<2>(keys[k]) == std::get<2>(keys[k - 1])) {
      throw InvalidArgument("demotions[" + std::to_string(std::max(std::get<3>(keys[k]), std::get<3>(keys[k - 1]))) +
                            "] repeats demotions[" +
                            std::to_string(std::min(std::get<3>(keys[k]), std::get<3>(keys[k - 1]))) +
                            "], expected each (id, layer, window) once");
    }
  }
  // Prepare every host allocation before any block moves: the ops, a
  // private copy of each listed sequence's prompt that forks share (they
  // keep theirs; the first listing of a sequence holds its copy), room in
  // each target list (a quantized list never holds more than one block per
  // window), the block ids and slab records.
  std::vector<DemoteOp> ops;
  ops.reserve(demotions.size());
  std::vector<std::shared_ptr<Prompt>> private_prompts(demotions.size());
  const std::uint64_t batch = ++m.epoch;
  for (std::size_t i = 0; i < demotions.size(); ++i) {
    const Demotion& d = demotions[i];
    Sequence& seq = *seqs[i];
    const auto size = seq.table.blocks(d.layer, d.target).size();
    const auto most = static_cast<std::size_t>(seq.prompt->plan.num_windows() + m.stream_blocks(seq));
    seq.table.reserve(d.layer, d.target, std::min(size + demotions.size(), most));
    if (d.stream) {
      // Room only (an empty list of layers reads as all FP16): the commit
      // grows a list within it, allocating nothing.
      if (seq.aged.empty()) seq.aged.resize(static_cast<std::size_t>(m.num_layers()));
      reserve_geometric(seq.aged[static_cast<std::size_t>(d.layer)].blocks, static_cast<std::size_t>(d.window) + 1);
    }
    if (seq.seen_epoch == batch) continue;
    seq.seen_epoch = batch;
    seq.seen_index = i;
    if (seq.prompt.use_count() > 1) private_prompts[i] = std::make_shared<Prompt>(*seq.prompt);
  }
  BlockIds fresh;
  m.prepare_blocks(need, "demote", fresh);

  // Commit: nothing below allocates or throws. Every destination is taken
  // before any source is released, so no op's destination overlaps another
  // op's source.
  m.take_blocks(need, fresh);
  std::array<std::size_t, kNumPrecisions> next{};
  const std::int32_t bs = m.block_size();
  for (std::size_t i = 0; i < demotions.size(); ++i) {
    const Demotion& d = demotions[i];
    Sequence& seq = *seqs[i];
    if (auto& copy = private_prompts[seq.seen_index]) seq.prompt = std::move(copy);  // moved-from: taken once
    Prompt& prompt = *seq.prompt;
    if (d.stream) {
      const Precision current = Impl::stream_precision(seq, d.layer, d.window);
      const std::int32_t src =
          seq.table.remove_block(d.layer, current, m.stream_index(seq, d.layer, d.window, current));
      const std::int32_t dst = fresh[at(d.target)][next[at(d.target)]++];
      seq.table.insert_block(d.layer, d.target, m.stream_index(seq, d.layer, d.window, d.target), dst);
      detail::AgedStream& a = seq.aged[static_cast<std::size_t>(d.layer)];
      if (a.blocks.size() <= static_cast<std::size_t>(d.window)) {
        a.blocks.resize(static_cast<std::size_t>(d.window) + 1, Precision::FP16);  // within the reserved room
      }
      a.blocks[static_cast<std::size_t>(d.window)] = d.target;
      --a.counts[at(current)];  // FP16's count is not kept
      ++a.counts[at(d.target)];
      ops.push_back({d.id, d.layer, prompt.plan.num_windows() + d.window, current, src, d.target, dst});
      continue;
    }
    const Precision current = prompt.plan.at(d.layer, d.window);
    // List positions: windows before it at each precision (FP16: its rank).
    const std::span<const Precision> row = prompt.plan.layer(d.layer);
    const auto src_index = static_cast<std::int32_t>(current == Precision::FP16
                                                         ? m.fp16_rank(prompt, d.layer, d.window) / bs
                                                         : std::count(row.begin(), row.begin() + d.window, current));
    const auto dst_index = static_cast<std::int32_t>(std::count(row.begin(), row.begin() + d.window, d.target));
    const std::int32_t src = seq.table.remove_block(d.layer, current, src_index);
    const std::int32_t dst = fresh[at(d.target)][next[at(d.target)]++];
    seq.table.insert_block(d.layer, d.target, dst_index, dst);
    prompt.plan.set(d.layer, d.window, d.target);
    ops.push_back({d.id, d.layer, d.window, current, src, d.target, dst});
  }
  for (const DemoteOp& op : ops) {
    if (!m.pool(op.src_precision).release(op.src_block)) m.holders_changed(op.src_precision, op.src_block);
  }
  return ops;
}

}  // namespace mixkv
