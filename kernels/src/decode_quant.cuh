#pragma once
// The decode kernel's quantized blocks (decode_kernel.cuh): where a thread's
// packed INT4/INT2 code fields sit, their extraction into MMA operands
// (FP16 subnormals, or exact bfloat16 integers in a BF16 instance), and the
// scores and accumulation of one quantized block with the per-channel K and
// per-token V parameters folded into the MMAs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "decode_params.cuh"
#include "decode_softmax.cuh"
#include "device_math.cuh"
#include "elem16.cuh"
#include "mixkv/core/block_format.h"

namespace mixkv::gpu::detail {

// The thread's run of one channel's K codes: S/8 tokens of `Bits` bits.
template <int S, int Bits>
__device__ __forceinline__ uint32_t load_k_run(const char* k_codes, int channel, int g) {
  constexpr int kChannelBytes = S * Bits / 8;
  constexpr int kRunBits = S / 8 * Bits;
  const char* base = k_codes + channel * kChannelBytes;
  static_assert(kRunBits != 8, "one-byte runs are stored run-major: load_k_pairs reads them as words");
  if constexpr (kRunBits == 32) {
    return *reinterpret_cast<const uint32_t*>(base + 4 * g);
  } else if constexpr (kRunBits == 16) {
    return *reinterpret_cast<const uint16_t*>(base + 2 * g);
  } else {  // 4 bits: half a byte; bits above the run are ignored by the extraction
    return static_cast<uint32_t>(*reinterpret_cast<const uint8_t*>(base + (g >> 1))) >> (4 * (g & 1));
  }
}

// `Bytes` consecutive bytes of shared memory (aligned to their size, or to
// 16 above that) in the widest loads; under 4 bytes in the low bits of w[0].
template <int Bytes>
struct SmemRun {
  static constexpr int kWords = Bytes >= 4 ? Bytes / 4 : 1;
  uint32_t w[kWords];
  __device__ __forceinline__ void load(const char* p) {
    if constexpr (Bytes >= 16) {
#pragma unroll
      for (int i = 0; i < Bytes / 16; ++i) {
        const uint4 x = reinterpret_cast<const uint4*>(p)[i];
        w[4 * i] = x.x;
        w[4 * i + 1] = x.y;
        w[4 * i + 2] = x.z;
        w[4 * i + 3] = x.w;
      }
    } else if constexpr (Bytes == 8) {
      const uint2 x = *reinterpret_cast<const uint2*>(p);
      w[0] = x.x;
      w[1] = x.y;
    } else if constexpr (Bytes == 4) {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    } else {
      w[0] = *reinterpret_cast<const uint16_t*>(p);
    }
  }
};

// The thread's run of one token's V codes: D/8 channels of `Bits` bits.
template <int D, int Bits>
inline constexpr int kVRunBytes = D / 8 * Bits / 8;

// Where token i of a thread's K run lies in the pair word of two channels
// (x[0]: bits 0..15 of each run, x[1]: bits 16..31): its half, whether that
// half is shifted right by 8 first, and the bit k of its code there, so that
// k + Bits <= 10 and one lop3 makes the subnormal 2^(k-24) code (codes_at).
template <int Bits>
struct KRunPos {
  static constexpr int half(int i) { return i * Bits / 16; }
  static constexpr int bit(int i) { return i * Bits % 16; }
  static constexpr bool shifted(int i) { return bit(i) + Bits > 10; }
  static constexpr int k(int i) { return shifted(i) ? bit(i) - 8 : bit(i); }
};

template <int Bits>
__device__ __forceinline__ uint32_t codes_at(uint32_t x, int k) {
  return x & ((((1u << Bits) - 1u) << k) * 0x00010001u);
}

// Where a V field at bit `bit` of a 16-bit half lands after its lop3: fields
// above bit 10 - Bits are first shifted down by 8, the code sits at bit k.
template <int Bits>
struct VFieldPos {
  static constexpr bool shifted(int bit) { return bit + Bits > 10; }
  static constexpr int k(int bit) { return shifted(bit) ? bit - 8 : bit; }
};

// 2^(k-24) code (as half2) of the two `Bits`-bit fields at bit `bit` of
// each 16-bit half.
template <int Bits>
__device__ __forceinline__ uint32_t v_codes_at(uint32_t x, int bit) {
  return codes_at<Bits>(VFieldPos<Bits>::shifted(bit) ? x >> 8 : x, VFieldPos<Bits>::k(bit));
}

// The V codes of channel tile cm in the thread's run (channels 2 cm, 2 cm + 1
// of it: O^T rows g and g + 8): their word of the run, the prmt selector
// that pairs that word's half of two tokens, the bit of row g's field in
// the half (row g + 8 at shift + Bits) and the bit k each code lands at.
template <int Bits>
struct VTilePos {
  static constexpr int kChannelsPerWord = 32 / Bits;
  static constexpr int word(int cm) { return 2 * cm / kChannelsPerWord; }
  static constexpr int in_word(int cm) { return 2 * cm % kChannelsPerWord; }
  static constexpr uint32_t sel(int cm) { return in_word(cm) / (16 / Bits) ? 0x7632 : 0x5410; }
  static constexpr int shift(int cm) { return in_word(cm) % (16 / Bits) * Bits; }
  static constexpr int k(int cm, int half) { return VFieldPos<Bits>::k(shift(cm) + half * Bits); }
};

template <int Bits>
__device__ __forceinline__ uint32_t k_codes_of(const uint32_t (&x)[2], int i) {
  const uint32_t h = x[KRunPos<Bits>::half(i)];
  return codes_at<Bits>(KRunPos<Bits>::shifted(i) ? h >> 8 : h, KRunPos<Bits>::k(i));
}

// A BF16 instance takes a code as the exact bfloat16 2^k x: bfloat16 has
// no subnormal that the tensor cores and an FP32 accumulator would keep for
// every product (2^-133 x q is below FP32's normal range), so one lop3 puts
// the field under the exponent of 128 (0x4300 | field = 128 + 2^k x, exact
// while k + Bits <= 7) and one bfloat16x2 subtraction takes the 128 away.
// The field at bit `bit` of a 16-bit half is shifted down to k = bit % 4
// first (k <= 3; bits the shift brings down from the upper half land above
// the field and are masked off).
struct Bf16CodePos {
  static constexpr int shift(int bit) { return bit & ~3; }
  static constexpr int k(int bit) { return bit & 3; }
};

template <int Bits>
__device__ __forceinline__ uint32_t bf16_codes_at(uint32_t x, int bit) {
  static_assert(Bf16CodePos::k(14) + Bits <= 7, "the field stays in bfloat16's mantissa under 128");
  const uint32_t biased = codes_at<Bits>(x >> Bf16CodePos::shift(bit), Bf16CodePos::k(bit)) | 0x43004300u;
  const __nv_bfloat162 v = __hsub2(Elem16<__nv_bfloat16>::pair(biased), Elem16<__nv_bfloat16>::pair(0x43004300u));
  return Elem16<__nv_bfloat16>::bits(v);
}

// The code fields of a cache of type E: FP16 subnormals 2^(k-24) x or
// BFloat16 integers 2^k x. kExp is the exponent offset (-24, 0), k_of(i)
// the k of token i of a K run (k_codes) and v_k(bit) that of a V field at
// bit `bit` of a half (v_codes).
template <typename E, int Bits>
struct CodeField {
  static constexpr bool kFp16 = std::is_same_v<E, __half>;
  static constexpr int kExp = kFp16 ? -24 : 0;
  static constexpr int k_of(int i) { return kFp16 ? KRunPos<Bits>::k(i) : Bf16CodePos::k(KRunPos<Bits>::bit(i)); }
  static constexpr int v_k(int bit) { return kFp16 ? VFieldPos<Bits>::k(bit) : Bf16CodePos::k(bit); }
  __device__ static __forceinline__ uint32_t k_codes(const uint32_t (&x)[2], int i) {
    if constexpr (kFp16) {
      return k_codes_of<Bits>(x, i);
    } else {
      return bf16_codes_at<Bits>(x[KRunPos<Bits>::half(i)], KRunPos<Bits>::bit(i));
    }
  }
  __device__ static __forceinline__ uint32_t v_codes(uint32_t x, int bit) {
    if constexpr (kFp16) {
      return v_codes_at<Bits>(x, bit);
    } else {
      return bf16_codes_at<Bits>(x, bit);
    }
  }
};

// a * b of two packed pairs of E.
template <typename E>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  if constexpr (std::is_same_v<E, __half>) {
    return hmul2_u32(a, b);
  } else {
    using Elem = Elem16<E>;
    return Elem::bits(__hmul2(Elem::pair(a), Elem::pair(b)));
  }
}

// a * b - hi of two packed pairs of E in one rounding (a fused multiply-add):
// with hi = mul2(a, b), what that product's rounding dropped, so hi + lo
// carries a * b to about twice E's precision.
template <typename E>
__device__ __forceinline__ uint32_t mul2_rest(uint32_t a, uint32_t b, uint32_t hi) {
  using Elem = Elem16<E>;
  return Elem::bits(__hfma2(Elem::pair(a), Elem::pair(b), __hneg2(Elem::pair(hi))));
}

// The thread's K code runs of every k-step, paired as the MMA wants them:
// x[ks][0] holds channels c0 = 16 ks + 2r and c0 + 1, x[ks][1] channels
// c0 + 8 and c0 + 9; [..][h] has bits 16h..16h+15 of each run (low channel
// in the low half).
template <int D, int S, int Bits>
__device__ __forceinline__ void load_k_pairs(const char* k_codes, uint32_t (&x)[D / 16][2][2], int lane) {
  const int g = lane >> 2;
  const int r = lane & 3;
  constexpr BlockFormat F{Bits == 4 ? Precision::INT4 : Precision::INT2, 1, D, S};
  if constexpr (F.k_runs_are_bytes()) {
    // One-byte runs, stored run-major (block_format.h): the thread's word of
    // a k-step holds run g of channels c0, c0 + 8, c0 + 1, c0 + 9 (c0 =
    // 16 ks + 2r), so its bytes 0 and 2 are x[ks][0]'s halves and bytes 1
    // and 3 x[ks][1]'s; the byte above each run is masked off by the code
    // extraction (a one-byte run's fields sit in bits 0..7 of its half).
    static_assert(
        F.k_code_byte(2, 1) - F.k_code_byte(0, 0) == 4 * 5 && F.k_code_byte(8, 0) == F.k_code_byte(0, 0) + 1 &&
            F.k_code_byte(1, 0) == F.k_code_byte(0, 0) + 2 && F.k_code_byte(9, 0) == F.k_code_byte(0, 0) + 3 &&
            F.k_code_byte(16, 0) == F.k_code_byte(0, 0) + 128,
        "thread (g, r) of k-step ks reads the word at 128 ks + 4 (4 g + r)");
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(k_codes + 128 * ks + 4 * lane);
      x[ks][0][0] = w;
      x[ks][1][0] = w >> 8;
      x[ks][0][1] = x[ks][1][1] = 0u;  // 8-bit runs
    }
  } else if constexpr (S * Bits / 8 == 16) {
    // 16-byte channel rows: a transposing ldmatrix of 8 channel rows gives
    // thread (g, r) the 16-bit run g of channels 2r (low) and 2r + 1 (high),
    // so one x4 load covers two k-steps; lane l names channel 32 h + l.
#pragma unroll
    for (int h = 0; h < D / 32; ++h) {
      uint32_t m[4];
      ldmatrix_x4_trans(m, k_codes + (32 * h + lane) * 16);
      x[2 * h][0][0] = m[0];
      x[2 * h][1][0] = m[1];
      x[2 * h + 1][0][0] = m[2];
      x[2 * h + 1][1][0] = m[3];
      x[2 * h][0][1] = x[2 * h][1][1] = x[2 * h + 1][0][1] = x[2 * h + 1][1][1] = 0u;  // 16-bit runs
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const int c0 = 16 * ks + 2 * r;
      const uint32_t u0 = load_k_run<S, Bits>(k_codes, c0, g);
      const uint32_t u1 = load_k_run<S, Bits>(k_codes, c0 + 1, g);
      const uint32_t u8 = load_k_run<S, Bits>(k_codes, c0 + 8, g);
      const uint32_t u9 = load_k_run<S, Bits>(k_codes, c0 + 9, g);
      x[ks][0][0] = prmt(u0, u1, 0x5410);
      x[ks][0][1] = prmt(u0, u1, 0x7632);
      x[ks][1][0] = prmt(u8, u9, 0x5410);
      x[ks][1][1] = prmt(u8, u9, 0x7632);
    }
  }
}

// One quantized block of S tokens (permuted token order, see the top), of
// a cache of type E (CodeField: what follows is FP16's; BF16 takes the
// codes as exact integers, 2^k x, and the same folding with 2^-k).
// The tensor cores get the codes as FP16 subnormals straight from one lop3
// each (the MMA takes subnormal inputs exactly, and no product of two FP16
// numbers is below 2^-48, a normal FP32 number):
//   K: 2^(k-24) x (k fixed per token row), so
//      S^T[t] = 2^(24-k_t) sum_c q'_c (2^(k_t-24) x_tc) + sum_c q_c m_c,
//      the last term from one rank-1 MMA per k-step;
//   V: 2^(k-24) x (k fixed per channel row) straight into the running O^T,
//      which a quantized segment keeps times 2^(k-24) (scale_acc_to_codes:
//      exact, once per segment).
// Codes biased into normal FP16 numbers (1024 + code, the usual trick)
// would need rank-1 MMAs to take the bias back out: 24 more for a 32-token
// block than its 40.
//
// Out: the block's exponent arguments, scores times scale_log2 relative to
// (base0, base1): one fma a score, 2^(24-k_t) scale_log2 from the
// parameters' constant bank and the rank-1 term and the base in its addend.
template <typename E, int D, int S, int Bits, int NT>
__device__ __forceinline__ void quant_block_scores(const DecodeParams& p, const char* slot,
                                                   const uint32_t (&qf)[NT][D / 16][2], const float (&base)[NT][2],
                                                   float (&s)[NT][S / 16][4], int lane) {
  constexpr Precision P = Bits == 4 ? Precision::INT4 : Precision::INT2;
  constexpr BlockFormat F{P, 1, D, S};
  constexpr int MT = S / 16;
  using Field = CodeField<E, Bits>;
  const int r = lane & 3;
  constexpr bool kTwoTermK = Bits == 4;

  // ---- S^T = K Q'^T, plus the rank-1 terms
  // One MMA chain per m-tile (two MMAs a k-step with kTwoTermK): splitting
  // it would cost a 4-FADD merge per m-tile and registers the INT2 loop
  // has no room for.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) s[nt][mt][0] = s[nt][mt][1] = s[nt][mt][2] = s[nt][mt][3] = 0.0f;
  }
  // The rank-1 product is read from rows g only ([0], [1]): rows g + 8 of
  // its A operand are whatever costs no register copy.
  float bias[NT][4];  // sum_c q_c m_c
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) bias[nt][0] = bias[nt][1] = bias[nt][2] = bias[nt][3] = 0.0f;
  uint32_t kx[D / 16][2][2];
  load_k_pairs<D, S, Bits>(slot + F.k_offset(), kx, lane);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    // The K params of the channel pairs c0, c0 + 1 and c0 + 8, c0 + 9 (c0 =
    // 16 ks + 2r, the thread's B fragments), as stored (block_format.h):
    // each pair's mins word then its scales word, the two pairs adjacent.
    // The 16-byte load is the bias MMA's A quad as it is: mins in a[0],
    // a[2] (rows g); the scales in a[1], a[3] only reach rows g + 8, which
    // are never read.
    static_assert(F.k_scale_offset(0) == F.k_min_offset(0) + 4 && F.k_min_offset(1) == F.k_min_offset(0) + 2 &&
                      F.k_min_offset(8) == F.k_min_offset(0) + 8 && F.k_min_offset(2) == F.k_min_offset(0) + 16 &&
                      F.k_min_offset(16) == F.k_min_offset(0) + 64,
                  "a channel pair's K params: its two minimums, then its two scales; pairs r, r + 4 adjacent");
    const uint4 params = *reinterpret_cast<const uint4*>(slot + F.k_min_offset(16 * ks + 2 * r));
    // INT4: q s_K as two terms (hi + lo), each a B operand of its own MMA:
    // one rounded product costs every score a relative error of E's unit
    // roundoff, which the exponential turns into that much error in every
    // probability (the largest arithmetic error of a quantized pool); the
    // codes (A) are exact either way. INT4 blocks wait on memory, so the
    // MMAs are free there; INT2 blocks wait on issued instructions, and
    // the second term would cost them about a tenth of their rate.
    uint32_t qb[NT][2], ql[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      qb[nt][0] = mul2<E>(qf[nt][ks][0], params.y);
      qb[nt][1] = mul2<E>(qf[nt][ks][1], params.w);
      if constexpr (kTwoTermK) {
        ql[nt][0] = mul2_rest<E>(qf[nt][ks][0], params.y, qb[nt][0]);
        ql[nt][1] = mul2_rest<E>(qf[nt][ks][1], params.w, qb[nt][1]);
      }
    }
    const uint32_t am[4] = {params.x, params.y, params.z, params.w};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) Elem16<E>::mma_16816(bias[nt], am, qf[nt][ks][0], qf[nt][ks][1]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint32_t a[4] = {Field::k_codes(kx[ks][0], 2 * mt), Field::k_codes(kx[ks][0], 2 * mt + 1),
                             Field::k_codes(kx[ks][1], 2 * mt), Field::k_codes(kx[ks][1], 2 * mt + 1)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        Elem16<E>::mma_16816(s[nt][mt], a, qb[nt][0], qb[nt][1]);
        if constexpr (kTwoTermK) Elem16<E>::mma_16816(s[nt][mt], a, ql[nt][0], ql[nt][1]);
      }
    }
  }
  static_assert(Field::k_of(S / 8 - 1) < 9 && Field::k_of(S / 8 - 2) < 9, "code_score_scale's range");
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float add0 = fmaf(bias[nt][0], p.scale_log2, -base[nt][0]);
    const float add1 = fmaf(bias[nt][1], p.scale_log2, -base[nt][1]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // rows g: run token 2mt; rows g + 8: run token 2mt + 1
      const float f0 = p.code_score_scale[Field::k_of(2 * mt)];
      const float f1 = p.code_score_scale[Field::k_of(2 * mt + 1)];
      s[nt][mt][0] = fmaf(s[nt][mt][0], f0, add0);
      s[nt][mt][1] = fmaf(s[nt][mt][1], f0, add1);
      s[nt][mt][2] = fmaf(s[nt][mt][2], f1, add0);
      s[nt][mt][3] = fmaf(s[nt][mt][3], f1, add1);
    }
  }
}

// O^T += V^T P^T of one quantized block, P (s) its probabilities.
template <typename E, int D, int S, int Bits, int NT>
__device__ __forceinline__ void quant_block_accumulate(const char* slot, float (&s)[NT][S / 16][4],
                                                       WarpState<D, NT>& st, int lane) {
  constexpr Precision P = Bits == 4 ? Precision::INT4 : Precision::INT2;
  constexpr BlockFormat F{P, 1, D, S};
  constexpr int MT = S / 16;
  constexpr int kRunTokens = S / 8;
  const int g = lane >> 2;
  const int r = lane & 3;

  // ---- fold the per-token V parameters of the thread's tokens into P:
  // the minimums into the running sum_t p_t vmin_t (FP32), the scales into
  // P once it is FP16, one HMUL2 a token with the scale broadcast from the
  // params word (two FMULs and a conversion in FP32; P' rounds twice).
  static_assert(F.v_scale_offset(1) == F.v_scale_offset(0) + 4 && F.v_min_offset(0) == F.v_scale_offset(0) + 2,
                "V params: one (scale, min) word per token");
  SmemRun<4 * kRunTokens> v_params;  // (scale, min) of each of the thread's tokens
  v_params.load(slot + F.v_scale_offset(kRunTokens * g));
  auto vmin = [&](int i) {
    if constexpr (std::is_same_v<E, __half>) {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(v_params.w[i] >> 16)));
    } else {
      return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(v_params.w[i] >> 16)));
    }
  };
  auto times_vscale = [&](uint32_t p2, int i) {
    if constexpr (std::is_same_v<E, __half>) {
      const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&p2),
                                __low2half2(*reinterpret_cast<const __half2*>(&v_params.w[i])));
      return *reinterpret_cast<const uint32_t*>(&r);
    } else {
      using Elem = Elem16<E>;
      return Elem::bits(__hmul2(Elem::pair(p2), __low2bfloat162(Elem::pair(v_params.w[i]))));
    }
  };
  uint32_t pb[NT][MT][2];  // P'^T as B fragments
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int i0 = 2 * mt;
    const int i1 = 2 * mt + 1;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      st.vb[nt][0] = fmaf(s[nt][mt][2], vmin(i1), fmaf(s[nt][mt][0], vmin(i0), st.vb[nt][0]));
      st.vb[nt][1] = fmaf(s[nt][mt][3], vmin(i1), fmaf(s[nt][mt][1], vmin(i0), st.vb[nt][1]));
      pb[nt][mt][0] = movmatrix_trans(times_vscale(pack2<E>(s[nt][mt][0], s[nt][mt][1]), i0));
      pb[nt][mt][1] = movmatrix_trans(times_vscale(pack2<E>(s[nt][mt][2], s[nt][mt][3]), i1));
    }
  }

  // ---- O^T += V^T P'^T, one k-step per m-tile of 16 tokens
  const char* v_codes = slot + F.v_offset();
  constexpr int kRowBytes = D * Bits / 8;
  // k = 2r, 2r+1, 2r+8, 2r+9 of m-tile mt: tokens ta, tb, ta + 1, tb + 1
  constexpr int kVBytes = kVRunBytes<D, Bits>;
  SmemRun<kVBytes> v[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ta = kRunTokens * (2 * r) + 2 * mt;
    const int tb = kRunTokens * (2 * r + 1) + 2 * mt;
    const char* run = v_codes + g * kVBytes;
    v[mt][0].load(run + ta * kRowBytes);
    v[mt][1].load(run + tb * kRowBytes);
    v[mt][2].load(run + (ta + 1) * kRowBytes);
    v[mt][3].load(run + (tb + 1) * kRowBytes);
  }
#pragma unroll
  for (int cm = 0; cm < D / 16; ++cm) {
    const int word = VTilePos<Bits>::word(cm);
    const uint32_t sel = VTilePos<Bits>::sel(cm);
    const int shift = VTilePos<Bits>::shift(cm);  // row g; row g + 8 at shift + Bits
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint32_t xab = prmt(v[mt][0].w[word], v[mt][1].w[word], sel);
      const uint32_t xcd = prmt(v[mt][2].w[word], v[mt][3].w[word], sel);
      using Field = CodeField<E, Bits>;
      const uint32_t a[4] = {Field::v_codes(xab, shift), Field::v_codes(xab, shift + Bits), Field::v_codes(xcd, shift),
                             Field::v_codes(xcd, shift + Bits)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) Elem16<E>::mma_16816(st.acc[nt][cm], a, pb[nt][mt][0], pb[nt][mt][1]);
    }
  }
}

// Entering (to_codes) or leaving a quantized segment of `Bits`: O^T rows
// times 2^(k-24) or 2^(24-k), k the bit of their V codes (exact powers of
// two: the accumulators are sums of p v, far from FP32's limits); in a
// BF16 instance 2^k or 2^-k (CodeField::kExp).
template <typename E, int Bits, int D, int NT>
__device__ __forceinline__ void scale_acc_to_codes(WarpState<D, NT>& st, bool to_codes) {
  using Field = CodeField<E, Bits>;
#pragma unroll
  for (int cm = 0; cm < D / 16; ++cm) {
    const int k0 = Field::v_k(VTilePos<Bits>::shift(cm)) + Field::kExp;
    const int k1 = Field::v_k(VTilePos<Bits>::shift(cm) + Bits) + Field::kExp;
    const float f0 = __int_as_float((127 + (to_codes ? k0 : -k0)) << 23);
    const float f1 = __int_as_float((127 + (to_codes ? k1 : -k1)) << 23);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      st.acc[nt][cm][0] *= f0;
      st.acc[nt][cm][1] *= f0;
      st.acc[nt][cm][2] *= f1;
      st.acc[nt][cm][3] *= f1;
    }
  }
}
}  // namespace mixkv::gpu::detail
