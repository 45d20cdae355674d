// bfloat16 on the host (bit-compatible with __nv_bfloat16 and torch's
// bfloat16: round-to-nearest-even, NaN kept), the DType vocabulary, and the
// cache's dtype as CacheShape and BlockFormat carry it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../cpu/cpu_test_util.h"
#include "mixkv/core/bfloat16.h"
#include "mixkv/core/block_format.h"
#include "mixkv/core/cache_shape.h"
#include "mixkv/core/dtype.h"
#include "mixkv/core/span16.h"

namespace mixkv {
namespace {

std::uint16_t to_bits(float f) { return float_to_bfloat16(f).bits; }
float from_bits(std::uint16_t b) { return bfloat16_to_float(BFloat16{b}); }
float from_word(std::uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

TEST(BFloat16, KnownBitPatterns) {
  EXPECT_EQ(to_bits(0.0f), 0x0000);
  EXPECT_EQ(to_bits(-0.0f), 0x8000);
  EXPECT_EQ(to_bits(1.0f), 0x3f80);
  EXPECT_EQ(to_bits(-2.0f), 0xc000);
  EXPECT_EQ(to_bits(0.1f), 0x3dcd);  // 0x3dcccccd rounds up
  EXPECT_EQ(to_bits(65504.0f), 0x4780);
  EXPECT_EQ(to_bits(1e6f), 0x4974);  // 1e6 = 0x49742400: no overflow, unlike FP16
  EXPECT_EQ(to_bits(std::numeric_limits<float>::min()), 0x0080);
  EXPECT_EQ(to_bits(std::numeric_limits<float>::denorm_min()), 0x0000);  // rounds to 0 (tie-free: below half)
  EXPECT_EQ(from_bits(0x7f7f), from_word(0x7f7f0000u));                  // largest finite
  EXPECT_EQ(from_bits(0x0001), from_word(0x00010000u));                  // smallest subnormal
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(to_bits(from_word(0x3f808000u)), 0x3f80);  // tie, even is down
  EXPECT_EQ(to_bits(from_word(0x3f818000u)), 0x3f82);  // tie, even is up
  EXPECT_EQ(to_bits(from_word(0x3f808001u)), 0x3f81);  // just above the tie
  EXPECT_EQ(to_bits(from_word(0x3f807fffu)), 0x3f80);  // just below
  EXPECT_EQ(to_bits(from_word(0xbf818000u)), 0xbf82);
  EXPECT_EQ(to_bits(from_word(0x3fff8000u)), 0x4000);  // a carry into the exponent
  EXPECT_EQ(to_bits(from_word(0x00008000u)), 0x0000);  // subnormal tie, even is down
  EXPECT_EQ(to_bits(from_word(0x00018000u)), 0x0002);  // subnormal tie, even is up
}

TEST(BFloat16, InfinityNanAndOverflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(to_bits(inf), 0x7f80);
  EXPECT_EQ(to_bits(-inf), 0xff80);
  EXPECT_EQ(to_bits(std::numeric_limits<float>::max()), 0x7f80);  // past the largest finite: inf
  EXPECT_EQ(to_bits(from_word(0x7f7f7fffu)), 0x7f7f);             // below the midpoint: stays finite
  for (std::uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7fbfffffu}) {
    const std::uint16_t b = to_bits(from_word(nan));
    EXPECT_TRUE(std::isnan(from_bits(b))) << std::hex << nan;  // a NaN never rounds into inf
    EXPECT_EQ(b & 0x8000u, (nan >> 16) & 0x8000u);
  }
  EXPECT_FALSE(float16_is_finite(DType::BF16, 0x7f80));
  EXPECT_FALSE(float16_is_finite(DType::BF16, 0xffc1));
  EXPECT_TRUE(float16_is_finite(DType::BF16, 0x7f7f));
  EXPECT_TRUE(float16_is_finite(DType::BF16, 0x7c00));  // FP16's inf is a finite bfloat16
  EXPECT_FALSE(float16_is_finite(DType::F16, 0x7c00));
}

// Every bfloat16 widens exactly and narrows back to itself (NaN to a NaN).
TEST(BFloat16, EveryValueRoundTrips) {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = from_bits(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(from_bits(to_bits(f))));
      continue;
    }
    ASSERT_EQ(to_bits(f), b);
    ASSERT_EQ(float16_value(DType::BF16, static_cast<std::uint16_t>(b)), f);
  }
}

// Random floats: the result is one of the two neighbouring bfloat16 values,
// the nearer one, the even one on a tie (checked in double).
TEST(BFloat16, RandomFloatsRoundToTheNearest) {
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) {
    const float f = from_word(rng() & 0x7effffffu);  // finite, positive, far below the overflow
    const std::uint16_t b = to_bits(f);
    const double lo = from_bits(static_cast<std::uint16_t>(b - (b > 0))), mid = from_bits(b),
                 hi = from_bits(static_cast<std::uint16_t>(b + 1));
    const double d = std::abs(mid - f);
    ASSERT_LE(d, std::abs(lo - f)) << f;
    ASSERT_LE(d, std::abs(hi - f)) << f;
  }
}

TEST(BFloat16, Float16sToFloats) {
  const std::vector<BFloat16> b{{0x3f80}, {0xc000}, {0x0001}, {0x7f7f}, {0x4974}};
  std::vector<float> out(b.size());
  float16s_to_floats(DType::BF16, reinterpret_cast<const std::byte*>(b.data()), out.data(), b.size());
  for (std::size_t i = 0; i < b.size(); ++i) EXPECT_EQ(out[i], bfloat16_to_float(b[i]));
  const std::vector<Half> h{{0x3c00}, {0x7bff}};
  float16s_to_floats(DType::F16, reinterpret_cast<const std::byte*>(h.data()), out.data(), h.size());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 65504.0f);
  EXPECT_THROW(float16s_to_floats(DType::BF16, nullptr, out.data(), 1), InvalidArgument);
  const Span16 span(b);
  EXPECT_EQ(span.dtype(), DType::BF16);
  EXPECT_EQ(span.size(), b.size());
  EXPECT_EQ(span.value(1), -2.0f);
  EXPECT_EQ(Span16(h).dtype(), DType::F16);
}

TEST(DType, NamesAndParsing) {
  EXPECT_EQ(to_string(DType::F16), "float16");
  EXPECT_EQ(to_string(DType::BF16), "bfloat16");
  EXPECT_EQ(parse_dtype("bfloat16"), DType::BF16);
  EXPECT_EQ(parse_dtype("torch.bfloat16"), DType::BF16);
  EXPECT_EQ(parse_dtype("bf16"), DType::BF16);
  EXPECT_EQ(parse_dtype("float16"), DType::F16);
  EXPECT_EQ(parse_dtype("half"), DType::F16);
  EXPECT_EQ(parse_dtype("float32"), DType::F32);
  MIXKV_EXPECT_INVALID(parse_dtype("float8", "shape.dtype"), "shape.dtype = 'float8'");
  EXPECT_TRUE(is_cache_dtype(DType::F16));
  EXPECT_TRUE(is_cache_dtype(DType::BF16));
  EXPECT_FALSE(is_cache_dtype(DType::F32));
}

TEST(CacheShapeDtype, DefaultsToF16AndValidates) {
  CacheShape s{2, 4, 128, 32};
  EXPECT_EQ(s.dtype, DType::F16);
  EXPECT_EQ(to_string(s), "CacheShape(num_layers=2, num_kv_heads=4, head_dim=128, block_size=32)");
  s.dtype = DType::BF16;
  validate(s);
  EXPECT_EQ(to_string(s), "CacheShape(num_layers=2, num_kv_heads=4, head_dim=128, block_size=32, dtype=bfloat16)");
  EXPECT_NE(s, (CacheShape{2, 4, 128, 32}));
  s.dtype = DType::F32;
  MIXKV_EXPECT_INVALID(validate(s), "shape.dtype = float32, expected float16 or bfloat16");
}

// The byte format does not depend on the 16-bit type: a BF16 cache's blocks
// are the FP16 cache's sizes and offsets.
TEST(CacheShapeDtype, BlockFormatIsTheSameSize) {
  for (Precision p : kAllPrecisions) {
    const BlockFormat f{p, 4, 128, 32};
    const BlockFormat b{p, 4, 128, 32, DType::BF16};
    EXPECT_EQ(f.block_bytes(), b.block_bytes());
    EXPECT_EQ(f.v_offset(), b.v_offset());
    if (is_quantized(p)) {
      EXPECT_EQ(f.k_scale_offset(5), b.k_scale_offset(5));
      EXPECT_EQ(f.v_min_offset(7), b.v_min_offset(7));
    }
  }
}

}  // namespace
}  // namespace mixkv
