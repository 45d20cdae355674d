// store_prefill, append and copy_blocks on the device against the CPU
// reference: the whole arena must come back byte for byte identical (FP16
// copies exactly; INT4/INT2 codes and FP16 (scale, min) bit-exact, because
// both sides apply quant_math.h with IEEE division and no FMA contraction).
#include <gtest/gtest.h>

#include <tuple>

#include "cuda_test_util.h"
#include "mixkv/cpu/store.h"
#include "mixkv/kernels/store.h"

namespace mixkv::test {
namespace {

struct StoreCase {
  int heads, dim, block;
  int rows;
};

class StorePrefillCuda : public ::testing::TestWithParam<StoreCase> {};

// Rows cut into windows of random precision; FP16 rows of the FP16 windows
// and of the tail go to shuffled slots.
StoreMapping random_mapping(TestArena& arena, int rows, int block, Rng& rng) {
  StoreMapping m;
  m.fp16_slots.assign(rows, -1);
  std::vector<std::int32_t> fp16_rows;
  for (int w = 0; w * block < rows; ++w) {
    const int first = w * block;
    const bool full = first + block <= rows;
    const int pick = full ? static_cast<int>(rng() % 3) : 0;
    if (pick == 0) {
      for (int r = first; r < std::min(rows, first + block); ++r) fp16_rows.push_back(r);
    } else {
      const Precision p = pick == 1 ? Precision::INT4 : Precision::INT2;
      (p == Precision::INT4 ? m.int4_windows : m.int2_windows).push_back({arena.alloc(p), first});
    }
  }
  std::shuffle(fp16_rows.begin(), fp16_rows.end(), rng);
  std::int32_t block_id = 0;
  for (std::size_t i = 0; i < fp16_rows.size(); ++i) {
    if (i % block == 0) block_id = arena.alloc(Precision::FP16);
    m.fp16_slots[fp16_rows[i]] = block_id * block + static_cast<std::int32_t>(i % block);
  }
  return m;
}

TEST_P(StorePrefillCuda, MatchesCpuByteForByte) {
  MIXKV_REQUIRE_CUDA();
  const StoreCase c = GetParam();
  const int windows = (c.rows + c.block - 1) / c.block;
  TestArena arena(c.heads, c.dim, c.block, {windows + 1, windows + 1, windows + 1}, 7);
  DeviceArenaCopy device(arena);  // same poisoned bytes before the store
  Rng rng(11);
  const StoreMapping mapping = random_mapping(arena, c.rows, c.block, rng);
  const std::size_t values = static_cast<std::size_t>(c.rows) * c.heads * c.dim;
  const std::vector<Half> k = random_halves(rng, values, 2.0);
  const std::vector<Half> v = random_halves(rng, values, 0.5);

  cpu::store_prefill(k, v, mapping, arena.views());

  DeviceVector<Half> dk(k), dv(v);
  gpu::DeviceStoreMapping dmap;
  dmap.upload(mapping, c.block, nullptr);
  gpu::StorePrefillArgs args;
  args.k = dk.get();
  args.v = dv.get();
  dmap.fill(args);
  args.pools = device.pools;
  gpu::store_prefill(args);
  const std::vector<std::byte> got = device.download();

  ASSERT_EQ(got.size(), arena.bytes().size());
  std::size_t first_diff = got.size();
  std::size_t diffs = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != arena.bytes()[i]) {
      if (first_diff == got.size()) first_diff = i;
      ++diffs;
    }
  }
  EXPECT_EQ(diffs, 0u) << "first differing byte at " << first_diff << " (int4 windows "
                       << mapping.int4_windows.size() << ", int2 windows " << mapping.int2_windows.size() << ")";
}

INSTANTIATE_TEST_SUITE_P(
    OddSizes, StorePrefillCuda,
    ::testing::Values(StoreCase{1, 64, 32, 97}, StoreCase{3, 64, 32, 33}, StoreCase{4, 128, 32, 1},
                      StoreCase{4, 128, 32, 31}, StoreCase{4, 128, 32, 97}, StoreCase{2, 128, 16, 97},
                      StoreCase{2, 128, 64, 200}, StoreCase{3, 256, 32, 97}, StoreCase{4, 128, 32, 19600}),
    [](const auto& info) {
      const StoreCase& c = info.param;
      return "H" + std::to_string(c.heads) + "_D" + std::to_string(c.dim) + "_S" + std::to_string(c.block) + "_rows" +
             std::to_string(c.rows);
    });

TEST(AppendCuda, MatchesCpu) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 3, dim = 128, block = 32, batch = 17;
  TestArena arena(heads, dim, block, {batch, 1, 1}, 3);
  DeviceArenaCopy device(arena);
  Rng rng(5);
  std::vector<std::int32_t> slots;
  for (int i = 0; i < batch; ++i) slots.push_back(arena.alloc(Precision::FP16) * block + static_cast<int>(rng() % block));
  const auto k = random_halves(rng, static_cast<std::size_t>(batch) * heads * dim);
  const auto v = random_halves(rng, k.size());
  cpu::append(k, v, slots, arena.view(Precision::FP16));
  DeviceVector<Half> dk(k), dv(v);
  DeviceVector<std::int32_t> ds(slots);
  gpu::AppendArgs args{dk.get(), dv.get(), ds.get(), batch, device.pools[0], nullptr};
  gpu::append(args);
  EXPECT_TRUE(device.download() == arena.bytes());
}

TEST(CopyBlocksCuda, MatchesCpu) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 2, dim = 64, block = 32;
  TestArena arena(heads, dim, block, {8, 1, 1}, 9);
  Rng rng(1);
  // Give every FP16 block distinct contents first.
  for (auto& b : arena.bytes()) b = static_cast<std::byte>(rng() & 0x3b);
  DeviceArenaCopy device(arena);
  std::vector<BlockCopy> copies;
  for (int i = 0; i < 3; ++i) copies.push_back({arena.alloc(Precision::FP16), arena.alloc(Precision::FP16)});
  cpu::copy_blocks(copies, arena.view(Precision::FP16));
  DeviceVector<BlockCopy> dc(copies);
  gpu::copy_blocks({dc.get(), static_cast<std::int32_t>(copies.size()), device.pools[0], nullptr});
  EXPECT_TRUE(device.download() == arena.bytes());
}

TEST(StoreCudaBadInput, NamesTheArgument) {
  gpu::StorePrefillArgs args;  // no pools at all: validated before any CUDA call
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args), "pools[FP16]");
  gpu::AppendArgs append_args;
  MIXKV_EXPECT_INVALID(gpu::append(append_args), "fp16_pool");
  StoreMapping bad;
  bad.fp16_slots = {0, -2};
  gpu::DeviceStoreMapping dmap;
  MIXKV_EXPECT_INVALID(dmap.upload(bad, 32, nullptr), "fp16_slots[1]");
}

}  // namespace
}  // namespace mixkv::test
