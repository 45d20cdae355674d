// merge_states against cpu::merge_states (empty states included, in place),
// and demote against the CPU quantization of the same values: FP16 ->
// INT4/INT2 must equal cpu::write_head of the FP16 values byte for byte;
// INT4 -> INT2 must equal the reference quantizer applied to the INT4
// block's dequantized values (cpu::read_head).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>

#include "cuda_test_util.h"
#include "mixkv/cpu/merge_states.h"
#include "mixkv/cpu/quantize.h"
#include "mixkv/kernels/demote.h"
#include "mixkv/kernels/device_status.h"
#include "mixkv/kernels/merge_states.h"

namespace mixkv::test {
namespace {

TEST(MergeStatesCuda, MatchesCpuWithEmptyStates) {
  MIXKV_REQUIRE_CUDA();
  const int states = 37, dim = 128;
  Rng rng(1);
  std::vector<float> oa(states * dim), ob(states * dim), la(states), lb(states);
  for (auto& x : oa) x = static_cast<float>(normal(rng));
  for (auto& x : ob) x = static_cast<float>(normal(rng));
  constexpr float kEmpty = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < states; ++i) {
    la[i] = i % 4 == 1 || i % 4 == 3 ? kEmpty : static_cast<float>(normal(rng, 0, 5));
    lb[i] = i % 4 == 2 || i % 4 == 3 ? kEmpty : static_cast<float>(normal(rng, 0, 5));
  }
  std::vector<float> ref_o(states * dim), ref_l(states);
  cpu::merge_states(oa, la, ob, lb, dim, ref_o, ref_l);

  DeviceVector<float> doa(oa), dla(la), dob(ob), dlb(lb);
  DeviceVector<float> dout(states * dim), dlse(states);
  gpu::merge_states({doa.get(), dla.get(), dob.get(), dlb.get(), dout.get(), dlse.get(), states, dim, nullptr});
  const auto out = dout.to_host();
  const auto lse = dlse.to_host();
  for (int i = 0; i < states; ++i) {
    if (std::isinf(ref_l[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << i;
    } else {
      EXPECT_NEAR(lse[i], ref_l[i], 1e-5f * std::max(1.0f, std::abs(ref_l[i]))) << i;
    }
    for (int c = 0; c < dim; ++c) {
      ASSERT_TRUE(std::isfinite(out[i * dim + c])) << i;
      EXPECT_NEAR(out[i * dim + c], ref_o[i * dim + c], 1e-5f) << i << "," << c;
    }
  }
  // In place into a: same result.
  gpu::merge_states({doa.get(), dla.get(), dob.get(), dlb.get(), doa.get(), dla.get(), states, dim, nullptr});
  EXPECT_EQ(doa.to_host(), out);
}

// The reference quantizer applied to float values (the INT4 -> INT2 path):
// write_head's rules, from floats instead of halves.
void quantize_floats(const BlockFormat& f, const float* k, const float* v, std::byte* region) {
  const int S = f.block_size, D = f.head_dim, qmax = max_code(f.precision);
  std::vector<std::uint8_t> kc(S * D), vc(S * D);
  auto params = [&](float lo, float hi, std::size_t scale_at, std::size_t min_at) {
    const Half scale = float_to_half(quant_step(lo, hi, qmax));
    const Half min = float_to_half(lo);
    std::memcpy(region + scale_at, &scale, 2);
    std::memcpy(region + min_at, &min, 2);
    return std::pair<float, float>(half_to_float(scale), half_to_float(min));
  };
  for (int c = 0; c < D; ++c) {
    float lo = k[c], hi = k[c];
    for (int t = 0; t < S; ++t) lo = std::min(lo, k[t * D + c]), hi = std::max(hi, k[t * D + c]);
    const auto [s, m] = params(lo, hi, f.k_scale_offset(c), f.k_min_offset(c));
    const float inverse = quant_inverse_step(s), bias = quant_bias(m, inverse);
    for (int t = 0; t < S; ++t)
      kc[t * D + c] = static_cast<std::uint8_t>(quant_code(k[t * D + c], inverse, bias, qmax));
  }
  for (int t = 0; t < S; ++t) {
    const float lo = *std::min_element(v + t * D, v + t * D + D);
    const float hi = *std::max_element(v + t * D, v + t * D + D);
    const auto [s, m] = params(lo, hi, f.v_scale_offset(t), f.v_min_offset(t));
    const float inverse = quant_inverse_step(s), bias = quant_bias(m, inverse);
    for (int c = 0; c < D; ++c)
      vc[t * D + c] = static_cast<std::uint8_t>(quant_code(v[t * D + c], inverse, bias, qmax));
  }
  cpu::pack_codes(f, kc.data(), vc.data(), region);
}

struct DemoteCase {
  Precision src, dst;
  int dim, block;
};
class DemoteCuda : public ::testing::TestWithParam<DemoteCase> {};

TEST_P(DemoteCuda, MatchesCpuQuantization) {
  MIXKV_REQUIRE_CUDA();
  const DemoteCase c = GetParam();
  const int heads = 3, count = 5;
  TestArena arena(heads, c.dim, c.block, {count, count, 2 * count}, 21);
  Rng rng(4);
  std::vector<BlockCopy> moves;
  for (int i = 0; i < count; ++i) moves.push_back({arena.alloc(c.src), arena.alloc(c.dst)});
  // Source blocks: FP16 values, or INT4 blocks quantized from them.
  const BlockFormat sf = arena.format(c.src);
  const BlockFormat df = arena.format(c.dst);
  const std::size_t values = static_cast<std::size_t>(c.block) * c.dim;
  for (const BlockCopy& m : moves) {
    for (int h = 0; h < heads; ++h) {
      const auto k = random_halves(rng, values, 3.0);
      const auto v = random_halves(rng, values, 0.7);
      cpu::write_head(sf, k.data(), v.data(), c.dim, arena.view(c.src).block(m.src) + sf.head_offset(h));
    }
  }
  DeviceArenaCopy device(arena);
  // Expected destination heads.
  std::vector<float> k(values), v(values);
  for (const BlockCopy& m : moves) {
    for (int h = 0; h < heads; ++h) {
      const std::byte* src = arena.view(c.src).block(m.src) + sf.head_offset(h);
      std::byte* dst = arena.view(c.dst).block(m.dst) + df.head_offset(h);
      cpu::read_head(sf, src, k.data(), v.data());
      if (c.src == Precision::FP16) {
        std::vector<Half> kh(values), vh(values);
        for (std::size_t i = 0; i < values; ++i) kh[i] = float_to_half(k[i]), vh[i] = float_to_half(v[i]);
        cpu::write_head(df, kh.data(), vh.data(), c.dim, dst);
      } else {
        quantize_floats(df, k.data(), v.data(), dst);
      }
    }
  }
  DeviceVector<BlockCopy> dmoves(moves);
  gpu::demote({dmoves.get(), count, device.pools[pool_index(c.src)], device.pools[pool_index(c.dst)], nullptr});
  const auto got = device.download();
  std::size_t diffs = 0;
  for (std::size_t i = 0; i < got.size(); ++i) diffs += got[i] != arena.bytes()[i];
  EXPECT_EQ(diffs, 0u);
}

INSTANTIATE_TEST_SUITE_P(Pairs, DemoteCuda,
                         ::testing::Values(DemoteCase{Precision::FP16, Precision::INT4, 128, 32},
                                           DemoteCase{Precision::FP16, Precision::INT2, 128, 32},
                                           DemoteCase{Precision::INT4, Precision::INT2, 128, 32},
                                           DemoteCase{Precision::FP16, Precision::INT4, 64, 16},
                                           DemoteCase{Precision::INT4, Precision::INT2, 256, 64}),
                         [](const auto& info) {
                           return std::string(to_string(info.param.src)) + "_to_" +
                                  std::string(to_string(info.param.dst)) + "_D" + std::to_string(info.param.dim) +
                                  "_S" + std::to_string(info.param.block);
                         });

// demote with a src or dst one past its pool, far past it, negative: that
// move is skipped and raised by the status (naming moves[1], the value and
// the pool's limit); the other moves give the bytes a launch of only them
// gives, the context survives and the status is clear after the report.
TEST(DemoteCudaBadIds, SkippedRecordedAndRaised) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 2, dim = 128, block = 32;
  TestArena arena(heads, dim, block, {4, 4, 4}, 5);
  Rng rng(6);
  for (auto& b : arena.bytes()) b = static_cast<std::byte>(rng() & 0x3b);  // finite FP16 values
  const PoolViews host = bounded_views(arena);
  const BlockCopy first{arena.alloc(Precision::FP16), arena.alloc(Precision::INT4)};
  const BlockCopy last{arena.alloc(Precision::FP16), arena.alloc(Precision::INT4)};
  const std::vector<BlockCopy> good = {first, last};
  DeviceArenaCopy reference(arena);
  DeviceVector<BlockCopy> dgood(good);
  gpu::demote({dgood.get(), 2, reference.pools[0], reference.pools[1], nullptr});
  const std::vector<std::byte> expected = reference.download();

  gpu::DeviceStatus status;
  for (const bool dst : {false, true}) {
    const std::int32_t limit = host[dst ? 1 : 0].num_blocks;
    for (const std::int32_t bad : {limit, limit + 1, 1 << 30, INT32_MAX, -1, INT32_MIN}) {
      SCOPED_TRACE(std::string(dst ? "dst " : "src ") + std::to_string(bad));
      DeviceArenaCopy device(arena);
      const BlockCopy wrong = dst ? BlockCopy{first.src, bad} : BlockCopy{bad, last.dst};
      const std::vector<BlockCopy> moves = {first, wrong, last};
      DeviceVector<BlockCopy> dmoves(moves);
      gpu::demote({dmoves.get(), 3, device.pools[0], device.pools[1], nullptr, &status});
      expect_error_naming<IndexOutOfRange>(
          [&] { status.check(nullptr); },
          {std::string("demote: moves[1].") + (dst ? "dst" : "src") + " = " + std::to_string(bad),
           "[0, " + std::to_string(limit) + ")"});
      expect_context_usable("demote with a bad id");
      EXPECT_TRUE(device.download() == expected);
      // The next valid demote on the same context is exact.
      gpu::demote({dgood.get(), 2, device.pools[0], device.pools[1], nullptr, &status});
      EXPECT_NO_THROW(status.check(nullptr));
      EXPECT_TRUE(device.download() == expected);
    }
  }
}

// A source head holding NaN (a corrupt block) is skipped and recorded, as
// the CPU backend rejects the block; the other moves are exact.
TEST(DemoteCudaNonFinite, SourceWithNanIsSkippedRecordedAndRaised) {
  MIXKV_REQUIRE_CUDA();
  const int heads = 2, dim = 128, block = 32;
  TestArena arena(heads, dim, block, {4, 4, 4}, 5);
  Rng rng(7);
  for (auto& b : arena.bytes()) b = static_cast<std::byte>(rng() & 0x3b);  // finite FP16 values
  const PoolViews host = bounded_views(arena);
  const BlockCopy first{arena.alloc(Precision::FP16), arena.alloc(Precision::INT2)};
  const BlockCopy corrupt{arena.alloc(Precision::FP16), arena.alloc(Precision::INT2)};
  const BlockCopy last{arena.alloc(Precision::FP16), arena.alloc(Precision::INT2)};
  const std::vector<BlockCopy> good = {first, last};
  DeviceArenaCopy reference(arena);
  DeviceVector<BlockCopy> dgood(good);
  gpu::demote({dgood.get(), 2, reference.pools[0], reference.pools[2], nullptr});
  const std::vector<std::byte> expected = reference.download();

  // A NaN in head 1's V rows of the corrupt source.
  const BlockFormat f = host[0].format;
  std::byte* v = host[0].block(corrupt.src) + f.head_offset(1) + f.v_offset();
  const std::uint16_t nan_bits = 0x7e00;
  std::memcpy(v + 2 * (5 * dim + 17), &nan_bits, sizeof nan_bits);
  DeviceArenaCopy device(arena);
  const std::vector<std::byte> before = device.download();
  const std::vector<BlockCopy> moves = {first, corrupt, last};
  DeviceVector<BlockCopy> dmoves(moves);
  gpu::DeviceStatus status;
  gpu::demote({dmoves.get(), 3, device.pools[0], device.pools[2], nullptr, &status});
  expect_error_naming<InvalidArgument>([&] { status.check(nullptr); },
                                       {"demote: moves[1].src holds NaN or inf (head 1)", "skipped"});
  expect_context_usable("demote of a NaN block");
  // The corrupt move's NaN head wrote nothing (each head is a CTA and is
  // checked on its own); the good moves are exact.
  const std::vector<std::byte> after = device.download();
  const std::size_t int2_bytes = host[2].format.block_bytes();
  auto block_range = [&](Precision p, std::int32_t id) {
    const std::size_t begin = static_cast<std::size_t>(host[pool_index(p)].block(id) - arena.bytes().data());
    return std::pair{begin, begin + host[pool_index(p)].format.block_bytes()};
  };
  const auto [c0, c1] = block_range(Precision::INT2, corrupt.dst);
  const BlockFormat g = host[2].format;
  const std::size_t h0 = c0 + g.head_offset(1);
  const std::size_t h1 = h0 + g.head_bytes();
  EXPECT_TRUE(std::equal(after.begin() + h0, after.begin() + h1, before.begin() + h0));
  for (const BlockCopy& m : good) {
    const auto [b0, b1] = block_range(Precision::INT2, m.dst);
    EXPECT_TRUE(std::equal(after.begin() + b0, after.begin() + b1, expected.begin() + b0));
  }
  EXPECT_EQ(int2_bytes, static_cast<std::size_t>(c1 - c0));
}

TEST(DemoteCudaBadInput, RejectsPromotion) {
  gpu::DemoteArgs args;
  args.src_pool.format.precision = Precision::INT2;
  args.dst_pool.format.precision = Precision::INT4;
  MIXKV_EXPECT_INVALID(gpu::demote(args), "expected (FP16, INT4), (FP16, INT2) or (INT4, INT2)");
}

}  // namespace
}  // namespace mixkv::test
