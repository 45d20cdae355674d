// store_prefill, append and copy_blocks on the device against the CPU
// reference: the whole arena must come back byte for byte identical (FP16
// copies exactly; INT4/INT2 codes and FP16 (scale, min) bit-exact, because
// both sides apply quant_math.h with IEEE division and no FMA contraction).
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <tuple>

#include "cuda_test_util.h"
#include "mixkv/cpu/store.h"
#include "mixkv/kernels/demote.h"
#include "mixkv/kernels/device_status.h"
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

// Stores c.rows random rows (which `edit` may then overwrite) through a
// random mapping on both backends; the arenas must agree byte for byte.
template <typename Edit>
void expect_store_matches_cpu(const StoreCase& c, Edit edit) {
  const int windows = (c.rows + c.block - 1) / c.block;
  TestArena arena(c.heads, c.dim, c.block, {windows + 1, windows + 1, windows + 1}, 7);
  DeviceArenaCopy device(arena);  // same poisoned bytes before the store
  Rng rng(11);
  const StoreMapping mapping = random_mapping(arena, c.rows, c.block, rng);
  const std::size_t values = static_cast<std::size_t>(c.rows) * c.heads * c.dim;
  std::vector<Half> k = random_halves(rng, values, 2.0);
  std::vector<Half> v = random_halves(rng, values, 0.5);
  edit(k, v);

  cpu::store_prefill(k, v, mapping, bounded_views(arena));

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
  EXPECT_EQ(diffs, 0u) << "first differing byte at " << first_diff << " (int4 windows " << mapping.int4_windows.size()
                       << ", int2 windows " << mapping.int2_windows.size() << ")";
}

TEST_P(StorePrefillCuda, MatchesCpuByteForByte) {
  MIXKV_REQUIRE_CUDA();
  expect_store_matches_cpu(GetParam(), [](std::vector<Half>&, std::vector<Half>&) {});
}

// Groups random rows do not produce, for the device's clamping: constant K
// channels and V tokens (scale 0, every code 0), and ranges of a few dozen
// FP16 subnormal steps whose scale rounds down enough (e.g. 31 steps / 15 =
// 2.07 -> 2) that the top codes must clamp to the maximum.
TEST(StorePrefillCudaEdges, ConstantAndSubnormalGroupsMatchCpu) {
  MIXKV_REQUIRE_CUDA();
  const StoreCase c{2, 128, 32, 256};
  expect_store_matches_cpu(c, [&c](std::vector<Half>& k, std::vector<Half>& v) {
    for (int r = 0; r < c.rows; ++r) {
      const int t = r % c.block;  // token within its window
      for (int h = 0; h < c.heads; ++h) {
        const std::size_t row = (static_cast<std::size_t>(r) * c.heads + h) * c.dim;
        k[row + 5] = float_to_half(1.5f);
        k[row + 9] = float_to_half(std::ldexp(static_cast<float>(t), -24));
        for (int ch = 0; ch < c.dim; ++ch) {
          if (t == 3) v[row + ch] = float_to_half(-0.25f);
          if (t == 4) v[row + ch] = float_to_half(std::ldexp(static_cast<float>(ch), -24));
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(OddSizes, StorePrefillCuda,
                         ::testing::Values(StoreCase{1, 64, 32, 97}, StoreCase{3, 64, 32, 33}, StoreCase{4, 128, 32, 1},
                                           StoreCase{4, 128, 32, 31}, StoreCase{4, 128, 32, 97},
                                           StoreCase{2, 128, 16, 97}, StoreCase{2, 128, 64, 200},
                                           StoreCase{3, 256, 32, 97}, StoreCase{4, 128, 32, 19600},
                                           // Several tiles per persistent CTA: ~6 rounds of two stages; and tiles too
                                           // large for two stages (one stage, > 1 round on up to 132 SMs).
                                           StoreCase{4, 64, 16, 40000}, StoreCase{1, 256, 128, 40000},
                                           // Shapes with no instance of their own, through the generic one: 10 row
                                           // chunks per head (the load's column wrap), odd INT2 words per channel.
                                           StoreCase{2, 80, 48, 200}, StoreCase{3, 96, 32, 97},
                                           // FP16 rows of 256 K/V chunk pairs: two rounds of a copy unit's lanes.
                                           StoreCase{8, 256, 32, 70}),
                         [](const auto& info) {
                           const StoreCase& c = info.param;
                           return "H" + std::to_string(c.heads) + "_D" + std::to_string(c.dim) + "_S" +
                                  std::to_string(c.block) + "_rows" + std::to_string(c.rows);
                         });

TEST(AppendCuda, MatchesCpu) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 3, dim = 128, block = 32, batch = 17;
  TestArena arena(heads, dim, block, {batch, 1, 1}, 3);
  DeviceArenaCopy device(arena);
  Rng rng(5);
  std::vector<std::int32_t> slots;
  for (int i = 0; i < batch; ++i)
    slots.push_back(arena.alloc(Precision::FP16) * block + static_cast<int>(rng() % block));
  // Every third row is padding (slot -1), holding NaNs: nothing of it may land.
  for (int i = 0; i < batch; i += 3) slots[i] = -1;
  auto k = random_halves(rng, static_cast<std::size_t>(batch) * heads * dim);
  const auto v = random_halves(rng, k.size());
  for (int i = 0; i < batch; i += 3) k[static_cast<std::size_t>(i) * heads * dim + 5] = Half{0x7e00};
  cpu::append(k, v, slots, bounded_views(arena)[0]);
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
  cpu::copy_blocks(copies, bounded_views(arena)[0]);
  DeviceVector<BlockCopy> dc(copies);
  gpu::copy_blocks({dc.get(), static_cast<std::int32_t>(copies.size()), device.pools[0], nullptr});
  EXPECT_TRUE(device.download() == arena.bytes());
}

// Ids the kernels cannot trust: one past the end, far past it, negative.
std::vector<std::int32_t> bad_ids(std::int32_t limit) { return {limit, limit + 1, 1 << 30, INT32_MAX, -2, INT32_MIN}; }

// append with a slot one past the FP16 pool, far past it and negative
// (other than -1, padding): the kernel skips that row and records it; the
// host raises it as IndexOutOfRange naming the row, the value and the limit.
// The other rows land exactly, the context survives, the status is clear
// after the report, and the next append is exact. Without args.status the
// offence goes to the current device's default status.
TEST(AppendCudaBadSlots, SkippedRecordedAndRaised) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 2, dim = 64, block = 32, batch = 3;
  TestArena arena(heads, dim, block, {16, 1, 1}, 4);
  DeviceArenaCopy device(arena);
  const PoolViews host = bounded_views(arena);
  const std::int32_t limit = host[0].num_blocks * block;
  Rng rng(8);
  gpu::DeviceStatus status;
  auto run = [&](std::int32_t bad, gpu::DeviceStatus* where) {
    std::vector<std::int32_t> slots = {arena.alloc(Precision::FP16) * block + 1, bad,
                                       arena.alloc(Precision::FP16) * block + 2};
    const auto k = random_halves(rng, static_cast<std::size_t>(batch) * heads * dim);
    const auto v = random_halves(rng, k.size());
    std::vector<std::int32_t> valid = slots;
    valid[1] = -1;
    cpu::append(k, v, valid, host[0]);
    DeviceVector<Half> dk(k), dv(v);
    DeviceVector<std::int32_t> ds(slots);
    gpu::append({dk.get(), dv.get(), ds.get(), batch, device.pools[0], nullptr, where});
  };
  for (const std::int32_t bad : bad_ids(limit)) {
    SCOPED_TRACE("slot " + std::to_string(bad));
    run(bad, &status);
    expect_error_naming<IndexOutOfRange>(
        [&] { status.check(nullptr); },
        {"append: fp16_slots[1] = " + std::to_string(bad), "[0, " + std::to_string(limit) + ")"});
    EXPECT_FALSE(status.offence().has_value());
    expect_context_usable("append with a bad slot");
    EXPECT_TRUE(device.download() == arena.bytes()) << "a row other than the bad one differs, or the bad one landed";
  }
  run(limit, nullptr);
  expect_error_naming<IndexOutOfRange>([&] { gpu::DeviceStatus::for_current_device().check(nullptr); },
                                       {"fp16_slots[1] = " + std::to_string(limit)});
  // A valid append afterwards: exact, and nothing to report.
  run(-1, &status);
  EXPECT_NO_THROW(status.check(nullptr));
  EXPECT_NO_THROW(gpu::DeviceStatus::for_current_device().check(nullptr));
  EXPECT_TRUE(device.download() == arena.bytes());
}

// copy_blocks with a src or dst one past the pool, far past it, negative:
// that copy is skipped and raised by the status, the others are exact.
TEST(CopyBlocksCudaBadIds, SkippedRecordedAndRaised) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 2, dim = 64, block = 32;
  TestArena arena(heads, dim, block, {8, 1, 1}, 9);
  Rng rng(1);
  for (auto& b : arena.bytes()) b = static_cast<std::byte>(rng() & 0x3b);
  DeviceArenaCopy device(arena);
  const PoolViews host = bounded_views(arena);
  const std::int32_t limit = host[0].num_blocks;
  const BlockCopy first{arena.alloc(Precision::FP16), arena.alloc(Precision::FP16)};
  const BlockCopy last{arena.alloc(Precision::FP16), arena.alloc(Precision::FP16)};
  const std::vector<BlockCopy> good = {first, last};
  cpu::copy_blocks(good, host[0]);
  gpu::DeviceStatus status;
  for (const bool dst : {false, true}) {
    for (const std::int32_t bad : bad_ids(limit)) {
      SCOPED_TRACE(std::string(dst ? "dst " : "src ") + std::to_string(bad));
      const BlockCopy wrong = dst ? BlockCopy{first.src, bad} : BlockCopy{bad, last.dst};
      const std::vector<BlockCopy> copies = {first, wrong, last};
      DeviceVector<BlockCopy> dc(copies);
      gpu::copy_blocks({dc.get(), 3, device.pools[0], nullptr, &status});
      expect_error_naming<IndexOutOfRange>(
          [&] { status.check(nullptr); },
          {std::string("copy_blocks: copies[1].") + (dst ? "dst" : "src") + " = " + std::to_string(bad),
           "[0, " + std::to_string(limit) + ")"});
      expect_context_usable("copy_blocks with a bad id");
      EXPECT_TRUE(device.download() == arena.bytes());
    }
  }
  DeviceVector<BlockCopy> dc(good);
  gpu::copy_blocks({dc.get(), 2, device.pools[0], nullptr, &status});
  EXPECT_NO_THROW(status.check(nullptr));
  EXPECT_TRUE(device.download() == arena.bytes());
}

// A mapping's slots and window ids are checked on the host when the upload
// knows the arena: one past, far past, negative are typed errors naming the
// element and the limit, and the previous upload stays. A mapping uploaded
// without the arena is checked at store_prefill against the pools it would
// write: nothing is launched then.
TEST(StoreCudaBadIds, CheckedOnTheHostBeforeUploadAndLaunch) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 2, dim = 128, block = 32, rows = 3 * block;
  TestArena arena(heads, dim, block, {4, 4, 4}, 2);
  DeviceArenaCopy device(arena);
  const PoolLayout layout = layout_of(arena);
  StoreMapping good;
  good.fp16_slots.assign(rows, -1);
  const std::int32_t fp16_block = arena.alloc(Precision::FP16);
  for (int r = 0; r < block; ++r) good.fp16_slots[r] = fp16_block * block + r;
  good.int4_windows = {{arena.alloc(Precision::INT4), block}};
  good.int2_windows = {{arena.alloc(Precision::INT2), 2 * block}};
  gpu::DeviceStoreMapping dmap;
  dmap.upload(good, layout, nullptr);
  gpu::StorePrefillArgs before;
  dmap.fill(before);

  const std::int32_t slot_limit = layout.pools[0].num_blocks * block;
  for (const std::int32_t bad : bad_ids(slot_limit)) {
    SCOPED_TRACE("slot " + std::to_string(bad));
    StoreMapping m = good;
    m.fp16_slots[5] = bad;
    if (bad < -1) {
      MIXKV_EXPECT_INVALID(dmap.upload(m, layout, nullptr), "mapping.fp16_slots[5] = " + std::to_string(bad));
    } else {
      expect_error_naming<IndexOutOfRange>(
          [&] { dmap.upload(m, layout, nullptr); },
          {"mapping.fp16_slots[5] = " + std::to_string(bad), "[0, " + std::to_string(slot_limit) + ")"});
    }
  }
  for (const Precision p : {Precision::INT4, Precision::INT2}) {
    const std::int32_t limit = layout.pools[pool_index(p)].num_blocks;
    for (const std::int32_t bad : bad_ids(limit)) {
      SCOPED_TRACE(std::string(to_string(p)) + " block " + std::to_string(bad));
      StoreMapping m = good;
      (p == Precision::INT4 ? m.int4_windows : m.int2_windows)[0].block_id = bad;
      const std::string name =
          p == Precision::INT4 ? "mapping.int4_windows[0].block_id = " : "mapping.int2_windows[0].block_id = ";
      expect_error_naming<IndexOutOfRange>([&] { dmap.upload(m, layout, nullptr); },
                                           {name + std::to_string(bad), "[0, " + std::to_string(limit) + ")"});
    }
  }
  gpu::StorePrefillArgs after;
  dmap.fill(after);
  EXPECT_EQ(after.rows, before.rows);
  EXPECT_EQ(after.num_fp16_rows, before.num_fp16_rows);
  EXPECT_EQ(after.num_int4_windows, before.num_int4_windows);
  EXPECT_EQ(after.num_int2_windows, before.num_int2_windows);
  EXPECT_EQ(after.max_block_ids, before.max_block_ids);

  // Uploaded without the arena (only the sign checked): store_prefill
  // refuses the INT2 window one past the pool before launching anything.
  StoreMapping past = good;
  past.int2_windows[0].block_id = layout.pools[2].num_blocks;
  dmap.upload(past, block, nullptr);
  Rng rng(3);
  const std::size_t values = static_cast<std::size_t>(rows) * heads * dim;
  DeviceVector<Half> dk(random_halves(rng, values)), dv(random_halves(rng, values));
  gpu::StorePrefillArgs args;
  args.k = dk.get();
  args.v = dv.get();
  dmap.fill(args);
  args.pools = device.pools;
  expect_error_naming<IndexOutOfRange>([&] { gpu::store_prefill(args); },
                                       {"max_block_ids[INT2] = " + std::to_string(layout.pools[2].num_blocks),
                                        "[0, " + std::to_string(layout.pools[2].num_blocks) + ")"});
  expect_context_usable("a refused store_prefill");
  EXPECT_TRUE(device.download() == arena.bytes()) << "a refused store_prefill wrote";

  // The valid mapping afterwards stores exactly what the CPU stores.
  dmap.upload(good, layout, nullptr);
  gpu::StorePrefillArgs ok;
  ok.k = dk.get();
  ok.v = dv.get();
  dmap.fill(ok);
  ok.pools = device.pools;
  gpu::store_prefill(ok);
  cuda_ok(cudaDeviceSynchronize(), "store_prefill");
  // The same K/V on the host: the device copies hold what random_halves gave.
  std::vector<Half> k(values), v(values);
  cuda_ok(cudaMemcpy(k.data(), dk.get(), values * sizeof(Half), cudaMemcpyDeviceToHost), "D2H k");
  cuda_ok(cudaMemcpy(v.data(), dv.get(), values * sizeof(Half), cudaMemcpyDeviceToHost), "D2H v");
  cpu::store_prefill(k, v, good, bounded_views(arena));
  EXPECT_TRUE(device.download() == arena.bytes());
}

TEST(StoreCudaBadInput, NamesTheArgument) {
  gpu::StorePrefillArgs args;  // no pools at all: validated before any CUDA call
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args), "pools[FP16]");
  gpu::AppendArgs append_args;
  MIXKV_EXPECT_INVALID(gpu::append(append_args), "fp16_pool");
  std::byte arena[16];
  alignas(16) const Half values[8] = {};
  const std::int32_t slots[1] = {0};
  append_args.fp16_pool = {arena, sizeof(arena), 1, {Precision::FP16, 1, 64, 16}};
  append_args.batch = 1;
  append_args.k = values + 1;
  append_args.v = values;
  append_args.fp16_slots = slots;
  MIXKV_EXPECT_INVALID(gpu::append(append_args), "append: k, v: expected 16-byte aligned device pointers (k is not");
  StoreMapping bad;
  bad.fp16_slots = {0, -2};
  gpu::DeviceStoreMapping dmap;
  MIXKV_EXPECT_INVALID(dmap.upload(bad, 32, nullptr), "fp16_slots[1]");
}

// The quantizing kernels take FP16 and BF16 caches: rows of the other
// 16-bit type, or pools of different types, are refused on the host before
// any CUDA call (tests/cuda/bf16_store_test.cpp runs BF16 caches).
TEST(StoreCudaBadInput, RefusesMismatchedDtypes) {
  std::byte arena[16];
  alignas(16) const Half values[8] = {};
  gpu::StorePrefillArgs args;
  for (Precision p : kAllPrecisions) {
    args.pools[pool_index(p)] = {arena, sizeof(arena), 1, {p, 1, 64, 16, DType::BF16}};
  }
  args.k = args.v = values;
  args.rows = 1;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args), "store_prefill: dtype (of k, v) = float16: expected bfloat16");
  args.pools[0].format.dtype = DType::F16;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args), "pools[INT4].format.dtype = bfloat16: expected float16");
  gpu::DemoteArgs demote;
  demote.src_pool = args.pools[0];
  demote.dst_pool = args.pools[1];
  MIXKV_EXPECT_INVALID(gpu::demote(demote), "demote: dst_pool.format.dtype = bfloat16: expected float16");
}

// Shapes and inputs the store kernels cannot index, fit or read, rejected on the host
// before any CUDA call (the pointers are never dereferenced).
TEST(StoreCudaBadInput, RejectsShapesTheKernelCannotHold) {
  std::byte arena[16];
  alignas(16) const Half values[8] = {};
  const WindowSlot windows[1] = {};
  auto args_for = [&](std::int32_t heads, std::int32_t dim, std::int32_t block) {
    gpu::StorePrefillArgs args;
    for (Precision p : kAllPrecisions) args.pools[pool_index(p)] = {arena, sizeof(arena), 1, {p, heads, dim, block}};
    args.k = args.v = values;
    args.rows = 1;
    args.int4_windows = windows;
    args.num_int4_windows = 1;
    return args;
  };
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args_for(1 << 18, 512, 16)), "num_kv_heads * head_dim");
  gpu::StorePrefillArgs many_tiles = args_for(1, 64, 16);
  many_tiles.num_int4_windows = 1 << 30;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(many_tiles), "num_int4_windows + num_int2_windows");
  // The units kernel's shapes count 4 work items a tile at D 128, S 32.
  gpu::StorePrefillArgs many_units = args_for(1, 128, 32);
  many_units.num_int4_windows = 1 << 28;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(many_units), "expected < 2^30 / 4");
  gpu::StorePrefillArgs misaligned = args_for(1, 128, 32);
  misaligned.v = values + 1;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(misaligned),
                       "k, v: expected 16-byte aligned device pointers (k is, v is not)");
  MIXKV_EXPECT_INVALID(gpu::store_prefill(args_for(1, 512, 256)), "too large for one tile");
  gpu::StorePrefillArgs extra_fp16_rows = args_for(1, 128, 32);
  extra_fp16_rows.num_fp16_rows = 2;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(extra_fp16_rows), "num_fp16_rows = 2: expected in [0, rows = 1]");
  gpu::StorePrefillArgs null_fp16_rows = args_for(1, 128, 32);
  null_fp16_rows.num_fp16_rows = 1;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(null_fp16_rows), "fp16_rows is null");
  // One FP16 row a copy work item at 2 heads x D 512: 2^30 rows are too many.
  const gpu::RowSlot row_slots[1] = {};
  gpu::StorePrefillArgs many_fp16_rows = args_for(2, 512, 16);
  many_fp16_rows.rows = many_fp16_rows.num_fp16_rows = 1 << 30;
  many_fp16_rows.fp16_rows = row_slots;
  MIXKV_EXPECT_INVALID(gpu::store_prefill(many_fp16_rows), "num_fp16_rows = 1073741824: expected < 2^30 work items");
}

}  // namespace
}  // namespace mixkv::test
