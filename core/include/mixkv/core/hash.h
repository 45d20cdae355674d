#pragma once
#include <cstdint>

namespace mixkv {

// MurmurHash3's 64-bit finalizer: a bijection whose every output bit
// depends on every input bit, so chained or counter inputs come out
// uniformly spread (the prefix index's hash chain, seeded test data).
constexpr std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

}  // namespace mixkv
