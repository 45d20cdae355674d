// KVCacheManager::append_tokens: one FP16 decode token per sequence, copy-on-write.
#include "manager_impl.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <boost/unordered/unordered_flat_map.hpp>

namespace mixkv {

AppendResult KVCacheManager::append_tokens(std::span<const SequenceId> ids, AppendSlots form) {
  Impl& m = *impl_;
  require_slots_form(form);
  std::vector<Sequence*> seqs;
  {
    const std::vector<const Sequence*> found = m.require_ids(ids);
    seqs.reserve(found.size());
    for (std::size_t i = 0; i < found.size(); ++i) {
      if (found[i]->num_tokens == std::numeric_limits<std::int32_t>::max()) {
        throw InvalidArgument("ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                              " holds 2^31 - 1 tokens, expected room for one more");
      }
      seqs.push_back(const_cast<Sequence*>(found[i]));  // the manager's own, non-const
    }
  }
  return m.append(seqs, form);
}

SequenceHandle KVCacheManager::handle(SequenceId id) const { return impl_->find(id, "id").handle; }

AppendResult KVCacheManager::append_tokens(std::span<const SequenceHandle> handles, AppendSlots form) {
  Impl& m = *impl_;
  require_slots_form(form);
  std::vector<Sequence*> seqs;
  seqs.reserve(handles.size());
  const std::uint64_t batch = ++m.epoch;
  // The argument's name is built only for an error: this loop runs once per
  // sequence and step.
  auto name = [](std::size_t i) { return "handles[" + std::to_string(i) + "]"; };
  for (std::size_t i = 0; i < handles.size(); ++i) {
    const SequenceHandle h = handles[i];
    const auto index = static_cast<std::size_t>(h.index);
    if (h.index < 0 || index >= m.handles.size() || m.handles[index] == nullptr ||
        m.generations[index] != h.generation) {
      throw UnknownId(name(i) + " = (" + std::to_string(h.index) + ", " + std::to_string(h.generation) +
                      ") names no sequence of this cache (stale or never handed out)");
    }
    Sequence& seq = *m.handles[index];
    if (seq.seen_epoch == batch) {
      throw InvalidArgument(name(i) + " repeats handles[" + std::to_string(seq.seen_index) +
                            "], expected distinct sequences");
    }
    if (seq.swapped) throw InvalidArgument(name(i) + " names a swapped-out sequence, expected one in device memory");
    if (seq.num_tokens == std::numeric_limits<std::int32_t>::max()) {
      throw InvalidArgument(name(i) + " holds 2^31 - 1 tokens, expected room for one more");
    }
    seq.seen_epoch = batch;
    seq.seen_index = i;
    seqs.push_back(&seq);
  }
  return m.append(seqs, form);
}

// A sequence's new token sits at offset num_tokens % block_size of its FP16
// tail in every layer (FP16 tokens = tokens - whole quantized windows). A
// sequence outside forks with a nonzero offset has room in every tail: the
// fast path, O(1) with AppendSlots::Compact. The others (a new block in
// every layer, or forked tails that may need copy-on-write) take the
// general path, O(num_layers), once per block_size tokens outside forks.
AppendResult KVCacheManager::Impl::append(const std::vector<Sequence*>& all, AppendSlots form) {
  const std::int32_t bs = block_size();
  const auto layers = static_cast<std::size_t>(num_layers());
  const std::size_t n = all.size();
  const bool per_layer = form == AppendSlots::PerLayer;
  AppendResult result;
  if (per_layer) result.slots.assign(layers, std::vector<std::int32_t>(n));
  result.offsets.resize(n);
  std::vector<std::size_t> general;  // batch indices, ascending
  std::vector<Sequence*> forked;
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& seq = *all[i];
    const std::int32_t offset = seq.num_tokens % bs;
    result.offsets[i] = offset;
    if (!seq.forked && offset != 0) continue;
    general.push_back(i);
    if (seq.forked) forked.push_back(all[i]);
  }
  // The new FP16 blocks, counted exactly (all or nothing): a sequence
  // outside forks opens a block in every layer.
  BlockCounts need = count_fresh(forked);
  need[0] += static_cast<std::int64_t>(general.size() - forked.size()) * num_layers();
  // Every host allocation of the call comes before any block or table
  // changes (the result above, the block ids, slab records, the general
  // path's room), so that std::bad_alloc leaves every sequence as it was.
  const bool any_forked = !forked.empty();
  prepare_blocks(need, "append_tokens", fresh_ids);
  if (!general.empty()) prepare_general(all, general, any_forked, need[0], result);

  // Commit: nothing below allocates or throws.
  take_blocks(need, fresh_ids);
  fill_general(all, general, any_forked, fresh_ids[0], result);

  std::size_t next_general = 0;
  if (per_layer) {
    // Memory-latency bound (a sequence's record, then its tails): both are
    // fetched a few sequences ahead of the one being written.
    constexpr std::size_t kAhead = 8;
    std::int32_t* const* out = slot_rows.data();
    for (std::size_t l = 0; l < layers; ++l) slot_rows[l] = result.slots[l].data();
    for (std::size_t i = 0; i < std::min(n, 2 * kAhead); ++i) __builtin_prefetch(&all[i]->table);
    for (std::size_t i = 0; i < std::min(n, kAhead); ++i) __builtin_prefetch(all[i]->table.fp16_tails().data());
    for (std::size_t i = 0; i < n; ++i) {
      if (i + 2 * kAhead < n) __builtin_prefetch(&all[i + 2 * kAhead]->table);
      if (i + kAhead < n) __builtin_prefetch(all[i + kAhead]->table.fp16_tails().data());
      if (next_general < general.size() && general[next_general] == i) {
        ++next_general;
      } else {
        PageTable& table = all[i]->table;
        table.fill_all_fp16_tails();
        // The offset is the same in every layer (check_invariants holds the
        // fills to it).
        const std::int32_t offset = result.offsets[i];
        const std::int32_t* tails = table.fp16_tails().data();
        for (std::size_t l = 0; l < layers; ++l) out[l][i] = tails[l] * bs + offset;
      }
      ++all[i]->num_tokens;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      if (next_general < general.size() && general[next_general] == i) {
        ++next_general;
      } else {
        all[i]->table.fill_all_fp16_tails();
      }
      ++all[i]->num_tokens;
    }
  }
  return result;
}

BlockCounts KVCacheManager::Impl::count_fresh(const std::vector<Sequence*>& seqs) const {
  Impl& m = const_cast<Impl&>(*this);
  const BlockPool& fp16 = m.pool(Precision::FP16);
  const std::int32_t bs = m.block_size();
  auto needs_block = [&](const PageTable& t, std::int32_t layer, auto&& shared) {
    const auto tail = t.blocks(layer, Precision::FP16);
    return tail.empty() || t.fp16_tail_fill(layer) == bs || shared(tail.back());
  };
  BlockCounts need{};
  if (seqs.empty()) return need;
  boost::unordered_flat_map<std::int32_t, std::int32_t> copied;  // tail block -> holders that left it
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Sequence* seq : seqs) {
      const bool fresh = needs_block(seq->table, layer, [&](std::int32_t block) {
        if (fp16.ref_count(block) <= 1) return false;  // the common case: no map look-up
        std::int32_t& left = copied[block];
        if (fp16.ref_count(block) - left <= 1) return false;
        ++left;
        return true;
      });
      need[0] += fresh ? 1 : 0;
    }
  }
  return need;
}

// The host memory fill_general() needs, so that it allocates nothing: the
// result's changed tails and copy-on-write copies (at most one per fresh
// block), the per-sequence flags, room for one more FP16 block in every
// layer of each sequence on the general path.
void KVCacheManager::Impl::prepare_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general,
                                           bool any_forked, std::int64_t fresh_blocks, AppendResult& result) {
  result.tails_changed.reserve(general.size());
  result.tail_blocks.reserve(general.size() * static_cast<std::size_t>(num_layers()));
  if (any_forked) {
    result.copies.reserve(static_cast<std::size_t>(fresh_blocks));
    tail_changed.assign(general.size(), 0);
  }
  for (const std::size_t i : general) all[i]->table.reserve_fp16_tails();
}

// The general path for the batch indices `general` (prepared by
// prepare_general). Fresh ids are handed out in layer order, then batch
// order, so that the ids a call gives are a fixed function of its input.
void KVCacheManager::Impl::fill_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general,
                                        bool any_forked, const std::vector<std::int32_t>& fresh, AppendResult& result) {
  BlockPool& fp16 = pool(Precision::FP16);
  const std::int32_t bs = block_size();
  const auto layers = static_cast<std::size_t>(num_layers());
  const bool per_layer = !result.slots.empty();
  if (!any_forked) {
    // Every tail is full (or the layer has none): a new block in every
    // layer, the id of (layer l, k-th sequence) at l * general.size() + k.
    std::vector<std::int32_t>& ids = layer_ids;
    for (std::size_t k = 0; k < general.size(); ++k) {
      const std::size_t i = general[k];
      for (std::size_t l = 0; l < layers; ++l) ids[l] = fresh[l * general.size() + k];
      all[i]->table.open_fp16_tails(ids);
      if (per_layer) {
        for (std::size_t l = 0; l < layers; ++l) result.slots[l][i] = ids[l] * bs;
      }
      result.tails_changed.push_back(static_cast<std::int32_t>(i));
      result.tail_blocks.insert(result.tail_blocks.end(), ids.begin(), ids.end());
    }
    return;
  }
  std::vector<std::uint8_t>& changed = tail_changed;
  std::size_t next = 0;
  for (std::int32_t layer = 0; layer < num_layers(); ++layer) {
    for (std::size_t k = 0; k < general.size(); ++k) {
      const std::size_t i = general[k];
      PageTable& table = all[i]->table;
      const auto tail = table.blocks(layer, Precision::FP16);
      std::int32_t slot = 0;
      if (tail.empty() || table.fp16_tail_fill(layer) == bs) {
        const std::int32_t block = fresh[next++];
        table.push_block(layer, Precision::FP16, block, 1);
        slot = block * bs;
        changed[k] = 1;
      } else if (fp16.ref_count(tail.back()) > 1) {
        // Copy-on-write: this holder moves to a private copy of the tail;
        // the others keep the original.
        const std::int32_t src = tail.back();
        const std::int32_t dst = fresh[next++];
        result.copies.push_back({src, dst});
        fp16.release(src);
        table.replace_fp16_tail(layer, dst);
        slot = table.fill_fp16_tail(layer);
        changed[k] = 1;
      } else {
        slot = table.fill_fp16_tail(layer);
      }
      if (per_layer) result.slots[static_cast<std::size_t>(layer)][i] = slot;
    }
  }
  for (std::size_t k = 0; k < general.size(); ++k) {
    if (!changed[k]) continue;
    const auto tails = all[general[k]]->table.fp16_tails();
    result.tails_changed.push_back(static_cast<std::int32_t>(general[k]));
    result.tail_blocks.insert(result.tail_blocks.end(), tails.begin(), tails.end());
  }
}

}  // namespace mixkv
