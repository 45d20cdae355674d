#include "mixkv/core/page_table.h"

#include <algorithm>
#include <string>

#include "mixkv/core/checks.h"
#include "mixkv/core/errors.h"

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
  tails_.assign(static_cast<std::size_t>(num_layers), -1);
  base_fills_.assign(static_cast<std::size_t>(num_layers), 0);
}

bool operator==(const PageTable& a, const PageTable& b) {
  if (a.block_size_ != b.block_size_ || a.layers_ != b.layers_ || a.tails_ != b.tails_) return false;
  for (std::size_t l = 0; l < a.layers_.size(); ++l) {
    if (a.fill_at(l) != b.fill_at(l)) return false;
  }
  return true;
}

const PageTable::Layer& PageTable::layer_at(std::int32_t layer) const {
  detail::require_index("layer", layer, num_layers());
  return layers_[static_cast<std::size_t>(layer)];
}

PageTable::Layer& PageTable::layer_at(std::int32_t layer) {
  detail::require_index("layer", layer, num_layers());
  return layers_[static_cast<std::size_t>(layer)];
}

void PageTable::settle() {
  if (appended_ != 0) {
    for (std::int32_t& base : base_fills_) base += appended_;
    appended_ = 0;
  }
  room_ = kStale;
}

std::int32_t PageTable::compute_room() const {
  std::int32_t room = block_size_;
  for (std::size_t l = 0; l < tails_.size(); ++l) {
    room = std::min(room, tails_[l] < 0 ? 0 : block_size_ - fill_at(l));
  }
  return room;
}

std::int32_t PageTable::fp16_room() const { return room_ == kStale ? compute_room() : room_; }

std::span<const std::int32_t> PageTable::blocks(std::int32_t layer, Precision p) const {
  const Layer& l = layer_at(layer);
  return l.blocks[index_of(p)];
}

std::int32_t PageTable::fp16_tail_fill(std::int32_t layer) const {
  detail::require_index("layer", layer, num_layers());
  return fill_at(static_cast<std::size_t>(layer));
}

std::int64_t PageTable::fp16_tokens(std::int32_t layer) const {
  const Layer& l = layer_at(layer);
  const auto n = static_cast<std::int64_t>(l.blocks[0].size());
  return n == 0 ? 0 : (n - 1) * block_size_ + fill_at(static_cast<std::size_t>(layer));
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
  const auto at = static_cast<std::size_t>(layer);
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
    if (!l.blocks[pool].empty() && fill_at(at) != block_size_) {
      throw InvalidArgument("layer " + std::to_string(layer) + ": the FP16 tail holds " + std::to_string(fill_at(at)) +
                            " of " + std::to_string(block_size_) +
                            " tokens, expected a full tail before a new FP16 block");
    }
    settle();
    base_fills_[at] = fill;
    tails_[at] = block_id;
  }
  l.blocks[pool].push_back(block_id);
}

std::int32_t PageTable::fill_fp16_tail(std::int32_t layer) {
  Layer& l = layer_at(layer);
  const auto at = static_cast<std::size_t>(layer);
  if (l.blocks[0].empty() || fill_at(at) >= block_size_) {
    throw InvalidArgument("layer " + std::to_string(layer) + ": the FP16 tail has no room (" +
                          std::to_string(l.blocks[0].size()) + " FP16 blocks, tail fill " +
                          std::to_string(fill_at(at)) + "), expected a partly filled tail");
  }
  settle();
  return l.blocks[0].back() * block_size_ + base_fills_[at]++;
}

void PageTable::replace_fp16_tail(std::int32_t layer, std::int32_t block_id) {
  Layer& l = layer_at(layer);
  if (l.blocks[0].empty()) {
    throw InvalidArgument("layer " + std::to_string(layer) + " has no FP16 block, expected a tail to replace");
  }
  if (block_id < 0) throw InvalidArgument("block_id = " + std::to_string(block_id) + ", expected >= 0");
  l.blocks[0].back() = block_id;
  tails_[static_cast<std::size_t>(layer)] = block_id;  // the fill (and so the room) stays
}

std::int32_t PageTable::remove_block(std::int32_t layer, Precision p, std::int32_t index) {
  Layer& l = layer_at(layer);
  std::vector<std::int32_t>& list = l.blocks[index_of(p)];
  detail::require_index("index", index, static_cast<std::int64_t>(list.size()));
  const bool tail = static_cast<std::size_t>(index) + 1 == list.size();
  const auto at = static_cast<std::size_t>(layer);
  if (p == Precision::FP16 && tail && fill_at(at) != block_size_) {
    throw InvalidArgument("layer " + std::to_string(layer) + ": FP16 block " + std::to_string(index) + " holds " +
                          std::to_string(fill_at(at)) + " of " + std::to_string(block_size_) +
                          " tokens, expected a full block");
  }
  const std::int32_t block = list[static_cast<std::size_t>(index)];
  list.erase(list.begin() + index);
  // Every FP16 block before the tail is full, so a removed tail leaves a full one.
  if (p == Precision::FP16 && tail) {
    settle();
    base_fills_[at] = list.empty() ? 0 : block_size_;
    tails_[at] = list.empty() ? -1 : list.back();
  }
  return block;
}

void PageTable::reserve(std::int32_t layer, Precision p, std::size_t count) {
  layer_at(layer).blocks[index_of(p)].reserve(count);
}

void PageTable::reserve_fp16_tails() {
  for (Layer& l : layers_) {
    std::vector<std::int32_t>& list = l.blocks[0];
    if (list.size() == list.capacity()) list.reserve(std::max<std::size_t>(4, 2 * list.capacity()));
  }
}

void PageTable::fill_all_fp16_tails() {
  if (room_ == kStale) room_ = compute_room();
  if (room_ == 0) {
    std::size_t full = 0;
    while (tails_[full] >= 0 && fill_at(full) < block_size_) ++full;
    throw InvalidArgument("layer " + std::to_string(full) + ": the FP16 tail has no room (tail fill " +
                          std::to_string(fill_at(full)) + "), expected a partly filled tail in every layer");
  }
  --room_;
  ++appended_;
}

void PageTable::open_fp16_tails(std::span<const std::int32_t> block_ids) {
  const std::size_t layers = tails_.size();
  if (block_ids.size() != layers) {
    throw InvalidArgument("block_ids.size() = " + std::to_string(block_ids.size()) +
                          ", expected num_layers = " + std::to_string(layers));
  }
  for (std::size_t l = 0; l < layers; ++l) {
    if (block_ids[l] < 0) {
      throw InvalidArgument("block_ids[" + std::to_string(l) + "] = " + std::to_string(block_ids[l]) +
                            ", expected >= 0");
    }
    if (tails_[l] >= 0 && fill_at(l) != block_size_) {
      throw InvalidArgument("layer " + std::to_string(l) + ": the FP16 tail holds " + std::to_string(fill_at(l)) +
                            " of " + std::to_string(block_size_) +
                            " tokens, expected a full tail before a new FP16 block");
    }
  }
  for (std::size_t l = 0; l < layers; ++l) {
    layers_[l].blocks[0].push_back(block_ids[l]);
    tails_[l] = block_ids[l];
    base_fills_[l] = 1;
  }
  appended_ = 0;
  room_ = block_size_ - 1;
}

void PageTable::drop_fp16_tokens(std::int32_t count) {
  std::int64_t fewest = count;
  for (std::int32_t layer = 0; layer < num_layers(); ++layer) fewest = std::min(fewest, fp16_tokens(layer));
  if (count < 0 || fewest < count) {
    throw InvalidArgument("count = " + std::to_string(count) + ", expected 0 <= count <= " + std::to_string(fewest) +
                          " (the fewest FP16 tokens of a layer)");
  }
  if (count == 0) return;
  settle();
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    std::vector<std::int32_t>& list = layers_[l].blocks[0];
    const std::int64_t left = fp16_tokens(static_cast<std::int32_t>(l)) - count;
    const std::int64_t keep = (left + block_size_ - 1) / block_size_;
    list.resize(static_cast<std::size_t>(keep));  // shrinking: no allocation
    base_fills_[l] = static_cast<std::int32_t>(left - std::max<std::int64_t>(keep - 1, 0) * block_size_);
    tails_[l] = keep == 0 ? -1 : list.back();
  }
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
