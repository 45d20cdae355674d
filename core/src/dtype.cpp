#include "mixkv/core/dtype.h"

#include <string>

#include "mixkv/core/errors.h"
#include "mixkv/core/span16.h"

namespace mixkv {

std::string to_string(DType t) {
  switch (t) {
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F32: return "float32";
    case DType::I32: return "int32";
  }
  return "dtype(" + std::to_string(static_cast<int>(t)) + ")";
}

DType parse_dtype(std::string_view name, std::string_view what) {
  std::string_view n = name;
  if (n.starts_with("torch.")) n.remove_prefix(6);
  if (n == "float16" || n == "f16" || n == "fp16" || n == "half") return DType::F16;
  if (n == "bfloat16" || n == "bf16") return DType::BF16;
  if (n == "float32" || n == "f32" || n == "float") return DType::F32;
  if (n == "int32" || n == "i32") return DType::I32;
  throw InvalidArgument(std::string(what) + " = '" + std::string(name) +
                        "': expected float16, bfloat16, float32 or int32");
}

void float16s_to_floats(DType t, const std::byte* values, float* out, std::size_t count) {
  if (t != DType::BF16) {
    halves_to_floats(values, out, count);
    return;
  }
  if (count > 0 && (values == nullptr || out == nullptr)) {
    throw InvalidArgument(std::string("float16s_to_floats: ") + (values == nullptr ? "values" : "out") +
                          " is null: expected " + std::to_string(count) + " values");
  }
  for (std::size_t i = 0; i < count; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, values + 2 * i, sizeof bits);
    out[i] = bfloat16_to_float(BFloat16{bits});
  }
}

}  // namespace mixkv
