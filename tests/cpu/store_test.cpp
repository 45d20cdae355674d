// store_prefill, append and copy_blocks on a hand-made arena.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>

#include "cpu_test_util.h"

namespace mixkv::test {
namespace {

constexpr std::int32_t kHeads = 3;
constexpr std::int32_t kDim = 64;
constexpr std::int32_t kBlock = 16;
constexpr std::size_t kRow = static_cast<std::size_t>(kHeads) * kDim;

// K and V of one head of one FP16 token, read back from the arena.
std::vector<Half> fp16_token(const PoolView& pool, std::int32_t slot, std::int32_t head, bool want_v) {
  const BlockFormat& f = pool.format;
  std::vector<float> k(f.block_size * f.head_dim), v(k.size());
  cpu::read_head(f, pool.block(slot / f.block_size) + f.head_offset(head), k.data(), v.data());
  std::vector<Half> out(f.head_dim);
  const float* src = (want_v ? v.data() : k.data()) + (slot % f.block_size) * f.head_dim;
  for (int c = 0; c < f.head_dim; ++c) out[c] = float_to_half(src[c]);
  return out;
}

std::vector<Half> row_head(const std::vector<Half>& rows, std::size_t row, std::int32_t head) {
  const auto first = rows.begin() + static_cast<std::ptrdiff_t>(row * kRow + head * kDim);
  return {first, first + kDim};
}

TEST(StorePrefill, WritesFp16RowsAndQuantizedWindows) {
  TestArena arena(kHeads, kDim, kBlock, {8, 4, 4});
  Rng rng(21);
  // 2 sequences, rows concatenated: 37 tokens (window 0 INT4, window 1 INT2,
  // 5 FP16 tail rows) then 20 tokens (window 0 FP16, 4 FP16 tail rows).
  std::vector<SequenceData> seqs(2);
  seqs[0] = {37, random_halves(rng, 37 * kRow), random_halves(rng, 37 * kRow), {Precision::INT4, Precision::INT2}};
  seqs[1] = {20, random_halves(rng, 20 * kRow), random_halves(rng, 20 * kRow), {Precision::FP16}};
  const PlacedBatch placed = place_batch(arena, seqs);

  // Each sequence's tokens, read back from its page lists in table order,
  // are a permutation of the expected (dequantized) rows.
  const auto& tables = placed.tables;
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    for (std::int32_t h = 0; h < kHeads; ++h) {
      std::vector<std::vector<float>> got, want;
      for (Precision p : kAllPrecisions) {
        const auto& table = tables[pool_index(p)];
        const PoolView& pool = arena.view(p);
        for (std::int32_t j = table.indptr[s]; j < table.indptr[s + 1]; ++j) {
          std::vector<float> k(kBlock * kDim), v(k.size());
          cpu::read_head(pool.format, pool.block(table.indices[j]) + pool.format.head_offset(h), k.data(), v.data());
          const std::int32_t n = j + 1 == table.indptr[s + 1] ? table.last_block_len[s] : kBlock;
          for (std::int32_t t = 0; t < n; ++t) {
            std::vector<float> token(k.begin() + t * kDim, k.begin() + (t + 1) * kDim);
            token.insert(token.end(), v.begin() + t * kDim, v.begin() + (t + 1) * kDim);
            got.push_back(std::move(token));
          }
        }
      }
      const ExpectedKV& e = placed.expected[s];
      for (std::int32_t t = 0; t < seqs[s].tokens; ++t) {
        std::vector<float> token(e.k[h].begin() + t * kDim, e.k[h].begin() + (t + 1) * kDim);
        token.insert(token.end(), e.v[h].begin() + t * kDim, e.v[h].begin() + (t + 1) * kDim);
        want.push_back(std::move(token));
      }
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      EXPECT_EQ(got, want) << "sequence " << s << " head " << h;
    }
  }
  // Sequence 0's FP16 block holds 5 tokens: the other 11 rows were not touched.
  const std::int32_t tail = tables[0].indices[tables[0].indptr[0]];
  std::vector<float> k(kBlock * kDim), v(k.size());
  cpu::read_head(arena.format(Precision::FP16), arena.view(Precision::FP16).block(tail), k.data(), v.data());
  EXPECT_EQ(std::count_if(k.begin(), k.end(), [](float x) { return std::isnan(x); }), 11 * kDim);
}

TEST(StorePrefill, Fp16SlotsAreExactCopies) {
  TestArena arena(kHeads, kDim, kBlock, {4, 1, 1});
  Rng rng(22);
  const std::vector<Half> k = random_halves(rng, 3 * kRow), v = random_halves(rng, 3 * kRow);
  const std::int32_t block = arena.alloc(Precision::FP16);
  StoreMapping mapping;
  mapping.fp16_slots = {block * kBlock + 9, block * kBlock + 0, block * kBlock + 15};
  cpu::store_prefill(k, v, mapping, arena.views());
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::int32_t h = 0; h < kHeads; ++h) {
      EXPECT_EQ(fp16_token(arena.view(Precision::FP16), mapping.fp16_slots[r], h, false), row_head(k, r, h));
      EXPECT_EQ(fp16_token(arena.view(Precision::FP16), mapping.fp16_slots[r], h, true), row_head(v, r, h));
    }
  }
}

TEST(StorePrefill, EmptyMappingWritesNothing) {
  TestArena arena(kHeads, kDim, kBlock, {1, 1, 1});
  const std::vector<std::byte> before = arena.bytes();
  cpu::store_prefill({}, {}, StoreMapping{}, arena.views());
  EXPECT_EQ(arena.bytes(), before);
}

TEST(Append, WritesOneTokenPerSlot) {
  TestArena arena(kHeads, kDim, kBlock, {4, 1, 1});
  Rng rng(23);
  const std::int32_t a = arena.alloc(Precision::FP16);
  const std::int32_t b = arena.alloc(Precision::FP16);
  const std::vector<std::int32_t> slots = {a * kBlock + 4, b * kBlock + 15, a * kBlock + 5};
  const std::vector<Half> k = random_halves(rng, 3 * kRow), v = random_halves(rng, 3 * kRow);
  cpu::append(k, v, slots, arena.view(Precision::FP16));
  for (std::size_t i = 0; i < slots.size(); ++i) {
    for (std::int32_t h = 0; h < kHeads; ++h) {
      EXPECT_EQ(fp16_token(arena.view(Precision::FP16), slots[i], h, false), row_head(k, i, h));
      EXPECT_EQ(fp16_token(arena.view(Precision::FP16), slots[i], h, true), row_head(v, i, h));
    }
  }
  // Only the three tokens' bytes changed: 3 tokens x heads x (K + V) x dim halves.
  const std::size_t poisoned = std::count(arena.bytes().begin(), arena.bytes().end(), kPoison);
  EXPECT_GT(arena.bytes().size() - poisoned, 0u);
  EXPECT_LE(arena.bytes().size() - poisoned, 3u * kHeads * 2 * kDim * 2);
}

// Slot -1 pads a batch: its row is neither written nor checked, so it may
// hold anything (a CUDA graph's static buffer from an earlier step).
TEST(Append, PaddingRowsAreSkipped) {
  TestArena arena(kHeads, kDim, kBlock, {4, 1, 1});
  Rng rng(29);
  const std::int32_t a = arena.alloc(Precision::FP16);
  const std::vector<std::int32_t> slots = {-1, a * kBlock + 7, -1};
  std::vector<Half> k = random_halves(rng, 3 * kRow), v = random_halves(rng, 3 * kRow);
  k[3] = Half{0x7e00};             // NaN in padding row 0
  v[2 * kRow + 1] = Half{0xfc00};  // -inf in padding row 2
  cpu::append(k, v, slots, arena.view(Precision::FP16));
  for (std::int32_t h = 0; h < kHeads; ++h) {
    EXPECT_EQ(fp16_token(arena.view(Precision::FP16), slots[1], h, false), row_head(k, 1, h));
    EXPECT_EQ(fp16_token(arena.view(Precision::FP16), slots[1], h, true), row_head(v, 1, h));
  }
  const std::size_t poisoned = std::count(arena.bytes().begin(), arena.bytes().end(), kPoison);
  EXPECT_LE(arena.bytes().size() - poisoned, 1u * kHeads * 2 * kDim * 2);
  // The written rows are still checked, and named by their index in k.
  k[kRow + 2] = Half{0x7c00};
  MIXKV_EXPECT_INVALID(cpu::append(k, v, slots, arena.view(Precision::FP16)), "k[" + std::to_string(kRow + 2) + "]");
}

TEST(CopyBlocks, CopiesWholeBlocks) {
  for (Precision p : kAllPrecisions) {
    TestArena arena(kHeads, kDim, kBlock, {8, 8, 8});
    Rng rng(24);
    const PoolView& pool = arena.view(p);
    const std::int32_t s1 = arena.alloc(p), s2 = arena.alloc(p);
    const std::int32_t d1 = arena.alloc(p), d2 = arena.alloc(p), d3 = arena.alloc(p);
    for (std::int32_t id : {s1, s2}) {
      for (std::size_t i = 0; i < pool.format.block_bytes(); ++i) pool.block(id)[i] = static_cast<std::byte>(rng());
    }
    std::vector<std::byte> expected = arena.bytes();
    std::memcpy(expected.data() + (pool.block(d1) - arena.bytes().data()), pool.block(s1), pool.format.block_bytes());
    std::memcpy(expected.data() + (pool.block(d2) - arena.bytes().data()), pool.block(s2), pool.format.block_bytes());
    std::memcpy(expected.data() + (pool.block(d3) - arena.bytes().data()), pool.block(s1), pool.format.block_bytes());
    const std::vector<BlockCopy> copies = {{s1, d1}, {s2, d2}, {s1, d3}};  // one source, two copies
    cpu::copy_blocks(copies, pool);
    EXPECT_EQ(arena.bytes(), expected) << to_string(p);
  }
}

// Bad input: each call throws InvalidArgument naming the argument and
// leaves every byte of the arena as it was.
class StoreBadInput : public ::testing::Test {
 protected:
  StoreBadInput() : arena_(kHeads, kDim, kBlock, {8, 4, 4}) {
    Rng rng(25);
    k_ = random_halves(rng, 40 * kRow);
    v_ = random_halves(rng, 40 * kRow);
    // Rows 0..15 INT4, 16..31 INT2, 32..39 FP16.
    mapping_.int4_windows = {{arena_.alloc(Precision::INT4), 0}};
    mapping_.int2_windows = {{arena_.alloc(Precision::INT2), 16}};
    mapping_.fp16_slots.assign(40, -1);
    const std::int32_t block = arena_.alloc(Precision::FP16);
    for (int r = 32; r < 40; ++r) mapping_.fp16_slots[r] = block * kBlock + (r - 32);
    before_ = arena_.bytes();
  }
  void expect_rejected(const StoreMapping& mapping, const std::string& name) {
    MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping, arena_.views()), name);
    EXPECT_EQ(arena_.bytes(), before_);
  }
  void expect_out_of_range(const StoreMapping& mapping, const std::string& name) {
    MIXKV_EXPECT_OUT_OF_RANGE(cpu::store_prefill(k_, v_, mapping, arena_.views()), name);
    EXPECT_EQ(arena_.bytes(), before_);
  }

  TestArena arena_;
  std::vector<Half> k_, v_;
  StoreMapping mapping_;
  std::vector<std::byte> before_;
};

TEST_F(StoreBadInput, ValidMappingIsAccepted) {
  cpu::store_prefill(k_, v_, mapping_, arena_.views());
  EXPECT_NE(arena_.bytes(), before_);
}

TEST_F(StoreBadInput, StorePrefill) {
  const std::vector<Half> short_k(k_.begin(), k_.end() - 1);
  MIXKV_EXPECT_INVALID(cpu::store_prefill(short_k, v_, mapping_, arena_.views()), "k has");
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, short_k, mapping_, arena_.views()), "v has");
  StoreMapping m = mapping_;
  m.fp16_slots[35] = -2;
  expect_out_of_range(m, "mapping.fp16_slots[35] = -2, expected -1 (a quantized row) or 0 <= mapping.fp16_slots[35]");
  m = mapping_;
  m.fp16_slots[35] = m.fp16_slots[36];
  expect_rejected(m, "mapping.fp16_slots");
  m = mapping_;
  m.int4_windows[0].block_id = -1;
  expect_out_of_range(m, "mapping.int4_windows[0].block_id = -1");
  m = mapping_;
  m.int2_windows[0].first_row = 30;  // runs past row 39 and over FP16 rows
  expect_rejected(m, "mapping.int2_windows[0]");
  m = mapping_;
  m.int2_windows[0].first_row = 24;  // fits, but covers FP16 rows 32..39
  expect_rejected(m, "mapping.int2_windows[0]");
  m = mapping_;
  m.int2_windows[0].first_row = -1;
  expect_rejected(m, "mapping.int2_windows[0].first_row");
  m = mapping_;
  m.int4_windows.push_back({m.int4_windows[0].block_id + 1, 8});  // overlaps window 0
  expect_rejected(m, "mapping.int4_windows[1]");
  m = mapping_;
  m.int2_windows.clear();  // rows 16..31 go nowhere
  expect_rejected(m, "mapping.fp16_slots[16]");
  m = mapping_;
  m.fp16_slots.resize(56, -1);
  m.int2_windows.push_back({m.int2_windows[0].block_id, 40});  // one block, two windows
  MIXKV_EXPECT_INVALID(
      cpu::store_prefill(std::vector<Half>(56 * kRow), std::vector<Half>(56 * kRow), m, arena_.views()),
      "mapping.int2_windows block ids");
  EXPECT_EQ(arena_.bytes(), before_);
}

TEST_F(StoreBadInput, NonFiniteValuesNameKOrV) {
  // In the last FP16 row: everything before it would have been writable.
  k_[39 * kRow + 5] = Half{0x7c00};
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping_, arena_.views()), "k[");
  k_[39 * kRow + 5] = Half{0};
  v_[20 * kRow + 1] = Half{0x7e00};  // inside the INT2 window
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping_, arena_.views()), "v[");
  EXPECT_EQ(arena_.bytes(), before_);
}

TEST_F(StoreBadInput, InconsistentPools) {
  PoolViews pools = arena_.views();
  pools[1].format.head_dim = 32;  // smaller, so its slab still fits and the geometry check fires
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping_, pools), "pools[INT4].format.head_dim");
  pools = arena_.views();
  pools[2].format.precision = Precision::INT4;
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping_, pools), "pools[INT2].format.precision");
  pools = arena_.views();
  pools[0].base = nullptr;
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping_, pools), "pools[FP16].base");
  pools = arena_.views();
  pools[1].blocks_per_slab = 1000;
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping_, pools), "pools[INT4].slab_bytes");
  pools = arena_.views();
  pools[2].format.num_kv_heads = 2;
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k_, v_, mapping_, pools), "pools[INT2].format.num_kv_heads");
  EXPECT_EQ(arena_.bytes(), before_);
}

TEST_F(StoreBadInput, Append) {
  const PoolView& pool = arena_.view(Precision::FP16);
  const std::vector<Half> k(2 * kRow), v(2 * kRow);
  const std::vector<std::int32_t> slots = {3, 17};
  MIXKV_EXPECT_INVALID(cpu::append(std::span(k).first(kRow), v, slots, pool), "k has");
  MIXKV_EXPECT_INVALID(cpu::append(k, std::span(v).first(kRow), slots, pool), "v has");
  MIXKV_EXPECT_OUT_OF_RANGE(cpu::append(k, v, std::vector<std::int32_t>{3, -2}, pool), "fp16_slots[1] = -2");
  MIXKV_EXPECT_INVALID(cpu::append(k, v, std::vector<std::int32_t>{3, 3}, pool), "fp16_slots");
  MIXKV_EXPECT_INVALID(cpu::append(k, v, slots, arena_.view(Precision::INT4)), "fp16_pool.format.precision");
  std::vector<Half> bad = k;
  bad[kRow + 7] = Half{0xfc00};
  MIXKV_EXPECT_INVALID(cpu::append(bad, v, slots, pool), "k[");
  MIXKV_EXPECT_INVALID(cpu::append(k, bad, slots, pool), "v[");
  EXPECT_EQ(arena_.bytes(), before_);
}

// Ids one past the end, far past it, at INT32_MAX, negative: each names the
// argument and the limit; the arena keeps every byte.
TEST_F(StoreBadInput, IdsAreBoundedByTheirPool) {
  const std::int32_t fp16_blocks = arena_.view(Precision::FP16).num_blocks;
  const std::int32_t slots = fp16_blocks * kBlock;
  for (std::int32_t bad : {slots, slots + 1, 1000000, std::numeric_limits<std::int32_t>::max(), -2, -1000000,
                           std::numeric_limits<std::int32_t>::min()}) {
    StoreMapping m = mapping_;
    m.fp16_slots[33] = bad;
    expect_out_of_range(m, "mapping.fp16_slots[33] = " + std::to_string(bad) +
                               ", expected -1 (a quantized row) or 0 <= mapping.fp16_slots[33] < " +
                               std::to_string(slots));
  }
  for (Precision p : {Precision::INT4, Precision::INT2}) {
    const std::int32_t n = arena_.view(p).num_blocks;
    const std::string name =
        p == Precision::INT4 ? "mapping.int4_windows[0].block_id" : "mapping.int2_windows[0].block_id";
    for (std::int32_t bad :
         {n, n + 1, 1000000, std::numeric_limits<std::int32_t>::max(), -1, std::numeric_limits<std::int32_t>::min()}) {
      StoreMapping m = mapping_;
      (p == Precision::INT4 ? m.int4_windows : m.int2_windows)[0].block_id = bad;
      expect_out_of_range(m,
                          name + " = " + std::to_string(bad) + ", expected 0 <= " + name + " < " + std::to_string(n));
    }
  }

  const PoolView& pool = arena_.view(Precision::FP16);
  const std::vector<Half> k(2 * kRow), v(2 * kRow);
  for (std::int32_t bad : {slots, 1000000, -2}) {
    MIXKV_EXPECT_OUT_OF_RANGE(cpu::append(k, v, std::vector<std::int32_t>{-1, bad}, pool),
                              "fp16_slots[1] = " + std::to_string(bad) +
                                  ", expected -1 (a padding row) or 0 <= fp16_slots[1] < " + std::to_string(slots));
  }
  using Copies = std::vector<BlockCopy>;
  for (std::int32_t bad : {fp16_blocks, 1000000, std::numeric_limits<std::int32_t>::max()}) {
    MIXKV_EXPECT_OUT_OF_RANGE(
        cpu::copy_blocks(Copies{{1, 2}, {3, bad}}, pool),
        "copies[1].dst = " + std::to_string(bad) + ", expected 0 <= copies[1].dst < " + std::to_string(fp16_blocks));
    MIXKV_EXPECT_OUT_OF_RANGE(cpu::copy_blocks(Copies{{bad, 2}}, pool), "copies[0].src = " + std::to_string(bad));
  }
  // A view that addresses nothing refuses every id.
  PoolView empty = pool;
  empty.num_blocks = 0;
  MIXKV_EXPECT_OUT_OF_RANGE(cpu::copy_blocks(Copies{{0, 1}}, empty),
                            "copies[0].src = 0, expected 0 <= copies[0].src < 0");
  EXPECT_EQ(arena_.bytes(), before_);

  // The last slot and the last block are in range, and inside the arena.
  EXPECT_NO_THROW(cpu::append(k, v, std::vector<std::int32_t>{slots - 1, -1}, pool));
  EXPECT_NO_THROW(cpu::copy_blocks(Copies{{0, fp16_blocks - 1}}, pool));
}

TEST_F(StoreBadInput, CopyBlocks) {
  const PoolView& pool = arena_.view(Precision::FP16);
  using Copies = std::vector<BlockCopy>;
  MIXKV_EXPECT_INVALID(cpu::copy_blocks(Copies{{1, 2}, {4, 4}}, pool), "copies[1]");
  MIXKV_EXPECT_OUT_OF_RANGE(cpu::copy_blocks(Copies{{-1, 2}}, pool), "copies[0].src = -1");
  MIXKV_EXPECT_OUT_OF_RANGE(cpu::copy_blocks(Copies{{1, -3}}, pool), "copies[0].dst = -3");
  MIXKV_EXPECT_INVALID(cpu::copy_blocks(Copies{{1, 2}, {3, 2}}, pool), "copies[].dst");
  MIXKV_EXPECT_INVALID(cpu::copy_blocks(Copies{{1, 2}, {2, 3}}, pool), "copies[0].dst");
  PoolView broken = pool;
  broken.blocks_per_slab = 0;
  MIXKV_EXPECT_INVALID(cpu::copy_blocks(Copies{{1, 2}}, broken), "pool.blocks_per_slab");
  EXPECT_EQ(arena_.bytes(), before_);
}

}  // namespace
}  // namespace mixkv::test
