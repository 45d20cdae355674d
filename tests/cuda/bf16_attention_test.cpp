// Decode and extend attention of a BF16 cache on the device against
// cpu::decode_attention / cpu::extend_attention on the same BF16 cache and
// a float64 attention over the same values (quantized windows as the
// reference dequantizes them), on FP16-pool, INT4, INT2 and mixed caches at
// head_dim 64 and 128, GQA groups 3, 4, 7 and 16, contexts 1 to 4,099;
// split pieces merged; q of the other 16-bit type refused naming it.
//
// Tolerances (row-normalized error as ErrorStats; LSE relative to
// max(1, |lse|)) come from bfloat16's 8-bit significand, each rounding at
// most 2^-9 relative: the output's own rounding (max 2^-9 = 2e-3 of a
// row's largest value), P rounded before the PV MMA, and, on quantized
// blocks, q * s_K and P * s_V rounded before the MMAs that fold the
// scales (decode) or the dequantized tile rounded (extend). The decode
// kernel's q * s_K error enters every logit (LSE up to ~8e-3) and its
// P * s_V error is measured against V's minimum-and-range decomposition,
// whose terms are larger than V: a float64 model of exactly these
// roundings over random data gives decode mean <= 3.6e-3, max <= 1.2e-2,
// LSE <= 8e-3, and extend mean <= 1e-3, max <= 7e-3, LSE <= 1.1e-3. The
// bounds are about twice those.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "extend_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/cpu/extend_attention.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/extend_plan.h"

namespace mixkv::test {
namespace {

struct Bounds {
  double mean, max, lse;
};
constexpr Bounds kDecodeBounds{8e-3, 2.5e-2, 1.6e-2};
constexpr Bounds kExtendBounds{2e-3, 1.6e-2, 4e-3};

// Fractions of full windows in FP16 / INT4 (the rest INT2) of the mixed cases.
constexpr Mix kMixed{0.3, 0.4};

void expect_close(const DecodeResult& got, const DecodeResult& ref, int dim, Bounds bounds, const std::string& what) {
  ASSERT_EQ(got.out.size(), ref.out.size()) << what;
  const ErrorStats e = row_errors(got.out, ref.out, dim);
  EXPECT_TRUE(e.finite) << what << ": non-finite output";
  EXPECT_LE(e.mean, bounds.mean) << what;
  EXPECT_LE(e.max, bounds.max) << what;
  int off = 0;
  double lse_error = 0.0;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    const double err = std::abs(got.lse[i] - ref.lse[i]) / std::max(1.0f, std::abs(ref.lse[i]));
    lse_error = std::max(lse_error, err);
    if (!(err <= bounds.lse) && off++ < 5) {
      ADD_FAILURE() << what << ": lse[" << i << "] = " << got.lse[i] << ", expected " << ref.lse[i];
    }
  }
  EXPECT_EQ(off, 0) << what << ": " << off << " lse values off";
  // The errors measured, for the test report (--gtest_output), beside their
  // bounds; the key in letters, digits and '_' (an XML attribute name).
  std::string key = what;
  for (char& ch : key) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  ::testing::Test::RecordProperty(
      key, std::to_string(e.mean) + " mean, " + std::to_string(e.max) + " max, " + std::to_string(lse_error) + " lse");
}

// A BF16 cache holding `contexts` and the queries of one step.
struct Data {
  std::unique_ptr<TestArena> arena;
  PlacedBatch placed;
  int q_heads = 0, kv_heads = 0, dim = 0;
  float scale = 0.0f;
};

Data make_data(const std::vector<int>& contexts, int q_heads, int kv_heads, int dim, int block, Mix mix, Rng& rng) {
  Data d;
  const auto seqs = mixed_sequences<BFloat16>(contexts, kv_heads, dim, block, mix, rng);
  d.arena = std::make_unique<TestArena>(kv_heads, dim, block, blocks_needed(seqs, block, 1), 3, DType::BF16);
  d.placed = place_batch(*d.arena, seqs);
  d.q_heads = q_heads;
  d.kv_heads = kv_heads;
  d.dim = dim;
  d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  return d;
}

// ------------------------------------------------------------------ decode --

// Float64 attention of each sequence's query over its cached tokens.
DecodeResult dense_decode(const Data& d, const std::vector<BFloat16>& q) {
  const std::size_t batch = d.placed.expected.size();
  DecodeResult r{std::vector<float>(batch * d.q_heads * d.dim), std::vector<float>(batch * d.q_heads)};
  const int group = d.q_heads / d.kv_heads;
  for (std::size_t b = 0; b < batch; ++b) {
    for (int h = 0; h < d.q_heads; ++h) {
      const std::size_t row = b * d.q_heads + h;
      std::vector<double> qh(d.dim);
      for (int c = 0; c < d.dim; ++c) qh[c] = to_float(q[row * d.dim + c]);
      const ExpectedKV& e = d.placed.expected[b];
      const DenseState s = dense_attention(qh.data(), e.k[h / group].data(), e.v[h / group].data(),
                                           e.k[h / group].size() / d.dim, d.dim, d.scale);
      for (int c = 0; c < d.dim; ++c) r.out[row * d.dim + c] = static_cast<float>(s.out[c]);
      r.lse[row] = static_cast<float>(s.lse);
    }
  }
  return r;
}

DecodeResult run_decode(const Data& d, const std::vector<BFloat16>& q, int chunks, int max_heads_per_item) {
  const auto batch = static_cast<std::int32_t>(d.placed.tables[0].indptr.size() - 1);
  DeviceArenaCopy device(*d.arena);
  gpu::DevicePageTables tables({1, batch, longest_list(d.placed)}, layout_of(*d.arena));
  fill_tables(tables, d.placed);
  tables.upload(nullptr);
  gpu::DecodePlanConfig config;
  config.num_layers = 1;
  config.num_q_heads = d.q_heads;
  config.num_kv_heads = d.kv_heads;
  config.head_dim = d.dim;
  config.block_size = d.arena->format(Precision::FP16).block_size;
  config.max_batch = batch;
  config.chunks_per_sequence = chunks;
  config.max_heads_per_item = max_heads_per_item;
  gpu::DecodePlan plan(config, tables);
  std::vector<std::int32_t> slots(batch);
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, nullptr);
  DeviceVector<BFloat16> dq(q), dout(q.size());
  DeviceVector<float> dlse(static_cast<std::size_t>(batch) * d.q_heads);
  dout.fill_bytes(0xff);  // bfloat16 NaN: every element must be written
  dlse.fill_bytes(0x7f);
  gpu::DecodeRunArgs run;
  run.q = dq.get();
  run.out = dout.get();
  run.dtype = DType::BF16;
  run.lse = dlse.get();
  run.sm_scale = d.scale;
  run.pools = device.pools;
  plan.run(run);
  return {widen(dout.to_host()), dlse.to_host()};
}

struct DecodeCase {
  std::vector<int> contexts;
  int q_heads, kv_heads, dim, block;
  Mix mix;
  int chunks;              // DecodePlanConfig::chunks_per_sequence (0: the plan's choice)
  int max_heads_per_item;  // 0: the plan's choice; 16: the two-tile instance where built
  const char* name;
};

class Bf16DecodeCuda : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(Bf16DecodeCuda, MatchesCpuAndFloat64) {
  MIXKV_REQUIRE_CUDA();
  const DecodeCase c = GetParam();
  Rng rng(19 + c.dim + c.block + c.q_heads);
  const Data d = make_data(c.contexts, c.q_heads, c.kv_heads, c.dim, c.block, c.mix, rng);
  const std::vector<BFloat16> q = random_bfloats(rng, c.contexts.size() * c.q_heads * c.dim);
  const DecodeResult got = run_decode(d, q, c.chunks, c.max_heads_per_item);
  expect_close(got, dense_decode(d, q), c.dim, kDecodeBounds, std::string(c.name) + " vs float64");
  expect_close(got, cpu_decode(*d.arena, d.placed, q, c.q_heads, d.scale), c.dim, kDecodeBounds,
               std::string(c.name) + " vs cpu::decode_attention");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Bf16DecodeCuda,
    ::testing::Values(DecodeCase{{1, 31, 33, 1000, 4099}, 8, 2, 128, 32, kMixed, 0, 0, "d128_mixed"},
                      DecodeCase{{97, 33, 1, 300}, 9, 3, 64, 32, kMixed, 0, 0, "d64_gqa3"},
                      DecodeCase{{600, 97}, 28, 4, 128, 16, kMixed, 0, 0, "d128_s16_gqa7"},
                      DecodeCase{{500, 64}, 8, 2, 64, 16, kMixed, 0, 0, "d64_s16"},
                      DecodeCase{{300, 129}, 8, 2, 128, 64, kMixed, 0, 0, "d128_s64"},
                      DecodeCase{{257, 40}, 8, 2, 64, 32, kAllFp16, 0, 0, "d64_all_fp16"},
                      DecodeCase{{512, 96}, 8, 2, 128, 32, kAllInt4, 0, 0, "d128_all_int4"},
                      DecodeCase{{512, 96}, 8, 2, 128, 32, kAllInt2, 0, 0, "d128_all_int2"},
                      DecodeCase{{2000, 33}, 8, 2, 128, 32, kMixed, 5, 0, "d128_split5"},
                      DecodeCase{{300, 64}, 32, 2, 128, 32, kMixed, 0, 16, "d128_two_tiles"}),
    [](const auto& info) { return std::string(info.param.name); });

// ------------------------------------------------------------------ extend --

using NewRows = BasicNewRows<BFloat16>;

NewRows new_rows(const Data& d, const std::vector<int>& chunks, Rng& rng) {
  return make_new_rows<BFloat16>(chunks, d.q_heads, d.kv_heads, d.dim, rng);
}

DecodeResult dense_extend(const Data& d, const NewRows& rows) {
  return test::dense_extend(d.placed, d.kv_heads, d.dim, d.q_heads, d.scale, rows);
}

DecodeResult cpu_extend(const Data& d, const NewRows& rows) {
  return test::cpu_extend(*d.arena, d.placed, d.q_heads, d.scale, rows);
}

// The CUDA extend with `chunks_per_tile` pieces a tile (0: the plan's choice).
DecodeResult run_extend(const Data& d, const NewRows& rows, int chunks_per_tile) {
  const auto batch = static_cast<std::int32_t>(rows.indptr.size() - 1);
  DeviceArenaCopy device(*d.arena);
  gpu::DevicePageTables tables({1, batch, longest_list(d.placed)}, layout_of(*d.arena));
  fill_tables(tables, d.placed);
  tables.upload(nullptr);
  gpu::ExtendPlanConfig config;
  config.num_layers = 1;
  config.num_q_heads = d.q_heads;
  config.num_kv_heads = d.kv_heads;
  config.head_dim = d.dim;
  config.block_size = d.arena->format(Precision::FP16).block_size;
  config.max_batch = batch;
  config.max_rows = rows.rows();
  config.chunks_per_tile = chunks_per_tile;
  // Forced pieces may exceed the default workspace: room for 3 a tile.
  config.max_items_per_layer = 3 * (rows.rows() * (d.q_heads / d.kv_heads) / 64 + batch) * d.kv_heads + 8;
  gpu::ExtendPlan plan(config, tables);
  std::vector<std::int32_t> slots(batch);
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, rows.indptr, nullptr);
  DeviceVector<BFloat16> dq(rows.q), dk(rows.k), dv(rows.v), dout(rows.q.size());
  DeviceVector<float> dlse(static_cast<std::size_t>(rows.rows()) * d.q_heads);
  dout.fill_bytes(0xff);
  dlse.fill_bytes(0x7f);
  gpu::ExtendRunArgs run;
  run.q = dq.get();
  run.k = dk.get();
  run.v = dv.get();
  run.out = dout.get();
  run.dtype = DType::BF16;
  run.lse = dlse.get();
  run.sm_scale = d.scale;
  run.pools = device.pools;
  plan.run(run);
  return {widen(dout.to_host()), dlse.to_host()};
}

struct ExtendCase {
  std::vector<int> contexts, chunks;
  int q_heads, kv_heads, dim, block;
  Mix mix;
  const char* name;
};

class Bf16ExtendCuda : public ::testing::TestWithParam<ExtendCase> {};

// Against both references, unsplit and cut into 3 pieces a tile.
TEST_P(Bf16ExtendCuda, MatchesCpuAndFloat64) {
  MIXKV_REQUIRE_CUDA();
  const ExtendCase c = GetParam();
  Rng rng(29 + c.dim + c.block + c.q_heads);
  const Data d = make_data(c.contexts, c.q_heads, c.kv_heads, c.dim, c.block, c.mix, rng);
  const NewRows rows = new_rows(d, c.chunks, rng);
  const DecodeResult dense = dense_extend(d, rows);
  const DecodeResult cpu = cpu_extend(d, rows);
  for (int pieces : {1, 3}) {
    const DecodeResult got = run_extend(d, rows, pieces);
    const std::string what = std::string(c.name) + ", " + std::to_string(pieces) + " pieces a tile";
    expect_close(got, dense, c.dim, kExtendBounds, what + " vs float64");
    expect_close(got, cpu, c.dim, kExtendBounds, what + " vs cpu::extend_attention");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Bf16ExtendCuda,
    ::testing::Values(ExtendCase{{0, 1, 31, 33, 4099}, {1, 7, 17, 100, 3}, 28, 4, 128, 32, kMixed, "d128_mixed"},
                      ExtendCase{{97, 33, 0}, {7, 17, 1}, 9, 3, 64, 32, kMixed, "d64_gqa3"},
                      ExtendCase{{97, 200}, {17, 70}, 8, 2, 128, 16, kMixed, "d128_s16"},
                      ExtendCase{{300, 97}, {17, 33}, 8, 2, 128, 64, kMixed, "d128_s64"},
                      ExtendCase{{150, 64}, {20, 9}, 8, 2, 64, 16, kMixed, "d64_s16"},
                      ExtendCase{{256, 97}, {17, 7}, 8, 2, 64, 32, kAllFp16, "d64_all_fp16"},
                      ExtendCase{{256, 97}, {17, 7}, 28, 4, 128, 32, kAllInt4, "d128_all_int4"},
                      ExtendCase{{256, 64}, {17, 7}, 28, 4, 128, 32, kAllInt2, "d128_all_int2"}),
    [](const auto& info) { return std::string(info.param.name); });

// ------------------------------------------------------------- bad input --

// q of the other 16-bit type is refused naming the argument, and out is
// left as it was.
TEST(Bf16AttentionCudaBadInput, OtherTypeIsRefusedAndChangesNothing) {
  MIXKV_REQUIRE_CUDA();
  Rng rng(31);
  const Data d = make_data({100}, 4, 2, 64, 32, kMixed, rng);
  const std::vector<BFloat16> q = random_bfloats(rng, static_cast<std::size_t>(d.q_heads) * d.dim);
  DeviceArenaCopy device(*d.arena);
  gpu::DevicePageTables tables({1, 1, longest_list(d.placed)}, layout_of(*d.arena));
  fill_tables(tables, d.placed);
  tables.upload(nullptr);
  gpu::DecodePlan decode({1, d.q_heads, d.kv_heads, d.dim, 32, 1, 0, 0, 0}, tables);
  const std::vector<std::int32_t> slots{0};
  decode.plan(slots, nullptr);
  DeviceVector<BFloat16> dq(q), dout(q.size());
  dout.fill_bytes(0x11);
  const std::vector<BFloat16> before = dout.to_host();
  gpu::DecodeRunArgs run;
  run.q = dq.get();
  run.out = dout.get();
  run.sm_scale = d.scale;
  run.pools = device.pools;  // dtype left at float16
  MIXKV_EXPECT_INVALID(decode.run(run),
                       "DecodePlan::run: dtype (of q, out) = float16: expected bfloat16 (pools[FP16].format.dtype");
  gpu::ExtendPlan extend({1, d.q_heads, d.kv_heads, d.dim, 32, 1, 1, 0, 0, 0}, tables);
  const std::vector<std::int32_t> indptr{0, 1};
  extend.plan(slots, indptr, nullptr);
  DeviceVector<BFloat16> dk(std::vector<BFloat16>(static_cast<std::size_t>(d.kv_heads) * d.dim));
  gpu::ExtendRunArgs ext;
  ext.q = dq.get();
  ext.k = ext.v = dk.get();
  ext.out = dout.get();
  ext.sm_scale = d.scale;
  ext.pools = device.pools;
  MIXKV_EXPECT_INVALID(extend.run(ext),
                       "ExtendPlan::run: dtype (of q, k, v, out) = float16: expected bfloat16 (pools[FP16]");
  ext.pools[pool_index(Precision::INT4)].format.dtype = DType::F16;
  ext.dtype = DType::BF16;
  MIXKV_EXPECT_INVALID(extend.run(ext), "ExtendPlan::run: pools[INT4].format.dtype = float16: expected bfloat16");
  EXPECT_EQ(dout.to_host(), before) << "a refused run wrote out";
  expect_context_usable("refused runs");
  run.dtype = DType::BF16;
  decode.run(run);
  EXPECT_NE(dout.to_host(), before);
  expect_context_usable("the accepted run");
}

}  // namespace
}  // namespace mixkv::test
