// Page lists of a prompt prefix: the cached part of a prefill chunk.
#include "mixkv/cache/prefix_tables.h"

#include <string>
#include <unordered_map>
#include <vector>

#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

void check_rows(const KVCacheManager& cache, std::span<const SequenceId> ids, std::span<const std::int32_t> rows) {
  if (rows.size() != ids.size()) {
    throw InvalidArgument("rows: " + std::to_string(rows.size()) + " entries, expected one per id (" +
                          std::to_string(ids.size()) + ")");
  }
  const std::int32_t bs = cache.config().shape.block_size;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const TokenLayout& layout = cache.layout(ids[i]);
    const std::string name = "rows[" + std::to_string(i) + "]";
    if (rows[i] < 0 || rows[i] > layout.num_tokens()) {
      throw InvalidArgument(name + " = " + std::to_string(rows[i]) +
                            ", expected 0 <= rows <= " + std::to_string(layout.num_tokens()) +
                            " (the prompt of sequence " + std::to_string(ids[i]) + ")");
    }
    for (const std::int32_t start : layout.window_starts(bs)) {
      if (rows[i] > start && rows[i] < start + bs) {
        throw InvalidArgument(name + " = " + std::to_string(rows[i]) + " lies inside the visual window at rows [" +
                              std::to_string(start) + ", " + std::to_string(start + bs) +
                              "): a prefix ends on a window boundary");
      }
    }
  }
}

// One (sequence, layer): appends its prefix lists to the three tables.
void append_prefix(const KVCacheManager& cache, SequenceId id, std::int32_t layer, std::int32_t rows,
                   std::array<PagedPoolTable, kNumPrecisions>& tables) {
  const std::int32_t bs = cache.config().shape.block_size;
  const StoreMapping mapping = cache.prefill_mapping(id, layer);

  // FP16: the prefix's tokens per block of the layer's FP16 list.
  const auto fp16 = cache.blocks(id, layer, Precision::FP16);
  std::unordered_map<std::int32_t, std::size_t> position;
  position.reserve(fp16.size());
  for (std::size_t j = 0; j < fp16.size(); ++j) position.emplace(fp16[j], j);
  std::vector<std::int32_t> fill(fp16.size(), 0);
  for (std::int32_t r = 0; r < rows; ++r) {
    const std::int32_t slot = mapping.fp16_slots[static_cast<std::size_t>(r)];
    if (slot >= 0) ++fill[position.at(slot / bs)];
  }
  PagedPoolTable& f = tables[pool_index(Precision::FP16)];
  std::int32_t last = 0;
  for (std::size_t j = 0; j < fp16.size(); ++j) {
    if (fill[j] == 0) continue;
    // Dense lists are what the attention ops read: only the last block may
    // be partial. The manager's packing guarantees it at window boundaries.
    if (last != 0 && last != bs) {
      throw InvariantViolation("prefix of sequence " + std::to_string(id) + " layer " + std::to_string(layer) +
                               ": a partly covered FP16 block is not the last");
    }
    f.indices.push_back(fp16[j]);
    last = fill[j];
  }
  f.last_block_len.push_back(last);
  f.indptr.push_back(static_cast<std::int32_t>(f.indices.size()));

  for (const Precision p : {Precision::INT4, Precision::INT2}) {
    PagedPoolTable& t = tables[pool_index(p)];
    for (const WindowSlot& w : p == Precision::INT4 ? mapping.int4_windows : mapping.int2_windows) {
      if (w.first_row + bs <= rows) t.indices.push_back(w.block_id);
    }
    t.last_block_len.push_back(t.indptr.back() == static_cast<std::int32_t>(t.indices.size()) ? 0 : bs);
    t.indptr.push_back(static_cast<std::int32_t>(t.indices.size()));
  }
}

}  // namespace

DecodeMetadata prefix_metadata(const KVCacheManager& cache, std::span<const SequenceId> ids,
                               std::span<const std::int32_t> rows) {
  check_rows(cache, ids, rows);
  DecodeMetadata metadata;
  metadata.batch_size = static_cast<std::int32_t>(ids.size());
  metadata.layers.resize(static_cast<std::size_t>(cache.config().shape.num_layers));
  for (std::size_t layer = 0; layer < metadata.layers.size(); ++layer) {
    auto& tables = metadata.layers[layer];
    for (PagedPoolTable& t : tables) {
      t.indptr.assign(1, 0);
      t.last_block_len.reserve(ids.size());
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      append_prefix(cache, ids[i], static_cast<std::int32_t>(layer), rows[i], tables);
    }
  }
  return metadata;
}

}  // namespace mixkv
