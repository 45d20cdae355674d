#pragma once
// Min-max RTN quantization of one (block, KV head) tile held in shared
// memory, with the rounding of quant_math.h written with explicit IEEE
// intrinsics (its FMAs as __fmaf_rn, nothing else contracted) so that codes
// and (scale, min) match the CPU reference bit for bit. Shared by
// store_prefill and demote. Templates over the cache's 16-bit type E
// (elem16.cuh): the stored (scale, min) are of E, and so are the tile's
// values where it holds the input as it came (T = E).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "elem16.cuh"
#include "mixkv/core/block_format.h"

namespace mixkv::gpu::detail {

struct GroupParamsDevice {
  float inverse_step;  // quant_inverse_step of the stored scale
  float bias;          // quant_bias of the stored minimum
  uint32_t packed;     // (scale, min) of the cache's type as stored
};

// quant_step's IEEE quotient (hi - lo) / kMaxCode in three instructions:
// the product with the rounded reciprocal, corrected once by its FMA
// residual. For the divisors 3 and 15 this equals the IEEE quotient for
// every non-negative float below 2^127 (checked exhaustively on the host
// with fmaf, which rounds as FFMA does); __fdiv_rn adds a range check and a
// slow-path branch, ~10 more instructions a group.
template <uint32_t kMaxCode>
__device__ __forceinline__ float range_over_max_code(float range) {
  static_assert(kMaxCode == 3 || kMaxCode == 15, "the exactness was checked for these divisors only");
  constexpr float kDivisor = static_cast<float>(kMaxCode);
  constexpr float kReciprocal = 1.0f / kDivisor;
  const float q = __fmul_rn(range, kReciprocal);
  return __fmaf_rn(__fmaf_rn(-q, kDivisor, range), kReciprocal, q);
}

// IEEE 1 / x (the host's 1.0f / x) for a widened positive FP16 value x.
// This is the instruction sequence ptxas emits for __frcp_rn on the inputs
// it can take directly (MUFU.RCP, then one FMA residual correction); its
// range test and slow path (~9 instructions) are for float exponents an FP16
// value never has (x and 1 / x both normal floats: 2^-24 <= x <= 65504).
__device__ __forceinline__ float reciprocal_of_half(float x) {
  float approx;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(approx) : "f"(x));
  return __fmaf_rn(approx, __fmaf_rn(-x, approx, 1.0f), approx);
}

// Whether the group's stored scale (the low half of GroupParamsDevice::
// packed, >= 0) is an FP16 subnormal: its codes may then need the clamp to
// max_code (biased_code).
__device__ __forceinline__ bool has_subnormal_scale(uint32_t packed) { return (packed & 0xffffu) - 1u < 0x3ffu; }

// The (scale, min) of a group spanning [lo, hi], rounded to E, and the
// constants its codes are computed with. BF16 takes the IEEE quotient and
// reciprocal (__fdiv_rn, __frcp_rn): a bfloat16 range may reach float's
// overflow and its scale float's subnormals, outside both FP16 shortcuts'
// domains.
template <uint32_t kMaxCode, typename E = __half>
__device__ __forceinline__ GroupParamsDevice group_params(float lo, float hi) {
  GroupParamsDevice g;
  if constexpr (std::is_same_v<E, __half>) {
    const __half scale = __float2half_rn(range_over_max_code<kMaxCode>(__fsub_rn(hi, lo)));
    const __half min = __float2half_rn(lo);
    const float widened = __half2float(scale);
    g.inverse_step = widened > 0.0f ? reciprocal_of_half(widened) : 0.0f;
    g.bias = __fmaf_rn(-__half2float(min), g.inverse_step, 0.5f);
    g.packed = static_cast<uint32_t>(__half_as_ushort(scale)) | (static_cast<uint32_t>(__half_as_ushort(min)) << 16);
  } else {
    using Elem = Elem16<E>;
    const E scale = Elem::round(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(kMaxCode)));
    const E min = Elem::round(lo);
    const float widened = Elem::widen(scale);
    g.inverse_step = widened > 0.0f ? __frcp_rn(widened) : 0.0f;
    g.bias = __fmaf_rn(-Elem::widen(min), g.inverse_step, 0.5f);
    g.packed = static_cast<uint32_t>(Elem::as_ushort(scale)) | (static_cast<uint32_t>(Elem::as_ushort(min)) << 16);
  }
  return g;
}

// quant_code() of quant_math.h as the bits of a float, without a
// float-to-integer conversion (the CUDA guide's throughput table for sm_90:
// 16 conversions per clock per SM against 128 FADDs). Clamping y to
// [0, max_code] first (floor commutes with clamping to integers), adding 2^23
// rounded down leaves floor(y) in the low mantissa bits: the result is
// kCodeBias + code. A constant group (inverse_step 0) gives floor(0.5) = 0.
// Each clamp is skipped where it cannot fire (quant_math.h): kClampLow, y
// is negative only when the stored FP16 minimum rounded above the group's
// lowest value, which an FP16 minimum never does (y >= 0.5 - 2^-9);
// kClampHigh, y reaches max_code + 1 only when the scale rounded down by
// more than the slack, which for FP16 input takes a subnormal FP16 scale
// (has_subnormal_scale): a normal one is within a relative 2^-11 of the
// step, so y < max_code (1 + 2^-11) + 0.5 + 2^-9 < max_code + 1.
inline constexpr uint32_t kCodeBias = 0x4B000000u;  // the bits of 2^23
template <uint32_t kMaxCode, bool kClampLow, bool kClampHigh>
__device__ __forceinline__ uint32_t biased_code(float x, float inverse_step, float bias) {
  float y = __fmaf_rn(x, inverse_step, bias);
  if constexpr (kClampHigh) y = fminf(y, static_cast<float>(kMaxCode));
  if constexpr (kClampLow) y = fmaxf(y, 0.0f);
  return __float_as_uint(__fadd_rd(y, 8388608.0f));
}

// biased_code with both clamps in quant_code's exact form, NaN coding as 0
// (fmaxf(fminf(NaN, m), 0) would give m): the codes of a BF16 cache, whose
// scale may be a float subnormal with an infinite reciprocal.
template <uint32_t kMaxCode>
__device__ __forceinline__ uint32_t exact_biased_code(float x, float inverse_step, float bias) {
  float y = __fmaf_rn(x, inverse_step, bias);
  y = y >= 0.0f ? fminf(y, static_cast<float>(kMaxCode)) : 0.0f;
  return __float_as_uint(__fadd_rd(y, 8388608.0f));
}

// The code rule of a cache of type E: biased_code's skipped clamps where
// FP16 allows them (kClampLow, kClampHigh as there), exact_biased_code for
// BF16.
template <typename E, uint32_t kMaxCode, bool kClampLow, bool kClampHigh>
__device__ __forceinline__ uint32_t code_of(float x, float inverse_step, float bias) {
  if constexpr (std::is_same_v<E, __half>) {
    return biased_code<kMaxCode, kClampLow, kClampHigh>(x, inverse_step, bias);
  } else {
    return exact_biased_code<kMaxCode>(x, inverse_step, bias);
  }
}

// What a run of kCodes biased codes (a word's 32 / kBits by default), each
// shifted to its place and summed, holds beyond the codes themselves (mod
// 2^32): subtracting it once per run leaves exactly the packed codes.
template <int kBits, int kCodes = 32 / kBits>
constexpr uint32_t word_bias() {
  uint32_t bias = 0;
  for (int i = 0; i < kCodes; ++i) bias += kCodeBias << (i * kBits);
  return bias;
}

__device__ __forceinline__ float dequant_device(uint32_t code, float scale, float min) {
  return __fadd_rn(min, __fmul_rn(scale, static_cast<float>(code)));
}

// Four adjacent FP16 tile values as two __half2. The min/max passes stay in
// FP16: a half widens to float exactly and monotonically, so its minimum and
// maximum are those of the widened floats, and __hmin2/__hmax2 do two
// values per instruction without the widening.
struct Half4 {
  __half2 lo, hi;
};
__device__ __forceinline__ __half2 as_half2(uint32_t bits) { return *reinterpret_cast<const __half2*>(&bits); }
// The same for BF16 tiles: bfloat16 widens exactly and monotonically too.
struct Bf16x4 {
  __nv_bfloat162 lo, hi;
};

// The tile types' four-value vectors (Half4 for FP16 tiles, float4 for
// demote's float tiles) with the same operations, so one quantizer serves
// both.
template <typename T>
struct Vec4;
template <>
struct Vec4<__half> {
  using type = Half4;
  // Loaded as plain words: a load of the __half2 struct itself compiles to
  // separate 4-byte loads.
  __device__ static Half4 load(const __half* at) {
    const uint2 x = *reinterpret_cast<const uint2*>(at);
    return {as_half2(x.x), as_half2(x.y)};
  }
  // Eight values from 16-byte aligned `at`: one 16-byte shared load.
  __device__ static void load8(const __half* at, Half4& a, Half4& b) {
    const uint4 x = *reinterpret_cast<const uint4*>(at);
    a = {as_half2(x.x), as_half2(x.y)};
    b = {as_half2(x.z), as_half2(x.w)};
  }
  __device__ static Half4 fill(float x) {
    const __half2 h = __float2half2_rn(x);
    return {h, h};
  }
};
template <>
struct Vec4<__nv_bfloat16> {
  using type = Bf16x4;
  __device__ static Bf16x4 load(const __nv_bfloat16* at) {
    const uint2 x = *reinterpret_cast<const uint2*>(at);
    return {Elem16<__nv_bfloat16>::pair(x.x), Elem16<__nv_bfloat16>::pair(x.y)};
  }
  __device__ static void load8(const __nv_bfloat16* at, Bf16x4& a, Bf16x4& b) {
    const uint4 x = *reinterpret_cast<const uint4*>(at);
    a = {Elem16<__nv_bfloat16>::pair(x.x), Elem16<__nv_bfloat16>::pair(x.y)};
    b = {Elem16<__nv_bfloat16>::pair(x.z), Elem16<__nv_bfloat16>::pair(x.w)};
  }
  __device__ static Bf16x4 fill(float x) {
    const __nv_bfloat162 h = __float2bfloat162_rn(x);
    return {h, h};
  }
};
template <>
struct Vec4<float> {
  using type = float4;
  __device__ static float4 load(const float* at) { return *reinterpret_cast<const float4*>(at); }
  __device__ static void load8(const float* at, float4& a, float4& b) {
    a = reinterpret_cast<const float4*>(at)[0];
    b = reinterpret_cast<const float4*>(at)[1];
  }
  __device__ static float4 fill(float x) { return make_float4(x, x, x, x); }
};

__device__ __forceinline__ Half4 vmin(Half4 a, Half4 b) { return {__hmin2(a.lo, b.lo), __hmin2(a.hi, b.hi)}; }
__device__ __forceinline__ Half4 vmax(Half4 a, Half4 b) { return {__hmax2(a.lo, b.lo), __hmax2(a.hi, b.hi)}; }
__device__ __forceinline__ Bf16x4 vmin(Bf16x4 a, Bf16x4 b) { return {__hmin2(a.lo, b.lo), __hmin2(a.hi, b.hi)}; }
__device__ __forceinline__ Bf16x4 vmax(Bf16x4 a, Bf16x4 b) { return {__hmax2(a.lo, b.lo), __hmax2(a.hi, b.hi)}; }
__device__ __forceinline__ float4 vmin(float4 a, float4 b) {
  return make_float4(fminf(a.x, b.x), fminf(a.y, b.y), fminf(a.z, b.z), fminf(a.w, b.w));
}
__device__ __forceinline__ float4 vmax(float4 a, float4 b) {
  return make_float4(fmaxf(a.x, b.x), fmaxf(a.y, b.y), fmaxf(a.z, b.z), fmaxf(a.w, b.w));
}
__device__ __forceinline__ Half4 shfl_xor(Half4 a, int offset) {
  return {__shfl_xor_sync(0xffffffffu, a.lo, offset), __shfl_xor_sync(0xffffffffu, a.hi, offset)};
}
__device__ __forceinline__ Bf16x4 shfl_xor(Bf16x4 a, int offset) {
  return {__shfl_xor_sync(0xffffffffu, a.lo, offset), __shfl_xor_sync(0xffffffffu, a.hi, offset)};
}
__device__ __forceinline__ float4 shfl_xor(float4 a, int offset) {
  return make_float4(__shfl_xor_sync(0xffffffffu, a.x, offset), __shfl_xor_sync(0xffffffffu, a.y, offset),
                     __shfl_xor_sync(0xffffffffu, a.z, offset), __shfl_xor_sync(0xffffffffu, a.w, offset));
}
__device__ __forceinline__ float4 widen(Half4 a) {
  const float2 lo = __half22float2(a.lo), hi = __half22float2(a.hi);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float4 widen(Bf16x4 a) {
  const float2 lo = __bfloat1622float2(a.lo), hi = __bfloat1622float2(a.hi);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float4 widen(float4 a) { return a; }
__device__ __forceinline__ float component(float4 a, int i) { return i == 0 ? a.x : i == 1 ? a.y : i == 2 ? a.z : a.w; }
// Value i of four halves, widening only that one: a select of the word and
// of its half (the four-way select of widened floats compiled to branches).
__device__ __forceinline__ float component(Half4 a, int i) {
  const __half2 pair = i & 2 ? a.hi : a.lo;
  return __half2float(i & 1 ? __high2half(pair) : __low2half(pair));
}
__device__ __forceinline__ float component(Bf16x4 a, int i) {
  const __nv_bfloat162 pair = i & 2 ? a.hi : a.lo;
  return __bfloat162float(i & 1 ? __high2bfloat16(pair) : __low2bfloat16(pair));
}

// Eight adjacent tile values as floats, from 16-byte aligned `at`.
template <typename T>
__device__ __forceinline__ void tile_eight(const T* at, float (&x)[8]) {
  typename Vec4<T>::type a, b;
  Vec4<T>::load8(at, a, b);
  const float4 lo = widen(a), hi = widen(b);
  x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
}

// The thread's share of a [rows][cols] index space walked with stride
// `threads` (the CTA size: i = threadIdx.x, threadIdx.x + threads, ...) as
// (row, col): one division up front instead of a runtime division and modulo
// per step (each ~20 instructions for a runtime divisor). With constant
// columns and threads every member but row and col is a constant, and where
// the columns divide the threads (col_step 0) the wrap test folds away: the
// loops over rows then have constant trip counts and unroll.
struct StridedIndex {
  int cols, row_step, col_step, row, col;
  __device__ StridedIndex(int columns, int threads)
      : cols(columns),
        row_step(threads / columns),
        col_step(threads % columns),
        row(static_cast<int>(threadIdx.x) / columns),
        col(static_cast<int>(threadIdx.x) % columns) {}
  __device__ void next() {
    row += row_step;
    col += col_step;
    if (col_step != 0 && col >= cols) col -= cols, ++row;  // col < cols stays so with col_step 0
  }
};

// A tile dimension: the template argument of an instance built for one
// shape (every bound, pitch and offset derived from it is then a constant),
// or, where that is 0 (the generic instance), the runtime value.
__host__ __device__ constexpr int fixed_or(int fixed, int runtime) { return fixed != 0 ? fixed : runtime; }

// A K/V tile in shared memory: K [S][pitch] then V [S][pitch] elements of T
// (__half for store_prefill: exact and half the bytes; float for demote's
// dequantized INT4 values), then the scratch of quantize_tile. The pitch pads
// each row by 16 bytes: every row starts 16-byte aligned, and at FP16 rows r
// and r + 1 start 4 banks apart, r and r + 4 16 banks apart (the lane
// layouts below are chosen for that).
template <typename T>
struct QuantTile {
  static constexpr int pad() { return 16 / static_cast<int>(sizeof(T)); }
  __host__ __device__ static constexpr int pitch(int head_dim) { return head_dim + pad(); }
  // The K and V rows alone (a multiple of 16 bytes: rows are).
  __host__ __device__ static constexpr std::size_t tile_bytes(int head_dim, int block_size) {
    return 2 * static_cast<std::size_t>(block_size) * pitch(head_dim) * sizeof(T);
  }
  __host__ __device__ static constexpr std::size_t scratch_bytes(int head_dim, int block_size) {
    return (2 * static_cast<std::size_t>(head_dim) + 2 * block_size) * sizeof(float);
  }
  __host__ __device__ static constexpr std::size_t bytes(int head_dim, int block_size) {
    return tile_bytes(head_dim, block_size) + scratch_bytes(head_dim, block_size);
  }
};

// quantize_tile with the code width fixed at compile time, so that every
// shift and loop bound of the code passes is a constant and the loops unroll
// (not recomputed per code). Codes are summed
// into their words: they occupy disjoint bits, so + equals | and the shift
// can fold into the add (IMAD/LEA); the biases of biased_code sum the same
// way and leave with one subtraction per word.
// kThreads: the CTA size. kHeadDim, kBlockSize: the tile shape where an
// instance is built for it (see fixed_or), else 0: `format`'s. At a runtime
// shape the loop bounds, strides and offsets are integer arithmetic and the
// loops run with remainders (about twice the instructions of a fixed
// shape's nearly straight-line code).
// E: the cache's 16-bit type, of the stored (scale, min) and of the codes'
// rounding rule (code_of); T is E, or float.
template <typename T, int kThreads, int kBits, int kHeadDim, int kBlockSize, typename E = __half>
__device__ void quantize_tile_bits(const BlockFormat& format, const T* tile, float* scratch, char* out) {
  using V = Vec4<T>;
  using V4 = typename V::type;
  constexpr uint32_t kMaxCode = (1u << kBits) - 1u;
  constexpr int kPerWord = 32 / kBits;
  constexpr bool kFp16 = std::is_same_v<T, __half>;  // see biased_code for what FP16 input spares
  constexpr uint32_t kWordBias = word_bias<kBits>();
  __builtin_assume(threadIdx.x < kThreads);  // bounds the threads' strided loops: at a fixed shape they unroll
  const int S = fixed_or(kBlockSize, format.block_size);
  const int D = fixed_or(kHeadDim, format.head_dim);
  // The head region's layout, from the precision of kBits rather than the
  // format's: its offsets are then constants for a fixed shape.
  const BlockFormat layout{kBits == 4 ? Precision::INT4 : Precision::INT2, 1, D, S};
  const int P = QuantTile<T>::pitch(D);
  const T* k = tile;
  const T* v = tile + S * P;
  float* k_inverse = scratch;
  float* k_bias = k_inverse + D;
  float* v_inverse = k_bias + D;
  float* v_bias = v_inverse + S;
  // One word per K channel and per V token (block_format.h): K by channel
  // pair, the pair's mins word then its scales word (k_param_word); V
  // (scale, min).
  uint32_t* k_params = reinterpret_cast<uint32_t*>(out + layout.k_params_offset());
  uint32_t* v_params = reinterpret_cast<uint32_t*>(out + layout.v_params_offset());
  const auto k_param_word = [&](int c) {  // channel c even: the pair's mins word; odd: its scales word
    return static_cast<int>((layout.k_min_offset(c & ~1) - layout.k_params_offset()) / 4) + (c & 1);
  };
  constexpr BlockFormat kLayout{Precision::INT4, 1, 64, 16};
  static_assert(kLayout.k_scale_offset(2) == kLayout.k_min_offset(2) + 4 &&
                    kLayout.v_scale_offset(3) == kLayout.v_params_offset() + 4 * 3 &&
                    kLayout.v_min_offset(3) == kLayout.v_params_offset() + 4 * 3 + 2,
                "the parameter words as written below");

  // Statistics: a warp takes a group of 8 K channel quads or 8 V tokens; the
  // lane's slot picks the item and its part (lane / 8) a quarter of the
  // item's values; parts combine by two shuffles. At FP16 the 8 slots of one
  // part read 8 adjacent quads of a row (16 banks) or 8 rows (4 banks apart),
  // and parts 0 and 1 read rows 4 apart (16 banks): no bank conflicts.
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  constexpr int warps = kThreads / 32;
  const int slot = lane % 8;
  const int part = lane / 8;

  bool subnormal_scale = false;  // of a group this thread set
  // K: one group per channel over the tokens; part p takes tokens 16i + 4p + r.
  const int quads = D / 4;
  for (int g = warp; g * 8 < quads; g += warps) {
    const int q = g * 8 + slot;
    const T* column = k + 4 * ::min(q, quads - 1);  // lanes past the last quad reduce a copy, for the shuffles
    V4 lo = V::fill(INFINITY), hi = V::fill(-INFINITY);
    for (int i = 0; i < S; i += 16) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const V4 x = V::load(column + (i + 4 * part + r) * P);
        lo = vmin(lo, x);
        hi = vmax(hi, x);
      }
    }
#pragma unroll
    for (int offset = 8; offset < 32; offset <<= 1) {
      lo = vmin(lo, shfl_xor(lo, offset));
      hi = vmax(hi, shfl_xor(hi, offset));
    }
    // Every part now holds the quad's range; part p sets channel 4q + p.
    // Parts 2j and 2j + 1 (lanes 8 apart) hold a channel pair: with the
    // partner's (scale, min), the even part writes the pair's mins word and
    // the odd part its scales word.
    const int c = 4 * q + part;
    const GroupParamsDevice gp = group_params<kMaxCode, E>(component(lo, part), component(hi, part));
    const uint32_t partner = __shfl_xor_sync(0xffffffffu, gp.packed, 8);
    if (q < quads) {
      k_inverse[c] = gp.inverse_step;
      k_bias[c] = gp.bias;
      const bool even = (part & 1) == 0;
      k_params[k_param_word(c)] =
          even ? __byte_perm(gp.packed, partner, 0x7632) : __byte_perm(partner, gp.packed, 0x5410);
      subnormal_scale |= has_subnormal_scale(gp.packed);
    }
  }
  // V: one group per token over the channels; part p takes the 8-channel
  // pieces p, p + 4, ... (S is a multiple of 16: no partial group).
  const int pieces8 = D / 8;
  for (int g = warp; g * 8 < S; g += warps) {
    const int t = g * 8 + slot;
    const T* row = v + t * P;
    V4 lo = V::fill(INFINITY), hi = V::fill(-INFINITY);
    for (int c = part; c < pieces8; c += 4) {
      V4 a, b;
      V::load8(row + 8 * c, a, b);
      lo = vmin(lo, vmin(a, b));
      hi = vmax(hi, vmax(a, b));
    }
#pragma unroll
    for (int offset = 8; offset < 32; offset <<= 1) {
      lo = vmin(lo, shfl_xor(lo, offset));
      hi = vmax(hi, shfl_xor(hi, offset));
    }
    if (part == 0) {
      const float4 l = widen(lo), h = widen(hi);
      const GroupParamsDevice gp =
          group_params<kMaxCode, E>(fminf(fminf(l.x, l.y), fminf(l.z, l.w)), fmaxf(fmaxf(h.x, h.y), fmaxf(h.z, h.w)));
      v_inverse[t] = gp.inverse_step;
      v_bias[t] = gp.bias;
      v_params[t] = gp.packed;
      subnormal_scale |= has_subnormal_scale(gp.packed);
    }
  }
  // Codes without the clamp to max_code unless some group of the tile needs
  // it (one instruction of ~5 a code; the code passes are built twice).
  const bool clamp_high = __syncthreads_or(subnormal_scale) != 0 || !kFp16;
  auto write_codes = [&]<bool kClampHigh>() {
    // K codes, per channel packed along tokens (block_format.h): a lane packs
    // word j of the four channels of quad q from kPerWord rows. A warp takes
    // two consecutive words (one if the words per channel are odd) of 16 (32)
    // adjacent quads: each of the four stores then writes 8-byte runs of
    // adjacent words instead of 32 scattered words, and no lane idles for any
    // S. Each half-warp holds one word: 16 adjacent quads of a row, 32 banks,
    // conflict-free. (Four words a warp would halve the store transactions
    // again, but put rows a multiple of 8 apart, same banks, into one
    // half-warp; rotating their rows costs registers, and a CTA an SM.)
    const int k_words = S / kPerWord;  // per channel
    const int lanes_per_quad = k_words % 2 == 0 ? 2 : 1;
    const int quads_per_unit = 32 / lanes_per_quad;
    const int quad_units = (quads + quads_per_unit - 1) / quads_per_unit;
    const int units = quad_units * (k_words / lanes_per_quad);
    // Word j of channel c: its bytes 4j..4j+3, one store where the channel's
    // bytes are contiguous, four where its runs are bytes stored run-major.
    auto store_k_word = [&](int c, int j, uint32_t w) {
      if (layout.k_runs_are_bytes()) {
#pragma unroll
        for (int b = 0; b < 4; ++b) out[layout.k_code_byte(c, 4 * j + b)] = static_cast<char>(w >> (8 * b));
      } else {
        *reinterpret_cast<uint32_t*>(out + layout.k_code_byte(c, 4 * j)) = w;
      }
    };
    for (int unit = warp; unit < units; unit += warps) {
      const int q = unit % quad_units * quads_per_unit + lane % quads_per_unit;
      const int j = unit / quad_units * lanes_per_quad + lane / quads_per_unit;
      if (q >= quads) continue;  // no shuffles below: such lanes may leave
      const float4 inverse = *reinterpret_cast<const float4*>(k_inverse + 4 * q);
      const float4 bias = *reinterpret_cast<const float4*>(k_bias + 4 * q);
      const T* column = k + j * kPerWord * P + 4 * q;
      uint32_t w0 = 0, w1 = 0, w2 = 0, w3 = 0;
#pragma unroll
      for (int r = 0; r < kPerWord; ++r) {
        const float4 x = widen(V::load(column + r * P));
        w0 += code_of<E, kMaxCode, !kFp16, kClampHigh>(x.x, inverse.x, bias.x) << (r * kBits);
        w1 += code_of<E, kMaxCode, !kFp16, kClampHigh>(x.y, inverse.y, bias.y) << (r * kBits);
        w2 += code_of<E, kMaxCode, !kFp16, kClampHigh>(x.z, inverse.z, bias.z) << (r * kBits);
        w3 += code_of<E, kMaxCode, !kFp16, kClampHigh>(x.w, inverse.w, bias.w) << (r * kBits);
      }
      store_k_word(4 * q, j, w0 - kWordBias);
      store_k_word(4 * q + 1, j, w1 - kWordBias);
      store_k_word(4 * q + 2, j, w2 - kWordBias);
      store_k_word(4 * q + 3, j, w3 - kWordBias);
    }
    // V codes, token-major packed along channels: a lane packs a piece of 16
    // channels of token t (two INT4 words, one 8-byte store; or one INT2
    // word). Adjacent lanes take adjacent pieces of a row, so a warp's stores
    // are contiguous. Pieces sit 32 bytes (8 banks) apart: pieces p and p + 4
    // of a quarter-warp's 16-byte loads would share banks, so pieces with bit
    // 2 set load their upper 8 channels first (4 banks further) and swap the
    // halves back in the packed result.
    const int pieces16 = D / 16;
    char* v_codes = out + layout.v_offset();
    const int v_token_bytes = static_cast<int>(layout.v_token_bytes());
    for (StridedIndex at(pieces16, kThreads); at.row < S; at.next()) {
      const int t = at.row;
      const int piece = at.col;
      const int first = piece & 4 ? 8 : 0;  // channel offset of the half loaded first
      const float inverse = v_inverse[t];
      const float bias = v_bias[t];
      const T* row = v + t * P + 16 * piece;
      uint32_t words[2] = {0, 0};  // in load order
#pragma unroll
      for (int e = 0; e < 16; e += 8) {
        float x[8];
        tile_eight(row + (e ^ first), x);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          words[(e + u) / kPerWord] += code_of<E, kMaxCode, !kFp16, kClampHigh>(x[u], inverse, bias)
                                       << ((e + u) % kPerWord * kBits);
        }
      }
      char* to = v_codes + t * v_token_bytes + piece * 2 * kBits;  // 16 codes of kBits: 2 * kBits bytes
      if constexpr (kBits == 4) {
        const uint32_t a = words[0] - kWordBias, b = words[1] - kWordBias;  // one word per half
        *reinterpret_cast<uint2*>(to) = first ? make_uint2(b, a) : make_uint2(a, b);
      } else {
        const uint32_t w = words[0] - kWordBias;  // the halves' codes in its low and high 16 bits
        *reinterpret_cast<uint32_t*>(to) = first ? __funnelshift_l(w, w, 16) : w;
      }
    }
  };
  if (clamp_high) {
    write_codes.template operator()<true>();
  } else {
    write_codes.template operator()<false>();
  }
}

// Quantizes the K/V tile (all kThreads threads of the CTA take part; a
// multiple of 32) into the head region `out` of `format` (INT4 or INT2; head
// region 8-byte aligned), for any shape `format` holds. Ends with no barrier
// pending; the caller's next use of the tile needs __syncthreads().
template <typename T, int kThreads, typename E = __half>
__device__ inline void quantize_tile(const BlockFormat& format, const T* tile, float* scratch, char* out) {
  if (format.bits() == 4) {
    quantize_tile_bits<T, kThreads, 4, 0, 0, E>(format, tile, scratch, out);
  } else {
    quantize_tile_bits<T, kThreads, 2, 0, 0, E>(format, tile, scratch, out);
  }
}

}  // namespace mixkv::gpu::detail
