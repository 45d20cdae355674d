#pragma once
// Quantization of a (block, KV head) tile by independent warps, straight
// from global memory through registers: store_prefill's path at the shapes
// built for it. The CTA-wide quantizer of quantize.cuh stages a whole tile
// in shared memory and runs a statistics pass and a code pass with barriers
// between them; with a few tiles per CTA taken in sequence, its SMs spend
// most of a long layer's time waiting on tile loads and barriers. Here a
// warp owns a fixed share of one tile, loads it with all its loads in
// flight at once, and needs no barrier: the groups a share holds are whole,
// or complete within the warp by shuffles. Codes and (scale, min) are those
// of quantize.cuh bit for bit (the same group_params and code rule), for
// either 16-bit type E of a cache (elem16.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "elem16.cuh"
#include "mixkv/core/block_format.h"
#include "quantize.cuh"

namespace mixkv::gpu::detail {

// A warp's share of a tile, its unit: 2,048 values, each lane 8 rows of 8
// adjacent halves (one 16-byte load a row).
//   K unit: every token of kKChannels adjacent channels. Lane: channel
//     octet g = lane % (kKChannels / 8), token octet s = lane /
//     (kKChannels / 8). A channel's 8 codes of octet s are bytes of its
//     packed K codes (a word at INT4, a half word at INT2; bytes apart
//     where the format stores one-byte runs run-major, block_format.h).
//   V unit: kVTokens adjacent tokens of every channel. Lane: channel octet
//     g = lane % (D / 8), token octet r = lane / (D / 8). A token's 8 codes
//     of octet g are one packed run of the token-major V codes.
// A K group (a channel over S tokens) spans the S / 8 lanes of one channel
// octet, a V group (a token over D channels) the D / 8 lanes of one token
// octet: each range completes by shuffles within the warp. Shapes of
// powers of two with D in [64, 256] and D * S >= 2048.
template <int kHeadDim, int kBlockSize>
struct WarpTileUnits {
  static constexpr bool power_of_two(int x) { return x > 0 && (x & (x - 1)) == 0; }
  static constexpr bool kApplies = power_of_two(kHeadDim) && power_of_two(kBlockSize) && kHeadDim >= 64 &&
                                   kHeadDim <= 256 && kBlockSize >= 16 && kBlockSize <= 256 &&
                                   kHeadDim * kBlockSize >= 2048;
  static constexpr int kKChannels = kApplies ? 2048 / kBlockSize : 8;
  static constexpr int kVTokens = kApplies ? 2048 / kHeadDim : 8;
  static constexpr int kKUnits = kHeadDim / kKChannels;
  static constexpr int kVUnits = kBlockSize / kVTokens;
  static constexpr int kPerTile = kKUnits + kVUnits;
};

// Run of 8 packed codes as stored: a word at INT4, a half word at INT2.
template <int kBits>
using CodeRun = std::conditional_t<kBits == 4, uint32_t, uint16_t>;

// The tile's input is read once: streaming loads (evict first).
__device__ __forceinline__ uint4 load_streaming(const void* at) { return __ldcs(reinterpret_cast<const uint4*>(at)); }

// Word j (channels 2j, 2j + 1 of the octet) of a row.
template <typename E>
__device__ __forceinline__ typename Elem16<E>::T2 value_pair(const uint4& row, int j) {
  return Elem16<E>::pair(j == 0 ? row.x : j == 1 ? row.y : j == 2 ? row.z : row.w);
}

// The element of `values` at runtime index i (< N), by selects: indexing a
// register array at run time would put it in local memory.
template <typename T, int N>
__device__ __forceinline__ T element_at(const T (&values)[N], int i) {
  T picked = values[0];
#pragma unroll
  for (int j = 1; j < N; ++j) picked = i == j ? values[j] : picked;
  return picked;
}

// Quantizes K unit `channel0 / kKChannels` of a tile: `k` points at the
// tile's token 0, channel 0; rows are `row_halves` apart. `out` is the
// head's region in the kBits pool.
template <typename E, int kBits, int kHeadDim, int kBlockSize>
__device__ __forceinline__ void quantize_k_unit(const E* k, std::size_t row_halves, int channel0, char* out) {
  using Units = WarpTileUnits<kHeadDim, kBlockSize>;
  static_assert(Units::kApplies);
  constexpr uint32_t kMaxCode = (1u << kBits) - 1u;
  constexpr int kOctets = Units::kKChannels / 8;  // lanes a token row
  constexpr int kSlices = kBlockSize / 8;         // lanes a channel octet
  constexpr BlockFormat layout{kBits == 4 ? Precision::INT4 : Precision::INT2, 1, kHeadDim, kBlockSize};
  constexpr bool kRunMajor = layout.k_runs_are_bytes();
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane % kOctets;
  const int s = lane / kOctets;
  const int c0 = channel0 + 8 * g;  // the lane's first channel

  uint4 x[8];
  const E* at = k + static_cast<std::size_t>(8 * s) * row_halves + c0;
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = load_streaming(at + i * row_halves);

  // Ranges of the lane's channel pairs over its 8 tokens, then over the
  // channel octet's kSlices lanes.
  using Elem = Elem16<E>;
  typename Elem::T2 lo[4], hi[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    lo[j] = hi[j] = value_pair<E>(x[0], j);
#pragma unroll
    for (int i = 1; i < 8; ++i) {
      lo[j] = __hmin2(lo[j], value_pair<E>(x[i], j));
      hi[j] = __hmax2(hi[j], value_pair<E>(x[i], j));
    }
#pragma unroll
    for (int offset = kOctets; offset < 32; offset <<= 1) {
      lo[j] = __hmin2(lo[j], __shfl_xor_sync(0xffffffffu, lo[j], offset));
      hi[j] = __hmax2(hi[j], __shfl_xor_sync(0xffffffffu, hi[j], offset));
    }
  }

  // Parameters: of the octet's 4 channel pairs, the lane of slice s takes
  // pairs s % kTakers + kTakers m. The first kTakers slices store theirs
  // (one 8-byte run: the pair's mins word, then its scales word) and every
  // lane gathers the 8 channels' (inverse step, bias) by shuffles.
  constexpr int kTakers = kSlices < 4 ? kSlices : 4;
  constexpr int kTaken = 4 / kTakers;  // pairs a lane takes
  float inverse_taken[kTaken][2], bias_taken[kTaken][2];
  bool subnormal_scale = false;
#pragma unroll
  for (int m = 0; m < kTaken; ++m) {
    const int pair = s % kTakers + kTakers * m;
    const float2 l = Elem::widen2(element_at(lo, pair));
    const float2 h = Elem::widen2(element_at(hi, pair));
    const GroupParamsDevice a = group_params<kMaxCode, E>(l.x, h.x);
    const GroupParamsDevice b = group_params<kMaxCode, E>(l.y, h.y);
    inverse_taken[m][0] = a.inverse_step, inverse_taken[m][1] = b.inverse_step;
    bias_taken[m][0] = a.bias, bias_taken[m][1] = b.bias;
    subnormal_scale |= has_subnormal_scale(a.packed) || has_subnormal_scale(b.packed);
    if (s < kTakers) {
      const int c = c0 + 2 * pair;
      *reinterpret_cast<uint2*>(out + layout.k_min_offset(c)) =
          make_uint2(__byte_perm(a.packed, b.packed, 0x7632), __byte_perm(a.packed, b.packed, 0x5410));
    }
  }
  // Codes: channel c's run of octet s, token i at bits i * kBits; by half
  // octets, each gathering its 4 channels' (inverse step, bias) first
  // (the 8 channels' at once spilled at 64 registers).
  auto write_codes = [&]<bool kClampHigh>() {
    // INT2 x 32: the lane's two bytes of a channel are runs 2s and 2s + 1,
    // which the format keeps 16 bytes apart, each in a word shared with the
    // partner channel octet (lane ^ 1). The two lanes trade the run they do
    // not store, so each stores its run of the 16-channel group whole: one
    // 16-byte store instead of 16 byte stores.
    constexpr bool kTradeRuns = kRunMajor && sizeof(CodeRun<kBits>) == 2;
    static_assert(!kTradeRuns || (layout.k_code_byte(8, 0) == layout.k_code_byte(0, 0) + 1 &&
                                  layout.k_code_byte(1, 0) == layout.k_code_byte(0, 0) + 2 &&
                                  layout.k_code_byte(2, 0) == layout.k_code_byte(0, 0) + 4 &&
                                  layout.k_code_byte(0, 1) == layout.k_code_byte(0, 0) + 16 &&
                                  layout.k_code_byte(16, 0) == layout.k_code_byte(0, 0) + 128),
                  "a group's run: 16 bytes, word w = channels 2w, 2w + 8, 2w + 1, 2w + 9");
    [[maybe_unused]] const bool odd_octet = (g & 1) != 0;
    [[maybe_unused]] uint32_t group_run[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float inverse[4], bias[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int pair = 2 * half + c / 2;
        const int from = g + pair % kTakers * kOctets;
        inverse[c] = __shfl_sync(0xffffffffu, inverse_taken[pair / kTakers][c % 2], from);
        bias[c] = __shfl_sync(0xffffffffu, bias_taken[pair / kTakers][c % 2], from);
      }
      uint32_t run[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float2 f = Elem::widen2(value_pair<E>(x[i], 2 * half + j));
          run[2 * j] += code_of<E, kMaxCode, false, kClampHigh>(f.x, inverse[2 * j], bias[2 * j]) << (i * kBits);
          run[2 * j + 1] += code_of<E, kMaxCode, false, kClampHigh>(f.y, inverse[2 * j + 1], bias[2 * j + 1])
                            << (i * kBits);
        }
      }
      CodeRun<kBits> packed[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) packed[c] = static_cast<CodeRun<kBits>>(run[c] - word_bias<kBits, 8>());
      if constexpr (kTradeRuns) {
        // Byte 2c of `low` / `high` is channel 4 half + c's run 2s, byte
        // 2c + 1 its run 2s + 1; a group word is ordered (own channel 2w,
        // partner's 2w, own 2w + 1, partner's 2w + 1), even octet first.
        const uint32_t low = packed[0] | static_cast<uint32_t>(packed[1]) << 16;
        const uint32_t high = packed[2] | static_cast<uint32_t>(packed[3]) << 16;
        const uint32_t kept = __byte_perm(low, high, odd_octet ? 0x7531 : 0x6420);
        const uint32_t sent = __byte_perm(low, high, odd_octet ? 0x6420 : 0x7531);
        const uint32_t received = __shfl_xor_sync(0xffffffffu, sent, 1);
        group_run[2 * half] = __byte_perm(kept, received, odd_octet ? 0x1504 : 0x5140);
        group_run[2 * half + 1] = __byte_perm(kept, received, odd_octet ? 0x3726 : 0x7362);
      } else {
        // The lane's 8 codes of a channel are its bytes sizeof(run) * s ..:
        // one store where the channel's bytes are contiguous, one a byte
        // where its runs are bytes stored run-major (block_format.h).
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int channel = c0 + 4 * half + c;
          constexpr int kBytes = static_cast<int>(sizeof(CodeRun<kBits>));
          if constexpr (kRunMajor) {
#pragma unroll
            for (int b = 0; b < kBytes; ++b) {
              out[layout.k_code_byte(channel, kBytes * s + b)] = static_cast<char>(packed[c] >> (8 * b));
            }
          } else {
            *reinterpret_cast<CodeRun<kBits>*>(out + layout.k_code_byte(channel, kBytes * s)) = packed[c];
          }
        }
      }
    }
    if constexpr (kTradeRuns) {
      const int group_channel0 = c0 - (odd_octet ? 8 : 0);
      *reinterpret_cast<uint4*>(out + layout.k_code_byte(group_channel0, 2 * s + (odd_octet ? 1 : 0))) =
          make_uint4(group_run[0], group_run[1], group_run[2], group_run[3]);
    }
  };
  if (__any_sync(0xffffffffu, subnormal_scale)) {
    write_codes.template operator()<true>();
  } else {
    write_codes.template operator()<false>();
  }
}

// Quantizes V unit `token0 / kVTokens` of a tile: `v` points at the tile's
// token 0, channel 0; rows are `row_halves` apart.
template <typename E, int kBits, int kHeadDim, int kBlockSize>
__device__ __forceinline__ void quantize_v_unit(const E* v, std::size_t row_halves, int token0, char* out) {
  static_assert(WarpTileUnits<kHeadDim, kBlockSize>::kApplies);
  constexpr uint32_t kMaxCode = (1u << kBits) - 1u;
  constexpr int kOctets = kHeadDim / 8;  // lanes a token row
  constexpr BlockFormat layout{kBits == 4 ? Precision::INT4 : Precision::INT2, 1, kHeadDim, kBlockSize};
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane % kOctets;
  const int t0 = token0 + 8 * (lane / kOctets);  // the lane's first token

  uint4 x[8];
  const E* at = v + static_cast<std::size_t>(t0) * row_halves + 8 * g;
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = load_streaming(at + i * row_halves);

  // Range of token t0 + i as (min, -max), so that one minimum a shuffle
  // step combines both; over the lane's 8 channels, then the row's lanes.
  // The negation and the pairing as bit operations (through __hneg2 and
  // __lows2half2 they compiled to HADD2s and PRMTs that spilled).
  // The sign is bit 15 of either type.
  using Elem = Elem16<E>;
  using T2 = typename Elem::T2;
  T2 range[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const T2 lo =
        __hmin2(__hmin2(Elem::pair(x[i].x), Elem::pair(x[i].y)), __hmin2(Elem::pair(x[i].z), Elem::pair(x[i].w)));
    const T2 hi =
        __hmax2(__hmax2(Elem::pair(x[i].x), Elem::pair(x[i].y)), __hmax2(Elem::pair(x[i].z), Elem::pair(x[i].w)));
    const uint32_t lo_bits = *reinterpret_cast<const uint32_t*>(&lo);
    const uint32_t negated_hi_bits = *reinterpret_cast<const uint32_t*>(&hi) ^ 0x80008000u;
    range[i] = __hmin2(Elem::pair(__byte_perm(lo_bits, negated_hi_bits, 0x5410)),
                       Elem::pair(__byte_perm(lo_bits, negated_hi_bits, 0x7632)));
#pragma unroll
    for (int offset = 1; offset < kOctets; offset <<= 1) {
      range[i] = __hmin2(range[i], __shfl_xor_sync(0xffffffffu, range[i], offset));
    }
  }

  // Parameters: lane g < 8 of a row takes token t0 + g and stores its
  // word; each token's (inverse step, bias) reaches the row's lanes by
  // shuffles just before its codes.
  const float2 r = Elem::widen2(element_at(range, g % 8));
  const GroupParamsDevice gp = group_params<kMaxCode, E>(r.x, -r.y);
  if (g < 8) *reinterpret_cast<uint32_t*>(out + layout.v_scale_offset(t0 + g)) = gp.packed;
  const int row_lane0 = lane - g;

  // Codes: token t0 + i's run of octet g, channel 8g + c at bits c * kBits.
  auto write_codes = [&]<bool kClampHigh>() {
    auto* runs = reinterpret_cast<CodeRun<kBits>*>(out + layout.v_offset());
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float inverse = __shfl_sync(0xffffffffu, gp.inverse_step, row_lane0 + i);
      const float bias = __shfl_sync(0xffffffffu, gp.bias, row_lane0 + i);
      uint32_t run = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = Elem::widen2(value_pair<E>(x[i], j));
        run += code_of<E, kMaxCode, false, kClampHigh>(f.x, inverse, bias) << (2 * j * kBits);
        run += code_of<E, kMaxCode, false, kClampHigh>(f.y, inverse, bias) << ((2 * j + 1) * kBits);
      }
      runs[(t0 + i) * kOctets + g] = static_cast<CodeRun<kBits>>(run - word_bias<kBits, 8>());
    }
  };
  const bool subnormal_scale = g < 8 && has_subnormal_scale(gp.packed);
  if (__any_sync(0xffffffffu, subnormal_scale)) {
    write_codes.template operator()<true>();
  } else {
    write_codes.template operator()<false>();
  }
}

}  // namespace mixkv::gpu::detail
