#pragma once
#include <cstddef>
#include <cstdint>

#include "mixkv/core/dtype.h"
#include "mixkv/core/host_device.h"
#include "mixkv/core/precision.h"

namespace mixkv {

// The byte layout of one block: the single definition shared by the host
// reference, the CUDA kernels, the allocator and the benchmarks.
//
// A block holds one layer's K and V for block_size tokens and every KV head.
// Heads are stored one after another (head-major), so one (sequence, head)
// reads one contiguous run of head_bytes():
//
//   FP16 head:  K[token][channel] half | V[token][channel] half
//   INT4/INT2:  K codes | V codes | K params | V params
//     K codes   per channel, packed along tokens: channel c owns
//               block_size * bits / 8 bytes; token t of it sits at bits
//               [t * bits, (t + 1) * bits) counted little-endian from the
//               channel's first byte (at INT4 x 32 tokens one channel is
//               one 16-byte load). Channel-major (channel c's bytes
//               contiguous), except where a channel is 8 one-byte runs of
//               block_size / 8 tokens (INT4 x 16, INT2 x 32 tokens): there
//               byte i of every channel of a group of 16 comes together,
//               see k_code_byte.
//     V codes   token-major, packed along channels the same way: token t
//               owns head_dim * bits / 8 bytes.
//     K params  per channel (scale, min) halves, stored by channel pair:
//               channels c, c + 1 (c even) as min_c, min_c+1, scale_c,
//               scale_c+1, so that a pair's minimums and its scales are each
//               one 32-bit word: the decode kernel's MMAs take them as they
//               are (see paged_decode_kernel). Within each group of 16
//               channels the 8 pairs go in the order 0, 4, 1, 5, 2, 6, 3, 7,
//               so that pairs r and r + 4, which one decode thread needs
//               together, are one 16-byte load (see k_min_offset). K is
//               quantized per channel over the block's tokens (keys have
//               outlier channels).
//     V params  per token (scale, min) as two halves: V is per token over the
//               whole head (finer channel groups bought less accuracy than
//               the same bytes spent on precision:
//               benchmarks/results/v_grouping.md).
//   Dequantized value = min + scale * code (eqs. 14-16 with the zero point
//   folded into the stored minimum).
//
// Every 16-bit value above ("half": the FP16 elements and the (scale, min)
// parameters) is of the cache's type `dtype`, IEEE binary16 (F16) or
// bfloat16 (BF16); no size or offset depends on it. The pool named FP16
// holds the cache's unquantized rows in that type.
struct BlockFormat {
  Precision precision = Precision::FP16;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t block_size = 0;
  DType dtype = DType::F16;

  MIXKV_HOST_DEVICE constexpr int bits() const { return bits_of(precision); }
  MIXKV_HOST_DEVICE constexpr int codes_per_byte() const { return 8 / bits(); }

  // Bytes of one channel's packed K codes (quantized formats).
  MIXKV_HOST_DEVICE constexpr std::size_t k_channel_bytes() const {
    return static_cast<std::size_t>(block_size) * bits() / 8;
  }
  // Bytes of one token's packed V codes (quantized formats).
  MIXKV_HOST_DEVICE constexpr std::size_t v_token_bytes() const {
    return static_cast<std::size_t>(head_dim) * bits() / 8;
  }

  MIXKV_HOST_DEVICE constexpr std::size_t k_offset() const { return 0; }
  MIXKV_HOST_DEVICE constexpr std::size_t v_offset() const {
    return precision == Precision::FP16 ? static_cast<std::size_t>(block_size) * head_dim * 2
                                        : k_channel_bytes() * head_dim;
  }
  // The parameter regions (quantized formats only): 4 bytes per channel
  // (K) and per token (V); where each half lies in them is below.
  MIXKV_HOST_DEVICE constexpr std::size_t k_params_offset() const { return v_offset() + v_token_bytes() * block_size; }
  MIXKV_HOST_DEVICE constexpr std::size_t v_params_offset() const {
    return k_params_offset() + static_cast<std::size_t>(head_dim) * 4;
  }
  // The halves of channel c's K (scale, min) and token t's V (scale, min).
  MIXKV_HOST_DEVICE constexpr std::size_t k_min_offset(int channel) const {
    const auto c = static_cast<std::size_t>(channel);  // unsigned: shifts, no sign fix-up
    const std::size_t pair = c % 16 / 2;               // pair of the 16-channel group
    return k_params_offset() + c / 16 * 64 + (pair % 4 * 2 + pair / 4) * 8 + c % 2 * 2;
  }
  MIXKV_HOST_DEVICE constexpr std::size_t k_scale_offset(int channel) const { return k_min_offset(channel) + 4; }
  MIXKV_HOST_DEVICE constexpr std::size_t v_scale_offset(int token) const {
    return v_params_offset() + static_cast<std::size_t>(token) * 4;
  }
  MIXKV_HOST_DEVICE constexpr std::size_t v_min_offset(int token) const { return v_scale_offset(token) + 2; }

  MIXKV_HOST_DEVICE constexpr std::size_t head_bytes() const {
    return precision == Precision::FP16 ? static_cast<std::size_t>(block_size) * head_dim * 2 * 2
                                        : v_params_offset() + static_cast<std::size_t>(block_size) * 4;
  }
  MIXKV_HOST_DEVICE constexpr std::size_t head_offset(int head) const {
    return head_bytes() * static_cast<std::size_t>(head);
  }
  MIXKV_HOST_DEVICE constexpr std::size_t block_bytes() const {
    return head_bytes() * static_cast<std::size_t>(num_kv_heads);
  }

  // Whether a channel's K codes are 8 bytes, one run of block_size / 8
  // tokens each (INT4 x 16, INT2 x 32 tokens; head_dim is a multiple of 16).
  MIXKV_HOST_DEVICE constexpr bool k_runs_are_bytes() const {
    return precision != Precision::FP16 && block_size * bits() == 64;
  }
  // Byte i of channel c's K codes, from the head region's start. Where runs
  // are bytes they are stored run-major by groups of 16 channels: group
  // c / 16, then run i, then the 4 channel pairs (2r, 2r + 1) of the group
  // as channels 2r, 2r + 8, 2r + 1, 2r + 9 (a 4-byte word each). The decode
  // kernel's thread (run g, pair r) then takes the codes of its four
  // channels of a k-step in one 4-byte load, as its MMA operands pair
  // them: channel-major, they were four 1-byte loads from 8 bytes apart.
  MIXKV_HOST_DEVICE constexpr std::size_t k_code_byte(int channel, int i) const {
    if (k_runs_are_bytes()) {
      const int c = channel % 16;
      return k_offset() + static_cast<std::size_t>(channel / 16) * 128 + static_cast<std::size_t>(i) * 16 +
             (c % 8) / 2 * 4 + (c % 2) * 2 + c / 8;
    }
    return k_offset() + k_channel_bytes() * channel + static_cast<std::size_t>(i);
  }

  // Where code (token, channel) lives inside a head's region: byte offset and
  // bit shift within that byte.
  struct CodeLocation {
    std::size_t byte;
    int shift;
  };
  MIXKV_HOST_DEVICE constexpr CodeLocation k_code_location(int token, int channel) const {
    return {k_code_byte(channel, token / codes_per_byte()), (token % codes_per_byte()) * bits()};
  }
  MIXKV_HOST_DEVICE constexpr CodeLocation v_code_location(int token, int channel) const {
    return {v_offset() + v_token_bytes() * token + static_cast<std::size_t>(channel) / codes_per_byte(),
            (channel % codes_per_byte()) * bits()};
  }
};

// Bytes per token per KV head of a precision, metadata included.
MIXKV_HOST_DEVICE constexpr double bytes_per_token_per_head(Precision p, int head_dim, int block_size) {
  return static_cast<double>(BlockFormat{p, 1, head_dim, block_size}.head_bytes()) / block_size;
}

static_assert(BlockFormat{Precision::INT4, 1, 128, 32}.head_bytes() == 148 * 32);
static_assert(BlockFormat{Precision::INT2, 1, 128, 32}.head_bytes() == 84 * 32);
static_assert(BlockFormat{Precision::FP16, 1, 128, 32}.head_bytes() == 512 * 32);

}  // namespace mixkv
