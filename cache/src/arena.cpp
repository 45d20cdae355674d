#include "mixkv/cache/arena.h"

#include <limits>
#include <string>

#include "mixkv/core/checks.h"
#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

std::string slab_name(std::int32_t slab) { return "slab " + std::to_string(slab); }

std::string owner_name(std::int8_t owner) {
  return owner < 0 ? "free" : std::string(to_string(static_cast<Precision>(owner)));
}

}  // namespace

Arena::Arena(std::size_t arena_bytes, std::size_t slab_bytes) : slab_bytes_(slab_bytes) {
  if (slab_bytes == 0) throw InvalidArgument("slab_bytes = 0, expected > 0");
  if (arena_bytes < slab_bytes) {
    throw InvalidArgument("arena_bytes = " + std::to_string(arena_bytes) +
                          ", expected at least one slab (slab_bytes = " + std::to_string(slab_bytes) + ")");
  }
  const std::size_t slabs = arena_bytes / slab_bytes;
  if (slabs > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    throw InvalidArgument("arena_bytes = " + std::to_string(arena_bytes) + " gives " + std::to_string(slabs) +
                          " slabs, expected at most 2^31 - 1 (raise slab_bytes)");
  }
  owners_.assign(slabs, kFree);
  // Stack with slab 0 on top: a fresh arena hands slabs out in address order.
  free_.reserve(slabs);
  for (std::size_t s = slabs; s-- > 0;) free_.push_back(static_cast<std::int32_t>(s));
}

std::optional<Precision> Arena::owner(std::int32_t slab) const {
  detail::require_index("slab", slab, total_slabs());
  const std::int8_t o = owners_[static_cast<std::size_t>(slab)];
  if (o == kFree) return std::nullopt;
  return static_cast<Precision>(o);
}

std::int32_t Arena::take(Precision p) {
  detail::require_precision(p, "p");
  if (free_.empty()) {
    throw OutOfMemory("arena: no free slab for the " + std::string(to_string(p)) + " pool (all " +
                      std::to_string(total_slabs()) + " slabs owned)");
  }
  const std::int32_t slab = free_.back();
  free_.pop_back();
  owners_[static_cast<std::size_t>(slab)] = static_cast<std::int8_t>(pool_index(p));
  ++owned_[static_cast<std::size_t>(pool_index(p))];
  return slab;
}

void Arena::give_back(std::int32_t slab, Precision p) {
  detail::require_precision(p, "p");
  const std::optional<Precision> o = owner(slab);
  if (o != p) {
    throw InvalidArgument("slab = " + std::to_string(slab) + " is " +
                          owner_name(o ? static_cast<std::int8_t>(pool_index(*o)) : kFree) +
                          ", expected a slab of the " + std::string(to_string(p)) + " pool");
  }
  owners_[static_cast<std::size_t>(slab)] = kFree;
  --owned_[static_cast<std::size_t>(pool_index(p))];
  free_.push_back(slab);
}

std::vector<std::int32_t> Arena::free_list() const { return {free_.rbegin(), free_.rend()}; }

void Arena::check_invariants() const {
  std::array<std::int32_t, kNumPrecisions> owned{};
  std::int32_t free_count = 0;
  for (std::size_t s = 0; s < owners_.size(); ++s) {
    const std::int8_t o = owners_[s];
    if (o == kFree) {
      ++free_count;
    } else if (o >= 0 && o < kNumPrecisions) {
      ++owned[static_cast<std::size_t>(o)];
    } else {
      throw InvariantViolation("arena: " + slab_name(static_cast<std::int32_t>(s)) + " has owner code " +
                               std::to_string(o));
    }
  }
  if (free_count != free_slabs()) {
    throw InvariantViolation("arena: " + std::to_string(free_count) + " slabs marked free but the free list holds " +
                             std::to_string(free_slabs()));
  }
  std::vector<bool> seen(owners_.size(), false);
  for (const std::int32_t s : free_) {
    if (s < 0 || s >= total_slabs() || owners_[static_cast<std::size_t>(s)] != kFree ||
        seen[static_cast<std::size_t>(s)]) {
      throw InvariantViolation("arena: free list entry " + slab_name(s) + " is out of range, owned or repeated");
    }
    seen[static_cast<std::size_t>(s)] = true;
  }
  for (const Precision p : kAllPrecisions) {
    if (owned[static_cast<std::size_t>(pool_index(p))] != owned_slabs(p)) {
      throw InvariantViolation("arena: " + std::string(to_string(p)) + " owns " +
                               std::to_string(owned[static_cast<std::size_t>(pool_index(p))]) +
                               " slabs but its count says " + std::to_string(owned_slabs(p)));
    }
  }
}

}  // namespace mixkv
