// Decode attention over the three pools: kernel correctness against a dense
// float64 attention on the same (dequantized) values, pool and order
// invariance, empty states, quantization quality, bad input.
#include <gtest/gtest.h>

#include <iostream>
#include <tuple>

#include "cpu_test_util.h"
#include "mixkv/cpu/decode_attention.h"

namespace mixkv::test {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// Dense float64 attention of every (sequence, query head) over `expected`.
std::vector<DenseState> reference(const PlacedBatch& placed, const std::vector<Half>& q, std::int32_t num_q_heads,
                                  std::int32_t num_kv_heads, std::int32_t dim, double sm_scale) {
  std::vector<DenseState> states;
  const std::int32_t group = num_q_heads / num_kv_heads;
  for (std::size_t b = 0; b < placed.expected.size(); ++b) {
    for (std::int32_t h = 0; h < num_q_heads; ++h) {
      std::vector<double> qh(dim);
      for (std::int32_t c = 0; c < dim; ++c) qh[c] = half_to_float(q[(b * num_q_heads + h) * dim + c]);
      const ExpectedKV& e = placed.expected[b];
      states.push_back(dense_attention(qh.data(), e.k[h / group].data(), e.v[h / group].data(),
                                       e.k[h / group].size() / dim, dim, sm_scale));
    }
  }
  return states;
}

struct ErrorStats {
  double mean = 0, max = 0, lse_max = 0;
};

// Relative output error and absolute LSE error per (sequence, query head);
// empty sequences must give out 0 and lse -inf exactly.
ErrorStats compare(const DecodeResult& got, const std::vector<DenseState>& want, std::int32_t dim) {
  ErrorStats stats;
  std::size_t counted = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const float* out = &got.out[i * dim];
    if (std::isinf(want[i].lse)) {
      EXPECT_EQ(got.lse[i], -std::numeric_limits<float>::infinity()) << "state " << i;
      for (std::int32_t c = 0; c < dim; ++c) EXPECT_EQ(out[c], 0.0f) << "state " << i << " channel " << c;
      continue;
    }
    const double e = relative_error(out, want[i].out);
    EXPECT_TRUE(std::isfinite(e)) << "state " << i;
    stats.mean += e;
    stats.max = std::max(stats.max, e);
    stats.lse_max = std::max(stats.lse_max, std::abs(got.lse[i] - want[i].lse));
    ++counted;
  }
  if (counted > 0) stats.mean /= counted;
  return stats;
}

std::vector<SequenceData> random_sequences(Rng& rng, const std::vector<std::int32_t>& contexts, std::int32_t kv_heads,
                                           std::int32_t dim, std::int32_t block, bool mixed) {
  std::vector<SequenceData> seqs;
  for (std::int32_t n : contexts) {
    const std::size_t values = static_cast<std::size_t>(n) * kv_heads * dim;
    SequenceData seq{n, random_halves(rng, values), random_halves(rng, values), {}};
    for (std::int32_t w = 0; w < n / block; ++w) {
      seq.windows.push_back(mixed ? kAllPrecisions[rng() % kNumPrecisions] : Precision::FP16);
    }
    seqs.push_back(std::move(seq));
  }
  return seqs;
}

// One attention problem: sequences placed through store_prefill, random
// queries, the kernel's result and the dense reference on the same values.
struct Problem {
  std::int32_t q_heads, kv_heads, dim, block;
  std::vector<SequenceData> seqs;
  std::uint64_t arena_seed = 1;

  ErrorStats check(double tolerance, std::uint64_t q_seed = 5) const {
    TestArena arena(kv_heads, dim, block, blocks_needed(seqs, block), arena_seed);
    const PlacedBatch placed = place_batch(arena, seqs);
    Rng rng(q_seed);
    const std::vector<Half> q = random_halves(rng, seqs.size() * q_heads * dim);
    const float sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));
    const DecodeResult got = cpu_decode(arena, placed, q, q_heads, sm_scale);
    const ErrorStats stats = compare(got, reference(placed, q, q_heads, kv_heads, dim, sm_scale), dim);
    EXPECT_LE(stats.max, tolerance);
    EXPECT_LE(stats.lse_max, tolerance);
    return stats;
  }
};

// (head_dim, (q heads, kv heads), batch)
using Sizes = std::tuple<int, std::pair<int, int>, int>;

class AttentionSizes : public ::testing::TestWithParam<Sizes> {
 protected:
  Problem problem(bool mixed) const {
    const auto [dim, heads, batch] = GetParam();
    // Block sizes 16, 32, 64 in turn over the parameter grid.
    const std::int32_t block = 16 << ((dim / 64 + heads.first + batch) % 3);
    const std::vector<std::int32_t> contexts_cycle = {1, 31, 33, 97};
    std::vector<std::int32_t> contexts;
    for (int b = 0; b < batch; ++b) contexts.push_back(contexts_cycle[(b + heads.first) % 4]);
    Rng rng(static_cast<std::uint64_t>(dim * 1000 + heads.first * 10 + batch));
    return {heads.first, heads.second, dim, block, random_sequences(rng, contexts, heads.second, dim, block, mixed)};
  }
};

std::string sizes_name(const ::testing::TestParamInfo<Sizes>& info) {
  const auto [dim, heads, batch] = info.param;
  return "D" + std::to_string(dim) + "_Q" + std::to_string(heads.first) + "_KV" + std::to_string(heads.second) + "_B" +
         std::to_string(batch);
}

// testing.md item 3 asks for 1e-3 against an fp32-accumulating kernel; this
// reference accumulates in double, so only the float output rounding remains.
TEST_P(AttentionSizes, Fp16MatchesDenseFloat64) { problem(false).check(1e-5); }

TEST_P(AttentionSizes, MixedPoolsMatchDenseOnDequantizedValues) { problem(true).check(1e-5); }

INSTANTIATE_TEST_SUITE_P(OddSizes, AttentionSizes,
                         ::testing::Combine(::testing::Values(64, 128, 256),
                                            ::testing::Values(std::pair{1, 1}, std::pair{4, 1}, std::pair{7, 1},
                                                              std::pair{9, 3}, std::pair{28, 4}),
                                            ::testing::Values(1, 3, 17)),
                         sizes_name);

// The paper's setting: batch 1, 19,600 tokens, Qwen2-7B heads (28 q / 4 KV).
TEST(DecodeAttention, LongContextFp16) {
  Rng rng(41);
  Problem p{28, 4, 128, 32, random_sequences(rng, {19'600}, 4, 128, 32, false)};
  p.check(1e-5);
}

TEST(DecodeAttention, LongContextMixedPools) {
  Rng rng(42);
  Problem p{28, 4, 128, 32, random_sequences(rng, {19'600}, 4, 128, 32, true)};
  p.check(1e-5);
}

// A window whose values are min + step * code (power-of-two step, every code
// present in each group) quantizes exactly at `p`, so it can sit in the FP16
// pool or in pool p and give the same values.
std::vector<Half> exact_window_values(Rng& rng, std::int32_t kv_heads, std::int32_t dim, std::int32_t block,
                                      Precision p, bool per_channel) {
  const int qmax = max_code(p);
  std::vector<Half> values(static_cast<std::size_t>(block) * kv_heads * dim);
  const std::int32_t groups = per_channel ? dim : block;
  const std::int32_t group_len = per_channel ? block : dim;
  for (std::int32_t h = 0; h < kv_heads; ++h) {
    for (std::int32_t g = 0; g < groups; ++g) {
      const float min = -2.0f + 0.25f * static_cast<float>(rng() % 9);
      const float step = std::ldexp(1.0f, -2 - static_cast<int>(rng() % 4));
      std::vector<int> codes(group_len);
      for (std::int32_t i = 0; i < group_len; ++i) codes[i] = i <= qmax ? i : static_cast<int>(rng() % (qmax + 1));
      std::shuffle(codes.begin(), codes.end(), rng);
      for (std::int32_t i = 0; i < group_len; ++i) {
        const std::int32_t t = per_channel ? i : g;
        const std::int32_t c = per_channel ? g : i;
        values[(static_cast<std::size_t>(t) * kv_heads + h) * dim + c] = float_to_half(min + step * codes[i]);
      }
    }
  }
  return values;
}

// testing.md item 4: the same windows in other pools, in other orders, in
// other blocks give the same output.
TEST(DecodeAttention, PoolAndOrderInvariance) {
  constexpr std::int32_t kQ = 8, kKv = 2, kDim = 128, kBlock = 32, kWindows = 9, kTail = 13;
  Rng rng(43);
  std::vector<SequenceData> base;
  std::vector<std::vector<Precision>> exact_in;  // the quantized pool each window is exact for
  for (int s = 0; s < 3; ++s) {
    SequenceData seq;
    seq.tokens = kWindows * kBlock + kTail;
    std::vector<Precision> pools;
    for (int w = 0; w < kWindows; ++w) {
      const Precision p = w % 3 == 0 ? Precision::INT2 : Precision::INT4;
      const auto k = exact_window_values(rng, kKv, kDim, kBlock, p, true);
      const auto v = exact_window_values(rng, kKv, kDim, kBlock, p, false);
      seq.k.insert(seq.k.end(), k.begin(), k.end());
      seq.v.insert(seq.v.end(), v.begin(), v.end());
      pools.push_back(p);
    }
    const auto tail_k = random_halves(rng, kTail * kKv * kDim), tail_v = random_halves(rng, kTail * kKv * kDim);
    seq.k.insert(seq.k.end(), tail_k.begin(), tail_k.end());
    seq.v.insert(seq.v.end(), tail_v.begin(), tail_v.end());
    base.push_back(std::move(seq));
    exact_in.push_back(std::move(pools));
  }
  const std::vector<Half> q = random_halves(rng, base.size() * kQ * kDim, 2.0);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(kDim));

  // Placement 0: everything FP16. Then each window in its exact pool or in
  // FP16 at random, with other block ids and page-list orders each time.
  std::vector<DecodeResult> results;
  std::vector<DenseState> dense;
  for (std::uint64_t placement = 0; placement < 4; ++placement) {
    std::vector<SequenceData> seqs = base;
    for (std::size_t s = 0; s < seqs.size(); ++s) {
      for (int w = 0; w < kWindows; ++w) {
        const bool quantize = placement == 3 || (placement > 0 && rng() % 2 == 0);  // 3: all quantized
        seqs[s].windows.push_back(quantize ? exact_in[s][w] : Precision::FP16);
      }
    }
    TestArena arena(kKv, kDim, kBlock, blocks_needed(seqs, kBlock), 100 + placement);
    const PlacedBatch placed = place_batch(arena, seqs);
    results.push_back(cpu_decode(arena, placed, q, kQ, sm_scale));
    if (placement == 0) dense = reference(placed, q, kQ, kKv, kDim, sm_scale);
  }
  for (std::size_t i = 0; i < results.size(); ++i) {
    const ErrorStats vs_dense = compare(results[i], dense, kDim);
    EXPECT_LE(vs_dense.max, 1e-5) << "placement " << i;
    EXPECT_LE(vs_dense.lse_max, 1e-5) << "placement " << i;
    for (std::size_t j = 0; j < dense.size(); ++j) {
      std::vector<double> first(results[0].out.begin() + j * kDim, results[0].out.begin() + (j + 1) * kDim);
      EXPECT_LE(relative_error(&results[i].out[j * kDim], first), 1e-6) << "placement " << i << " state " << j;
    }
  }
}

// Empty pools, single-pool sequences and sequences with no tokens at all,
// side by side in one batch.
TEST(DecodeAttention, EmptyPoolsAndEmptySequences) {
  constexpr std::int32_t kQ = 6, kKv = 3, kDim = 64, kBlock = 16;
  Rng rng(44);
  std::vector<SequenceData> seqs = random_sequences(rng, {0, 48, 20, 32, 0, 16}, kKv, kDim, kBlock, false);
  seqs[1].windows = {Precision::INT2, Precision::INT2, Precision::INT2};  // INT2 only
  seqs[3].windows = {Precision::INT4, Precision::INT4};                   // INT4 only
  seqs[5].windows = {Precision::INT4};                                    // one INT4 window
  // seqs[2]: FP16 only (one full window + 4 tail tokens).
  TestArena arena(kKv, kDim, kBlock, blocks_needed(seqs, kBlock), 7);
  const PlacedBatch placed = place_batch(arena, seqs);
  EXPECT_EQ(placed.tables[0].indptr, (std::vector<std::int32_t>{0, 0, 0, 2, 2, 2, 2}));
  const std::vector<Half> q = random_halves(rng, seqs.size() * kQ * kDim);
  const float sm_scale = 0.125f;
  const DecodeResult got = cpu_decode(arena, placed, q, kQ, sm_scale);  // out and lse start as NaN
  for (float x : got.out) ASSERT_FALSE(std::isnan(x));
  for (float x : got.lse) ASSERT_FALSE(std::isnan(x));
  const ErrorStats stats = compare(got, reference(placed, q, kQ, kKv, kDim, sm_scale), kDim);
  EXPECT_LE(stats.max, 1e-5);
  EXPECT_LE(stats.lse_max, 1e-5);
}

TEST(DecodeAttention, EmptyBatch) {
  TestArena arena(1, 64, 16, {1, 1, 1});
  std::array<PagedPoolTable, kNumPrecisions> tables;
  for (auto& t : tables) t.indptr = {0};
  cpu::DecodeAttentionArgs args;
  args.num_q_heads = 1;
  args.sm_scale = 1.0f;
  args.tables = &tables;
  args.pools = arena.views();
  cpu::decode_attention(args);
}

// testing.md item 5: quality of INT4 / INT2 attention against FP16.
class AttentionQuality : public ::testing::Test {
 protected:
  static constexpr std::int32_t kD = QualityData::kDim;
  static constexpr std::int32_t kS = QualityData::kBlock;
  static constexpr std::int32_t kWindows = QualityData::kTokens / kS;

  // Output of every query head (one KV head) with the windows in `pools`.
  static DecodeResult attend(const QualityData& data, const std::vector<Precision>& pools, const std::vector<Half>& q,
                             std::int32_t q_heads) {
    std::vector<SequenceData> seqs{{QualityData::kTokens, data.k, data.v, pools}};
    TestArena arena(1, kD, kS, blocks_needed(seqs, kS), 3);
    const PlacedBatch placed = place_batch(arena, seqs);
    return cpu_decode(arena, placed, q, q_heads, 1.0f / std::sqrt(static_cast<float>(kD)));
  }

  // FP16 reference: dense float64 attention on the original values.
  static std::vector<DenseState> fp16_reference(const QualityData& data, const std::vector<Half>& q,
                                                std::int32_t q_heads) {
    const std::vector<float> k = widen(data.k), v = widen(data.v);
    std::vector<DenseState> states;
    for (std::int32_t h = 0; h < q_heads; ++h) {
      std::vector<double> qh(kD);
      for (std::int32_t c = 0; c < kD; ++c) qh[c] = half_to_float(q[h * kD + c]);
      states.push_back(dense_attention(qh.data(), k.data(), v.data(), QualityData::kTokens, kD, 1.0 / std::sqrt(kD)));
    }
    return states;
  }

  // Share of the attention mass that the tokens of `window` take.
  static double window_mass(const std::vector<Half>& k, const std::vector<Half>& q, std::int32_t window) {
    std::vector<double> scores(QualityData::kTokens);
    for (std::int32_t t = 0; t < QualityData::kTokens; ++t) {
      double dot = 0.0;
      for (std::int32_t c = 0; c < kD; ++c) dot += half_to_float(q[c]) * half_to_float(k[t * kD + c]);
      scores[t] = dot / std::sqrt(kD);
    }
    const double max = *std::max_element(scores.begin(), scores.end());
    double total = 0.0, inside = 0.0;
    for (std::int32_t t = 0; t < QualityData::kTokens; ++t) {
      const double w = std::exp(scores[t] - max);
      total += w;
      if (t / kS == window) inside += w;
    }
    return inside / total;
  }
};

TEST_F(AttentionQuality, RandomQueriesInt4AndInt2VsFp16) {
  constexpr std::int32_t kQueries = 64;  // 64 query heads on the one KV head
  const QualityData data = quality_data();
  Rng rng(51);
  const std::vector<Half> q = random_halves(rng, kQueries * kD);
  const std::vector<DenseState> ref = fp16_reference(data, q, kQueries);
  const ErrorStats int4 = compare(attend(data, std::vector(kWindows, Precision::INT4), q, kQueries), ref, kD);
  const ErrorStats int2 = compare(attend(data, std::vector(kWindows, Precision::INT2), q, kQueries), ref, kD);
  std::cout << "[quality] attention vs FP16, random queries: INT4 mean " << int4.mean << " max " << int4.max
            << "; INT2 mean " << int2.mean << " max " << int2.max << "\n";
  RecordProperty("int4_attention_mean", std::to_string(int4.mean));
  RecordProperty("int4_attention_max", std::to_string(int4.max));
  EXPECT_LE(int4.mean, 0.17);
  EXPECT_LE(int4.max, 0.35);
}

// The property WindowQuant relies on: a query that puts ~95% of its mass on
// one window loses almost nothing when that window stays FP16 and every
// other window is INT2. The window is relevant to the query the way a
// relevant window is in a model: its keys share a component along the
// query (Gaussian keys alone can only be made peaked by a huge query norm,
// which amplifies the INT2 key noise of every other window as much).
TEST_F(AttentionQuality, PeakedQueryWithItsWindowInFp16AndTheRestInt2) {
  constexpr std::int32_t kTarget = 21;
  QualityData data = quality_data();
  Rng rng(52);
  // A unit direction over the ordinary (non-outlier) channels.
  std::vector<double> e(kD);
  for (double& x : e) x = normal(rng);
  for (int c : QualityData::kOutliers) e[c] = 0.0;
  double norm = 0.0;
  for (double x : e) norm += x * x;
  for (double& x : e) x /= std::sqrt(norm);
  // q = gamma * sqrt(D) * e: a score changes by gamma per unit of key along e.
  const double gamma = 0.25;
  std::vector<Half> q(kD);
  for (std::int32_t c = 0; c < kD; ++c) q[c] = float_to_half(static_cast<float>(gamma * std::sqrt(kD) * e[c]));
  const std::vector<Half> original_k = data.k;
  auto shifted_keys = [&](double a) {
    std::vector<Half> k = original_k;
    for (std::int32_t t = kTarget * kS; t < (kTarget + 1) * kS; ++t) {
      for (std::int32_t c = 0; c < kD; ++c) {
        k[t * kD + c] = float_to_half(static_cast<float>(half_to_float(k[t * kD + c]) + a * e[c]));
      }
    }
    return k;
  };
  // Bisection on the shift for 95% of the mass.
  double lo = 0.0, hi = 200.0;
  for (int i = 0; i < 60; ++i) {
    const double mid = (lo + hi) / 2;
    (window_mass(shifted_keys(mid), q, kTarget) < 0.95 ? lo : hi) = mid;
  }
  data.k = shifted_keys(hi);
  const double mass = window_mass(data.k, q, kTarget);
  ASSERT_NEAR(mass, 0.95, 0.01);

  std::vector<Precision> pools(kWindows, Precision::INT2);
  pools[kTarget] = Precision::FP16;
  const ErrorStats peaked = compare(attend(data, pools, q, 1), fp16_reference(data, q, 1), kD);
  std::cout << "[quality] peaked query (window mass " << mass << ", key shift " << hi
            << "), its window FP16, rest INT2: error " << peaked.max << "\n";
  RecordProperty("peaked_error", std::to_string(peaked.max));
  EXPECT_LE(peaked.max, 0.005);
}

// Bad input: InvalidArgument naming the argument; out and lse untouched.
class DecodeBadInput : public ::testing::Test {
 protected:
  static constexpr std::int32_t kQ = 4, kKv = 2, kDim = 64, kBlock = 16;
  DecodeBadInput() : arena_(kKv, kDim, kBlock, {8, 4, 4}, 9) {
    Rng rng(61);
    std::vector<SequenceData> seqs = random_sequences(rng, {40, 16}, kKv, kDim, kBlock, false);
    seqs[0].windows = {Precision::INT4, Precision::INT2};
    seqs[1].windows = {Precision::FP16};
    placed_ = place_batch(arena_, seqs);
    q_ = random_halves(rng, 2 * kQ * kDim);
    out_.assign(2 * kQ * kDim, 42.0f);
    lse_.assign(2 * kQ, 42.0f);
    args_.q = q_;
    args_.num_q_heads = kQ;
    args_.sm_scale = 0.125f;
    args_.tables = &placed_.tables;
    args_.pools = arena_.views();
    args_.out = out_;
    args_.lse = lse_;
  }
  // Expects `mutate(args, tables)` to make decode_attention throw naming `name`.
  template <typename Mutate>
  void expect_rejected(Mutate mutate, const std::string& name) {
    cpu::DecodeAttentionArgs args = args_;
    auto tables = placed_.tables;
    args.tables = &tables;
    mutate(args, tables);
    MIXKV_EXPECT_INVALID(cpu::decode_attention(args), name);
    EXPECT_EQ(out_, std::vector<float>(out_.size(), 42.0f)) << name;
    EXPECT_EQ(lse_, std::vector<float>(lse_.size(), 42.0f)) << name;
  }
  // The same for IndexOutOfRange (a block id outside its pool).
  template <typename Mutate>
  void expect_out_of_range(Mutate mutate, const std::string& name) {
    cpu::DecodeAttentionArgs args = args_;
    auto tables = placed_.tables;
    args.tables = &tables;
    mutate(args, tables);
    MIXKV_EXPECT_OUT_OF_RANGE(cpu::decode_attention(args), name);
    EXPECT_EQ(out_, std::vector<float>(out_.size(), 42.0f)) << name;
    EXPECT_EQ(lse_, std::vector<float>(lse_.size(), 42.0f)) << name;
  }

  TestArena arena_;
  PlacedBatch placed_;
  std::vector<Half> q_;
  std::vector<float> out_, lse_;
  cpu::DecodeAttentionArgs args_;
};

using Tables = std::array<PagedPoolTable, kNumPrecisions>;

TEST_F(DecodeBadInput, ValidArgumentsAreAccepted) {
  cpu::decode_attention(args_);
  EXPECT_NE(out_, std::vector<float>(out_.size(), 42.0f));
}

TEST_F(DecodeBadInput, Tables) {
  expect_rejected([](auto& a, Tables&) { a.tables = nullptr; }, "tables is null");
  expect_rejected([](auto&, Tables& t) { t[0].indptr.clear(); }, "tables[FP16].indptr");
  expect_rejected([](auto&, Tables& t) { t[1].indptr.push_back(t[1].indptr.back()); }, "tables[INT4].indptr has");
  expect_rejected([](auto&, Tables& t) { t[2].indptr[0] = 1; }, "tables[INT2].indptr[0]");
  expect_rejected([](auto&, Tables& t) { std::swap(t[0].indptr[1], t[0].indptr[2]); }, "tables[FP16].indptr[");
  expect_rejected([](auto&, Tables& t) { t[0].indices.push_back(0); }, "tables[FP16].indptr[2]");
  expect_rejected([](auto&, Tables& t) { t[2].last_block_len.pop_back(); }, "tables[INT2].last_block_len has");
  expect_rejected([](auto&, Tables& t) { t[0].last_block_len[0] = 0; }, "tables[FP16].last_block_len[0]");
  expect_rejected([](auto&, Tables& t) { t[0].last_block_len[1] = kBlock + 1; }, "tables[FP16].last_block_len[1]");
  expect_rejected([](auto&, Tables& t) { t[1].last_block_len[0] = kBlock - 1; }, "tables[INT4].last_block_len[0]");
  expect_rejected([](auto&, Tables& t) { t[2].last_block_len[1] = 3; }, "tables[INT2].last_block_len[1]");
}

// Every page-table id is checked against its pool's num_blocks, from below
// and above: one past the last block, far past it, negative.
TEST_F(DecodeBadInput, BlockIdsOutsideTheirPool) {
  for (Precision p : kAllPrecisions) {
    const int i = pool_index(p);
    const std::int32_t n = arena_.view(p).num_blocks;
    const std::string name = "tables[" + std::string(to_string(p)) + "].indices[0]";
    for (std::int32_t bad : {n, n + 1, 1000000, std::numeric_limits<std::int32_t>::max(), -1, -1000000,
                             std::numeric_limits<std::int32_t>::min()}) {
      expect_out_of_range([&](auto&, Tables& t) { t[i].indices[0] = bad; },
                          name + " = " + std::to_string(bad) + ", expected 0 <= " + name + " < " + std::to_string(n));
    }
  }
  // The last block of each pool is in range (and in the arena).
  auto tables = placed_.tables;
  for (Precision p : kAllPrecisions) tables[pool_index(p)].indices[0] = arena_.view(p).num_blocks - 1;
  cpu::DecodeAttentionArgs args = args_;
  args.tables = &tables;
  EXPECT_NO_THROW(cpu::decode_attention(args));
}

// out, lse and q are read and written row by row: any overlap is refused,
// as merge_states refuses it.
TEST_F(DecodeBadInput, OverlappingOutputs) {
  std::vector<float> both(out_.size() + lse_.size(), 42.0f);
  const std::span<float> whole(both);
  expect_rejected(
      [&](auto& a, Tables&) {
        a.out = whole.first(out_.size());
        a.lse = whole.subspan(out_.size() - 1, lse_.size());
      },
      "out overlaps lse");
  expect_rejected(
      [&](auto& a, Tables&) {
        a.out = whole.first(out_.size());
        a.lse = whole.first(lse_.size());
      },
      "out overlaps lse");
  std::vector<float> big(out_.size() + q_.size());
  const std::span<Half> q_in_big(reinterpret_cast<Half*>(big.data() + out_.size() - 4), q_.size());
  std::copy(q_.begin(), q_.end(), q_in_big.begin());
  expect_rejected(
      [&](auto& a, Tables&) {
        a.q = q_in_big;
        a.out = std::span<float>(big).first(out_.size());
      },
      "out overlaps q");
  EXPECT_EQ(both, std::vector<float>(both.size(), 42.0f));
}

TEST_F(DecodeBadInput, ShapesAndScalars) {
  expect_rejected([](auto& a, Tables&) { a.num_q_heads = 3; }, "num_q_heads");
  expect_rejected([](auto& a, Tables&) { a.num_q_heads = 0; }, "num_q_heads");
  expect_rejected([](auto& a, Tables&) { a.sm_scale = 0.0f; }, "sm_scale");
  expect_rejected([](auto& a, Tables&) { a.sm_scale = -0.1f; }, "sm_scale");
  expect_rejected([](auto& a, Tables&) { a.sm_scale = kNan; }, "sm_scale");
  expect_rejected([](auto& a, Tables&) { a.sm_scale = std::numeric_limits<float>::infinity(); }, "sm_scale");
  expect_rejected([](auto& a, Tables&) { a.q = a.q.first(a.q.size() - 1); }, "q has");
  expect_rejected([](auto& a, Tables&) { a.out = a.out.first(a.out.size() - kDim); }, "out has");
  expect_rejected([](auto& a, Tables&) { a.lse = a.lse.first(1); }, "lse has");
  std::vector<Half> bad_q = q_;
  bad_q[kQ * kDim + 3] = Half{0x7c01};
  expect_rejected([&](auto& a, Tables&) { a.q = bad_q; }, "q[");
}

TEST_F(DecodeBadInput, Pools) {
  // Shrinking a format keeps its slab big enough, so the geometry check fires.
  expect_rejected([](auto& a, Tables&) { a.pools[1].format.head_dim = 32; }, "pools[INT4].format.head_dim");
  expect_rejected(
      [](auto& a, Tables&) {
        a.pools[2].format.block_size = 32;
        a.pools[2].blocks_per_slab = 1;
      },
      "pools[INT2].format.block_size");
  expect_rejected([](auto& a, Tables&) { a.pools[2].format.num_kv_heads = 1; }, "pools[INT2].format.num_kv_heads");
  expect_rejected([](auto& a, Tables&) { a.pools[1].blocks_per_slab = 1000; }, "pools[INT4].slab_bytes");
  expect_rejected([](auto& a, Tables&) { std::swap(a.pools[1], a.pools[2]); }, "pools[INT4].format.precision");
  expect_rejected([](auto& a, Tables&) { a.pools[0].base = nullptr; }, "pools[FP16].base");
  expect_rejected([](auto& a, Tables&) { a.pools[0].format.head_dim = 40; }, "pools[FP16].format.head_dim");
}

}  // namespace
}  // namespace mixkv::test
