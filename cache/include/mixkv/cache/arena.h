#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "mixkv/core/precision.h"

namespace mixkv {

namespace detail {
struct ManagerTestAccess;
}  // namespace detail

// The slab bookkeeping of the one KV allocation: arena_bytes / slab_bytes
// equal slabs (any remainder is unused), each free or owned by exactly one
// pool. A pool grows by taking a free slab and hands back a slab whose blocks
// are all free, which is how memory moves between FP16, INT4 and INT2 as the
// mix of a workload changes. The arena never touches memory; it only says
// who owns which slab.
class Arena {
 public:
  // Throws InvalidArgument naming slab_bytes (0) or arena_bytes (smaller than
  // one slab, or more than 2^31 - 1 slabs).
  Arena(std::size_t arena_bytes, std::size_t slab_bytes);

  std::size_t slab_bytes() const { return slab_bytes_; }
  std::int32_t total_slabs() const { return static_cast<std::int32_t>(owners_.size()); }
  std::int32_t free_slabs() const { return static_cast<std::int32_t>(free_.size()); }
  // Slabs owned by pool p.
  std::int32_t owned_slabs(Precision p) const { return owned_[static_cast<std::size_t>(pool_index(p))]; }

  // The owning pool, or nullopt for a free slab. IndexOutOfRange names "slab".
  std::optional<Precision> owner(std::int32_t slab) const;

  // Hands a free slab to pool p (the most recently given back first, so a
  // slab reclaimed from one pool goes straight to the pool that asked).
  // OutOfMemory when no slab is free.
  std::int32_t take(Precision p);
  // Pool p returns `slab`. InvalidArgument unless p owns it. Allocates
  // nothing (the free list has room for every slab), like take(): the
  // manager moves slabs in phases that must not fail.
  void give_back(std::int32_t slab, Precision p);

  // Free slabs in the order take() hands them out.
  std::vector<std::int32_t> free_list() const;

  // Throws InvariantViolation if owners, owner counts and the free list disagree.
  void check_invariants() const;

 private:
  // Tests corrupt the bookkeeping through it to see check_invariants() fire.
  friend struct detail::ManagerTestAccess;

  static constexpr std::int8_t kFree = -1;

  std::size_t slab_bytes_ = 0;
  std::vector<std::int8_t> owners_;  // [slab]: pool_index() or kFree
  std::vector<std::int32_t> free_;   // stack of free slabs; take() pops the back
  std::array<std::int32_t, kNumPrecisions> owned_{};
};

}  // namespace mixkv
