// A BF16 cache's store_prefill, append and demote on the device against the
// CPU backend's BF16 reference: the whole arena must come back byte for byte
// identical (FP16-pool rows are the bfloat16 bits as given; INT4/INT2 codes
// and bfloat16 (scale, min) bit-exact, both sides applying quant_math.h
// with IEEE division and reciprocal), at head_dim 64, 96, 128 and 256 and
// block sizes 16, 32 and 64 (the warp-unit instances and the generic one),
// with values past FP16's range and groups of bfloat16 subnormals; and the
// 16-bit type checks: an array of the other type, or pools that disagree,
// refused naming the argument before anything is enqueued.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cuda_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/store.h"
#include "mixkv/kernels/demote.h"
#include "mixkv/kernels/device_status.h"
#include "mixkv/kernels/store.h"

namespace mixkv::test {
namespace {

// Rows cut into windows of random precision; FP16 rows of the FP16 windows
// and of the tail go to shuffled slots.
StoreMapping random_mapping(TestArena& arena, int rows, int block, Rng& rng) {
  StoreMapping m;
  m.fp16_slots.assign(rows, -1);
  std::vector<std::int32_t> fp16_rows;
  for (int w = 0; w * block < rows; ++w) {
    const int first = w * block;
    const int pick = first + block <= rows ? static_cast<int>(rng() % 3) : 0;
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

std::size_t differing_bytes(const std::vector<std::byte>& got, const std::vector<std::byte>& want, std::size_t& first) {
  std::size_t diffs = 0;
  first = got.size();
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (got[i] != want[i]) {
      if (first == got.size()) first = i;
      ++diffs;
    }
  }
  return diffs;
}

struct StoreCase {
  int heads, dim, block, rows;
  double sd;  // of the random values: 1e5 lies past FP16's 65504
};

// Stores c.rows random bfloat16 rows (which `edit` may then overwrite)
// through a random mapping on both backends; the arenas must agree.
template <typename Edit>
void expect_store_matches_cpu(const StoreCase& c, Edit edit) {
  const int windows = (c.rows + c.block - 1) / c.block;
  TestArena arena(c.heads, c.dim, c.block, {windows + 1, windows + 1, windows + 1}, 7, DType::BF16);
  DeviceArenaCopy device(arena);  // same poisoned bytes before the store
  Rng rng(11 + c.dim + c.block);
  const StoreMapping mapping = random_mapping(arena, c.rows, c.block, rng);
  const std::size_t values = static_cast<std::size_t>(c.rows) * c.heads * c.dim;
  std::vector<BFloat16> k = random_bfloats(rng, values, 2.0 * c.sd);
  std::vector<BFloat16> v = random_bfloats(rng, values, 0.5 * c.sd);
  edit(k, v);

  cpu::store_prefill(k, v, mapping, bounded_views(arena));

  DeviceVector<BFloat16> dk(k), dv(v);
  gpu::DeviceStoreMapping dmap;
  dmap.upload(mapping, c.block, nullptr);
  gpu::StorePrefillArgs args;
  args.k = dk.get();
  args.v = dv.get();
  args.dtype = DType::BF16;
  dmap.fill(args);
  args.pools = device.pools;
  gpu::store_prefill(args);
  const std::vector<std::byte> got = device.download();

  ASSERT_EQ(got.size(), arena.bytes().size());
  std::size_t first = 0;
  EXPECT_EQ(differing_bytes(got, arena.bytes(), first), 0u)
      << "first differing byte at " << first << " (int4 windows " << mapping.int4_windows.size() << ", int2 windows "
      << mapping.int2_windows.size() << ")";
}

class Bf16StorePrefillCuda : public ::testing::TestWithParam<StoreCase> {};

TEST_P(Bf16StorePrefillCuda, MatchesCpuByteForByte) {
  MIXKV_REQUIRE_CUDA();
  expect_store_matches_cpu(GetParam(), [](std::vector<BFloat16>&, std::vector<BFloat16>&) {});
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bf16StorePrefillCuda,
                         ::testing::Values(StoreCase{2, 64, 32, 256, 1.0}, StoreCase{4, 128, 16, 200, 1.0},
                                           StoreCase{2, 128, 32, 300, 1.0}, StoreCase{2, 128, 32, 300, 1e5},
                                           StoreCase{1, 128, 64, 256, 1.0}, StoreCase{3, 64, 16, 100, 1.0},
                                           StoreCase{2, 64, 64, 130, 1e5}, StoreCase{2, 256, 32, 128, 1.0},
                                           StoreCase{2, 96, 32, 96, 1.0}));

// Groups random rows do not produce: constant K channels and V tokens
// (scale 0, every code 0), ranges of bfloat16 subnormals (steps down to
// 2^-133, whose reciprocal overflows: the codes follow quant_code's
// clamps, NaN coding as 0), and a K channel spanning +-3e38, whose range
// overflows float (scale inf, every code 0), at the warp-unit shape and at
// the generic one.
TEST(Bf16StorePrefillCudaEdges, ConstantSubnormalAndHugeGroupsMatchCpu) {
  MIXKV_REQUIRE_CUDA();
  for (const StoreCase& c : {StoreCase{2, 128, 32, 256, 1.0}, StoreCase{2, 64, 16, 64, 1.0}}) {
    expect_store_matches_cpu(c, [&c](std::vector<BFloat16>& k, std::vector<BFloat16>& v) {
      for (int r = 0; r < c.rows; ++r) {
        const int t = r % c.block;  // token within its window
        for (int h = 0; h < c.heads; ++h) {
          const std::size_t row = (static_cast<std::size_t>(r) * c.heads + h) * c.dim;
          k[row + 5] = float_to_bfloat16(1.5f);
          k[row + 9] = BFloat16{static_cast<std::uint16_t>(t)};  // t x 2^-133
          k[row + 12] = float_to_bfloat16(t % 2 ? 3e38f : -3e38f);
          k[row + 17] = BFloat16{static_cast<std::uint16_t>(0x8000u | (t % 3))};  // -0, -2^-133, -2^-132
          for (int ch = 0; ch < c.dim; ++ch) {
            if (t == 3) v[row + ch] = float_to_bfloat16(-0.25f);
            if (t == 4) v[row + ch] = BFloat16{static_cast<std::uint16_t>(ch % 128)};
          }
        }
      }
    });
  }
}

// append copies BF16 rows into their FP16-pool slots as they are.
TEST(Bf16AppendCuda, CopiesTheBitsIntoTheirSlots) {
  MIXKV_REQUIRE_CUDA();
  constexpr int kHeads = 2, kDim = 128, kBlock = 32, kBatch = 5;
  TestArena arena(kHeads, kDim, kBlock, {3, 1, 1}, 5, DType::BF16);
  DeviceArenaCopy device(arena);
  Rng rng(3);
  const std::vector<BFloat16> k = random_bfloats(rng, kBatch * kHeads * kDim, 1e4);
  const std::vector<BFloat16> v = random_bfloats(rng, k.size());
  const std::int32_t block = arena.alloc(Precision::FP16);
  const std::vector<std::int32_t> slots{block * kBlock + 3, -1, block * kBlock, block * kBlock + 31, -1};
  std::vector<std::int32_t> cpu_slots;  // cpu::append has no padding rows: the rows with a slot alone
  std::vector<BFloat16> ck, cv;
  for (int b = 0; b < kBatch; ++b) {
    if (slots[b] < 0) continue;
    cpu_slots.push_back(slots[b]);
    ck.insert(ck.end(), k.begin() + b * kHeads * kDim, k.begin() + (b + 1) * kHeads * kDim);
    cv.insert(cv.end(), v.begin() + b * kHeads * kDim, v.begin() + (b + 1) * kHeads * kDim);
  }
  cpu::append(ck, cv, cpu_slots, bounded_views(arena)[pool_index(Precision::FP16)]);

  DeviceVector<BFloat16> dk(k), dv(v);
  DeviceVector<std::int32_t> dslots(slots);
  gpu::AppendArgs args;
  args.k = dk.get();
  args.v = dv.get();
  args.dtype = DType::BF16;
  args.fp16_slots = dslots.get();
  args.batch = kBatch;
  args.fp16_pool = device.pools[pool_index(Precision::FP16)];
  gpu::append(args);
  std::size_t first = 0;
  EXPECT_EQ(differing_bytes(device.download(), arena.bytes(), first), 0u) << "first differing byte at " << first;
  expect_context_usable("append");
}

// FP16 -> INT4, FP16 -> INT2 and INT4 -> INT2 of BF16 blocks: the bytes of
// cpu::demote (values past FP16's range included).
TEST(Bf16DemoteCuda, MatchesCpuByteForByte) {
  MIXKV_REQUIRE_CUDA();
  for (const int dim : {64, 128}) {
    constexpr int kHeads = 2, kBlock = 32, kWindows = 4;
    TestArena arena(kHeads, dim, kBlock, {kWindows + 1, 2 * kWindows + 1, 3 * kWindows + 1}, 9, DType::BF16);
    Rng rng(17 + dim);
    StoreMapping m;
    std::vector<std::int32_t> fp16_blocks, int4_blocks;
    for (int w = 0; w < kWindows; ++w) {
      fp16_blocks.push_back(arena.alloc(Precision::FP16));
      for (int t = 0; t < kBlock; ++t) m.fp16_slots.push_back(fp16_blocks.back() * kBlock + t);
    }
    for (int w = 0; w < kWindows; ++w) {
      int4_blocks.push_back(arena.alloc(Precision::INT4));
      m.int4_windows.push_back({int4_blocks.back(), static_cast<std::int32_t>(m.fp16_slots.size())});
      m.fp16_slots.resize(m.fp16_slots.size() + kBlock, -1);
    }
    const std::size_t values = m.fp16_slots.size() * kHeads * dim;
    const std::vector<BFloat16> k = random_bfloats(rng, values, 3e5), v = random_bfloats(rng, values);
    cpu::store_prefill(k, v, m, bounded_views(arena));
    DeviceArenaCopy device(arena);  // the stored blocks, before any demotion

    std::vector<DemoteOp> ops;
    std::vector<BlockCopy> to4, to2, from4;
    for (int w = 0; w < kWindows; ++w) {
      to4.push_back({fp16_blocks[w], arena.alloc(Precision::INT4)});
      to2.push_back({fp16_blocks[w], arena.alloc(Precision::INT2)});
      from4.push_back({int4_blocks[w], arena.alloc(Precision::INT2)});
      ops.push_back({0, 0, w, Precision::FP16, to4.back().src, Precision::INT4, to4.back().dst});
      ops.push_back({0, 0, w, Precision::FP16, to2.back().src, Precision::INT2, to2.back().dst});
      ops.push_back({0, 0, w, Precision::INT4, from4.back().src, Precision::INT2, from4.back().dst});
    }
    cpu::demote(ops, bounded_views(arena));

    const auto run = [&](const std::vector<BlockCopy>& moves, Precision src, Precision dst) {
      DeviceVector<BlockCopy> dmoves(moves);
      gpu::demote({dmoves.get(), static_cast<std::int32_t>(moves.size()), device.pools[pool_index(src)],
                   device.pools[pool_index(dst)], nullptr});
      cuda_ok(cudaDeviceSynchronize(), "demote");
    };
    run(to4, Precision::FP16, Precision::INT4);
    run(to2, Precision::FP16, Precision::INT2);
    run(from4, Precision::INT4, Precision::INT2);
    std::size_t first = 0;
    EXPECT_EQ(differing_bytes(device.download(), arena.bytes(), first), 0u)
        << "head_dim " << dim << ": first differing byte at " << first;
  }
}

// An array of the other 16-bit type, or pools of different types, is refused
// on the host naming the argument, and the arena is unchanged.
TEST(Bf16StoreCudaBadInput, MismatchedTypesAreRefusedAndChangeNothing) {
  MIXKV_REQUIRE_CUDA();
  constexpr int kHeads = 1, kDim = 64, kBlock = 16, kRows = 2 * kBlock;
  TestArena arena(kHeads, kDim, kBlock, {3, 2, 2}, 1, DType::BF16);
  DeviceArenaCopy device(arena);
  const std::vector<std::byte> before = device.download();
  Rng rng(5);
  StoreMapping m;
  m.int4_windows.push_back({arena.alloc(Precision::INT4), 0});
  m.fp16_slots.assign(kBlock, -1);
  const std::int32_t fp16 = arena.alloc(Precision::FP16);
  for (int t = 0; t < kBlock; ++t) m.fp16_slots.push_back(fp16 * kBlock + t);
  const std::vector<BFloat16> k = random_bfloats(rng, kRows * kHeads * kDim), v = random_bfloats(rng, k.size());
  DeviceVector<BFloat16> dk(k), dv(v);
  gpu::DeviceStoreMapping dmap;
  dmap.upload(m, kBlock, nullptr);
  gpu::StorePrefillArgs args;
  args.k = dk.get();
  args.v = dv.get();
  dmap.fill(args);
  args.pools = device.pools;
  args.dtype = DType::F16;  // float16 rows for a bfloat16 cache
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args),
                       "store_prefill: dtype (of k, v) = float16: expected bfloat16 (pools[FP16].format.dtype");
  args.dtype = DType::BF16;
  args.pools[pool_index(Precision::INT2)].format.dtype = DType::F16;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args),
                       "store_prefill: pools[INT2].format.dtype = float16: expected bfloat16");
  args.pools = device.pools;
  args.pools[pool_index(Precision::FP16)].format.dtype = DType::F32;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args), "pools[FP16].format.dtype = float32: expected float16 or bfloat16");

  const std::vector<std::int32_t> slots{fp16 * kBlock};
  DeviceVector<std::int32_t> dslots(slots);
  gpu::AppendArgs append;
  append.k = dk.get();
  append.v = dv.get();
  append.fp16_slots = dslots.get();
  append.batch = 1;
  append.fp16_pool = device.pools[pool_index(Precision::FP16)];
  MIXKV_EXPECT_INVALID(gpu::append(append), "append: dtype (of k, v) = float16: expected bfloat16 (fp16_pool");

  const std::vector<BlockCopy> moves{{fp16, arena.alloc(Precision::INT4)}};
  DeviceVector<BlockCopy> dmoves(moves);
  gpu::DemoteArgs demote{dmoves.get(), 1, device.pools[pool_index(Precision::FP16)],
                         device.pools[pool_index(Precision::INT4)], nullptr};
  demote.dst_pool.format.dtype = DType::F16;
  MIXKV_EXPECT_INVALID(gpu::demote(demote), "demote: dst_pool.format.dtype = float16: expected bfloat16 (src_pool");

  std::size_t first = 0;
  EXPECT_EQ(differing_bytes(device.download(), before, first), 0u) << "a refused call wrote byte " << first;
  expect_context_usable("refused calls");
  // The same calls with matching types go through.
  args.pools = device.pools;
  gpu::store_prefill(args);
  append.dtype = DType::BF16;
  gpu::append(append);
  demote.dst_pool = device.pools[pool_index(Precision::INT4)];
  gpu::demote(demote);
  expect_context_usable("the accepted calls");
}

}  // namespace
}  // namespace mixkv::test
