#include "mixkv/cache/block_pool.h"

#include <algorithm>
#include <cstddef>
#include <limits>

#include "mixkv/core/checks.h"
#include "mixkv/core/errors.h"

namespace mixkv {

BlockPool::BlockPool(const BlockFormat& format, std::size_t slab_bytes, std::int32_t total_slabs)
    : format_(format), total_slabs_(total_slabs) {
  detail::require_precision(format.precision, "format.precision");
  const std::size_t block_bytes = format.block_bytes();
  if (block_bytes == 0) {
    throw InvalidArgument("format: block_bytes() = 0, expected num_kv_heads, head_dim and block_size >= 1");
  }
  if (slab_bytes < block_bytes) {
    throw InvalidArgument("slab_bytes = " + std::to_string(slab_bytes) + ", expected at least one " +
                          std::string(to_string(format.precision)) + " block (" + std::to_string(block_bytes) +
                          " bytes)");
  }
  if (total_slabs < 0) throw InvalidArgument("total_slabs = " + std::to_string(total_slabs) + ", expected >= 0");
  const std::size_t per_slab = slab_bytes / block_bytes;
  const auto max_id = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());
  if (per_slab > max_id || (total_slabs > 0 && per_slab * static_cast<std::size_t>(total_slabs) > max_id)) {
    throw InvalidArgument("slab_bytes = " + std::to_string(slab_bytes) + " with " + std::to_string(total_slabs) +
                          " slabs gives more than 2^31 - 1 " + std::string(to_string(format.precision)) +
                          " block ids, expected fewer");
  }
  blocks_per_slab_ = static_cast<std::int32_t>(per_slab);
  slabs_.resize(static_cast<std::size_t>(total_slabs));
}

BlockPool::~BlockPool() = default;

std::string BlockPool::block_name(std::int32_t block_id) const {
  return "block_id = " + std::to_string(block_id) + " of the " + std::string(to_string(format_.precision)) + " pool";
}

BlockPool::Slab& BlockPool::slab_of(std::int32_t block_id, const char* name) const {
  detail::require_index(name, block_id, id_limit());
  Slab* slab = slabs_[static_cast<std::size_t>(block_id / blocks_per_slab_)].get();
  if (slab == nullptr) {
    throw InvalidArgument(block_name(block_id) + " lies in slab " + std::to_string(block_id / blocks_per_slab_) +
                          ", which the pool does not own");
  }
  return *slab;
}

std::int32_t BlockPool::id_of(const Slab& slab, const Block& block) const {
  return slab.index * blocks_per_slab_ + static_cast<std::int32_t>(&block - slab.blocks.get());
}

std::int32_t BlockPool::spare_slabs_after(std::int64_t blocks) const {
  if (blocks < 0 || blocks > free_blocks_) return 0;
  const std::int64_t in_partial = free_blocks_ - static_cast<std::int64_t>(empty_slabs()) * blocks_per_slab_;
  if (blocks <= in_partial) return empty_slabs();
  const std::int64_t opened = (blocks - in_partial + blocks_per_slab_ - 1) / blocks_per_slab_;
  return empty_slabs() - static_cast<std::int32_t>(opened);
}

bool BlockPool::owns_slab(std::int32_t slab) const {
  return slab >= 0 && slab < total_slabs_ && slabs_[static_cast<std::size_t>(slab)] != nullptr;
}

std::int32_t BlockPool::used_in_slab(std::int32_t slab) const {
  detail::require_index("slab", slab, total_slabs_);
  const Slab* record = slabs_[static_cast<std::size_t>(slab)].get();
  return record == nullptr ? 0 : record->used;
}

std::unique_ptr<BlockPool::Slab> BlockPool::make_slab_record() const {
  auto record = std::make_unique<Slab>();
  record->blocks = std::make_unique<Block[]>(static_cast<std::size_t>(blocks_per_slab_));
  return record;
}

void BlockPool::reserve_slabs(std::int32_t count) {
  if (count < 0) throw InvalidArgument("count = " + std::to_string(count) + ", expected >= 0");
  const auto wanted = static_cast<std::size_t>(count);
  if (reserved_records_.size() >= wanted) return;
  reserved_records_.reserve(wanted);
  const auto made_before = static_cast<std::ptrdiff_t>(reserved_records_.size());
  while (reserved_records_.size() < wanted) reserved_records_.push_back(make_slab_record());
  // add_slab() takes from the back: reversed, the new records go out in the
  // order they were made, so consecutive slabs get their block records in
  // address order, as when add_slab() made each. (Handed out backwards, they
  // made BlockPool::allocate 2.5x slower in scheduler_bench.)
  std::reverse(reserved_records_.begin() + made_before, reserved_records_.end());
}

void BlockPool::add_slab(std::int32_t slab) {
  detail::require_index("slab", slab, total_slabs_);
  if (owns_slab(slab)) {
    throw InvalidArgument("slab = " + std::to_string(slab) + " already belongs to the " +
                          std::string(to_string(format_.precision)) + " pool, expected a free slab");
  }
  std::unique_ptr<Slab> record;
  if (reserved_records_.empty()) {
    record = make_slab_record();
  } else {
    // A reserved record is as fresh as a new record: every block free, unlinked.
    record = std::move(reserved_records_.back());
    reserved_records_.pop_back();
  }
  record->index = slab;
  // In index order, so a fresh slab hands out its blocks in address order.
  for (std::int32_t i = 0; i < blocks_per_slab_; ++i) record->free_list.push_back(record->blocks[i]);
  // At the front: the slab was taken because blocks are needed now.
  empty_.push_front(*record);
  slabs_[static_cast<std::size_t>(slab)] = std::move(record);
  ++num_slabs_;
  free_blocks_ += blocks_per_slab_;
}

std::int32_t BlockPool::release_empty_slab() {
  if (empty_.empty()) {
    throw InvalidArgument("release_empty_slab: the " + std::string(to_string(format_.precision)) +
                          " pool has no entirely free slab");
  }
  Slab& slab = empty_.back();
  empty_.pop_back();
  const std::int32_t index = slab.index;
  slabs_[static_cast<std::size_t>(index)].reset();
  --num_slabs_;
  free_blocks_ -= blocks_per_slab_;
  return index;
}

std::int32_t BlockPool::allocate() {
  if (partial_.empty()) {
    if (empty_.empty()) {
      throw OutOfMemory("the " + std::string(to_string(format_.precision)) + " pool has no free block (" +
                        std::to_string(num_slabs_) + " slabs, all blocks used)");
    }
    Slab& opened = empty_.front();
    empty_.pop_front();
    partial_.push_front(opened);
  }
  Slab& slab = partial_.front();
  Block& block = slab.free_list.front();
  slab.free_list.pop_front();
  block.ref_count = 1;
  ++slab.used;
  --free_blocks_;
  if (slab.free_list.empty()) partial_.pop_front();
  return id_of(slab, block);
}

void BlockPool::retain(std::int32_t block_id) {
  Slab& slab = slab_of(block_id, "block_id");
  Block& block = slab.blocks[static_cast<std::size_t>(block_id % blocks_per_slab_)];
  if (block.ref_count == 0) throw InvalidArgument(block_name(block_id) + " is free, expected a used block");
  ++block.ref_count;
}

bool BlockPool::release(std::int32_t block_id) {
  Slab& slab = slab_of(block_id, "block_id");
  Block& block = slab.blocks[static_cast<std::size_t>(block_id % blocks_per_slab_)];
  if (block.ref_count == 0) {
    throw InvalidArgument(block_name(block_id) + " is already free (double free), expected a used block");
  }
  if (--block.ref_count > 0) return false;
  const bool was_full = slab.free_list.empty();
  slab.free_list.push_front(block);
  --slab.used;
  ++free_blocks_;
  if (slab.used == 0) {
    if (!was_full) partial_.erase(partial_.iterator_to(slab));
    empty_.push_front(slab);
  } else if (was_full) {
    partial_.push_front(slab);
  }
  return true;
}

std::int32_t BlockPool::ref_count(std::int32_t block_id) const {
  detail::require_index("block_id", block_id, id_limit());
  const Slab* slab = slabs_[static_cast<std::size_t>(block_id / blocks_per_slab_)].get();
  return slab == nullptr ? 0 : slab->blocks[static_cast<std::size_t>(block_id % blocks_per_slab_)].ref_count;
}

void BlockPool::check_invariants() const {
  const std::string pool = std::string(to_string(format_.precision)) + " pool: ";
  auto fail = [&](const std::string& what) { throw InvariantViolation(pool + what); };

  // Each slab list must walk to the same slabs forwards and backwards.
  auto walk = [&](const SlabList& list, const char* name, std::vector<const Slab*>& order) {
    for (const Slab& s : list) order.push_back(&s);
    std::size_t i = order.size();
    for (auto it = list.rbegin(); it != list.rend(); ++it) {
      if (i == 0 || order[--i] != &*it) fail(std::string(name) + " slab list walks differently backwards");
    }
    if (i != 0 || order.size() != list.size()) fail(std::string(name) + " slab list length disagrees with its size");
  };
  std::vector<const Slab*> partial;
  std::vector<const Slab*> empty;
  walk(partial_, "partial", partial);
  walk(empty_, "empty", empty);
  std::vector<std::int8_t> on_list(slabs_.size(), 0);  // 1 partial, 2 empty
  for (const Slab* s : partial) {
    if (!owns_slab(s->index) || slabs_[static_cast<std::size_t>(s->index)].get() != s) {
      fail("partial list holds slab " + std::to_string(s->index) + ", which the pool does not own");
    }
    on_list[static_cast<std::size_t>(s->index)] += 1;
  }
  for (const Slab* s : empty) {
    if (!owns_slab(s->index) || slabs_[static_cast<std::size_t>(s->index)].get() != s) {
      fail("empty list holds slab " + std::to_string(s->index) + ", which the pool does not own");
    }
    on_list[static_cast<std::size_t>(s->index)] += 2;
  }

  std::int32_t owned = 0;
  std::int64_t free_total = 0;
  for (std::size_t index = 0; index < slabs_.size(); ++index) {
    const Slab* slab = slabs_[index].get();
    if (slab == nullptr) continue;
    ++owned;
    const std::string name = "slab " + std::to_string(index) + ": ";
    if (slab->index != static_cast<std::int32_t>(index)) fail(name + "records index " + std::to_string(slab->index));

    // The free list walks to the same blocks both ways, each block of this
    // slab, each at most once (a second entry would hand a block out twice).
    // A walk along next pointers that meets a block again repeats forever,
    // so a walk longer than the slab is how a repeated block shows.
    std::vector<const Block*> forward;
    for (const Block& b : slab->free_list) {
      if (&b < slab->blocks.get() || &b >= slab->blocks.get() + blocks_per_slab_) {
        fail(name + "free list holds a block of another slab");
      }
      forward.push_back(&b);
      if (forward.size() > static_cast<std::size_t>(blocks_per_slab_)) {
        fail(name + "free list is longer than the slab (a block is on it twice)");
      }
    }
    std::size_t i = forward.size();
    for (auto it = slab->free_list.rbegin(); it != slab->free_list.rend(); ++it) {
      if (i == 0 || forward[--i] != &*it) fail(name + "free list walks differently backwards");
    }
    if (i != 0 || forward.size() != slab->free_list.size()) fail(name + "free list length disagrees with its size");
    std::vector<bool> listed(static_cast<std::size_t>(blocks_per_slab_), false);
    for (const Block* b : forward) listed[static_cast<std::size_t>(b - slab->blocks.get())] = true;
    // Free xor used: on the free list exactly when the ref count is 0.
    for (std::int32_t k = 0; k < blocks_per_slab_; ++k) {
      const Block& b = slab->blocks[static_cast<std::size_t>(k)];
      const std::string block = "block " + std::to_string(id_of(*slab, b));
      if (b.ref_count < 0) fail(block + " has ref count " + std::to_string(b.ref_count));
      if (listed[static_cast<std::size_t>(k)] != (b.ref_count == 0)) {
        fail(block + (b.ref_count == 0 ? " has ref count 0 but is not on the free list"
                                       : " is on the free list with ref count " + std::to_string(b.ref_count)));
      }
      if (b.hook.is_linked() != listed[static_cast<std::size_t>(k)]) fail(block + " is linked into a foreign list");
    }
    const auto free_here = static_cast<std::int32_t>(forward.size());
    if (slab->used != blocks_per_slab_ - free_here) {
      fail(name + "counts " + std::to_string(slab->used) + " used blocks, its free list says " +
           std::to_string(blocks_per_slab_ - free_here));
    }
    const std::int8_t expected = free_here == 0 ? 0 : (slab->used == 0 ? 2 : 1);
    if (on_list[index] != expected) {
      fail(name + "with " + std::to_string(slab->used) + " used blocks is on the wrong slab list");
    }
    free_total += free_here;
  }
  // A reserved record must be as fresh as a new one: add_slab() links all its
  // blocks and trusts their ref counts.
  for (const auto& record : reserved_records_) {
    if (record == nullptr || record->hook.is_linked() || !record->free_list.empty() || record->used != 0) {
      fail("a reserved slab record is in use");
    }
    for (std::int32_t k = 0; k < blocks_per_slab_; ++k) {
      const Block& b = record->blocks[static_cast<std::size_t>(k)];
      if (b.ref_count != 0 || b.hook.is_linked()) fail("a reserved slab record holds a used or linked block");
    }
  }
  if (owned != num_slabs_) {
    fail("owns " + std::to_string(owned) + " slabs, its count says " + std::to_string(num_slabs_));
  }
  if (free_total != free_blocks_) {
    fail(std::to_string(free_total) + " blocks on free lists, free count says " + std::to_string(free_blocks_));
  }
}

void BlockPool::describe(std::string& out) const {
  // Appends " label value"; plain += keeps GCC 12's -Wrestrict false positive
  // on `" " + std::to_string(..)` away.
  auto put = [&out](const char* label, std::int64_t value) {
    out += label;
    out += std::to_string(value);
  };
  out += "pool ";
  out += to_string(format_.precision);
  put(": slabs ", num_slabs_);
  put(", free ", free_blocks_);
  out += "\n  partial:";
  for (const Slab& s : partial_) put(" ", s.index);
  out += "\n  empty:";
  for (const Slab& s : empty_) put(" ", s.index);
  out += "\n";
  for (const auto& slab : slabs_) {
    if (slab == nullptr) continue;
    put("  slab ", slab->index);
    put(" used ", slab->used);
    out += " free:";
    for (const Block& b : slab->free_list) put(" ", id_of(*slab, b));
    out += " refs:";
    for (std::int32_t k = 0; k < blocks_per_slab_; ++k) {
      const Block& b = slab->blocks[static_cast<std::size_t>(k)];
      if (b.ref_count == 0) continue;
      put(" ", id_of(*slab, b));
      put("x", b.ref_count);
    }
    out += "\n";
  }
}

}  // namespace mixkv
