// KVCacheManager: fork, free_sequence, page-list inspection, decode metadata.
#include "manager_impl.h"

#include <vector>

namespace mixkv {

void KVCacheManager::fork(SequenceId parent, SequenceId child) {
  Impl& m = *impl_;
  const Sequence& source = m.resident(parent, "parent");
  if (m.sequences.contains(child)) {
    throw InvalidArgument("child = " + std::to_string(child) +
                          " is already a sequence of this cache, expected a new id");
  }
  // Prepare (host memory: the copy, the handle, the map node), then commit.
  Sequence copy = source;
  copy.forked = true;
  m.reserve_handle();
  Sequence& added = m.sequences.emplace(child, std::move(copy)).first->second;  // inserts or changes nothing
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      for (const std::int32_t block : added.table.blocks(layer, p)) m.pool(p).retain(block);
    }
  }
  const_cast<Sequence&>(source).forked = true;
  m.register_handle(added);
}

void KVCacheManager::free_sequence(SequenceId id) {
  Impl& m = *impl_;
  const auto it = m.sequences.find(id);
  if (it == m.sequences.end()) {
    throw UnknownId("id = " + std::to_string(id) + " is not a sequence of this cache");
  }
  const PageTable& table = it->second.table;
  // In reverse, so the LIFO free lists hand the blocks out again in the
  // order this sequence took them.
  for (std::int32_t layer = m.num_layers(); layer-- > 0;) {
    for (const Precision p : {Precision::INT2, Precision::INT4, Precision::FP16}) {
      const auto blocks = table.blocks(layer, p);
      for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) {
        if (it->second.swapped) {
          SwapPool& sp = m.swap[at(p)];
          sp.used[static_cast<std::size_t>(*b)] = 0;
          sp.free.push_back(*b);
        } else if (!m.pool(p).release(*b)) {
          m.holders_changed(p, *b);  // perhaps the prefix index's alone now
        }
      }
    }
  }
  m.release_handle(it->second);
  m.sequences.erase(it);
}

std::span<const std::int32_t> KVCacheManager::blocks(SequenceId id, std::int32_t layer, Precision p) const {
  const Sequence& seq = impl_->resident(id, "id");
  impl_->require_layer(layer);
  require_precision(p, "p");
  return seq.table.blocks(layer, p);
}

std::int32_t KVCacheManager::window_block(SequenceId id, std::int32_t layer, std::int32_t window) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.resident(id, "id");
  m.require_layer(layer);
  require_index("window", window, seq.prompt->plan.num_windows());
  std::int64_t rank = 0;
  const std::int32_t index = m.block_index(*seq.prompt, layer, window, rank);
  if (index < 0) return -1;
  return seq.table.blocks(layer, seq.prompt->plan.at(layer, window))[static_cast<std::size_t>(index)];
}

std::int32_t KVCacheManager::fp16_tail_fill(SequenceId id, std::int32_t layer) const {
  const Sequence& seq = impl_->resident(id, "id");
  impl_->require_layer(layer);
  return seq.table.fp16_tail_fill(layer);
}

std::int32_t KVCacheManager::ref_count(Precision p, std::int32_t block_id) const {
  require_precision(p, "p");
  return impl_->pool(p).ref_count(block_id);
}

DecodeMetadata KVCacheManager::decode_metadata(std::span<const SequenceId> ids) const {
  const Impl& m = *impl_;
  const std::vector<const Sequence*> seqs = m.require_ids(ids);

  DecodeMetadata meta;
  meta.batch_size = static_cast<std::int32_t>(ids.size());
  meta.layers.resize(static_cast<std::size_t>(m.num_layers()));
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      PagedPoolTable& t = meta.layers[static_cast<std::size_t>(layer)][at(p)];
      t.indptr.reserve(seqs.size() + 1);
      t.last_block_len.reserve(seqs.size());
      t.indptr.push_back(0);
      for (const Sequence* seq : seqs) {
        const auto blocks = seq->table.blocks(layer, p);
        t.indices.insert(t.indices.end(), blocks.begin(), blocks.end());
        t.indptr.push_back(static_cast<std::int32_t>(t.indices.size()));
        const std::int32_t last = p == Precision::FP16 ? seq->table.fp16_tail_fill(layer) : m.block_size();
        t.last_block_len.push_back(blocks.empty() ? 0 : last);
      }
    }
  }
  return meta;
}

const PageTable& KVCacheManager::page_table(SequenceId id) const { return impl_->resident(id, "id").table; }

BlockCounts KVCacheManager::blocks_held(SequenceId id) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.find(id, "id");
  BlockCounts held{};
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions)
      held[at(p)] += static_cast<std::int64_t>(seq.table.blocks(layer, p).size());
  }
  return held;
}

}  // namespace mixkv
