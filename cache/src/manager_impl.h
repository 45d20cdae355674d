#pragma once
// The manager's state, shared by its translation units (private header:
// cache/src only, and the tests' corruption hook).
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <boost/unordered_map.hpp>

#include "mixkv/cache/arena.h"
#include "mixkv/cache/block_pool.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/checks.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/page_table.h"
#include "prefix_index.h"

namespace mixkv {
namespace detail {

inline std::size_t at(Precision p) { return static_cast<std::size_t>(pool_index(p)); }

inline void require_slots_form(AppendSlots form) {
  if (form != AppendSlots::PerLayer && form != AppendSlots::Compact) {
    throw InvalidArgument("form = " + std::to_string(static_cast<int>(form)) +
                          ", expected AppendSlots::PerLayer (0) or AppendSlots::Compact (1)");
  }
}

inline std::string counts_text(const BlockCounts& counts) {
  return "FP16 " + std::to_string(counts[0]) + ", INT4 " + std::to_string(counts[1]) + ", INT2 " +
         std::to_string(counts[2]);
}

// A prompt is shared by forks; only demotion changes it (its plan), on a
// private copy.
struct Prompt {
  TokenLayout layout;
  PrecisionPlan plan;
};

// The stream blocks of one layer that age tiers demoted: the precision of
// blocks [0, blocks.size()) (later ones FP16) and how many are at each
// precision below FP16 (counts[pool_index]), so that a block's list position
// costs O(blocks after it), O(1) for the newest.
struct AgedStream {
  std::vector<Precision> blocks;
  std::array<std::int32_t, kNumPrecisions> counts{};
};

struct Sequence {
  std::shared_ptr<Prompt> prompt;
  std::int32_t num_tokens = 0;
  PageTable table;  // device block ids, or host swap slots while swapped
  bool swapped = false;
  // Age tiers: the precision of each full block of the FP16 stream (the
  // tokens outside visual windows: text, visual tails, generated tokens, in
  // order) that demote() moved, [layer][k]; a block past its layer's list,
  // and every block of a sequence with an empty list, is FP16. Per sequence,
  // not per prompt: forks copy it, and generated tokens are no prompt's.
  std::vector<AgedStream> aged{};  // [layer]
  // Set on both sides of a fork: only such sequences can share blocks, so
  // the others append without looking at ref counts.
  bool forked = false;
  // Prefix caching: rows [0, publish_rows) may be published. Under content
  // identity a hit that shared a window below FP16 ends it at the hit: the
  // rows after read quantized keys, so their K/V is not the content's.
  std::int32_t publish_rows = std::numeric_limits<std::int32_t>::max();
  SequenceHandle handle{};
  // Batch validation (require_ids) marks each sequence it has seen with the
  // batch's epoch, instead of hashing the ids a second time; demote() marks
  // the first listing of each sequence the same way.
  mutable std::uint64_t seen_epoch = 0;
  mutable std::size_t seen_index = 0;
};

// Host swap slots of one pool: a stack of free slots (slot 0 on top when
// fresh) and a used flag per slot.
struct SwapPool {
  std::vector<std::int32_t> free;
  std::vector<std::uint8_t> used;
};

// Block ids per pool, indexed by pool_index().
using BlockIds = std::array<std::vector<std::int32_t>, kNumPrecisions>;

// Capacity for `size` elements, doubling: for vectors that grow by one
// element per call, reserved ahead of the change that adds it.
template <typename T>
void reserve_geometric(std::vector<T>& v, std::size_t size) {
  if (v.capacity() < size) v.reserve(std::max(size, 2 * v.capacity()));
}

// What a pool can give: its free blocks, its empty slabs, blocks a slab.
struct Supply {
  std::int64_t free = 0;
  std::int64_t empty = 0;
  std::int64_t per_slab = 1;
};
using Supplies = std::array<Supply, kNumPrecisions>;

// A match against the prefix index with what add_sequence needs besides
// the summary: per layer and pool, the block at each list position that the
// sequence shares (-1: a fresh one), each list at its final size.
struct PrefixShares {
  PrefixMatch match;
  std::vector<BlockIds> lists;  // [layer][pool_index][position]; empty: no block shared
  std::int32_t publish_rows = std::numeric_limits<std::int32_t>::max();  // Sequence::publish_rows
};

}  // namespace detail

using detail::at;
using detail::BlockIds;
using detail::counts_text;
using detail::PrefixIndex;
using detail::PrefixNode;
using detail::PrefixShares;
using detail::Prompt;
using detail::require_index;
using detail::require_precision;
using detail::require_slots_form;
using detail::reserve_geometric;
using detail::Sequence;
using detail::Supplies;
using detail::SwapPool;

struct KVCacheManager::Impl {
  CacheConfig config;
  Arena arena;
  std::array<std::unique_ptr<BlockPool>, kNumPrecisions> pools;
  // Node-based (Boost 1.81 has no unordered_node_map): a sequence's address,
  // and so page_table(), stays valid while other sequences come and go.
  boost::unordered_map<SequenceId, Sequence> sequences;
  std::array<SwapPool, kNumPrecisions> swap;
  mutable std::uint64_t epoch = 0;
  // Handle registry: index -> sequence (null when free), with generations.
  // free_handles has room for every handle (reserve_handle), so that
  // free_sequence allocates nothing.
  std::vector<Sequence*> handles;
  std::vector<std::uint32_t> generations;
  std::vector<std::int32_t> free_handles;

  // append_tokens' scratch, kept between calls so that a decode step at a
  // block boundary allocates nothing for it: the fresh block ids, one
  // sequence's new tails ([layer], sized in the constructor), the sequences
  // of the general path whose tail changed, and the rows of PerLayer slots
  // ([layer], sized in the constructor).
  BlockIds fresh_ids;
  std::vector<std::int32_t> layer_ids;
  std::vector<std::uint8_t> tail_changed;
  std::vector<std::int32_t*> slot_rows;

  // Prefix caching (manager_prefix.cpp): null when off.
  std::unique_ptr<PrefixIndex> index;
  std::int64_t prefix_hits = 0;
  std::int64_t prefix_hit_rows = 0;
  std::int64_t prefix_published = 0;
  BlockCounts prefix_shared{};

  void reserve_handle();
  void register_handle(Sequence& seq);
  void release_handle(const Sequence& seq);
  AppendResult append(const std::vector<Sequence*>& all, AppendSlots form);
  BlockCounts count_fresh(const std::vector<Sequence*>& seqs) const;
  // Speculative decoding (manager_speculative.cpp): counts[i] tokens for
  // all[i]; and truncation of each seqs[s] to targets[s] tokens (validated).
  AppendResult append_rows(const std::vector<Sequence*>& all, std::span<const std::int32_t> counts, AppendSlots form);
  void drop_tokens(std::span<Sequence* const> seqs, std::span<const std::int32_t> targets);
  void prepare_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general, bool any_forked,
                       std::int64_t fresh_blocks, AppendResult& result);
  void fill_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general, bool any_forked,
                    const std::vector<std::int32_t>& fresh, AppendResult& result);

  explicit Impl(const CacheConfig& c);

  std::int32_t num_layers() const { return config.shape.num_layers; }
  std::int32_t block_size() const { return config.shape.block_size; }
  BlockPool& pool(Precision p) { return *pools[at(p)]; }
  const BlockPool& pool(Precision p) const { return *pools[at(p)]; }

  const Sequence& find(SequenceId id, const char* name) const;
  Sequence& find(SequenceId id, const char* name) { return const_cast<Sequence&>(std::as_const(*this).find(id, name)); }
  // Validates a batch of distinct, device-resident ids; returns the sequences.
  std::vector<const Sequence*> require_ids(std::span<const SequenceId> ids) const;
  const Sequence& resident(SequenceId id, const char* name) const;
  Sequence& resident(SequenceId id, const char* name) {
    return const_cast<Sequence&>(std::as_const(*this).resident(id, name));
  }
  std::int64_t fp16_rank(const Prompt& prompt, std::int32_t layer, std::int32_t window) const;
  std::int32_t block_index(const Prompt& prompt, std::int32_t layer, std::int32_t window, std::int64_t& rank) const;
  std::optional<std::string> why_not(const Sequence& seq, std::int32_t layer, std::int32_t window, Precision target,
                                     bool leave_shared) const;
  // Age tiers (manager_stream.cpp): full blocks of the FP16 stream, one
  // block's precision, why it cannot move to `target`, its position in pool
  // p's list of `layer`, demoted blocks in pool p, and whether any stream
  // block left FP16.
  std::int32_t stream_blocks(const Sequence& seq) const;
  static Precision stream_precision(const Sequence& seq, std::int32_t layer, std::int32_t block);
  std::optional<std::string> why_not_stream(const Sequence& seq, std::int32_t layer, std::int32_t block,
                                            Precision target) const;
  std::int32_t stream_index(const Sequence& seq, std::int32_t layer, std::int32_t block, Precision p) const;
  static std::int64_t aged_blocks(const Sequence& seq, std::int32_t layer, Precision p);
  static bool has_aged(const Sequence& seq);
  void require_layer(std::int32_t layer) const { require_index("layer", layer, num_layers()); }
  void require_prompt(const TokenLayout& layout, const PrecisionPlan& plan) const;
  void require_wanted(const PrecisionPlan& plan, const PrecisionPlan& wanted) const;
  BlockCounts prompt_demand(const TokenLayout& layout, const PrecisionPlan& plan) const;
  // add_sequence, sharing shares->lists' blocks when given.
  void add(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan, const PrefixShares* shares);

  // Prefix caching (manager_prefix.cpp): the prompt's match with the shared
  // blocks' places; after a sequence retained or released `block`, the
  // index's view of it.
  // `wanted` chooses the copies of shared windows under content identity
  // (KVCacheManager::match_prefix); `plan` stores the rest.
  PrefixShares match(const TokenLayout& layout, const PrecisionPlan& plan, std::span<const TokenKey> keys,
                     const PrecisionPlan& wanted) const;
  void holders_changed(Precision p, std::int32_t block) {
    if (index) index->holders_changed(p, block);
  }

  // Why `need` cannot be allocated now (after `match` takes its shared
  // blocks), or nullopt; counts what eviction would free.
  std::optional<std::string> shortfall(const BlockCounts& need, const PrefixMatch* match = nullptr) const;
  Supplies supplies() const;
  void prepare_blocks(const BlockCounts& need, const std::string& what, BlockIds& ids,
                      const PrefixMatch* match = nullptr);
  // Evicts cached blocks (least recently released first) until `need`
  // fits without eviction, then takes it.
  void take_blocks(const BlockCounts& need, BlockIds& ids);
  void grow(Precision p);
  // check_invariants() for the handle registry as a whole.
  void check_handles() const;
};

}  // namespace mixkv
