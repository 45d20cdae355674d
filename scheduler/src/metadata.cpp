// Decode attention metadata in CSR form: the full metadata of a step's
// batch (SchedulerConfig::build_metadata) and one layer's on demand
// (Scheduler::layer_metadata), both read from the current page tables.
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "mixkv/core/errors.h"
#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::at;
using scheduler_detail::Entry;

// Full CSR of the decode batch, from the page tables the entries hold (no
// look-ups): O(blocks of the batch), the part of a step that grows with context.
void Scheduler::Impl::build_metadata(const std::vector<Entry*>& decodes, StepOutput& out) const {
  DecodeMetadata& meta = out.metadata;
  const std::size_t n = decodes.size();
  meta.batch_size = static_cast<std::int32_t>(n);
  meta.layers.resize(static_cast<std::size_t>(num_layers));
  std::vector<const PageTable*> tables;
  tables.reserve(n);
  for (const Entry* e : decodes) tables.push_back(e->table);
  for (std::int32_t layer = 0; layer < num_layers; ++layer) {
    for (const Precision p : kAllPrecisions) {
      PagedPoolTable& t = meta.layers[static_cast<std::size_t>(layer)][at(p)];
      t.indptr.resize(n + 1);
      t.last_block_len.resize(n);
      std::int32_t total = 0;
      t.indptr[0] = 0;
      for (std::size_t i = 0; i < n; ++i) {
        total += static_cast<std::int32_t>(tables[i]->blocks(layer, p).size());
        t.indptr[i + 1] = total;
      }
      t.indices.resize(static_cast<std::size_t>(total));
      for (std::size_t i = 0; i < n; ++i) {
        const auto blocks = tables[i]->blocks(layer, p);
        std::copy(blocks.begin(), blocks.end(), t.indices.begin() + t.indptr[i]);
        const std::int32_t last = p == Precision::FP16 ? tables[i]->fp16_tail_fill(layer) : block_size;
        t.last_block_len[i] = blocks.empty() ? 0 : last;
      }
    }
  }
}

std::array<PagedPoolTable, kNumPrecisions> Scheduler::layer_metadata(std::int32_t layer) const {
  const Impl& s = *impl_;
  if (layer < 0 || layer >= s.num_layers) {
    throw IndexOutOfRange("layer = " + std::to_string(layer) + ", expected 0 <= layer < " +
                          std::to_string(s.num_layers));
  }
  std::array<PagedPoolTable, kNumPrecisions> tables;
  for (const Precision p : kAllPrecisions) {
    PagedPoolTable& t = tables[at(p)];
    t.indptr.push_back(0);
    for (const RequestId id : s.last_decodes) {
      const PageTable& table = s.cache.page_table(id);
      const auto blocks = table.blocks(layer, p);
      t.indices.insert(t.indices.end(), blocks.begin(), blocks.end());
      t.indptr.push_back(static_cast<std::int32_t>(t.indices.size()));
      const std::int32_t last = p == Precision::FP16 ? table.fp16_tail_fill(layer) : s.block_size;
      t.last_block_len.push_back(blocks.empty() ? 0 : last);
    }
  }
  return tables;
}

}  // namespace mixkv
