#pragma once
#include <cstddef>
#include <cstdint>

#include "mixkv/core/bfloat16.h"
#include "mixkv/core/block_format.h"
#include "mixkv/core/half.h"

namespace mixkv::cpu {

// Write one KV head of one block in `format` (any precision):
// k, v: [block_size tokens] rows of head_dim values, consecutive rows
// row_stride values apart, of format.dtype (the Half overload for F16, the
// BFloat16 one for BF16; the other is an InvalidArgument). FP16 copies;
// INT4/INT2 quantize K per channel over the tokens and V per token over the
// channels, then pack, with (scale, min) rounded to format.dtype.
void write_head(const BlockFormat& format, const Half* k, const Half* v, std::size_t row_stride,
                std::byte* head_region);
void write_head(const BlockFormat& format, const BFloat16* k, const BFloat16* v, std::size_t row_stride,
                std::byte* head_region);

// Dequantize (or widen) one head of a block: k_out, v_out are
// [block_size][head_dim] floats. The exact values every decode kernel sees.
void read_head(const BlockFormat& format, const std::byte* head_region, float* k_out, float* v_out);

// Raw codes of a quantized head, [block_size][head_dim] each, for the
// bit-exact pack/unpack tests.
void unpack_codes(const BlockFormat& format, const std::byte* head_region, std::uint8_t* k_codes,
                  std::uint8_t* v_codes);
void pack_codes(const BlockFormat& format, const std::uint8_t* k_codes, const std::uint8_t* v_codes,
                std::byte* head_region);

}  // namespace mixkv::cpu
