#include "mixkv/cache/page_table.h"

#include <string>

#include "checks.h"
#include "mixkv/cache/errors.h"

namespace mixkv {
namespace {

std::size_t index_of(Precision p) {
  detail::require_precision(p, "p");
  return static_cast<std::size_t>(pool_index(p));
}

}  // namespace

PageTable::PageTable(std::int32_t num_layers, std::int32_t block_size) : block_size_(block_size) {
  if (num_layers < 1) throw InvalidArgument("num_layers = " + std::to_string(num_layers) + ", expected >= 1");
  if (block_size < 1) throw InvalidArgument("block_size = " + std::to_string(block_size) + ", expected >= 1");
  layers_.resize(static_cast<std::size_t>(num_layers));
  fills_.assign(static_cast<std::size_t>(num_layers), 0);
  tails_.assign(static_cast<std::size_t>(num_layers), -1);
}

const PageTable::Layer& PageTable::layer_at(std::int32_t layer) const {
  detail::require_index("layer", layer, num_layers());
  return layers_[static_cast<std::size_t>(layer)];
}

PageTable::Layer& PageTable::layer_at(std::int32_t layer) {
  detail::require_index("layer", layer, num_layers());
  return layers_[static_cast<std::size_t>(layer)];
}

std::span<const std::int32_t> PageTable::blocks(std::int32_t layer, Precision p) const {
  const Layer& l = layer_at(layer);
  return l.blocks[index_of(p)];
}

std::int32_t PageTable::fp16_tail_fill(std::int32_t layer) const {
  detail::require_index("layer", layer, num_layers());
  return fills_[static_cast<std::size_t>(layer)];
}

std::int64_t PageTable::fp16_tokens(std::int32_t layer) const {
  const Layer& l = layer_at(layer);
  const auto n = static_cast<std::int64_t>(l.blocks[0].size());
  return n == 0 ? 0 : (n - 1) * block_size_ + fills_[static_cast<std::size_t>(layer)];
}

std::int32_t PageTable::fp16_slot(std::int32_t layer, std::int64_t k) const {
  detail::require_index("k", k, fp16_tokens(layer));
  const Layer& l = layers_[static_cast<std::size_t>(layer)];
  const std::int32_t block = l.blocks[0][static_cast<std::size_t>(k / block_size_)];
  return block * block_size_ + static_cast<std::int32_t>(k % block_size_);
}

void PageTable::push_block(std::int32_t layer, Precision p, std::int32_t block_id, std::int32_t fill) {
  Layer& l = layer_at(layer);
  const std::size_t pool = index_of(p);
  if (block_id < 0) throw InvalidArgument("block_id = " + std::to_string(block_id) + ", expected >= 0");
  if (is_quantized(p)) {
    if (fill != block_size_) {
      throw InvalidArgument("fill = " + std::to_string(fill) + " for a quantized block, expected block_size " +
                            std::to_string(block_size_) + " (one whole window)");
    }
  } else {
    if (fill < 1 || fill > block_size_) {
      throw InvalidArgument("fill = " + std::to_string(fill) +
                            ", expected 1 <= fill <= " + std::to_string(block_size_));
    }
    if (!l.blocks[pool].empty() && fills_[static_cast<std::size_t>(layer)] != block_size_) {
      throw InvalidArgument("layer " + std::to_string(layer) + ": the FP16 tail holds " +
                            std::to_string(fills_[static_cast<std::size_t>(layer)]) + " of " +
                            std::to_string(block_size_) + " tokens, expected a full tail before a new FP16 block");
    }
    fills_[static_cast<std::size_t>(layer)] = fill;
    tails_[static_cast<std::size_t>(layer)] = block_id;
  }
  l.blocks[pool].push_back(block_id);
}

std::int32_t PageTable::fill_fp16_tail(std::int32_t layer) {
  Layer& l = layer_at(layer);
  std::int32_t& fill = fills_[static_cast<std::size_t>(layer)];
  if (l.blocks[0].empty() || fill >= block_size_) {
    throw InvalidArgument("layer " + std::to_string(layer) + ": the FP16 tail has no room (" +
                          std::to_string(l.blocks[0].size()) + " FP16 blocks, tail fill " + std::to_string(fill) +
                          "), expected a partly filled tail");
  }
  return l.blocks[0].back() * block_size_ + fill++;
}

void PageTable::replace_fp16_tail(std::int32_t layer, std::int32_t block_id) {
  Layer& l = layer_at(layer);
  if (l.blocks[0].empty()) {
    throw InvalidArgument("layer " + std::to_string(layer) + " has no FP16 block, expected a tail to replace");
  }
  if (block_id < 0) throw InvalidArgument("block_id = " + std::to_string(block_id) + ", expected >= 0");
  l.blocks[0].back() = block_id;
  tails_[static_cast<std::size_t>(layer)] = block_id;
}

std::int32_t PageTable::remove_block(std::int32_t layer, Precision p, std::int32_t index) {
  Layer& l = layer_at(layer);
  std::vector<std::int32_t>& list = l.blocks[index_of(p)];
  detail::require_index("index", index, static_cast<std::int64_t>(list.size()));
  const bool tail = static_cast<std::size_t>(index) + 1 == list.size();
  const auto at = static_cast<std::size_t>(layer);
  if (p == Precision::FP16 && tail && fills_[at] != block_size_) {
    throw InvalidArgument("layer " + std::to_string(layer) + ": FP16 block " + std::to_string(index) + " holds " +
                          std::to_string(fills_[at]) + " of " + std::to_string(block_size_) +
                          " tokens, expected a full block");
  }
  const std::int32_t block = list[static_cast<std::size_t>(index)];
  list.erase(list.begin() + index);
  // Every FP16 block before the tail is full, so a removed tail leaves a full one.
  if (p == Precision::FP16 && tail) {
    fills_[at] = list.empty() ? 0 : block_size_;
    tails_[at] = list.empty() ? -1 : list.back();
  }
  return block;
}

void PageTable::fill_all_fp16_tails(std::span<std::int32_t* const> layer_slots, std::size_t i) {
  if (layer_slots.size() != fills_.size()) {
    throw InvalidArgument("layer_slots.size() = " + std::to_string(layer_slots.size()) + ", expected num_layers = " +
                          std::to_string(fills_.size()));
  }
  const std::size_t layers = fills_.size();
  for (std::size_t l = 0; l < layers; ++l) {
    if (tails_[l] < 0 || fills_[l] >= block_size_) {
      throw InvalidArgument("layer " + std::to_string(l) + ": the FP16 tail has no room (tail fill " +
                            std::to_string(fills_[l]) + "), expected a partly filled tail in every layer");
    }
  }
  for (std::size_t l = 0; l < layers; ++l) layer_slots[l][i] = tails_[l] * block_size_ + fills_[l]++;
}

void PageTable::insert_block(std::int32_t layer, Precision p, std::int32_t index, std::int32_t block_id) {
  Layer& l = layer_at(layer);
  if (!is_quantized(p)) {
    throw InvalidArgument("p = FP16: insert_block takes INT4 or INT2 blocks (FP16 tokens stay densely packed)");
  }
  std::vector<std::int32_t>& list = l.blocks[index_of(p)];
  detail::require_index("index", index, static_cast<std::int64_t>(list.size()) + 1);
  if (block_id < 0) throw InvalidArgument("block_id = " + std::to_string(block_id) + ", expected >= 0");
  list.insert(list.begin() + index, block_id);
}

}  // namespace mixkv
