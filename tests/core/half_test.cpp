// FP16 conversion: the host must agree bit for bit with __float2half_rn, since
// every stored FP16 value, scale and minimum goes through it.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../cpu/cpu_test_util.h"
#include "mixkv/core/half.h"

namespace mixkv {
namespace {

std::uint16_t to_bits(float f) { return float_to_half(f).bits; }
float from_bits(std::uint16_t b) { return half_to_float(Half{b}); }

TEST(Half, KnownBitPatterns) {
  EXPECT_EQ(to_bits(0.0f), 0x0000);
  EXPECT_EQ(to_bits(-0.0f), 0x8000);
  EXPECT_EQ(to_bits(1.0f), 0x3c00);
  EXPECT_EQ(to_bits(-2.0f), 0xc000);
  EXPECT_EQ(to_bits(0.5f), 0x3800);
  EXPECT_EQ(to_bits(0.1f), 0x2e66);
  EXPECT_EQ(to_bits(65504.0f), 0x7bff);                  // largest finite half
  EXPECT_EQ(to_bits(std::ldexp(1.0f, -14)), 0x0400);     // smallest normal
  EXPECT_EQ(to_bits(std::ldexp(1.0f, -24)), 0x0001);     // smallest subnormal
  EXPECT_EQ(to_bits(std::ldexp(1023.0f, -24)), 0x03ff);  // largest subnormal
  EXPECT_EQ(from_bits(0x3555), 0x1.554p-2f);
  EXPECT_EQ(from_bits(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(from_bits(0x83ff), -std::ldexp(1023.0f, -24));
  EXPECT_EQ(from_bits(0x7bff), 65504.0f);
}

TEST(Half, RoundsToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -10);                           // half ulp at [1, 2)
  EXPECT_EQ(to_bits(1.0f + ulp1 / 2), 0x3c00);                        // tie, even is down
  EXPECT_EQ(to_bits(1.0f + 3 * ulp1 / 2), 0x3c02);                    // tie, even is up
  EXPECT_EQ(to_bits(std::nextafter(1.0f + ulp1 / 2, 2.0f)), 0x3c01);  // just above the tie
  EXPECT_EQ(to_bits(std::nextafter(1.0f + ulp1 / 2, 0.0f)), 0x3c00);  // just below
  EXPECT_EQ(to_bits(-(1.0f + 3 * ulp1 / 2)), 0xbc02);
  // A carry out of the mantissa raises the exponent: 2047/1024 -> 2.
  EXPECT_EQ(to_bits(2.0f - ulp1 / 4), 0x4000);
}

TEST(Half, Subnormals) {
  const float tiny = std::ldexp(1.0f, -24);
  EXPECT_EQ(to_bits(tiny / 2), 0x0000);                        // tie with 0: even
  EXPECT_EQ(to_bits(std::nextafter(tiny / 2, 1.0f)), 0x0001);  // above the tie
  EXPECT_EQ(to_bits(3 * tiny / 2), 0x0002);                    // tie, even is up
  EXPECT_EQ(to_bits(5 * tiny / 2), 0x0002);                    // tie, even is down
  EXPECT_EQ(to_bits(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(to_bits(-std::ldexp(1.0f, -30)), 0x8000);
  EXPECT_EQ(to_bits(std::ldexp(1.0f, -14) - tiny / 2), 0x0400);  // rounds up into the normals
  EXPECT_EQ(to_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(Half, InfinityNanAndOverflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(to_bits(inf), 0x7c00);
  EXPECT_EQ(to_bits(-inf), 0xfc00);
  EXPECT_EQ(to_bits(65519.0f), 0x7bff);  // below the tie with 65536
  EXPECT_EQ(to_bits(65520.0f), 0x7c00);  // the tie rounds to even, which is inf
  EXPECT_EQ(to_bits(1e10f), 0x7c00);
  EXPECT_EQ(to_bits(-1e10f), 0xfc00);
  const std::uint16_t nan = to_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  // A signalling NaN whose payload sits in the low bits must stay a NaN.
  EXPECT_NE(to_bits(std::bit_cast<float>(0x7f800001u)) & 0x03ff, 0);
  EXPECT_EQ(from_bits(0x7c00), inf);
  EXPECT_EQ(from_bits(0xfc00), -inf);
  EXPECT_TRUE(std::isnan(from_bits(0x7e00)));
  EXPECT_TRUE(std::isnan(from_bits(0xfc01)));
}

TEST(Half, AllHalvesRoundTripThroughFloat) {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = from_bits(bits);
    // Independent decoding: sign * mantissa * 2^exponent.
    const int exponent = (bits >> 10) & 0x1f;
    const int mantissa = bits & 0x3ff;
    const float sign = (bits & 0x8000) ? -1.0f : 1.0f;
    if (exponent == 0x1f) {
      if (mantissa == 0) {
        EXPECT_EQ(f, sign * std::numeric_limits<float>::infinity()) << std::hex << b;
      } else {
        EXPECT_TRUE(std::isnan(f)) << std::hex << b;
        const std::uint16_t back = to_bits(f);
        EXPECT_TRUE((back & 0x7c00) == 0x7c00 && (back & 0x3ff) != 0) << std::hex << b;
        EXPECT_EQ(back & 0x8000, bits & 0x8000) << std::hex << b;
      }
      continue;
    }
    const float expected = exponent == 0 ? sign * std::ldexp(static_cast<float>(mantissa), -24)
                                         : sign * std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
    ASSERT_EQ(f, expected) << std::hex << b;
    ASSERT_EQ(to_bits(f), bits) << std::hex << b;
  }
}

// The bulk conversion (F16C where the CPU has it) gives half_to_float's
// values for every half, at any alignment and any count (the tail past a
// multiple of 8 takes the scalar loop); NaNs stay NaNs of the same sign.
TEST(Half, BulkConversionMatchesHalfToFloat) {
  std::vector<std::byte> packed(2 * 65536 + 3);
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    std::memcpy(packed.data() + 1 + 2 * b, &bits, 2);  // odd address: unaligned
  }
  for (const std::size_t count : {std::size_t{65536}, std::size_t{65531}, std::size_t{7}, std::size_t{0}}) {
    std::vector<float> out(count + 1, -1.0f);
    halves_to_floats(packed.data() + 1, out.data(), count);
    for (std::size_t i = 0; i < count; ++i) {
      const float expected = from_bits(static_cast<std::uint16_t>(i));
      if (std::isnan(expected)) {
        ASSERT_TRUE(std::isnan(out[i]) && std::signbit(out[i]) == std::signbit(expected)) << std::hex << i;
      } else {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::bit_cast<std::uint32_t>(expected)) << std::hex << i;
      }
    }
    EXPECT_EQ(out[count], -1.0f) << "wrote past count = " << count;
  }
  float one = -1.0f;
  MIXKV_EXPECT_INVALID(halves_to_floats(nullptr, &one, 1), "halves is null");
  MIXKV_EXPECT_INVALID(halves_to_floats(packed.data(), nullptr, 1), "out is null");
  EXPECT_EQ(one, -1.0f);
  halves_to_floats(nullptr, nullptr, 0);  // nothing to convert: no error
}

#if defined(__FLT16_MAX__)
// The compiler's own float -> _Float16 conversion (IEEE round-to-nearest-even)
// as an independent oracle over random floats of every magnitude, and over
// every float near a half tie.
TEST(Half, MatchesCompilerFloat16) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  auto check = [](float f) {
    const auto expected = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    if (std::isnan(f)) return;
    ASSERT_EQ(to_bits(f), expected) << std::hexfloat << f;
  };
  for (int i = 0; i < 2'000'000; ++i) check(std::bit_cast<float>(any_bits(rng)));
  // Floats around each tie of the half grid, normals and subnormals.
  for (std::uint32_t b = 0; b < 0x7c00; b += 7) {
    const float lo = from_bits(static_cast<std::uint16_t>(b));
    const float hi = from_bits(static_cast<std::uint16_t>(b + 1));
    const float tie = lo + (hi - lo) / 2;
    for (float f : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1e9f)}) {
      check(f);
      check(-f);
    }
  }
}
#endif

}  // namespace
}  // namespace mixkv
