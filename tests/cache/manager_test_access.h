#pragma once
// Test-only access to the bookkeeping of KVCacheManager, Arena and BlockPool
// (each names detail::ManagerTestAccess a friend), so that a test can break
// exactly one structure and expect check_invariants() to notice. Nothing
// here is part of the library.
#include <array>
#include <cstdint>
#include <vector>

#include <boost/intrusive/circular_list_algorithms.hpp>
#include <boost/intrusive/detail/list_node.hpp>

#include "manager_impl.h"

namespace mixkv {
namespace test {

// Raw links of an intrusive list node, for corruptions the list's own API
// refuses to make.
using ListNode = boost::intrusive::list_node<void*>;
using ListAlgo = boost::intrusive::circular_list_algorithms<boost::intrusive::list_node_traits<void*>>;

}  // namespace test

namespace detail {

struct ManagerTestAccess {
  // --- KVCacheManager ---
  static KVCacheManager::Impl& impl(KVCacheManager& m) { return *m.impl_; }
  static Arena& arena(KVCacheManager& m) { return m.impl_->arena; }
  static BlockPool& pool(KVCacheManager& m, Precision p) { return *m.impl_->pools[at(p)]; }
  static Sequence& sequence(KVCacheManager& m, SequenceId id) { return m.impl_->sequences.at(id); }
  static PageTable& table(KVCacheManager& m, SequenceId id) { return sequence(m, id).table; }
  static SwapPool& swap(KVCacheManager& m, Precision p) { return m.impl_->swap[at(p)]; }
  static std::vector<Sequence*>& handles(KVCacheManager& m) { return m.impl_->handles; }
  static std::vector<std::uint32_t>& generations(KVCacheManager& m) { return m.impl_->generations; }
  static std::vector<std::int32_t>& free_handles(KVCacheManager& m) { return m.impl_->free_handles; }

  // --- PageTable ---
  // The fill of each layer's FP16 tail, without the tokens appended to every
  // layer since the last single-layer change (0 after add_sequence).
  static std::vector<std::int32_t>& base_fills(PageTable& t) { return t.base_fills_; }
  static std::vector<std::int32_t>& tails(PageTable& t) { return t.tails_; }
  static std::int32_t& cached_room(PageTable& t) { return t.room_; }

  // --- Arena ---
  static std::vector<std::int8_t>& owners(Arena& a) { return a.owners_; }
  static std::vector<std::int32_t>& free_slabs(Arena& a) { return a.free_; }
  static std::array<std::int32_t, kNumPrecisions>& owned(Arena& a) { return a.owned_; }

  // --- BlockPool ---
  static auto& slab(BlockPool& b, std::int32_t slab) { return *b.slabs_[static_cast<std::size_t>(slab)]; }
  static auto& block(BlockPool& b, std::int32_t id) {
    return slab(b, id / b.blocks_per_slab_).blocks[static_cast<std::size_t>(id % b.blocks_per_slab_)];
  }
  static auto& partial(BlockPool& b) { return b.partial_; }
  static auto& empty(BlockPool& b) { return b.empty_; }
  static std::int64_t& free_count(BlockPool& b) { return b.free_blocks_; }
  static std::int32_t& slab_count(BlockPool& b) { return b.num_slabs_; }
  static auto& reserved(BlockPool& b) { return b.reserved_records_; }

  // --- PrefixIndex ---
  static PrefixIndex& index(KVCacheManager& m) { return *m.impl_->index; }
  static auto& lru(PrefixIndex& x) { return x.lru_; }
  static BlockCounts& evictable(PrefixIndex& x) { return x.evictable_; }
};

}  // namespace detail
}  // namespace mixkv
