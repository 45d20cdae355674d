#include "mixkv/cpu/quantize.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "detail.h"
#include "mixkv/core/quant_math.h"

namespace mixkv::cpu {
namespace {

using detail::invalid;

// A group's stored (scale, min): bits of the cache's 16-bit type.
struct GroupParams {
  std::uint16_t scale;
  std::uint16_t min;
};

// Stored (scale, min) of a group spanning [lo, hi] (quant_math.h), rounded
// to `dtype`: codes are then computed against these rounded values, exactly
// as the CUDA store kernel does.
GroupParams group_params(DType dtype, float lo, float hi, int max_code) {
  return {float16_bits(dtype, quant_step(lo, hi, max_code)), float16_bits(dtype, lo)};
}

// The (scale, min) at the given offsets of a head region
// (BlockFormat::k_scale_offset and friends).
void store_params(std::byte* region, std::size_t scale_at, std::size_t min_at, GroupParams params) {
  std::memcpy(region + scale_at, &params.scale, 2);
  std::memcpy(region + min_at, &params.min, 2);
}

GroupParams load_params(const std::byte* region, std::size_t scale_at, std::size_t min_at) {
  GroupParams params;
  std::memcpy(&params.scale, region + scale_at, 2);
  std::memcpy(&params.min, region + min_at, 2);
  return params;
}

void put_code(std::byte* region, BlockFormat::CodeLocation at, int code, int bits) {
  const unsigned mask = ((1u << bits) - 1u) << at.shift;
  const unsigned old = std::to_integer<unsigned>(region[at.byte]);
  region[at.byte] = static_cast<std::byte>((old & ~mask) | (static_cast<unsigned>(code) << at.shift));
}

int get_code(const std::byte* region, BlockFormat::CodeLocation at, int bits) {
  return static_cast<int>((std::to_integer<unsigned>(region[at.byte]) >> at.shift) & ((1u << bits) - 1u));
}

void check_quantized(std::string_view function, const BlockFormat& format) {
  if (!is_quantized(format.precision)) {
    invalid(function, ": format.precision = FP16: expected INT4 or INT2 (FP16 heads hold no codes)");
  }
}

void check_codes(std::string_view function, std::string_view name, const std::uint8_t* codes, std::size_t count,
                 int max_code) {
  for (std::size_t i = 0; i < count; ++i) {
    if (codes[i] > max_code) {
      invalid(function, ": ", name, "[", i, "] = ", static_cast<int>(codes[i]), ": expected a code in [0, ", max_code,
              "]");
    }
  }
}

// K/V rows as quantize_head reads them: 16-bit values of the cache's type
// (store) or floats (demotion of dequantized INT4 values). A 16-bit value
// widens exactly, so both give the codes of the same float values.
struct Rows16 {
  const std::byte* base;
  DType dtype;
  float operator[](std::size_t i) const {
    std::uint16_t bits;
    std::memcpy(&bits, base + 2 * i, 2);
    return float16_value(dtype, bits);
  }
};

template <typename Rows>
void quantize_head(const BlockFormat& format, Rows k, Rows v, std::size_t row_stride, std::byte* head_region) {
  const int tokens = format.block_size;
  const int dim = format.head_dim;
  const int bits = format.bits();
  const int max_code = mixkv::max_code(format.precision);
  const DType dtype = format.dtype;
  std::vector<float> group(static_cast<std::size_t>(std::max(tokens, dim)));

  // K: one group per channel, over the block's tokens.
  for (int c = 0; c < dim; ++c) {
    for (int t = 0; t < tokens; ++t) group[t] = k[t * row_stride + c];
    const auto [lo, hi] = std::minmax_element(group.begin(), group.begin() + tokens);
    const GroupParams params = group_params(dtype, *lo, *hi, max_code);
    const float inverse_step = quant_inverse_step(float16_value(dtype, params.scale));
    const float bias = quant_bias(float16_value(dtype, params.min), inverse_step);
    for (int t = 0; t < tokens; ++t) {
      put_code(head_region, format.k_code_location(t, c), quant_code(group[t], inverse_step, bias, max_code), bits);
    }
    store_params(head_region, format.k_scale_offset(c), format.k_min_offset(c), params);
  }
  // V: one group per token, over the channels.
  for (int t = 0; t < tokens; ++t) {
    for (int c = 0; c < dim; ++c) group[c] = v[t * row_stride + c];
    const auto [lo, hi] = std::minmax_element(group.begin(), group.begin() + dim);
    const GroupParams params = group_params(dtype, *lo, *hi, max_code);
    const float inverse_step = quant_inverse_step(float16_value(dtype, params.scale));
    const float bias = quant_bias(float16_value(dtype, params.min), inverse_step);
    for (int c = 0; c < dim; ++c) {
      put_code(head_region, format.v_code_location(t, c), quant_code(group[c], inverse_step, bias, max_code), bits);
    }
    store_params(head_region, format.v_scale_offset(t), format.v_min_offset(t), params);
  }
}

// Dequantizes one quantized head with the code width known at compile time.
// Each group (a K channel, a V token) dequantizes its 2^Bits possible codes
// once, with the same dequant() as everywhere else, and its packed bytes are
// then expanded by table lookups: decode attention reads every block through
// this, and the generic per-code location arithmetic cost ~19 instructions a
// value.
template <int Bits>
void read_quantized_head(const BlockFormat& format, const std::byte* head_region, float* k_out, float* v_out) {
  constexpr int kPerByte = 8 / Bits;
  constexpr int kCodes = 1 << Bits;
  constexpr unsigned kMask = kCodes - 1u;
  const std::size_t dim = static_cast<std::size_t>(format.head_dim);
  float table[kCodes];
  auto fill_table = [&](std::size_t scale_at, std::size_t min_at) {
    const GroupParams params = load_params(head_region, scale_at, min_at);
    const float scale = float16_value(format.dtype, params.scale);
    const float min = float16_value(format.dtype, params.min);
    for (int code = 0; code < kCodes; ++code) table[code] = dequant(code, scale, min);
  };
  const std::size_t k_bytes = format.k_channel_bytes();
  for (std::size_t c = 0; c < dim; ++c) {  // K: per-channel groups
    fill_table(format.k_scale_offset(static_cast<int>(c)), format.k_min_offset(static_cast<int>(c)));
    float* out = k_out + c;
    for (std::size_t i = 0; i < k_bytes; ++i) {
      const unsigned byte =
          std::to_integer<unsigned>(head_region[format.k_code_byte(static_cast<int>(c), static_cast<int>(i))]);
      for (int j = 0; j < kPerByte; ++j) out[(i * kPerByte + j) * dim] = table[(byte >> (j * Bits)) & kMask];
    }
  }
  const std::size_t v_bytes = format.v_token_bytes();
  for (int t = 0; t < format.block_size; ++t) {  // V: per-token groups, a token's codes contiguous
    fill_table(format.v_scale_offset(t), format.v_min_offset(t));
    const std::byte* codes = head_region + format.v_offset() + v_bytes * t;
    float* out = v_out + t * dim;
    for (std::size_t i = 0; i < v_bytes; ++i) {
      const unsigned byte = std::to_integer<unsigned>(codes[i]);
      for (int j = 0; j < kPerByte; ++j) out[i * kPerByte + j] = table[(byte >> (j * Bits)) & kMask];
    }
  }
}

}  // namespace

namespace detail {

void write_head_unchecked(const BlockFormat& format, const std::byte* k, const std::byte* v, std::size_t row_stride,
                          std::byte* head_region) {
  if (format.precision == Precision::FP16) {
    const std::size_t row_bytes = static_cast<std::size_t>(format.head_dim) * 2;
    for (int t = 0; t < format.block_size; ++t) {
      std::memcpy(head_region + fp16_k_row(format, t), k + t * row_stride * 2, row_bytes);
      std::memcpy(head_region + fp16_v_row(format, t), v + t * row_stride * 2, row_bytes);
    }
    return;
  }
  quantize_head(format, Rows16{k, format.dtype}, Rows16{v, format.dtype}, row_stride, head_region);
}

void quantize_head_floats(const BlockFormat& format, const float* k, const float* v, std::byte* head_region) {
  quantize_head(format, k, v, static_cast<std::size_t>(format.head_dim), head_region);
}

std::string unquantizable_floats(const BlockFormat& format, const float* k, const float* v) {
  const int tokens = format.block_size;
  const int dim = format.head_dim;
  const int max_code = mixkv::max_code(format.precision);
  // The group's stored min and step must be finite in the cache's type, so
  // that every code is computed from finite numbers and dequantizes to a
  // finite value.
  auto bad_group = [&](float lo, float hi) {
    if (!std::isfinite(lo) || !std::isfinite(hi)) return true;
    const GroupParams params = group_params(format.dtype, lo, hi, max_code);
    return !float16_is_finite(format.dtype, params.min) || !float16_is_finite(format.dtype, params.scale);
  };
  auto text = [](const auto&... parts) {
    std::string s;
    (append_part(s, parts), ...);
    return s;
  };
  for (int c = 0; c < dim; ++c) {
    float lo = k[c];
    float hi = k[c];
    for (int t = 0; t < tokens; ++t) {
      const float x = k[static_cast<std::size_t>(t) * dim + c];
      if (std::isnan(x)) return text("K token ", t, " channel ", c, " is NaN");
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    if (bad_group(lo, hi)) return text("K channel ", c, " spans [", lo, ", ", hi, "]");
  }
  for (int t = 0; t < tokens; ++t) {
    const float* row = v + static_cast<std::size_t>(t) * dim;
    float lo = row[0];
    float hi = row[0];
    for (int c = 0; c < dim; ++c) {
      if (std::isnan(row[c])) return text("V token ", t, " channel ", c, " is NaN");
      lo = std::min(lo, row[c]);
      hi = std::max(hi, row[c]);
    }
    if (bad_group(lo, hi)) return text("V token ", t, " spans [", lo, ", ", hi, "]");
  }
  return {};
}

void read_head_unchecked(const BlockFormat& format, const std::byte* head_region, float* k_out, float* v_out) {
  const int tokens = format.block_size;
  const int dim = format.head_dim;
  if (format.precision == Precision::FP16) {
    for (int t = 0; t < tokens; ++t) {
      float16s_to_floats(format.dtype, head_region + fp16_k_row(format, t), k_out + static_cast<std::size_t>(t) * dim,
                         dim);
      float16s_to_floats(format.dtype, head_region + fp16_v_row(format, t), v_out + static_cast<std::size_t>(t) * dim,
                         dim);
    }
    return;
  }
  if (format.bits() == 4) {
    read_quantized_head<4>(format, head_region, k_out, v_out);
  } else {
    read_quantized_head<2>(format, head_region, k_out, v_out);
  }
}

}  // namespace detail

namespace {

void write_head_checked(const BlockFormat& format, DType dtype, const std::byte* k, const std::byte* v,
                        std::size_t row_stride, std::byte* head_region) {
  constexpr std::string_view fn = "write_head";
  detail::check_format(fn, "format", format);
  detail::check_dtype(fn, "k", dtype, format.dtype, "format.dtype");
  if (k == nullptr) invalid(fn, ": k is null: expected block_size rows of head_dim values");
  if (v == nullptr) invalid(fn, ": v is null: expected block_size rows of head_dim values");
  if (head_region == nullptr) invalid(fn, ": head_region is null: expected head_bytes() writable bytes");
  if (row_stride < static_cast<std::size_t>(format.head_dim)) {
    invalid(fn, ": row_stride = ", row_stride, ": expected >= head_dim = ", format.head_dim);
  }
  // NaN/inf would poison a whole quantization group (and every FP16 read),
  // so they are rejected before anything is written.
  for (const auto& [name, rows] : {std::pair{"k", k}, std::pair{"v", v}}) {
    for (int t = 0; t < format.block_size; ++t) {
      for (int c = 0; c < format.head_dim; ++c) {
        std::uint16_t bits;
        std::memcpy(&bits, rows + (t * row_stride + c) * 2, 2);
        if (!float16_is_finite(dtype, bits)) {
          invalid(fn, ": ", name, "[", t, " * row_stride + ", c, "] (token ", t, ", channel ", c,
                  ") is NaN or inf: expected finite values");
        }
      }
    }
  }
  detail::write_head_unchecked(format, k, v, row_stride, head_region);
}

}  // namespace

void write_head(const BlockFormat& format, const Half* k, const Half* v, std::size_t row_stride,
                std::byte* head_region) {
  write_head_checked(format, DType::F16, reinterpret_cast<const std::byte*>(k), reinterpret_cast<const std::byte*>(v),
                     row_stride, head_region);
}

void write_head(const BlockFormat& format, const BFloat16* k, const BFloat16* v, std::size_t row_stride,
                std::byte* head_region) {
  write_head_checked(format, DType::BF16, reinterpret_cast<const std::byte*>(k), reinterpret_cast<const std::byte*>(v),
                     row_stride, head_region);
}

void read_head(const BlockFormat& format, const std::byte* head_region, float* k_out, float* v_out) {
  constexpr std::string_view fn = "read_head";
  detail::check_format(fn, "format", format);
  if (head_region == nullptr) invalid(fn, ": head_region is null: expected head_bytes() readable bytes");
  if (k_out == nullptr) invalid(fn, ": k_out is null: expected block_size * head_dim floats");
  if (v_out == nullptr) invalid(fn, ": v_out is null: expected block_size * head_dim floats");
  detail::read_head_unchecked(format, head_region, k_out, v_out);
}

void unpack_codes(const BlockFormat& format, const std::byte* head_region, std::uint8_t* k_codes,
                  std::uint8_t* v_codes) {
  constexpr std::string_view fn = "unpack_codes";
  detail::check_format(fn, "format", format);
  check_quantized(fn, format);
  if (head_region == nullptr) invalid(fn, ": head_region is null: expected head_bytes() readable bytes");
  if (k_codes == nullptr) invalid(fn, ": k_codes is null: expected block_size * head_dim bytes");
  if (v_codes == nullptr) invalid(fn, ": v_codes is null: expected block_size * head_dim bytes");
  const int bits = format.bits();
  for (int t = 0; t < format.block_size; ++t) {
    for (int c = 0; c < format.head_dim; ++c) {
      const std::size_t i = static_cast<std::size_t>(t) * format.head_dim + c;
      k_codes[i] = static_cast<std::uint8_t>(get_code(head_region, format.k_code_location(t, c), bits));
      v_codes[i] = static_cast<std::uint8_t>(get_code(head_region, format.v_code_location(t, c), bits));
    }
  }
}

void pack_codes(const BlockFormat& format, const std::uint8_t* k_codes, const std::uint8_t* v_codes,
                std::byte* head_region) {
  constexpr std::string_view fn = "pack_codes";
  detail::check_format(fn, "format", format);
  check_quantized(fn, format);
  if (k_codes == nullptr) invalid(fn, ": k_codes is null: expected block_size * head_dim codes");
  if (v_codes == nullptr) invalid(fn, ": v_codes is null: expected block_size * head_dim codes");
  if (head_region == nullptr) invalid(fn, ": head_region is null: expected head_bytes() writable bytes");
  const std::size_t count = static_cast<std::size_t>(format.block_size) * format.head_dim;
  const int max_code = mixkv::max_code(format.precision);
  check_codes(fn, "k_codes", k_codes, count, max_code);
  check_codes(fn, "v_codes", v_codes, count, max_code);
  const int bits = format.bits();
  for (int t = 0; t < format.block_size; ++t) {
    for (int c = 0; c < format.head_dim; ++c) {
      const std::size_t i = static_cast<std::size_t>(t) * format.head_dim + c;
      put_code(head_region, format.k_code_location(t, c), k_codes[i], bits);
      put_code(head_region, format.v_code_location(t, c), v_codes[i], bits);
    }
  }
}

}  // namespace mixkv::cpu
