#pragma once
// Eight-lane float vectors for the CPU decode kernel, twice: `avx2` (AVX2,
// FMA and F16C intrinsics; callers must be compiled for, and only run on, a
// CPU with them) and `portable` (plain C++ on arrays). Every operation of
// the two gives the same bits, lane for lane: multiply-add is one rounding
// in both (vfmadd, std::fma), reductions add in the same tree, and exp is
// the same polynomial, so a kernel written once over either type computes
// the same result whichever the CPU runs.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "mixkv/core/dtype.h"
#include "mixkv/core/half.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MIXKV_HAVE_AVX2_PATH 1
#define MIXKV_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#else
#define MIXKV_HAVE_AVX2_PATH 0
#endif

namespace mixkv::cpu::simd {

// exp(x) for x <= 0 (Cephes expf): x clamped to kExpLow, n = round(x / ln 2),
// r = x - n ln 2 in two steps, a degree-7 polynomial in r, times 2^n; within
// 2 ulp. Below kExpLow the result is exp(kExpLow) ~ 1.6e-38 instead of
// smaller: softmax weights there are below 2^-125 of the largest.
inline constexpr float kExpLow = -87.0f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

namespace portable {

struct F8 {
  float v[8];
};
struct I8 {  // eight 32-bit lanes, each a zero-extended byte
  std::uint32_t v[8];
};

inline F8 zero() { return F8{}; }
inline F8 set1(float x) {
  F8 r;
  for (float& a : r.v) a = x;
  return r;
}
inline F8 load(const float* p) {
  F8 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void store(float* p, F8 a) { std::memcpy(p, a.v, sizeof a.v); }
inline F8 load_halves(const std::byte* p) {
  F8 r;
  for (int i = 0; i < 8; ++i) {
    Half h;
    std::memcpy(&h, p + 2 * i, sizeof h);
    r.v[i] = half_to_float(h);
  }
  return r;
}
inline F8 load_bfloats(const std::byte* p) {  // exact: a bfloat16 is a float's top half
  F8 r;
  for (int i = 0; i < 8; ++i) {
    std::uint16_t b;
    std::memcpy(&b, p + 2 * i, sizeof b);
    const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
    std::memcpy(&r.v[i], &bits, sizeof bits);
  }
  return r;
}
// Eight values of a cache's 16-bit type (F16 or BF16), widened exactly.
inline F8 load16(DType t, const std::byte* p) { return t == DType::BF16 ? load_bfloats(p) : load_halves(p); }
#define MIXKV_LANEWISE(name, expr) \
  inline F8 name(F8 a, F8 b) {     \
    F8 r;                          \
    for (int i = 0; i < 8; ++i) {  \
      const float x = a.v[i];      \
      const float y = b.v[i];      \
      r.v[i] = (expr);             \
    }                              \
    return r;                      \
  }
MIXKV_LANEWISE(add, x + y)
MIXKV_LANEWISE(sub, x - y)
MIXKV_LANEWISE(mul, x* y)
MIXKV_LANEWISE(max, x > y ? x : y)  // maxps: the second operand unless x > y
#undef MIXKV_LANEWISE
inline F8 fma(F8 a, F8 b, F8 c) {  // a * b + c, one rounding
  F8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
// p[i] += double(a[i]) for the 8 lanes (exact widening, one double rounding).
inline void add_to_doubles(double* p, F8 a) {
  for (int i = 0; i < 8; ++i) p[i] += static_cast<double>(a.v[i]);
}
// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): the AVX2 reduction's tree.
inline float hsum(F8 a) {
  const float* v = a.v;
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
// Lane i of the result: the sum of v[i]'s lanes as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): eight reductions at once
// (the AVX2 code's horizontal adds).
inline F8 hsum8(const F8* v) {
  F8 r;
  for (int i = 0; i < 8; ++i) {
    const float* l = v[i].v;
    r.v[i] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
  return r;
}
inline I8 load_bytes(std::uint64_t bytes) {  // byte i (little-endian) to lane i
  I8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<std::uint32_t>(bytes >> (8 * i)) & 0xffu;
  return r;
}
// float(((x >> shift) & mask) - offset) per lane: codes centred on offset.
inline F8 code_values(I8 x, int shift, std::uint32_t mask, std::int32_t offset) {
  F8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(static_cast<std::int32_t>((x.v[i] >> shift) & mask) - offset);
  return r;
}
inline F8 exp_nonpositive(F8 x) {
  F8 r;
  for (int i = 0; i < 8; ++i) {
    const float xi = x.v[i] > kExpLow ? x.v[i] : kExpLow;
    const float n = std::nearbyint(xi * kLog2e);
    float t = std::fma(n, -kLn2Hi, xi);
    t = std::fma(n, -kLn2Lo, t);
    float p = kExpPoly[0];
    for (int k = 1; k < 6; ++k) p = std::fma(p, t, kExpPoly[k]);
    const float y = std::fma(p, t * t, t) + 1.0f;
    const std::uint32_t bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    r.v[i] = y * scale;
  }
  return r;
}

}  // namespace portable

#if MIXKV_HAVE_AVX2_PATH
namespace avx2 {

#define MIXKV_AVX2_INLINE MIXKV_AVX2_TARGET __attribute__((always_inline)) inline

struct F8 {
  __m256 v;
};
struct I8 {
  __m256i v;
};

MIXKV_AVX2_INLINE F8 zero() { return {_mm256_setzero_ps()}; }
MIXKV_AVX2_INLINE F8 set1(float x) { return {_mm256_set1_ps(x)}; }
MIXKV_AVX2_INLINE F8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
MIXKV_AVX2_INLINE void store(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
MIXKV_AVX2_INLINE F8 load_halves(const std::byte* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
MIXKV_AVX2_INLINE F8 load_bfloats(const std::byte* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
}
MIXKV_AVX2_INLINE F8 load16(DType t, const std::byte* p) { return t == DType::BF16 ? load_bfloats(p) : load_halves(p); }
MIXKV_AVX2_INLINE F8 add(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
MIXKV_AVX2_INLINE F8 sub(F8 a, F8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
MIXKV_AVX2_INLINE F8 mul(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
MIXKV_AVX2_INLINE F8 max(F8 a, F8 b) { return {_mm256_max_ps(a.v, b.v)}; }
MIXKV_AVX2_INLINE F8 fma(F8 a, F8 b, F8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
MIXKV_AVX2_INLINE void add_to_doubles(double* p, F8 a) {
  _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), _mm256_cvtps_pd(_mm256_castps256_ps128(a.v))));
  _mm256_storeu_pd(p + 4, _mm256_add_pd(_mm256_loadu_pd(p + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(a.v, 1))));
}
MIXKV_AVX2_INLINE float hsum(F8 a) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));  // i + (i + 4)
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                   // (0 + 2), (1 + 3)
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
MIXKV_AVX2_INLINE F8 hsum8(const F8* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0].v, v[1].v);  // per 128-bit half: (l0 + l1), (l2 + l3) of v0, then v1
  const __m256 t1 = _mm256_hadd_ps(v[2].v, v[3].v);
  const __m256 t2 = _mm256_hadd_ps(v[4].v, v[5].v);
  const __m256 t3 = _mm256_hadd_ps(v[6].v, v[7].v);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // halves: (l0 + l1) + (l2 + l3) of v0..v3; then of l4..l7
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
}
MIXKV_AVX2_INLINE I8 load_bytes(std::uint64_t bytes) {
  return {_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes)))};
}
MIXKV_AVX2_INLINE F8 code_values(I8 x, int shift, std::uint32_t mask, std::int32_t offset) {
  const __m256i c = _mm256_and_si256(_mm256_srli_epi32(x.v, shift), _mm256_set1_epi32(static_cast<int>(mask)));
  return {_mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(offset)))};
}
MIXKV_AVX2_INLINE F8 exp_nonpositive(F8 x) {
  const __m256 xi = _mm256_max_ps(x.v, _mm256_set1_ps(kExpLow));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(xi, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 t = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), xi);
  t = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), t);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int k = 1; k < 6; ++k) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kExpPoly[k]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(t, t), t), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(y, _mm256_castsi256_ps(bits))};
}

#undef MIXKV_AVX2_INLINE
}  // namespace avx2
#endif

}  // namespace mixkv::cpu::simd
