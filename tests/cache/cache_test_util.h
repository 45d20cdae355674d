#pragma once
// Tiny configurations for the cache tests: block ids and slab moves stay
// small enough to assert exactly.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/errors.h"

namespace mixkv::test {

// 1 KV head, head_dim 16, block_size 16: an FP16 block is 1,024 bytes, INT4
// 384 and INT2 256, so a 4 KiB slab holds 4 FP16, 10 INT4 or 16 INT2 blocks.
inline constexpr std::size_t kTinySlab = 4096;
inline constexpr std::int32_t kTinyBlock = 16;

inline CacheConfig tiny_config(std::int32_t num_layers, std::int32_t slabs) {
  CacheConfig config;
  config.shape = CacheShape{num_layers, 1, 16, kTinyBlock};
  config.slab_bytes = kTinySlab;
  config.arena_bytes = kTinySlab * static_cast<std::size_t>(slabs);
  return config;
}

inline TokenLayout text(std::int32_t n) { return TokenLayout({{TokenKind::Text, n}}); }

inline std::vector<std::int32_t> to_vector(std::span<const std::int32_t> s) { return {s.begin(), s.end()}; }

// Runs `call`, expects it to throw E with a message containing every one of
// `needles`, and the manager's state to be unchanged.
template <class E, class F>
void expect_rejected(const KVCacheManager& cache, F&& call, std::initializer_list<std::string> needles) {
  const std::string before = cache.describe_state();
  try {
    call();
    ADD_FAILURE() << "expected an exception";
  } catch (const E& e) {
    for (const std::string& needle : needles) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
  EXPECT_EQ(cache.describe_state(), before);
  EXPECT_NO_THROW(cache.check_invariants());
}

// Expects E with a message containing `needle` (no manager involved).
template <class E, class F>
void expect_error(F&& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected an exception naming " << needle;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

}  // namespace mixkv::test
