#include "mixkv/core/half.h"

#include <string>

#include "mixkv/core/errors.h"

#if defined(__x86_64__) || defined(__i386__)
#define MIXKV_HALF_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace mixkv {
namespace {

void halves_to_floats_generic(const std::byte* halves, float* out, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    Half h;
    std::memcpy(&h, halves + i * sizeof(Half), sizeof(Half));
    out[i] = half_to_float(h);
  }
}

#if defined(MIXKV_HALF_X86)
// vcvtph2ps is exact, like half_to_float (binary16 -> binary32 loses nothing).
__attribute__((target("avx,f16c"))) void halves_to_floats_f16c(const std::byte* halves, float* out, std::size_t count) {
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i * sizeof(Half)));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(packed));
  }
  halves_to_floats_generic(halves + i * sizeof(Half), out + i, count - i);
}
#endif

using ConvertFn = void (*)(const std::byte*, float*, std::size_t);

ConvertFn pick_conversion() {
#if defined(MIXKV_HALF_X86)
  // F16C and AVX from CPUID leaf 1 (ECX bits 29 and 28): clang before 16 has
  // no "f16c" for __builtin_cpu_supports.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0 && (ecx & bit_AVX) != 0) {
    return halves_to_floats_f16c;
  }
#endif
  return halves_to_floats_generic;
}

const ConvertFn convert = pick_conversion();

}  // namespace

void halves_to_floats(const std::byte* halves, float* out, std::size_t count) {
  if (count > 0 && (halves == nullptr || out == nullptr)) {
    throw InvalidArgument(std::string("halves_to_floats: ") + (halves == nullptr ? "halves" : "out") +
                          " is null: expected " + std::to_string(count) + " values");
  }
  convert(halves, out, count);
}

}  // namespace mixkv
