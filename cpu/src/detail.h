#pragma once
// Private to the CPU backend: the argument checks, the unchecked head kernels
// and the state-merge rule that quantize.cpp, store.cpp, decode_attention.cpp
// and merge_states.cpp share. Public entry points validate everything first
// and then call the unchecked kernels, so a throwing call writes nothing.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "mixkv/core/block_format.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/half.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/core/precision.h"
#include "mixkv/core/span16.h"
#include "mixkv/cpu/store.h"

namespace mixkv::cpu::detail {

// A number written in hexadecimal by invalid().
struct Hex {
  unsigned value;
};

inline void append_part(std::string& out, std::string_view text) { out.append(text); }
inline void append_part(std::string& out, char c) { out.push_back(c); }
template <typename Number>
requires std::is_arithmetic_v<Number>
void append_part(std::string& out, Number n) { out.append(std::to_string(n)); }
inline void append_part(std::string& out, Hex h) {
  char digits[2 * sizeof(unsigned) + 1];
  std::snprintf(digits, sizeof digits, "%x", h.value);
  out.append(digits);
}

// Messages are assembled with std::string rather than an ostringstream: on
// the H200 machine (Python 3.12, NumPy 2.5) every error raised through the
// ostringstream version inside the Python module crashed the process, while
// errors built as strings did not; strings need no locale at all.
template <typename... Parts>
[[noreturn]] void invalid(const Parts&... parts) {
  std::string message;
  (append_part(message, parts), ...);
  throw InvalidArgument(message);
}

// Throws IndexOutOfRange unless 0 <= value < limit (or value == -1 where
// `padding` names what -1 means): "fn: name = v, expected 0 <= name < limit
// (what)". The name is assembled from `name` only on failure, so checking
// every id of a page table costs a compare.
template <typename... NameParts>
void check_index(std::string_view function, std::int64_t value, std::int64_t limit, std::string_view what,
                 std::string_view padding, const NameParts&... name) {
  if ((value >= 0 && value < limit) || (!padding.empty() && value == -1)) return;
  std::string n;
  (append_part(n, name), ...);
  std::string message;
  for (std::string_view part : {function, std::string_view(": "), std::string_view(n), std::string_view(" = ")}) {
    message.append(part);
  }
  append_part(message, value);
  message.append(", expected ");
  if (!padding.empty()) {
    message.append("-1 (");
    message.append(padding);
    message.append(") or ");
  }
  message.append("0 <= ");
  message.append(n);
  message.append(" < ");
  append_part(message, limit);
  message.append(" (");
  message.append(what);
  message.append(")");
  throw IndexOutOfRange(message);
}

// Block ids of `pool`: [0, num_blocks), the ids that address bytes inside its buffer.
template <typename... NameParts>
void check_block(std::string_view function, std::int64_t id, const PoolView& pool, std::string_view pool_name,
                 const NameParts&... name) {
  if (id >= 0 && id < pool.num_blocks) return;
  check_index(function, id, pool.num_blocks, std::string(pool_name) + ".num_blocks", {}, name...);
}

// FP16 token slots of `pool`: [0, num_blocks * block_size); -1 passes where
// `padding` is not empty.
template <typename... NameParts>
void check_slot(std::string_view function, std::int64_t slot, const PoolView& pool, std::string_view pool_name,
                std::string_view padding, const NameParts&... name) {
  const std::int64_t limit = static_cast<std::int64_t>(pool.num_blocks) * pool.format.block_size;
  if (slot >= 0 && slot < limit) return;
  check_index(function, slot, limit, std::string(pool_name) + ".num_blocks * block_size", padding, name...);
}

// Throws InvalidArgument naming `name` at the first NaN or infinity;
// `values` starts at element `first` of the argument.
inline void check_finite(std::string_view function, std::string_view name, Span16 values, std::size_t first = 0) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint16_t bits = values.bits(i);
    if (!float16_is_finite(values.dtype(), bits)) {
      invalid(function, ": ", name, "[", first + i, "] is NaN or inf (bits 0x", Hex{bits}, "): expected finite values");
    }
  }
}

// K, V and q are in the cache's type: another type is refused, never
// reinterpreted (the bits of one mean nothing as the other) nor converted
// behind the caller's back.
inline void check_dtype(std::string_view function, std::string_view name, DType got, DType cache,
                        std::string_view cache_name) {
  if (got != cache) {
    invalid(function, ": ", name, ": dtype ", to_string(got), ": expected ", to_string(cache), " (", cache_name,
            ", the cache's dtype)");
  }
}

// The same limits as validate(CacheShape): they keep every packed run and
// metadata array of a block 16-byte aligned and whole bytes at INT2.
inline void check_format(std::string_view function, std::string_view name, const BlockFormat& f) {
  const auto p = static_cast<int>(f.precision);
  if (p < 0 || p >= kNumPrecisions) invalid(function, ": ", name, ".precision = ", p, ": expected FP16, INT4 or INT2");
  if (f.num_kv_heads < 1) invalid(function, ": ", name, ".num_kv_heads = ", f.num_kv_heads, ": expected >= 1");
  if (f.head_dim < 16 || f.head_dim > 512 || f.head_dim % 16 != 0) {
    invalid(function, ": ", name, ".head_dim = ", f.head_dim, ": expected a multiple of 16 in [16, 512]");
  }
  if (f.block_size < 16 || f.block_size > 256 || f.block_size % 16 != 0) {
    invalid(function, ": ", name, ".block_size = ", f.block_size, ": expected a multiple of 16 in [16, 256]");
  }
  if (!is_cache_dtype(f.dtype))
    invalid(function, ": ", name, ".dtype = ", to_string(f.dtype), ": expected float16 or bfloat16");
}

inline void check_pool(std::string_view function, std::string_view name, const PoolView& pool, Precision expected) {
  if (pool.format.precision != expected) {
    invalid(function, ": ", name, ".format.precision = ", to_string(pool.format.precision), ": expected ",
            to_string(expected));
  }
  check_format(function, std::string(name) + ".format", pool.format);
  if (pool.base == nullptr) invalid(function, ": ", name, ".base is null: expected the arena's first byte");
  if (pool.num_blocks < 0) invalid(function, ": ", name, ".num_blocks = ", pool.num_blocks, ": expected >= 0");
  if (pool.blocks_per_slab < 1) {
    invalid(function, ": ", name, ".blocks_per_slab = ", pool.blocks_per_slab, ": expected >= 1");
  }
  const std::size_t needed = static_cast<std::size_t>(pool.blocks_per_slab) * pool.format.block_bytes();
  if (pool.slab_bytes < needed) {
    invalid(function, ": ", name, ".slab_bytes = ", pool.slab_bytes,
            ": expected >= blocks_per_slab * block_bytes = ", needed);
  }
}

inline std::string pool_name(Precision p) { return "pools[" + std::string(to_string(p)) + "]"; }

// Each pools[i] must hold kAllPrecisions[i] and share the FP16 pool's
// geometry (num_kv_heads, head_dim, block_size) and dtype.
inline void check_pools(std::string_view function, const PoolViews& pools) {
  for (Precision p : kAllPrecisions) check_pool(function, pool_name(p), pools[pool_index(p)], p);
  const BlockFormat& ref = pools[0].format;
  for (Precision p : {Precision::INT4, Precision::INT2}) {
    const BlockFormat& f = pools[pool_index(p)].format;
    const std::string name = pool_name(p) + ".format.";
    if (f.num_kv_heads != ref.num_kv_heads) {
      invalid(function, ": ", name, "num_kv_heads = ", f.num_kv_heads, ": expected ", ref.num_kv_heads,
              " (pools[FP16].format.num_kv_heads)");
    }
    if (f.head_dim != ref.head_dim) {
      invalid(function, ": ", name, "head_dim = ", f.head_dim, ": expected ", ref.head_dim,
              " (pools[FP16].format.head_dim)");
    }
    if (f.block_size != ref.block_size) {
      invalid(function, ": ", name, "block_size = ", f.block_size, ": expected ", ref.block_size,
              " (pools[FP16].format.block_size)");
    }
    if (f.dtype != ref.dtype) {
      invalid(function, ": ", name, "dtype = ", to_string(f.dtype), ": expected ", to_string(ref.dtype),
              " (pools[FP16].format.dtype)");
    }
  }
}

// Byte offset of FP16 token `token`'s K (or V) row inside a head region:
// FP16 heads are K[token][channel] then V[token][channel] (block_format.h),
// 2 bytes a value in either 16-bit type.
inline std::size_t fp16_k_row(const BlockFormat& f, std::int32_t token) {
  return f.k_offset() + static_cast<std::size_t>(token) * f.head_dim * 2;
}
inline std::size_t fp16_v_row(const BlockFormat& f, std::int32_t token) {
  return f.v_offset() + static_cast<std::size_t>(token) * f.head_dim * 2;
}

// Unchecked kernels behind write_head / read_head (quantize.cpp). k and v
// are rows of head_dim values of format.dtype, row_stride values apart.
void write_head_unchecked(const BlockFormat& format, const std::byte* k, const std::byte* v, std::size_t row_stride,
                          std::byte* head_region);
void read_head_unchecked(const BlockFormat& format, const std::byte* head_region, float* k_out, float* v_out);
// Quantizes [block_size][head_dim] float K/V into a quantized head (demote).
void quantize_head_floats(const BlockFormat& format, const float* k, const float* v, std::byte* head_region);
// Empty when quantize_head_floats can store K/V in `format` (every value
// finite, every group's min and step finite in format.dtype), else what is wrong
// ("K channel 3 ...") for a message.
std::string unquantizable_floats(const BlockFormat& format, const float* k, const float* v);

// The merge rule of two attention states over disjoint key sets (natural
// log), evaluated in double. Empty states (lse = -inf) are handled by
// branches rather than by arithmetic, so -inf - -inf never happens and an
// empty state's output (whatever it holds) never leaks into the result.
// `out` may be `out_a` or `out_b` itself: element c is read before written.
template <typename In, typename Out>
void merge_state(double lse_a, const In* out_a, double lse_b, const In* out_b, std::int32_t head_dim, Out* out,
                 Out& lse) {
  constexpr double kEmpty = -std::numeric_limits<double>::infinity();
  if (lse_a == kEmpty && lse_b == kEmpty) {
    std::fill(out, out + head_dim, Out(0));
    lse = static_cast<Out>(kEmpty);
    return;
  }
  if (lse_b == kEmpty || lse_a == kEmpty) {
    const In* src = lse_b == kEmpty ? out_a : out_b;
    for (std::int32_t c = 0; c < head_dim; ++c) out[c] = static_cast<Out>(src[c]);
    lse = static_cast<Out>(lse_b == kEmpty ? lse_a : lse_b);
    return;
  }
  const double m = std::max(lse_a, lse_b);
  const double ea = std::exp(lse_a - m);
  const double eb = std::exp(lse_b - m);
  const double sum = ea + eb;
  const double wa = ea / sum;
  const double wb = eb / sum;
  for (std::int32_t c = 0; c < head_dim; ++c) {
    out[c] = static_cast<Out>(wa * static_cast<double>(out_a[c]) + wb * static_cast<double>(out_b[c]));
  }
  lse = static_cast<Out>(m + std::log(sum));
}

}  // namespace mixkv::cpu::detail
