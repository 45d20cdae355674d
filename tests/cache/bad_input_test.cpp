// Every public call of the manager, given bad input, throws the typed error
// of errors.h, names the argument, and leaves the state as it was.
#include <gtest/gtest.h>

#include <unistd.h>

#include <string>

#include "cache_test_util.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv {
namespace {

using test::expect_error;
using test::expect_rejected;
using test::text;
using test::tiny_config;

constexpr auto kBadPrecision = static_cast<Precision>(3);

TEST(BadInput, ConfigErrorsNameTheField) {
  auto with = [](auto change) {
    CacheConfig c = tiny_config(2, 4);
    change(c);
    return c;
  };
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.shape.num_layers = 0; })); },
                                "shape.num_layers = 0");
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.shape.num_kv_heads = -1; })); },
                                "shape.num_kv_heads = -1");
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.shape.head_dim = 24; })); },
                                "shape.head_dim = 24");
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.shape.block_size = 0; })); },
                                "shape.block_size = 0");
  // One FP16 block of this shape is 1,024 bytes.
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.slab_bytes = 1023; })); },
                                "slab_bytes = 1023");
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.slab_bytes = 0; })); },
                                "slab_bytes = 0");
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.arena_bytes = 4095; })); },
                                "arena_bytes = 4095");
  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) { c.arena_bytes = 0; })); },
                                "arena_bytes = 0");
  // 2^31 FP16 slots do not fit the int32 slot mapping.
  expect_error<InvalidArgument>(
      [&] { (void)KVCacheManager(with([](CacheConfig& c) { c.arena_bytes = std::size_t{1} << 37; })); },
      "arena_bytes = 137438953472 holds 2147483648 FP16 token slots, expected fewer than 2^31");
  EXPECT_NO_THROW((void)KVCacheManager(with([](CacheConfig& c) { c.arena_bytes = 4096 * 4 + 100; })));
}

// Sizes that would make the bookkeeping itself exhaust memory are refused
// before anything is allocated (each of these would otherwise allocate
// gigabytes): the slab count, the block ids of every pool, the swap pool.
TEST(BadInput, ResourceSizedConfigFieldsAreBoundedFirst) {
  auto with = [](auto change) {
    CacheConfig c = tiny_config(2, 4);
    change(c);
    return c;
  };
  constexpr std::size_t kTiB = std::size_t{1} << 40;
  expect_error<InvalidArgument>(
      [&] {
        (void)KVCacheManager(with([&](CacheConfig& c) {
          c.slab_bytes = 1024;  // one FP16 block
          c.arena_bytes = 2 * kTiB;
        }));
      },
      "arena_bytes = 2199023255552 gives 2147483648 slabs of slab_bytes = 1024, expected fewer than 2^31 slabs");
  expect_error<InvalidArgument>(
      [&] {
        (void)KVCacheManager(with([&](CacheConfig& c) {
          c.slab_bytes = kTiB;
          c.arena_bytes = kTiB;
        }));
      },
      "slab_bytes = 1099511627776 holds 2863311530 INT4 blocks, expected fewer than 2^31");
  expect_error<InvalidArgument>(
      [&] {
        (void)KVCacheManager(with([&](CacheConfig& c) {
          c.slab_bytes = std::size_t{1} << 20;  // 1,024 FP16 blocks
          c.arena_bytes = 2 * kTiB;
        }));
      },
      "arena_bytes = 2199023255552 gives 2147483648 FP16 block ids (2097152 slabs of 1024), expected fewer than 2^31");

  expect_error<InvalidArgument>([&] { (void)KVCacheManager(with([](CacheConfig& c) {
                                        c.swap_blocks = {-1, 0, 0};
                                      })); },
                                "swap_blocks[FP16] = -1, expected 0 <= swap_blocks < 2^31");
  expect_error<InvalidArgument>(
      [&] {
        (void)KVCacheManager(with([](CacheConfig& c) { c.swap_blocks = {0, 0, std::int64_t{1} << 31}; }));
      },
      "swap_blocks[INT2] = 2147483648, expected 0 <= swap_blocks < 2^31");
  constexpr std::int64_t kMax = (std::int64_t{1} << 31) - 1;
  expect_error<InvalidArgument>(
      [&] {
        (void)KVCacheManager(with([](CacheConfig& c) { c.swap_blocks = {kMax, kMax, kMax}; }));
      },
      "swap_blocks = [FP16 2147483647, INT4 2147483647, INT2 2147483647] needs 3573412788608 bytes of host swap "
      "buffer, expected at most the host's physical memory");
  // One FP16 slot more than the host's memory holds.
  const auto phys =
      static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const auto slots = static_cast<std::int64_t>(phys / 1024 + 1);
  if (slots <= kMax) {
    expect_error<InvalidArgument>(
        [&] {
          (void)KVCacheManager(with([&](CacheConfig& c) { c.swap_blocks = {slots, 0, 0}; }));
        },
        "bytes of host swap buffer, expected at most the host's physical memory (" + std::to_string(phys) + " bytes)");
  }
  EXPECT_NO_THROW((void)KVCacheManager(with([](CacheConfig& c) { c.swap_blocks = {1024, 1024, 1024}; })));
}

class BadInputOnACache : public ::testing::Test {
 protected:
  BadInputOnACache() : cache(tiny_config(2, 6)) {
    cache.add_sequence(1, text(20), PrecisionPlan(2, 0));
    cache.add_sequence(2, TokenLayout({{TokenKind::Visual, 40}}), PrecisionPlan(2, 2, Precision::INT2));
  }
  KVCacheManager cache;
};

TEST_F(BadInputOnACache, Precisions) {
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.format(kBadPrecision); }, {"p = 3"});
  std::byte arena[16];
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.pool_view(kBadPrecision, arena); }, {"p = 3"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.pool_view(Precision::FP16, nullptr); }, {"arena_base"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.pool_stats(kBadPrecision); }, {"p = 3"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.blocks(1, 0, kBadPrecision); }, {"p = 3"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.ref_count(kBadPrecision, 0); }, {"p = 3"});
}

TEST_F(BadInputOnACache, PlansAndLayouts) {
  const TokenLayout five_windows({{TokenKind::Visual, 80}, {TokenKind::Text, 3}});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.demand(five_windows, PrecisionPlan(2, 3)); },
                                   {"plan.num_windows() = 3, expected 5 for this layout and block_size 16"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.demand(five_windows, PrecisionPlan(3, 5)); },
                                   {"plan.num_layers() = 3, expected 2"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.demand(TokenLayout(), PrecisionPlan(2, 0)); }, {"layout"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.add_sequence(3, five_windows, PrecisionPlan(2, 4)); },
                                   {"plan.num_windows() = 4, expected 5"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.add_sequence(3, five_windows, PrecisionPlan()); },
                                   {"plan.num_layers() = 0"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.add_sequence(3, TokenLayout(), PrecisionPlan(2, 0)); },
                                   {"layout"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.can_allocate({0, -1, 0}); }, {"blocks[INT4] = -1"});
  EXPECT_FALSE(cache.contains(3));
}

TEST_F(BadInputOnACache, SequenceIds) {
  expect_rejected<InvalidArgument>(cache, [&] { cache.add_sequence(1, text(4), PrecisionPlan(2, 0)); },
                                   {"id = 1", "already"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.num_tokens(99); }, {"id = 99"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.layout(99); }, {"id = 99"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.plan(-5); }, {"id = -5"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.prefill_mapping(99, 0); }, {"id = 99"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.blocks(99, 0, Precision::FP16); }, {"id = 99"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.fp16_tail_fill(99, 0); }, {"id = 99"});
  expect_rejected<UnknownId>(cache, [&] { cache.free_sequence(99); }, {"id = 99"});
  expect_rejected<UnknownId>(cache, [&] { cache.fork(99, 3); }, {"parent = 99"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.fork(1, 2); }, {"child = 2"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.fork(1, 1); }, {"child = 1"});

  const std::vector<SequenceId> unknown{1, 99};
  expect_rejected<UnknownId>(cache, [&] { cache.append_tokens(unknown); }, {"ids[1] = 99"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.decode_metadata(unknown); }, {"ids[1] = 99"});
  const std::vector<SequenceId> repeated{1, 2, 1};
  expect_rejected<InvalidArgument>(cache, [&] { cache.append_tokens(repeated); }, {"ids[2] = 1 repeats ids[0]"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.decode_metadata(repeated); }, {"ids[2] = 1"});

  cache.free_sequence(2);
  expect_rejected<UnknownId>(cache, [&] { cache.free_sequence(2); }, {"id = 2"});
}

TEST_F(BadInputOnACache, LayersAndBlockIds) {
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.prefill_mapping(1, 2); }, {"layer = 2", "< 2"});
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.prefill_mapping(1, -1); }, {"layer = -1"});
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.blocks(1, 5, Precision::INT2); }, {"layer = 5"});
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.fp16_tail_fill(1, 2); }, {"layer = 2"});
  // 6 slabs of 4 FP16 blocks: ids 0..23.
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.ref_count(Precision::FP16, 24); }, {"block_id = 24"});
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.ref_count(Precision::INT2, -1); }, {"block_id = -1"});
  EXPECT_EQ(cache.ref_count(Precision::FP16, 23), 0);
}

}  // namespace
}  // namespace mixkv
