// Decode arithmetic on each pool against float64 attention over the same
// dequantized blocks (cpu::decode_attention), per head: the largest error
// of a (sequence, query head) row over its largest output value, at a long
// context and with attention peaked enough that score errors show (K with
// outlier channels, q at 1x and 3x). FP16 and INT4 stay within 1e-3. INT2
// rounds q s_K once (decode_quant.cuh: the exact two-term product would
// cost its instruction-bound loop about a tenth of its rate), which peaked
// attention turns into up to ~7e-3: its bar is 1e-2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "cuda_test_util.h"
#include "decode_test_util.h"

namespace mixkv::test {
namespace {

struct HeadErrors {
  double max = 0.0;
  double mean = 0.0;
};

// Per row of `dim` values: max |out - ref| / max |ref|; the largest and the
// mean over rows.
HeadErrors per_head(const std::vector<float>& out, const std::vector<float>& ref, int dim) {
  HeadErrors e;
  const std::size_t rows = ref.size() / static_cast<std::size_t>(dim);
  for (std::size_t r = 0; r < rows; ++r) {
    double scale = 1e-6, worst = 0.0;
    for (int c = 0; c < dim; ++c) scale = std::max(scale, std::abs(static_cast<double>(ref[r * dim + c])));
    for (int c = 0; c < dim; ++c) {
      const double d = std::abs(static_cast<double>(out[r * dim + c]) - ref[r * dim + c]);
      worst = std::max(worst, std::isfinite(d) ? d : 1e30);
    }
    e.max = std::max(e.max, worst / scale);
    e.mean += worst / scale / static_cast<double>(rows);
  }
  return e;
}

struct AccuracyCase {
  Precision pool;
  double q_sd;
};

class DecodeCudaAccuracy : public ::testing::TestWithParam<AccuracyCase> {};

TEST_P(DecodeCudaAccuracy, PerHeadErrorWithinTheBar) {
  MIXKV_REQUIRE_CUDA();
  const AccuracyCase c = GetParam();
  constexpr int kQHeads = 28, kKvHeads = 4, kDim = 128, kBlock = 32;
  const std::vector<int> contexts{19'600, 4'099};
  Rng rng(7);
  std::vector<SequenceData> seqs;
  for (int tokens : contexts) {
    SequenceData s;
    s.tokens = tokens;
    s.k = random_halves(rng, static_cast<std::size_t>(tokens) * kKvHeads * kDim);
    s.v = random_halves(rng, s.k.size());
    // Four outlier channels per head, as real keys have: they set the
    // per-channel scales' spread and the scores' size.
    for (std::size_t i = 0; i < s.k.size(); ++i) {
      if (i % kDim < 4) s.k[i] = float_to_half(8.0f * half_to_float(s.k[i]));
    }
    s.windows.assign(static_cast<std::size_t>(tokens / kBlock), c.pool);
    seqs.push_back(std::move(s));
  }
  TestArena arena(kKvHeads, kDim, kBlock, blocks_needed(contexts, kBlock), 3);
  const PlacedBatch placed = place_batch(arena, seqs);
  const auto q = random_halves(rng, contexts.size() * kQHeads * kDim, c.q_sd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  const DecodeResult ref = cpu_decode(arena, placed, q, kQHeads, scale);
  const DecodeResult got = run_gpu(arena, placed, q, kQHeads, scale);
  const HeadErrors e = per_head(got.out, ref.out, kDim);
  std::printf("[ accuracy ] %s pool, q sd %.0f: per-head error max %.2e mean %.2e\n",
              std::string(to_string(c.pool)).c_str(), c.q_sd, e.max, e.mean);
  EXPECT_LE(e.max, c.pool == Precision::INT2 ? 1e-2 : 1e-3) << to_string(c.pool) << ", q sd " << c.q_sd;
}

INSTANTIATE_TEST_SUITE_P(Pools, DecodeCudaAccuracy,
                         ::testing::Values(AccuracyCase{Precision::FP16, 1.0}, AccuracyCase{Precision::FP16, 3.0},
                                           AccuracyCase{Precision::INT4, 1.0}, AccuracyCase{Precision::INT4, 3.0},
                                           AccuracyCase{Precision::INT2, 1.0}, AccuracyCase{Precision::INT2, 3.0}));

}  // namespace
}  // namespace mixkv::test
