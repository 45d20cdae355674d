#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <boost/intrusive/list.hpp>

#include "mixkv/core/block_format.h"

namespace mixkv {

namespace detail {
struct ManagerTestAccess;
}  // namespace detail

// The blocks of one precision. The pool owns some of the arena's slabs; a
// slab holds blocks_per_slab blocks of the pool's format, and
// block id = slab * blocks_per_slab + index within the slab (pool_view.h).
//
// Free blocks sit on an intrusive doubly linked list per slab, and slabs with
// free blocks on two intrusive lists of the pool (partly used, entirely free).
// So alloc and free are O(1), giving an entirely free slab back to the arena
// is O(1) too (its blocks leave with it), and allocation fills partly used
// slabs before it opens an empty one: a pool that shrinks keeps as many
// entirely free slabs as possible for the other pools to reclaim. A block's
// ref count is the number of page tables holding it; 0 means free.
class BlockPool {
 public:
  // total_slabs is the arena's slab count (the range of slab indices).
  // InvalidArgument naming slab_bytes when one block does not fit a slab.
  BlockPool(const BlockFormat& format, std::size_t slab_bytes, std::int32_t total_slabs);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  const BlockFormat& format() const { return format_; }
  std::int32_t blocks_per_slab() const { return blocks_per_slab_; }
  // One past the largest block id any slab of the arena could give.
  std::int64_t id_limit() const { return static_cast<std::int64_t>(total_slabs_) * blocks_per_slab_; }

  std::int32_t num_slabs() const { return num_slabs_; }
  std::int32_t empty_slabs() const { return static_cast<std::int32_t>(empty_.size()); }
  std::int64_t capacity() const { return static_cast<std::int64_t>(num_slabs_) * blocks_per_slab_; }
  std::int64_t free_blocks() const { return free_blocks_; }
  std::int64_t used_blocks() const { return capacity() - free_blocks_; }

  // Empty slabs that could still be given back after `blocks` more
  // allocations (0 when the pool cannot provide them itself), following the
  // allocation order above; the exact count the manager's accounting needs.
  std::int32_t spare_slabs_after(std::int64_t blocks) const;

  bool owns_slab(std::int32_t slab) const;
  // Used blocks in `slab` (0 when the pool does not own it): how many
  // releases empty it. IndexOutOfRange names "slab".
  std::int32_t used_in_slab(std::int32_t slab) const;
  // The arena handed `slab` to this pool: all its blocks become free.
  // IndexOutOfRange names "slab"; InvalidArgument if the pool owns it already.
  // Uses a record made by reserve_slabs() when there is one, and then cannot
  // fail for lack of host memory.
  void add_slab(std::int32_t slab);
  // Makes the host records of `count` slabs ahead (std::bad_alloc here, while
  // nothing has moved), so that the next `count` add_slab() calls allocate
  // nothing: a caller that takes a slab from the arena and then adds it must
  // not fail in between. Reserved records are bookkeeping only: describe() and
  // the counts do not show them. InvalidArgument names count (< 0).
  void reserve_slabs(std::int32_t count);
  // Gives back an entirely free slab (the one emptied longest ago) and
  // returns its index. InvalidArgument when the pool has none.
  std::int32_t release_empty_slab();

  // A free block with ref count 1. OutOfMemory when none is free.
  std::int32_t allocate();
  // One more holder of a used block. InvalidArgument for a free block.
  void retain(std::int32_t block_id);
  // One holder less; returns true when the block became free. Releasing a
  // free block (a double free) throws InvalidArgument and changes nothing.
  bool release(std::int32_t block_id);
  // 0 for a free block or one outside this pool's slabs.
  // IndexOutOfRange names "block_id" outside [0, id_limit()).
  std::int32_t ref_count(std::int32_t block_id) const;

  // Every invariant of the pool's own bookkeeping; InvariantViolation
  // describes the first broken one.
  void check_invariants() const;
  // Canonical text: slabs, slab lists and free lists in order, ref counts.
  void describe(std::string& out) const;

 private:
  // Tests corrupt the bookkeeping through it to see check_invariants() fire.
  friend struct detail::ManagerTestAccess;

  using Hook = boost::intrusive::list_member_hook<boost::intrusive::link_mode<boost::intrusive::safe_link>>;

  struct Block {
    Hook hook;  // linked iff the block is free
    std::int32_t ref_count = 0;
  };
  using BlockList = boost::intrusive::list<Block, boost::intrusive::member_hook<Block, Hook, &Block::hook>>;

  struct Slab {
    Hook hook;  // on partial_ or empty_ while it has free blocks
    std::int32_t index = 0;
    std::int32_t used = 0;
    std::unique_ptr<Block[]> blocks;  // declared before free_list: destroyed after it
    BlockList free_list;
  };
  using SlabList = boost::intrusive::list<Slab, boost::intrusive::member_hook<Slab, Hook, &Slab::hook>>;

  std::unique_ptr<Slab> make_slab_record() const;
  Slab& slab_of(std::int32_t block_id, const char* name) const;
  std::int32_t id_of(const Slab& slab, const Block& block) const;
  std::string block_name(std::int32_t block_id) const;

  BlockFormat format_;
  std::int32_t blocks_per_slab_ = 0;
  std::int32_t total_slabs_ = 0;
  std::int32_t num_slabs_ = 0;
  std::int64_t free_blocks_ = 0;
  std::vector<std::unique_ptr<Slab>> slabs_;  // [arena slab index], null when not ours
  SlabList partial_;                          // some blocks used, some free; allocation takes the front
  SlabList empty_;                            // all blocks free; newly emptied at the front, given back from the back
  std::vector<std::unique_ptr<Slab>> reserved_records_;  // fresh, for add_slab (reserve_slabs)
};

}  // namespace mixkv
