// Every check of KVCacheManager::check_invariants() (with the Arena's and
// the pools' own) can fail: each test builds a small valid state, breaks
// exactly one structure through the test-only hook (manager_test_access.h),
// and expects InvariantViolation naming what broke. Where a corruption
// breaks intrusive links, the test mends them and the state checks clean
// again, which also shows that only that one thing was broken.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "cache_test_util.h"
#include "manager_test_access.h"

namespace mixkv {
namespace {

using A = detail::ManagerTestAccess;
using test::text;
using test::tiny_config;

constexpr Precision F = Precision::FP16;
constexpr Precision I4 = Precision::INT4;
constexpr Precision I2 = Precision::INT2;

// The state every test breaks (2 layers, 4 KiB slabs of 4 FP16, 10 INT4 or
// 16 INT2 blocks): sequence 1 (4 text, windows FP16 / INT4 / INT2, 3 text)
// and its fork 2 sharing every block; 3 swapped out (host slots in use); 5
// on its own, in a partly used FP16 slab whose other blocks 4 left free
// (and a free handle index). FP16 slab 0 is full, slab 3 partly used.
class Corrupt : public ::testing::Test {
 protected:
  Corrupt() : cache_(config()) {
    PrecisionPlan plan(2, 3);
    for (std::int32_t layer = 0; layer < 2; ++layer) {
      plan.set(layer, 1, I4);
      plan.set(layer, 2, I2);
    }
    cache_.add_sequence(1, TokenLayout({{TokenKind::Text, 4}, {TokenKind::Visual, 48}, {TokenKind::Text, 3}}), plan);
    cache_.fork(1, 2);
    cache_.add_sequence(3, text(20), PrecisionPlan(2, 0));
    cache_.swap_out(3);
    cache_.add_sequence(4, text(10), PrecisionPlan(2, 0));
    cache_.add_sequence(5, text(10), PrecisionPlan(2, 0));
    cache_.free_sequence(4);
  }

  void SetUp() override {
    ASSERT_NO_THROW(cache_.check_invariants());
    ASSERT_EQ(cache_.ref_count(F, fp16(1, 0)), 2);
    ASSERT_EQ(cache_.pool_stats(F).slabs, 2);
  }

  static CacheConfig config() {
    CacheConfig c = tiny_config(2, 8);
    c.swap_blocks = {6, 4, 4};
    return c;
  }

  // check_invariants() throws InvariantViolation whose message holds every needle.
  void expect_violation(std::initializer_list<std::string> needles) {
    EXPECT_THROW(cache_.check_invariants(), InvariantViolation);
    try {
      cache_.check_invariants();
    } catch (const InvariantViolation& e) {
      for (const std::string& needle : needles) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
            << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
      }
    }
  }

  BlockPool& pool(Precision p) { return A::pool(cache_, p); }
  std::int32_t fp16(SequenceId id, std::int32_t layer, std::size_t i = 0) { return cache_.blocks(id, layer, F)[i]; }
  // A free FP16 block (in slab 3, which sequence 5 shares with them).
  std::int32_t free_fp16() {
    for (std::int32_t id = 12; id < 16; ++id) {
      if (cache_.ref_count(F, id) == 0) return id;
    }
    ADD_FAILURE() << "no free FP16 block in slab 3";
    return -1;
  }
  // A slab taken from the arena into pool p's empty list: a valid state.
  std::int32_t add_empty_slab(Precision p) {
    const std::int32_t slab = A::arena(cache_).take(p);
    pool(p).add_slab(slab);
    EXPECT_NO_THROW(cache_.check_invariants());
    return slab;
  }

  KVCacheManager cache_;
};

// --- Arena: each slab free or owned by one pool, counts and free list agree ---

TEST_F(Corrupt, ArenaOwnerCodeOutOfRange) {
  A::owners(A::arena(cache_))[7] = 9;
  expect_violation({"arena: slab 7 has owner code 9"});
}

TEST_F(Corrupt, ArenaFreeListShorterThanFreeSlabs) {
  A::free_slabs(A::arena(cache_)).pop_back();
  expect_violation({"arena: 4 slabs marked free but the free list holds 3"});
}

TEST_F(Corrupt, ArenaFreeListHoldsOwnedSlab) {
  A::free_slabs(A::arena(cache_))[0] = 0;  // slab 0 is FP16's
  expect_violation({"arena: free list entry slab 0 is out of range, owned or repeated"});
}

TEST_F(Corrupt, ArenaOwnedCountOffByOne) {
  ++A::owned(A::arena(cache_))[pool_index(I4)];
  expect_violation({"arena: INT4 owns 1 slabs but its count says 2"});
}

// --- Arena and pools agree on the owner of every slab ---

TEST_F(Corrupt, SlabOwnedByTwoPools) {
  pool(I2).add_slab(0);  // FP16's slab 0, now in the INT2 pool too
  expect_violation({"INT2 pool holds 2 slabs, the arena counts 1"});
}

TEST_F(Corrupt, SlabOwnedByNoneWhileHoldingBlocks) {
  A::arena(cache_).give_back(0, F);  // the arena forgets slab 0; the pool still uses it
  expect_violation({"FP16 pool holds 2 slabs, the arena counts 1"});
}

TEST_F(Corrupt, ArenaAndPoolDisagreeOnOwner) {
  auto& owners = A::owners(A::arena(cache_));
  std::swap(owners[0], owners[1]);  // FP16's slab 0 and INT4's slab 1: counts unchanged
  expect_violation({"slab 0: the arena says INT4 but the FP16 pool holds it"});
}

// --- A pool's slab lists ---

TEST_F(Corrupt, SlabListWalksDifferentlyBackwards) {
  // The list holds slab 3 alone: its header's back link goes to slab 0 instead.
  test::ListNode* header = A::partial(pool(F)).end().pointed_node();
  test::ListNode* const prev = header->prev_;
  header->prev_ = &A::slab(pool(F), 0).hook;
  expect_violation({"FP16 pool: partial slab list walks differently backwards"});
  header->prev_ = prev;
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, SlabListLengthDisagreesWithSize) {
  auto& partial = A::partial(pool(F));
  test::ListNode* node = &partial.front().hook;
  test::ListAlgo::unlink(node);  // behind the list's size
  expect_violation({"FP16 pool: partial slab list length disagrees with its size"});
  test::ListAlgo::link_before(partial.end().pointed_node(), node);
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, PartialListHoldsSlabThePoolDoesNotOwn) {
  A::slab(pool(F), 3).index = 6;
  expect_violation({"FP16 pool: partial list holds slab 6, which the pool does not own"});
}

TEST_F(Corrupt, EmptyListHoldsSlabThePoolDoesNotOwn) {
  const std::int32_t slab = add_empty_slab(I2);
  A::slab(pool(I2), slab).index = 7;
  expect_violation({"INT2 pool: empty list holds slab 7, which the pool does not own"});
}

TEST_F(Corrupt, SlabRecordsAnotherIndex) {
  A::slab(pool(F), 0).index = 5;  // full: on no slab list
  expect_violation({"FP16 pool: slab 0: records index 5"});
}

TEST_F(Corrupt, SlabOnTheWrongList) {
  auto& slab = A::slab(pool(F), 3);  // 2 used, 2 free: partly used
  A::partial(pool(F)).erase(A::partial(pool(F)).iterator_to(slab));
  A::empty(pool(F)).push_front(slab);
  expect_violation({"FP16 pool: slab 3: with 2 used blocks is on the wrong slab list"});
  A::empty(pool(F)).erase(A::empty(pool(F)).iterator_to(slab));
  A::partial(pool(F)).push_front(slab);
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, SlabUsedCountOffByOne) {
  ++A::slab(pool(F), 3).used;
  expect_violation({"FP16 pool: slab 3: counts 3 used blocks, its free list says 2"});
}

TEST_F(Corrupt, PoolSlabCountOffByOne) {
  ++A::slab_count(pool(F));
  expect_violation({"FP16 pool: owns 2 slabs, its count says 3"});
}

// --- Free lists: free xor used, walked the same both ways, each block once ---

TEST_F(Corrupt, FreeListHoldsBlockOfAnotherSlab) {
  auto& src = A::slab(pool(F), 3);
  auto& dst = A::slab(pool(F), 0);
  auto& block = A::block(pool(F), free_fp16());
  const auto next = src.free_list.erase(src.free_list.iterator_to(block));
  dst.free_list.push_back(block);
  expect_violation({"FP16 pool: slab 0: free list holds a block of another slab"});
  dst.free_list.erase(dst.free_list.iterator_to(block));
  src.free_list.insert(next, block);
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, BlockTwiceOnFreeList) {
  auto& list = A::slab(pool(F), 3).free_list;
  ASSERT_EQ(list.size(), 2u);
  test::ListNode* last = &list.back().hook;
  test::ListNode* const next = last->next_;
  last->next_ = &list.front().hook;  // the walk meets the first block again
  expect_violation({"FP16 pool: slab 3: free list is longer than the slab (a block is on it twice)"});
  last->next_ = next;
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, FreeListWalksDifferentlyBackwards) {
  auto& list = A::slab(pool(F), 3).free_list;
  test::ListNode* last = &list.back().hook;
  test::ListNode* const prev = last->prev_;
  last->prev_ = last;
  expect_violation({"FP16 pool: slab 3: free list walks differently backwards"});
  last->prev_ = prev;
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, FreeListLengthDisagreesWithSize) {
  auto& list = A::slab(pool(F), 3).free_list;
  test::ListNode* first = &list.front().hook;
  test::ListNode* const next = first->next_;
  test::ListAlgo::unlink(first);  // behind the list's size
  expect_violation({"FP16 pool: slab 3: free list length disagrees with its size"});
  test::ListAlgo::link_before(next, first);
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, UsedBlockOnFreeList) {
  const std::int32_t id = fp16(5, 0);
  auto& list = A::slab(pool(F), id / 4).free_list;
  list.push_front(A::block(pool(F), id));
  expect_violation({"FP16 pool: block " + std::to_string(id) + " is on the free list with ref count 1"});
  list.pop_front();
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, RefCountTooLowFreesAHeldBlock) {
  const std::int32_t id = fp16(5, 0);
  A::block(pool(F), id).ref_count = 0;  // held once, counted 0: neither used nor on a free list
  expect_violation({"FP16 pool: block " + std::to_string(id) + " has ref count 0 but is not on the free list"});
}

TEST_F(Corrupt, NegativeRefCount) {
  const std::int32_t id = fp16(5, 0);
  A::block(pool(F), id).ref_count = -1;
  expect_violation({"FP16 pool: block " + std::to_string(id) + " has ref count -1"});
}

TEST_F(Corrupt, UsedBlockLinkedIntoAForeignList) {
  const std::int32_t id = fp16(5, 0);
  test::ListNode* hook = &A::block(pool(F), id).hook;
  hook->next_ = &A::block(pool(F), free_fp16()).hook;
  expect_violation({"FP16 pool: block " + std::to_string(id) + " is linked into a foreign list"});
  hook->next_ = nullptr;
  EXPECT_NO_THROW(cache_.check_invariants());
}

TEST_F(Corrupt, PoolFreeCountDiffersFromItsLists) {
  ++A::free_count(pool(F));
  expect_violation({"FP16 pool: 2 blocks on free lists, free count says 3"});
  A::free_count(pool(F)) -= 2;
  expect_violation({"FP16 pool: 2 blocks on free lists, free count says 1"});
}

TEST_F(Corrupt, ReservedSlabRecordInUse) {
  pool(F).reserve_slabs(1);
  ASSERT_NO_THROW(cache_.check_invariants());
  A::reserved(pool(F)).back()->used = 1;
  expect_violation({"FP16 pool: a reserved slab record is in use"});
}

TEST_F(Corrupt, ReservedSlabRecordHoldsUsedBlock) {
  pool(F).reserve_slabs(1);
  A::reserved(pool(F)).back()->blocks[0].ref_count = 1;
  expect_violation({"FP16 pool: a reserved slab record holds a used or linked block"});
}

// --- Ref counts equal the page tables holding each block; no leak ---

TEST_F(Corrupt, RefCountOneTooHigh) {
  const std::int32_t id = fp16(5, 0);
  pool(F).retain(id);
  expect_violation({"FP16 block " + std::to_string(id) + " has ref count 2 but 1 page tables hold it"});
}

TEST_F(Corrupt, RefCountOneTooLowOnASharedBlock) {
  const std::int32_t id = fp16(1, 0);  // held by 1 and its fork 2
  pool(F).release(id);
  expect_violation({"FP16 block " + std::to_string(id) + " has ref count 1 but 2 page tables hold it"});
}

TEST_F(Corrupt, BlockInTwoSequencesWithoutTheRefCount) {
  const std::int32_t shared = cache_.page_table(1).fp16_tails()[0];
  A::table(cache_, 5).replace_fp16_tail(0, shared);
  expect_violation({"FP16 block " + std::to_string(shared) + " has ref count 2 but 3 page tables hold it"});
}

TEST_F(Corrupt, FreeBlockInAPageTable) {
  const std::int32_t id = free_fp16();
  A::table(cache_, 5).replace_fp16_tail(0, id);
  expect_violation({"FP16 block " + std::to_string(id) + " has ref count 0 but 1 page tables hold it"});
}

TEST_F(Corrupt, UsedBlockHeldByNoTable) {
  (void)pool(F).allocate();
  expect_violation({"FP16 pool has 7 used blocks but page tables hold 6"});
}

// --- Page tables ---

TEST_F(Corrupt, BlockOutsideThePoolsSlabs) {
  A::table(cache_, 5).insert_block(0, I4, 0, 79);  // slab 7: not INT4's
  expect_violation({"sequence 5 layer 0: INT4 block 79 is outside the pool's slabs"});
}

TEST_F(Corrupt, BlockIdPastTheArena) {
  A::table(cache_, 5).insert_block(0, I4, 0, 80);  // 8 slabs of 10 INT4 blocks
  expect_violation({"sequence 5 layer 0: INT4 block 80 is outside the pool's slabs"});
}

TEST_F(Corrupt, BlockTwiceInOneTable) {
  const std::int32_t id = cache_.blocks(1, 0, I4)[0];
  A::table(cache_, 1).insert_block(0, I4, 1, id);
  expect_violation({"sequence 1 layer 0: INT4 block " + std::to_string(id) + " appears twice in one table"});
}

TEST_F(Corrupt, QuantizedListShorterThanItsPlan) {
  (void)A::table(cache_, 1).remove_block(1, I2, 0);
  expect_violation({"sequence 1 layer 1: 0 INT2 blocks, the plan has 1 windows"});
}

TEST_F(Corrupt, QuantizedListLongerThanItsPlan) {
  A::table(cache_, 5).insert_block(0, I2, 0, cache_.blocks(1, 0, I2)[0]);
  expect_violation({"sequence 5 layer 0: 1 INT2 blocks, the plan has 0 windows"});
}

TEST_F(Corrupt, FP16TailFillAboveBlockSize) {
  A::base_fills(A::table(cache_, 5))[0] = 17;
  expect_violation({"sequence 5 layer 0: FP16 tail fill 17 with 1 FP16 blocks of 16"});
}

TEST_F(Corrupt, FP16TailFillZeroWithABlock) {
  A::base_fills(A::table(cache_, 5))[1] = 0;
  expect_violation({"sequence 5 layer 1: FP16 tail fill 0 with 1 FP16 blocks of 16"});
}

TEST_F(Corrupt, FP16FillWithoutBlocks) {
  PageTable& table = A::table(cache_, 5);
  A::base_fills(table)[0] = test::kTinyBlock;  // full, so that the table lets it go
  (void)table.remove_block(0, F, 0);
  A::base_fills(table)[0] = 5;
  expect_violation({"sequence 5 layer 0: FP16 tail fill 5 with 0 FP16 blocks of 16"});
}

TEST_F(Corrupt, BlocksHoldOtherThanTheSequencesTokens) {
  A::sequence(cache_, 5).num_tokens = 11;
  expect_violation({"sequence 5 layer 0: blocks hold 10 tokens, the sequence has 11"});
}

TEST_F(Corrupt, FewerTokensThanThePrompt) {
  A::sequence(cache_, 5).num_tokens = 9;
  expect_violation({"sequence 5: 9 tokens, fewer than its prompt"});
}

TEST_F(Corrupt, TableShapedForOtherLayers) {
  A::table(cache_, 5) = PageTable(3, test::kTinyBlock);
  expect_violation({"sequence 5: page table shaped for 3 layers"});
}

TEST_F(Corrupt, FP16TailRecordedWrongly) {
  A::tails(A::table(cache_, 5))[1] = fp16(5, 0);
  expect_violation({"sequence 5 layer 1: FP16 tail recorded as block " + std::to_string(fp16(5, 0))});
}

TEST_F(Corrupt, FP16RoomRecordedWrongly) {
  A::cached_room(A::table(cache_, 5)) = 3;  // the tails hold 10 of 16
  expect_violation({"sequence 5: FP16 room recorded as 3, the tails leave 6"});
}

// --- Handles: each sequence's handle names it; free indices are empty ---

TEST_F(Corrupt, HandleEntryPointsAtAnotherSequence) {
  auto& handles = A::handles(cache_);
  std::swap(handles[static_cast<std::size_t>(cache_.handle(1).index)],
            handles[static_cast<std::size_t>(cache_.handle(2).index)]);
  expect_violation({"does not name it in the handle table"});
}

TEST_F(Corrupt, HandleGenerationMoved) {
  ++A::generations(cache_)[static_cast<std::size_t>(cache_.handle(5).index)];
  expect_violation({"sequence 5: handle (", "does not name it in the handle table"});
}

TEST_F(Corrupt, FreeHandleIndexNamesASequence) {
  auto& handles = A::handles(cache_);
  const std::int32_t index = A::free_handles(cache_).back();
  handles[static_cast<std::size_t>(index)] = &A::sequence(cache_, 1);  // a stale handle would resolve
  expect_violation({"handle table: free index " + std::to_string(index) + " is out of range, names a sequence"});
}

TEST_F(Corrupt, FreeHandleIndexListedTwice) {
  A::free_handles(cache_).push_back(A::free_handles(cache_).back());
  expect_violation({"handle table: free index", "listed twice"});
}

TEST_F(Corrupt, HandleIndexNeitherFreeNorLive) {
  A::free_handles(cache_).pop_back();
  expect_violation({"handle table: 0 free + 4 sequences, but 5 entries"});
}

TEST_F(Corrupt, HandleGenerationsMissing) {
  A::generations(cache_).pop_back();
  expect_violation({"handle table: 5 entries but 4 generations"});
}

// --- Host swap pool: slots in range, used, held once; free + held = capacity ---

TEST_F(Corrupt, SwappedSequenceHoldsAFreeSlot) {
  const std::int32_t slot = A::table(cache_, 3).blocks(0, F)[0];
  A::swap(cache_, F).used[static_cast<std::size_t>(slot)] = 0;
  expect_violation({"sequence 3 layer 0: FP16 host slot " + std::to_string(slot) + " is out of range or marked free"});
}

TEST_F(Corrupt, HostSlotHeldTwice) {
  PageTable& table = A::table(cache_, 3);
  const std::int32_t slot = table.blocks(0, F)[0];
  table.replace_fp16_tail(1, slot);
  expect_violation({"FP16 host slot " + std::to_string(slot) + " is held twice"});
}

TEST_F(Corrupt, SwapFreeSlotListedTwice) {
  auto& free = A::swap(cache_, I4).free;
  free.push_back(free.back());
  expect_violation(
      {"INT4 swap pool: free slot " + std::to_string(free.back()) + " is out of range, used or listed twice"});
}

TEST_F(Corrupt, SwapSlotBothFreeAndHeld) {
  const std::int32_t slot = A::table(cache_, 3).blocks(1, F)[0];
  A::swap(cache_, F).free.push_back(slot);
  expect_violation({"FP16 swap pool: free slot " + std::to_string(slot) + " is out of range, used or listed twice"});
}

TEST_F(Corrupt, SwapSlotLeaked) {
  A::swap(cache_, F).free.pop_back();
  expect_violation({"FP16 swap pool: 1 free + 4 held slots, capacity 6"});
}

}  // namespace
}  // namespace mixkv
