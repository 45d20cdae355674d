// swap_blocks and demote against bad ids and corrupt blocks; quant_code on
// NaN. Every rejected call names the argument and its limit and leaves every
// byte of the arena and the swap buffer as it was.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_test_util.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/swap.h"

namespace mixkv::test {
namespace {

constexpr std::int32_t kHeads = 2;
constexpr std::int32_t kDim = 32;
constexpr std::int32_t kBlock = 16;
constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min();

// A host swap buffer of `slots[p]` blocks per pool, laid out as
// KVCacheManager::swap_layout does (each pool one "slab", num_blocks its
// slots, 0 for a pool without any).
class SwapBuffer {
 public:
  SwapBuffer(const TestArena& arena, std::array<std::int32_t, kNumPrecisions> slots) {
    std::size_t bytes = 0;
    std::array<std::size_t, kNumPrecisions> offsets{};
    for (Precision p : kAllPrecisions) {
      offsets[pool_index(p)] = bytes;
      bytes += static_cast<std::size_t>(slots[pool_index(p)]) * arena.format(p).block_bytes();
    }
    bytes_.assign(bytes + 1, std::byte{0x5a});
    for (Precision p : kAllPrecisions) {
      const int i = pool_index(p);
      const BlockFormat f = arena.format(p);
      const std::int32_t per_slab = std::max(slots[i], 1);
      views_[i] = PoolView{bytes_.data() + offsets[i], per_slab * f.block_bytes(), per_slab, f, slots[i]};
    }
  }
  const PoolViews& views() const { return views_; }
  std::vector<std::byte>& bytes() { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
  PoolViews views_{};
};

class SwapBadInput : public ::testing::Test {
 protected:
  SwapBadInput() : arena_(kHeads, kDim, kBlock, {6, 6, 6}), swap_(arena_, {3, 2, 1}) {
    Rng rng(7);
    for (std::byte& b : arena_.bytes()) b = static_cast<std::byte>(rng());
    arena_before_ = arena_.bytes();
    swap_before_ = swap_.bytes();
  }
  void expect_out_of_range(const std::vector<SwapCopy>& copies, SwapDirection direction, const PoolViews& host,
                           const std::string& name) {
    MIXKV_EXPECT_OUT_OF_RANGE(cpu::swap_blocks(copies, direction, arena_.views(), host), name);
    EXPECT_EQ(arena_.bytes(), arena_before_) << name;
    EXPECT_EQ(swap_.bytes(), swap_before_) << name;
  }

  TestArena arena_;
  SwapBuffer swap_;
  std::vector<std::byte> arena_before_, swap_before_;
};

TEST_F(SwapBadInput, DeviceBlocksAndHostSlotsAreBoundedByTheirPools) {
  for (Precision p : kAllPrecisions) {
    const std::int32_t blocks = arena_.view(p).num_blocks;
    const std::int32_t slots = swap_.views()[pool_index(p)].num_blocks;
    const std::string pool(to_string(p));
    for (SwapDirection d : {SwapDirection::DeviceToHost, SwapDirection::HostToDevice}) {
      for (std::int32_t bad : {blocks, blocks + 1, 1000000, kMax, -1, kMin}) {
        // The first copy is valid: nothing is copied before the bad one is seen.
        expect_out_of_range({{p, 0, 0}, {p, bad, 0}}, d, swap_.views(),
                            "copies[1].device_block = " + std::to_string(bad) +
                                ", expected 0 <= copies[1].device_block < " + std::to_string(blocks) + " (device[" +
                                pool + "].num_blocks)");
      }
      for (std::int32_t bad : {slots, slots + 1, 1000000, kMax, -1, kMin}) {
        expect_out_of_range({{p, 0, 0}, {p, 1, bad}}, d, swap_.views(),
                            "copies[1].host_slot = " + std::to_string(bad) + ", expected 0 <= copies[1].host_slot < " +
                                std::to_string(slots) + " (host[" + pool + "].num_blocks)");
      }
    }
  }
  // The last device block and the last host slot of each pool are in range.
  for (Precision p : kAllPrecisions) {
    const std::vector<SwapCopy> last = {
        {p, arena_.view(p).num_blocks - 1, swap_.views()[pool_index(p)].num_blocks - 1}};
    EXPECT_NO_THROW(cpu::swap_blocks(last, SwapDirection::DeviceToHost, arena_.views(), swap_.views()));
  }
  EXPECT_NE(swap_.bytes(), swap_before_);
}

TEST_F(SwapBadInput, NoSwapPoolRefusesEveryCopy) {
  const SwapBuffer none(arena_, {0, 0, 0});
  for (Precision p : kAllPrecisions) {
    expect_out_of_range({{p, 0, 0}}, SwapDirection::DeviceToHost, none.views(),
                        "copies[0].host_slot = 0, expected 0 <= copies[0].host_slot < 0");
  }
  EXPECT_NO_THROW(cpu::swap_blocks({}, SwapDirection::HostToDevice, arena_.views(), none.views()));
}

TEST_F(SwapBadInput, PoolAndDirection) {
  MIXKV_EXPECT_INVALID(cpu::swap_blocks(std::vector<SwapCopy>{{static_cast<Precision>(3), 0, 0}},
                                        SwapDirection::DeviceToHost, arena_.views(), swap_.views()),
                       "copies[0].pool = 3");
  MIXKV_EXPECT_INVALID(cpu::swap_blocks(std::vector<SwapCopy>{{Precision::FP16, 0, 0}}, static_cast<SwapDirection>(7),
                                        arena_.views(), swap_.views()),
                       "direction = 7");
  EXPECT_EQ(arena_.bytes(), arena_before_);
  EXPECT_EQ(swap_.bytes(), swap_before_);
}

// Demote: a prompt stored through store_prefill, then moved down.
class DemoteBadInput : public ::testing::Test {
 protected:
  DemoteBadInput() : arena_(kHeads, kDim, kBlock, {4, 4, 4}) {
    Rng rng(11);
    const std::size_t row = static_cast<std::size_t>(kHeads) * kDim;
    const std::vector<Half> k = random_halves(rng, 2 * kBlock * row, 2.0);
    const std::vector<Half> v = random_halves(rng, 2 * kBlock * row);
    // Rows 0..15 FP16 (block fp16_), rows 16..31 INT4 (block int4_).
    fp16_ = arena_.alloc(Precision::FP16);
    int4_ = arena_.alloc(Precision::INT4);
    StoreMapping m;
    for (std::int32_t r = 0; r < kBlock; ++r) m.fp16_slots.push_back(fp16_ * kBlock + r);
    m.fp16_slots.resize(2 * kBlock, -1);
    m.int4_windows = {{int4_, kBlock}};
    cpu::store_prefill(k, v, m, arena_.views());
    to_int4_ = arena_.alloc(Precision::INT4);
    to_int2_ = arena_.alloc(Precision::INT2);
    before_ = arena_.bytes();
  }
  DemoteOp op(Precision src, std::int32_t src_block, Precision dst, std::int32_t dst_block) const {
    return DemoteOp{1, 0, 1, src, src_block, dst, dst_block};
  }
  void expect_out_of_range(const std::vector<DemoteOp>& ops, const std::string& name) {
    MIXKV_EXPECT_OUT_OF_RANGE(cpu::demote(ops, arena_.views()), name);
    EXPECT_EQ(arena_.bytes(), before_) << name;
  }
  void expect_invalid(const std::vector<DemoteOp>& ops, const std::string& name) {
    MIXKV_EXPECT_INVALID(cpu::demote(ops, arena_.views()), name);
    EXPECT_EQ(arena_.bytes(), before_) << name;
  }
  // Writes `bits` at byte `offset` of head 1 of `block` in pool p.
  void poke(Precision p, std::int32_t block, std::size_t offset, std::uint16_t bits) {
    const PoolView& view = arena_.view(p);
    std::memcpy(view.block(block) + view.format.head_offset(1) + offset, &bits, sizeof bits);
    before_ = arena_.bytes();
  }

  TestArena arena_;
  std::int32_t fp16_ = 0, int4_ = 0, to_int4_ = 0, to_int2_ = 0;
  std::vector<std::byte> before_;
};

TEST_F(DemoteBadInput, ValidOpsAreAccepted) {
  cpu::demote(std::vector<DemoteOp>{op(Precision::FP16, fp16_, Precision::INT4, to_int4_),
                                    op(Precision::INT4, int4_, Precision::INT2, to_int2_)},
              arena_.views());
  EXPECT_NE(arena_.bytes(), before_);
}

TEST_F(DemoteBadInput, BlocksAreBoundedByTheirPools) {
  for (Precision src : {Precision::FP16, Precision::INT4}) {
    const std::int32_t n = arena_.view(src).num_blocks;
    const std::string pool = "pools[" + std::string(to_string(src)) + "]";
    for (std::int32_t bad : {n, n + 1, 1000000, kMax, -1, kMin}) {
      expect_out_of_range(
          {op(Precision::FP16, fp16_, Precision::INT4, to_int4_), op(src, bad, Precision::INT2, to_int2_)},
          "ops[1].src_block = " + std::to_string(bad) + ", expected 0 <= ops[1].src_block < " + std::to_string(n) +
              " (" + pool + ".num_blocks)");
    }
  }
  for (Precision dst : {Precision::INT4, Precision::INT2}) {
    const std::int32_t n = arena_.view(dst).num_blocks;
    for (std::int32_t bad : {n, 1000000, kMax, -1, kMin}) {
      expect_out_of_range(
          {op(Precision::FP16, fp16_, dst, bad)},
          "ops[0].dst_block = " + std::to_string(bad) + ", expected 0 <= ops[0].dst_block < " + std::to_string(n));
    }
  }
}

TEST_F(DemoteBadInput, OpsThatDependOnTheirOrder) {
  expect_invalid(
      {op(Precision::FP16, fp16_, Precision::INT2, to_int2_), op(Precision::INT4, int4_, Precision::INT2, to_int2_)},
      "twice");
  // An INT4 destination that another op reads as its source.
  expect_invalid(
      {op(Precision::FP16, fp16_, Precision::INT4, int4_), op(Precision::INT4, int4_, Precision::INT2, to_int2_)},
      "ops[0].dst_block");
  expect_invalid({op(Precision::INT2, 0, Precision::INT4, 0)}, "ops[0]: (src_precision, dst_precision)");
}

// NaN or inf in a source block (a stale op, bytes written through the arena
// view) is a corrupt block: refused before anything is written.
TEST_F(DemoteBadInput, NanOrInfInTheSourceIsRejected) {
  const BlockFormat& f = arena_.format(Precision::FP16);
  for (std::uint16_t bits : {std::uint16_t{0x7e00}, std::uint16_t{0x7c00}, std::uint16_t{0xfc00}}) {
    DemoteBadInput::poke(Precision::FP16, fp16_, f.v_offset() + 5 * kDim * sizeof(Half) + 7 * sizeof(Half), bits);
    expect_invalid(
        {op(Precision::INT4, int4_, Precision::INT2, to_int2_), op(Precision::FP16, fp16_, Precision::INT4, to_int4_)},
        "ops[1]: FP16 block " + std::to_string(fp16_) + " head 1: V token 5");
  }
  const BlockFormat& q = arena_.format(Precision::INT4);
  poke(Precision::INT4, int4_, q.k_scale_offset(3), 0x7e00);  // K channel 3's scale: NaN
  expect_invalid({op(Precision::INT4, int4_, Precision::INT2, to_int2_)},
                 "ops[0]: INT4 block " + std::to_string(int4_) + " head 1: K ");
}

// Finite INT4 parameters whose values INT2's FP16 min or step cannot hold
// (a corrupt block: min and scale at 65504 dequantize up to ~1e6).
TEST_F(DemoteBadInput, ValuesBeyondFp16RangeAreRejected) {
  const BlockFormat& q = arena_.format(Precision::INT4);
  poke(Precision::INT4, int4_, q.v_scale_offset(2), 0x7bff);  // 65504
  poke(Precision::INT4, int4_, q.v_min_offset(2), 0x7bff);
  expect_invalid({op(Precision::INT4, int4_, Precision::INT2, to_int2_)}, "V token 2 spans");
}

// The widest legitimate INT4 group (FP16 -65504 .. 65504) dequantizes up to
// 65536: still demotable, with finite INT2 parameters.
TEST_F(DemoteBadInput, WidestLegitimateGroupIsDemoted) {
  const std::size_t row = static_cast<std::size_t>(kHeads) * kDim;
  std::vector<Half> k(kBlock * row, float_to_half(0.0f)), v(kBlock * row, float_to_half(1.0f));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = float_to_half(i % 2 ? 65504.0f : -65504.0f);
  StoreMapping m;
  m.fp16_slots.assign(kBlock, -1);
  const std::int32_t wide = arena_.alloc(Precision::INT4);
  m.int4_windows = {{wide, 0}};
  cpu::store_prefill(k, v, m, arena_.views());
  cpu::demote(std::vector<DemoteOp>{op(Precision::INT4, wide, Precision::INT2, to_int2_)}, arena_.views());
  std::vector<float> k2(kBlock * kDim), v2(k2.size());
  const PoolView& int2 = arena_.view(Precision::INT2);
  cpu::read_head(int2.format, int2.block(to_int2_), k2.data(), v2.data());
  for (float x : k2) EXPECT_TRUE(std::isfinite(x));
}

// The last line: NaN never reaches the float-to-int conversion (UBSan would
// stop the run), whatever the caller checked.
TEST(QuantCode, NanAndInfinityNeverReachTheConversion) {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(quant_code(nan, 1.0f, 0.5f, 15), 0);
  EXPECT_EQ(quant_code(1.0f, nan, 0.5f, 15), 0);
  EXPECT_EQ(quant_code(1.0f, 1.0f, nan, 3), 0);
  EXPECT_EQ(quant_code(inf, 0.0f, 0.5f, 15), 0);  // inf * 0
  EXPECT_EQ(quant_code(inf, 1.0f, 0.5f, 15), 15);
  EXPECT_EQ(quant_code(-inf, 1.0f, 0.5f, 15), 0);
  EXPECT_EQ(quant_code(2.0f, 1.0f, 0.5f, 15), 2);
}

}  // namespace
}  // namespace mixkv::test
