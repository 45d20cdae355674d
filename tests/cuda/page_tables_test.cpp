// Device page tables: the device copy equals the host mirror after upload,
// and an upload sends only the entries that changed (O(changes)).
#include <gtest/gtest.h>

#include <climits>
#include <numeric>

#include "cuda_test_util.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/kernels/device_page_tables.h"

namespace mixkv::test {
namespace {

std::vector<std::int32_t> device_row(const gpu::DeviceTablesView& view, int layer, int pool, int slot, int n) {
  std::vector<std::int32_t> row(n);
  const std::size_t at =
      ((static_cast<std::size_t>(layer) * kNumPrecisions + pool) * view.max_sequences + slot) * view.max_blocks;
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemcpy(row.data(), view.blocks + at, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost), "D2H");
  return row;
}

std::int32_t device_int(const std::int32_t* p) {
  std::int32_t x = 0;
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemcpy(&x, p, sizeof x, cudaMemcpyDeviceToHost), "D2H");
  return x;
}

TEST(DevicePageTablesCuda, UploadsOnlyChanges) {
  MIXKV_REQUIRE_CUDA();
  gpu::DevicePageTables tables({2, 4, 1000});
  std::vector<std::int32_t> list(612);
  std::iota(list.begin(), list.end(), 100);
  tables.set_blocks(3, 1, Precision::INT2, list);
  EXPECT_EQ(tables.pending_updates(), 612u + 1u);  // ids + count
  EXPECT_EQ(tables.upload(nullptr), 613u);
  const auto view = tables.device_view();
  EXPECT_EQ(device_row(view, 1, 2, 3, 612), list);
  EXPECT_EQ(device_int(view.counts + (1 * kNumPrecisions + 2) * 4 + 3), 612);

  // A decode step: one more FP16 token in a fresh tail block.
  std::vector<std::int32_t> fp16 = {7, 8};
  tables.set_blocks(3, 1, Precision::FP16, fp16, 32);
  tables.upload(nullptr);
  fp16.push_back(9);
  tables.set_blocks(3, 1, Precision::FP16, fp16, 1);
  EXPECT_EQ(tables.pending_updates(), 3u);  // new id, count, fill
  tables.set_blocks(3, 1, Precision::FP16, fp16, 2);
  EXPECT_EQ(tables.pending_updates(), 3u);  // the fill is sent once, with its last value
  tables.upload(nullptr);
  EXPECT_EQ(device_row(view, 1, 0, 3, 3), fp16);
  EXPECT_EQ(device_int(view.fp16_fill + 1 * 4 + 3), 2);
  // Unchanged lists send nothing.
  tables.set_blocks(3, 1, Precision::INT2, list);
  EXPECT_EQ(tables.pending_updates(), 0u);
  tables.clear(3);
  EXPECT_EQ(tables.num_blocks(3, 1, Precision::INT2), 0);
  EXPECT_EQ(tables.upload(nullptr), 3u);  // INT2 count, FP16 count, fill of layer 1
}

TEST(DevicePageTablesCuda, BadInputChangesNothing) {
  MIXKV_REQUIRE_CUDA();
  gpu::DevicePageTables tables({1, 2, 4});
  const std::vector<std::int32_t> too_long(5, 1);
  MIXKV_EXPECT_INVALID(tables.set_blocks(0, 0, Precision::INT4, too_long), "max_blocks_per_sequence");
  const std::vector<std::int32_t> negative = {1, -3};
  expect_error_naming<IndexOutOfRange>([&] { tables.set_blocks(0, 0, Precision::INT4, negative); }, {"blocks[1] = -3"});
  EXPECT_THROW(tables.set_blocks(2, 0, Precision::INT4, negative), IndexOutOfRange);
  EXPECT_EQ(tables.pending_updates(), 0u);
}

// With the arena's bound (from a PoolLayout or config.pool_blocks), a block
// one past the pool, far past it or negative is an IndexOutOfRange naming
// the entry and the bound, from set_blocks and from sync, and nothing
// changes: the mirror, the pending entries and the device copy stay as they
// were, so decode can never read outside the arena.
TEST(DevicePageTablesCuda, BlockIdsOutsideTheArenaAreRejected) {
  MIXKV_REQUIRE_CUDA();
  CacheConfig c;
  c.shape = CacheShape{2, 1, 64, 16};
  c.slab_bytes = std::size_t{1} << 16;
  c.arena_bytes = c.slab_bytes * 3;
  KVCacheManager manager(c);
  const PoolLayout layout = manager.arena_layout();
  gpu::DevicePageTables tables({2, 2, 8}, layout);
  for (const Precision p : kAllPrecisions) {
    EXPECT_EQ(tables.config().pool_blocks[pool_index(p)], layout.pools[pool_index(p)].num_blocks);
  }
  const std::vector<std::int32_t> held = {0, 1};
  tables.set_blocks(1, 0, Precision::INT2, held);
  tables.upload(nullptr);
  const gpu::DeviceTablesView view = tables.device_view();
  for (const Precision p : kAllPrecisions) {
    const std::int32_t limit = layout.pools[pool_index(p)].num_blocks;
    for (const std::int32_t bad : {limit, limit + 1, 1 << 30, INT32_MAX, -1, INT32_MIN}) {
      SCOPED_TRACE(std::string(to_string(p)) + " " + std::to_string(bad));
      const std::vector<std::int32_t> list = {limit - 1, bad};
      const std::size_t pending = tables.pending_updates();
      expect_error_naming<IndexOutOfRange>(
          [&] { tables.set_blocks(1, 0, p, list, p == Precision::FP16 ? 1 : 0); },
          {"blocks[1] = " + std::to_string(bad), "[0, " + std::to_string(limit) + ")"});
      EXPECT_EQ(tables.pending_updates(), pending);
      EXPECT_EQ(tables.num_blocks(1, 0, p), p == Precision::INT2 ? 2 : 0);
    }
    // The last block of each pool is accepted.
    const std::vector<std::int32_t> edge = {limit - 1};
    EXPECT_NO_THROW(tables.set_blocks(0, 1, p, edge, p == Precision::FP16 ? 1 : 0));
  }
  EXPECT_EQ(tables.upload(nullptr), 7u);  // three lists of one block, three counts, one fill
  EXPECT_EQ(device_row(view, 0, pool_index(Precision::INT2), 1, 2), held);
  EXPECT_EQ(device_int(view.counts + (0 * kNumPrecisions + pool_index(Precision::INT2)) * 2 + 1), 2);

  // sync: a page table holding one id past the INT4 pool changes nothing.
  PageTable table(2, 16);
  table.push_block(0, Precision::FP16, 3, 16);
  table.push_block(1, Precision::INT4, layout.pools[1].num_blocks, 16);
  expect_error_naming<IndexOutOfRange>([&] { tables.sync(0, table); },
                                       {"table.blocks(1, INT4)[0] = " + std::to_string(layout.pools[1].num_blocks)});
  EXPECT_EQ(tables.pending_updates(), 0u);
  EXPECT_EQ(tables.num_blocks(0, 0, Precision::FP16), 0);
  EXPECT_EQ(tables.num_blocks(0, 1, Precision::FP16), 1);

  // A narrower bound must stay above every id held; a bound of 0 is no bound.
  expect_error_naming<IndexOutOfRange>(
      [&] {
        tables.set_pool_blocks({layout.pools[0].num_blocks, 1, layout.pools[2].num_blocks});
      },
      {"pool_blocks[INT4] = 1", "holds block"});
  EXPECT_EQ(tables.config().pool_blocks[1], layout.pools[1].num_blocks);
  expect_error_naming<InvalidArgument>([&] { tables.set_pool_blocks({0, 1, 1}); }, {"pool_blocks[FP16] = 0"});
  gpu::PageTableConfig zero{1, 1, 1};
  zero.pool_blocks = {4, 0, 4};
  MIXKV_EXPECT_INVALID(gpu::DevicePageTables{zero}, "pool_blocks[INT4] = 0");
  expect_context_usable("rejected page-table edits");
}

// Every list, count and fill of `slot` in two mirrors.
void expect_same_slot(const gpu::DevicePageTables& a, const gpu::DevicePageTables& b, std::int32_t slot,
                      std::int32_t layers) {
  for (std::int32_t l = 0; l < layers; ++l) {
    for (const Precision p : kAllPrecisions) {
      const auto x = a.blocks(slot, l, p);
      const auto y = b.blocks(slot, l, p);
      EXPECT_EQ(std::vector<std::int32_t>(x.begin(), x.end()), std::vector<std::int32_t>(y.begin(), y.end()))
          << "slot " << slot << " layer " << l << " " << to_string(p);
    }
    EXPECT_EQ(a.fp16_fill(slot, l), b.fp16_fill(slot, l)) << "slot " << slot << " layer " << l;
  }
}

// sync_tail after appends (one or several tokens, across block boundaries),
// copy-on-write of forked tails and truncation of what was appended since
// the last sync gives the mirror sync() gives; after a demotion it refuses
// and changes nothing. Both mirrors are uploaded and the device copies
// compared too.
TEST(DevicePageTablesCuda, TailSyncEqualsAWholeSyncUnderAppends) {
  MIXKV_REQUIRE_CUDA();
  CacheConfig c;
  constexpr std::int32_t kLayers = 3;
  constexpr std::int32_t kBlock = 16;
  c.shape = CacheShape{kLayers, 1, 64, kBlock};
  c.slab_bytes = std::size_t{1} << 16;
  c.arena_bytes = c.slab_bytes * 64;
  KVCacheManager manager(c);
  gpu::DevicePageTables tail({kLayers, 4, 64}, manager.arena_layout());
  gpu::DevicePageTables whole({kLayers, 4, 64}, manager.arena_layout());
  // Sequence 0: two visual windows and text, window 1 INT4 in layer 1;
  // sequence 1: text only.
  PrecisionPlan plan(kLayers, 2);
  plan.set(1, 1, Precision::INT4);
  manager.add_sequence(0, TokenLayout({{TokenKind::Visual, 2 * kBlock}, {TokenKind::Text, 5}}), plan);
  manager.add_sequence(1, TokenLayout({{TokenKind::Text, 40}}), PrecisionPlan(kLayers, 0));
  std::vector<SequenceId> live = {0, 1};
  auto sync_both = [&](std::size_t slot, SequenceId id, bool expect_tail) {
    const PageTable& t = manager.page_table(id);
    const auto s = static_cast<std::int32_t>(slot);
    EXPECT_EQ(tail.sync_tail(s, t), expect_tail) << "slot " << slot;
    if (!expect_tail) tail.sync(s, t);
    whole.sync(s, t);
    expect_same_slot(tail, whole, s, kLayers);
  };
  for (std::size_t i = 0; i < live.size(); ++i) sync_both(i, live[i], live[i] == 1);  // 0 holds INT4 blocks

  std::uint64_t state = 7;
  auto next = [&](std::uint64_t n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (state >> 33) % n;
  };
  for (int round = 0; round < 100; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    if (round == 40) {
      // A fork shares the tail; the parent's next append copies it.
      manager.fork(1, 2);
      live.push_back(2);
      sync_both(2, 2, true);
    }
    std::vector<std::int32_t> counts(live.size());
    for (auto& n : counts) n = 1 + static_cast<std::int32_t>(next(3) == 0 ? next(20) : 0);
    manager.append_tokens(std::span<const SequenceId>(live), std::span<const std::int32_t>(counts));
    if (next(4) == 0) {
      // Drafts rejected: back to a shorter length within what was appended.
      const std::size_t k = next(live.size());
      manager.truncate(live[k], manager.num_tokens(live[k]) - 1 - static_cast<std::int32_t>(next(counts[k])));
    }
    for (std::size_t i = 0; i < live.size(); ++i) sync_both(i, live[i], true);
  }
  // A demotion moves a window out of the FP16 list: sync_tail refuses.
  const std::size_t before = tail.pending_updates();
  manager.demote(std::vector<Demotion>{{0, 0, 1, Precision::INT2}});
  EXPECT_FALSE(tail.sync_tail(0, manager.page_table(0)));
  EXPECT_EQ(tail.pending_updates(), before);
  tail.sync(0, manager.page_table(0));
  whole.sync(0, manager.page_table(0));
  expect_same_slot(tail, whole, 0, kLayers);

  tail.upload(nullptr);
  whole.upload(nullptr);
  const gpu::DeviceTablesView a = tail.device_view();
  const gpu::DeviceTablesView b = whole.device_view();
  const std::size_t entries = static_cast<std::size_t>(kLayers) * kNumPrecisions * 4 * 64 +
                              static_cast<std::size_t>(kLayers) * kNumPrecisions * 4 + kLayers * 4;
  std::vector<std::int32_t> x(entries), y(entries);
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemcpy(x.data(), a.blocks, entries * sizeof(std::int32_t), cudaMemcpyDeviceToHost), "D2H");
  cuda_ok(cudaMemcpy(y.data(), b.blocks, entries * sizeof(std::int32_t), cudaMemcpyDeviceToHost), "D2H");
  EXPECT_EQ(x, y);
}

}  // namespace
}  // namespace mixkv::test
