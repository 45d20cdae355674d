#pragma once
// Shared by the planner tests (CPU and CUDA): random prompt embeddings in
// every element type, and eq. 8 / eq. 9 computed the slow way.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mixkv/core/half.h"
#include "mixkv/core/token_layout.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv::test {

// Short names for the precisions in the tests' plan tables.
inline constexpr Precision F = Precision::FP16;
inline constexpr Precision I4 = Precision::INT4;
inline constexpr Precision I2 = Precision::INT2;

// Runs `call`, expects an exception of type E whose message contains `part`.
template <typename E>
void expect_error(const std::function<void()>& call, const std::string& part) {
  try {
    call();
    ADD_FAILURE() << "expected an exception containing \"" << part << "\", none was thrown";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
        << "message \"" << e.what() << "\" does not contain \"" << part << "\"";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type, message: " << e.what();
  }
}

inline std::uint16_t float_to_bf16(float value) {  // round to nearest even
  std::uint32_t x;
  std::memcpy(&x, &value, sizeof x);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

// A [tokens, hidden] matrix in one element type, plus the float values it
// holds (after rounding to that type), which the references use.
struct Matrix {
  ElementType type = ElementType::F32;
  std::int64_t tokens = 0;
  std::int32_t hidden = 0;
  std::vector<float> values;          // exact values held
  std::vector<float> f32;             // storage when F32
  std::vector<std::uint16_t> bits16;  // storage when F16 / BF16

  EmbeddingsView view() const {
    return {type == ElementType::F32 ? static_cast<const void*>(f32.data()) : bits16.data(), type, tokens, hidden};
  }
  float at(std::int64_t row, std::int32_t c) const { return values[static_cast<std::size_t>(row * hidden + c)]; }
  void set(std::int64_t row, std::int32_t c, float v) {
    const auto i = static_cast<std::size_t>(row * hidden + c);
    switch (type) {
      case ElementType::F32:
        f32[i] = v;
        values[i] = v;
        break;
      case ElementType::F16:
        bits16[i] = float_to_half(v).bits;
        values[i] = half_to_float(Half{bits16[i]});
        break;
      case ElementType::BF16: {
        bits16[i] = float_to_bf16(v);
        const std::uint32_t x = static_cast<std::uint32_t>(bits16[i]) << 16;
        std::memcpy(&values[i], &x, sizeof(float));
        break;
      }
    }
  }
};

inline Matrix make_matrix(ElementType type, std::int64_t tokens, std::int32_t hidden) {
  Matrix m;
  m.type = type;
  m.tokens = tokens;
  m.hidden = hidden;
  const auto n = static_cast<std::size_t>(tokens * hidden);
  m.values.assign(n, 0.0f);
  if (type == ElementType::F32)
    m.f32.assign(n, 0.0f);
  else
    m.bits16.assign(n, 0);
  return m;
}

// Gaussian rows around a few shared directions, so that windows differ in
// how close they are to the text (pure noise would give every score ~0).
inline Matrix random_embeddings(ElementType type, std::int64_t tokens, std::int32_t hidden, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<std::vector<float>> directions(4, std::vector<float>(static_cast<std::size_t>(hidden)));
  for (auto& d : directions) {
    for (float& x : d) x = normal(rng);
  }
  Matrix m = make_matrix(type, tokens, hidden);
  for (std::int64_t r = 0; r < tokens; ++r) {
    const auto& d = directions[static_cast<std::size_t>(r / 7) % directions.size()];
    const float weight = uniform(rng);
    const float scale = std::exp(uniform(rng));  // norms differ by up to e^4
    for (std::int32_t c = 0; c < hidden; ++c) m.set(r, c, scale * (normal(rng) + weight * d[c]));
  }
  return m;
}

// Eq. 8 as the paper writes it: the mean over all (text, window) token pairs
// of their cosine, in double. A zero row has cosine 0 with everything.
inline std::vector<double> brute_force_similarity(const TokenLayout& layout, const Matrix& m,
                                                  std::int32_t window_size) {
  std::vector<std::int64_t> text;
  std::int64_t position = 0;
  for (const Segment& s : layout.segments()) {
    if (s.kind == TokenKind::Text) {
      for (std::int64_t r = position; r < position + s.length; ++r) text.push_back(r);
    }
    position += s.length;
  }
  const auto norm = [&](std::int64_t r) {
    double n = 0.0;
    for (std::int32_t c = 0; c < m.hidden; ++c) n += static_cast<double>(m.at(r, c)) * m.at(r, c);
    return std::sqrt(n);
  };
  std::vector<double> scores;
  for (const std::int32_t start : layout.window_starts(window_size)) {
    double sum = 0.0;
    for (const std::int64_t t : text) {
      for (std::int64_t w = start; w < start + window_size; ++w) {
        double dot = 0.0;
        for (std::int32_t c = 0; c < m.hidden; ++c) dot += static_cast<double>(m.at(t, c)) * m.at(w, c);
        const double n = norm(t) * norm(w);
        if (n > 0.0) sum += dot / n;
      }
    }
    scores.push_back(sum / (static_cast<double>(text.size()) * window_size));
  }
  return scores;
}

}  // namespace mixkv::test
