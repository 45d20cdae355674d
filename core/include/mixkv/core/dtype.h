#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mixkv {

// Element types: of the arrays the ops and the engine take, and (F16 or
// BF16) of a cache's 16-bit values (CacheShape::dtype, BlockFormat::dtype).
enum class DType : std::uint8_t { F16 = 0, BF16 = 1, F32 = 2, I32 = 3 };

constexpr std::size_t dtype_bytes(DType t) { return t == DType::F16 || t == DType::BF16 ? 2 : 4; }

// The 16-bit float types a cache may hold: FP16 (IEEE binary16) and BF16
// (the top half of a binary32).
constexpr bool is_cache_dtype(DType t) { return t == DType::F16 || t == DType::BF16; }

// "float16", "bfloat16", "float32", "int32" (NumPy's and torch's names).
std::string to_string(DType t);

// The inverse of to_string, also taking "torch."-prefixed names and the
// short "f16", "bf16", "fp16", "half"; InvalidArgument naming `what`
// otherwise.
DType parse_dtype(std::string_view name, std::string_view what = "dtype");

}  // namespace mixkv
