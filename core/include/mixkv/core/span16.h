#pragma once
// A cache's 16-bit float type at run time: conversions by DType, and Span16,
// the read-only run of FP16 or BF16 values the CPU ops take as K, V and q
// (the element type travels with the data, so a mismatch with the cache is
// an error the op names instead of a silent reinterpretation).
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ranges>
#include <span>
#include <type_traits>

#include "mixkv/core/bfloat16.h"
#include "mixkv/core/dtype.h"
#include "mixkv/core/half.h"

namespace mixkv {

// Bits of a 16-bit float of type `t` (F16 or BF16), as float and back; both
// are exact widening / round-to-nearest-even narrowing.
inline float float16_value(DType t, std::uint16_t bits) {
  return t == DType::BF16 ? bfloat16_to_float(BFloat16{bits}) : half_to_float(Half{bits});
}
inline std::uint16_t float16_bits(DType t, float value) {
  return t == DType::BF16 ? float_to_bfloat16(value).bits : float_to_half(value).bits;
}
// Whether the bits of a value of type `t` are finite (not NaN, not inf).
constexpr bool float16_is_finite(DType t, std::uint16_t bits) {
  return t == DType::BF16 ? (bits & 0x7f80u) != 0x7f80u : (bits & 0x7c00u) != 0x7c00u;
}

// float16_value over `count` packed values at `values` (any alignment):
// halves_to_floats for F16, a shift for BF16. Throws InvalidArgument naming
// the pointer if either is null while count > 0.
void float16s_to_floats(DType t, const std::byte* values, float* out, std::size_t count);

template <class T>
concept Float16Element = std::same_as<T, Half> || std::same_as<T, BFloat16>;

template <Float16Element T>
constexpr DType dtype_of() {
  return std::same_as<T, BFloat16> ? DType::BF16 : DType::F16;
}

// A read-only span of FP16 or BF16 values. Built implicitly from any
// contiguous range of Half or BFloat16 (a std::vector, a std::span), whose
// type it records.
class Span16 {
 public:
  Span16() = default;
  Span16(const std::byte* data, std::size_t size, DType dtype) : data_(data), size_(size), dtype_(dtype) {}
  template <std::ranges::contiguous_range R>
  requires Float16Element<std::remove_cv_t<std::ranges::range_value_t<R>>> Span16(
      R&& range)  // NOLINT(google-explicit-constructor): a span converts as std::span does
      : data_(reinterpret_cast<const std::byte*>(std::ranges::data(range))),
        size_(std::ranges::size(range)),
        dtype_(dtype_of<std::remove_cv_t<std::ranges::range_value_t<R>>>()) {}

  DType dtype() const { return dtype_; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::byte* data() const { return data_; }
  std::span<const std::byte> as_bytes() const { return {data_, size_ * 2}; }
  // Element i's bits and value.
  std::uint16_t bits(std::size_t i) const {
    std::uint16_t b;
    std::memcpy(&b, data_ + 2 * i, sizeof b);
    return b;
  }
  float value(std::size_t i) const { return float16_value(dtype_, bits(i)); }
  // As std::span's: the first `count` values, and `count` values from
  // `offset` (all that follow by default).
  Span16 first(std::size_t count) const { return {data_, count, dtype_}; }
  Span16 subspan(std::size_t offset, std::size_t count = static_cast<std::size_t>(-1)) const {
    return {data_ + 2 * offset, count == static_cast<std::size_t>(-1) ? size_ - offset : count, dtype_};
  }

 private:
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  DType dtype_ = DType::F16;
};

}  // namespace mixkv
