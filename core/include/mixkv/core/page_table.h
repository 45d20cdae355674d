#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "mixkv/core/precision.h"

namespace mixkv {

namespace detail {
struct ManagerTestAccess;  // test-only access to the bookkeeping (tests/cache/manager_test_access.h)
}  // namespace detail

// The page lists of one sequence: per layer, the block ids it holds in each
// pool, in order, plus how many tokens the layer's last FP16 block holds.
//
// Quantized blocks always hold one full window. FP16 tokens (text, visual
// tails, FP16 windows, generated tokens) are packed densely in prompt order,
// so only the last FP16 block of a layer can be partly filled: the k-th FP16
// token of a layer sits in FP16 block k / block_size at offset k % block_size.
// The table holds ids only; the ref counts that let forked sequences share
// blocks are the pools' (block_pool.h).
class PageTable {
 public:
  // InvalidArgument naming num_layers (< 1) or block_size (< 1).
  PageTable(std::int32_t num_layers, std::int32_t block_size);

  std::int32_t num_layers() const { return static_cast<std::int32_t>(layers_.size()); }
  std::int32_t block_size() const { return block_size_; }

  // IndexOutOfRange names "layer"; InvalidArgument names "p".
  std::span<const std::int32_t> blocks(std::int32_t layer, Precision p) const;
  // Tokens in the last FP16 block: 1..block_size, or 0 with no FP16 block.
  std::int32_t fp16_tail_fill(std::int32_t layer) const;
  // The FP16 tail block of every layer ([layer], -1 without FP16 blocks),
  // contiguous: what an engine mirrors to place decode tokens (slot =
  // tail * block_size + offset).
  std::span<const std::int32_t> fp16_tails() const { return tails_; }
  // Tokens every layer's FP16 tail can still take: the minimum over layers
  // of block_size - fill, 0 when some layer has no FP16 block.
  std::int32_t fp16_room() const;
  // FP16 tokens of the layer: (FP16 blocks - 1) * block_size + tail fill.
  std::int64_t fp16_tokens(std::int32_t layer) const;
  // FP16 slot (block_id * block_size + offset) of the layer's k-th FP16
  // token. IndexOutOfRange names "k" outside [0, fp16_tokens(layer)).
  std::int32_t fp16_slot(std::int32_t layer, std::int64_t k) const;

  // Appends one block of pool p. For FP16 the new block becomes the tail and
  // holds `fill` tokens (1..block_size, InvalidArgument naming fill); the
  // previous tail must be full (InvalidArgument), which keeps the packing.
  // For quantized pools fill must be block_size (one whole window).
  void push_block(std::int32_t layer, Precision p, std::int32_t block_id, std::int32_t fill);
  // Adds one token to a tail that has room; returns its FP16 slot.
  // InvalidArgument when the layer has no FP16 block or the tail is full.
  std::int32_t fill_fp16_tail(std::int32_t layer);
  // Swaps the tail block for `block_id` (copy-on-write); fill is kept.
  // InvalidArgument when the layer has no FP16 block.
  void replace_fp16_tail(std::int32_t layer, std::int32_t block_id);
  // Demotion: removes the index-th block of pool p and returns its id. An
  // FP16 block must be full (FP16 tokens after it move down one block, still
  // densely packed); when it was the tail, the block before it (full)
  // becomes the tail. InvalidArgument for a partly filled FP16 block;
  // IndexOutOfRange names "index".
  std::int32_t remove_block(std::int32_t layer, Precision p, std::int32_t index);
  // Inserts a quantized block (one whole window) at position `index` of
  // pool p's list (0..size). InvalidArgument for FP16 or a negative id;
  // IndexOutOfRange names "index".
  void insert_block(std::int32_t layer, Precision p, std::int32_t index, std::int32_t block_id);

  // Decode fast path: one token into the FP16 tail of every layer, O(1):
  // the fills are kept as a per-layer base plus one count of tokens added
  // to every layer, and fp16_room() is cached. All or nothing:
  // InvalidArgument (nothing changed) unless fp16_room() > 0.
  void fill_all_fp16_tails();
  // Opens a new FP16 tail holding one token in every layer: block_ids[l]
  // for layer l. All or nothing: InvalidArgument unless block_ids.size() ==
  // num_layers(), every id is >= 0 and every layer's tail is full or absent.
  void open_fp16_tails(std::span<const std::int32_t> block_ids);

  // Speculative decoding: removes the last `count` FP16 tokens of every
  // layer (decode tokens are the last FP16 tokens of each layer), dropping
  // the blocks left empty from the lists; the caller reads their ids first
  // to release them. Allocates nothing. All or nothing: InvalidArgument
  // naming count unless 0 <= count <= fp16_tokens(layer) in every layer.
  void drop_fp16_tokens(std::int32_t count);

  // Capacity only, for callers that must change the table without failing
  // after they have taken blocks (the manager's calls give the strong
  // guarantee under std::bad_alloc too): these may throw std::bad_alloc and
  // change nothing else; the changes they prepare then allocate nothing.
  //
  // Room for `count` blocks in all in pool p's list of `layer` (push_block,
  // insert_block). IndexOutOfRange names "layer"; InvalidArgument names "p".
  void reserve(std::int32_t layer, Precision p, std::size_t count);
  // Room for one more FP16 block in every layer (push_block or
  // open_fp16_tails at a block boundary), growing geometrically so that a
  // decode loop reallocates a list once per doubling, not once per block.
  void reserve_fp16_tails();

  // Equal page lists and fills (however the fills are stored).
  friend bool operator==(const PageTable& a, const PageTable& b);
  friend struct detail::ManagerTestAccess;

 private:
  struct Layer {
    std::array<std::vector<std::int32_t>, kNumPrecisions> blocks;  // [pool_index]
    friend bool operator==(const Layer&, const Layer&) = default;
  };
  const Layer& layer_at(std::int32_t layer) const;
  Layer& layer_at(std::int32_t layer);

  // Before a change to one layer: folds appended_ into the per-layer bases.
  void settle();
  std::int32_t fill_at(std::size_t layer) const { return base_fills_[layer] + appended_; }
  std::int32_t compute_room() const;

  static constexpr std::int32_t kStale = -1;

  std::int32_t block_size_ = 0;
  std::vector<Layer> layers_;
  // Per layer, contiguous: the FP16 tail's block id (-1 without) and the
  // base of its fill: fill = base + appended_ (0 without FP16 blocks).
  std::vector<std::int32_t> tails_;
  std::vector<std::int32_t> base_fills_;
  // Tokens fill_all_fp16_tails() added to every layer since the last change
  // to a single layer: a decode token touches this count, not 2 x layers
  // entries.
  std::int32_t appended_ = 0;
  // fp16_room(), or kStale after a change to a single layer (computed again
  // by the next fill_all_fp16_tails(), once for the block_size tokens after
  // a boundary).
  std::int32_t room_ = 0;
};

}  // namespace mixkv
