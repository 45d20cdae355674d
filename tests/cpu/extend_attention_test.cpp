// Extend attention (chunked prefill, speculative verification): new rows
// over the three pools plus themselves (causal), against a dense float64
// attention on read_head's values, against decode for one new row, the same
// bits for any thread count and SIMD flavour, bad input.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <tuple>

#include "cpu_test_util.h"
#include "mixkv/cpu/extend_attention.h"

namespace mixkv::test {
namespace {

using Tables = std::array<PagedPoolTable, kNumPrecisions>;

std::vector<SequenceData> cached_sequences(Rng& rng, const std::vector<std::int32_t>& contexts, std::int32_t kv_heads,
                                           std::int32_t dim, std::int32_t block) {
  std::vector<SequenceData> seqs;
  for (std::int32_t n : contexts) {
    const std::size_t values = static_cast<std::size_t>(n) * kv_heads * dim;
    SequenceData seq{n, random_halves(rng, values), random_halves(rng, values), {}};
    for (std::int32_t w = 0; w < n / block; ++w) seq.windows.push_back(kAllPrecisions[rng() % kNumPrecisions]);
    seqs.push_back(std::move(seq));
  }
  return seqs;
}

// The new rows of a batch: qo_indptr, q [rows][q_heads][dim], k and v
// [rows][kv_heads][dim].
struct NewRows {
  std::vector<std::int32_t> qo_indptr{0};
  std::vector<Half> q, k, v;
};

NewRows new_rows(Rng& rng, const std::vector<std::int32_t>& counts, std::int32_t q_heads, std::int32_t kv_heads,
                 std::int32_t dim) {
  NewRows rows;
  for (std::int32_t n : counts) rows.qo_indptr.push_back(rows.qo_indptr.back() + n);
  const auto total = static_cast<std::size_t>(rows.qo_indptr.back());
  rows.q = random_halves(rng, total * q_heads * dim);
  rows.k = random_halves(rng, total * kv_heads * dim);
  rows.v = random_halves(rng, total * kv_heads * dim);
  return rows;
}

struct Result {
  std::vector<float> out, lse;
};

// Outputs start as NaN, so an element the op failed to write cannot pass.
Result cpu_extend(const TestArena& arena, const Tables& tables, const NewRows& rows, std::int32_t q_heads,
                  float sm_scale, std::int32_t threads = 0) {
  const std::size_t total = static_cast<std::size_t>(rows.qo_indptr.back()) * q_heads;
  const std::int32_t dim = arena.format(Precision::FP16).head_dim;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  Result r{std::vector<float>(total * dim, nan), std::vector<float>(total, nan)};
  cpu::ExtendAttentionArgs args;
  args.qo_indptr = rows.qo_indptr;
  args.q = rows.q;
  args.k = rows.k;
  args.v = rows.v;
  args.num_q_heads = q_heads;
  args.sm_scale = sm_scale;
  args.tables = &tables;
  args.pools = arena.views();
  args.out = r.out;
  args.lse = r.lse;
  args.num_threads = threads;
  cpu::extend_attention(args);
  return r;
}

// Dense float64 attention of every (new row, query head), rows in order:
// the cached tokens of the three page lists as read_head gives them, then
// the sequence's new rows up to the row itself.
std::vector<DenseState> reference(const TestArena& arena, const Tables& tables, const NewRows& rows,
                                  std::int32_t q_heads, double sm_scale) {
  const BlockFormat& shape = arena.format(Precision::FP16);
  const std::int32_t kv_heads = shape.num_kv_heads, dim = shape.head_dim, block = shape.block_size;
  const std::int32_t group = q_heads / kv_heads;
  const std::size_t batch = rows.qo_indptr.size() - 1;
  std::vector<DenseState> states(static_cast<std::size_t>(rows.qo_indptr.back()) * q_heads);
  std::vector<float> k_block(static_cast<std::size_t>(block) * dim), v_block(k_block.size());
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::int32_t g = 0; g < kv_heads; ++g) {
      std::vector<float> k, v;
      for (Precision p : kAllPrecisions) {
        const PagedPoolTable& table = tables[pool_index(p)];
        const PoolView& pool = arena.view(p);
        for (std::int32_t j = table.indptr[b]; j < table.indptr[b + 1]; ++j) {
          cpu::read_head(pool.format, pool.block(table.indices[j]) + pool.format.head_offset(g), k_block.data(),
                         v_block.data());
          const std::int32_t tokens = j + 1 == table.indptr[b + 1] ? table.last_block_len[b] : block;
          k.insert(k.end(), k_block.begin(), k_block.begin() + tokens * dim);
          v.insert(v.end(), v_block.begin(), v_block.begin() + tokens * dim);
        }
      }
      const std::size_t cached = k.size() / dim;
      for (std::int32_t r = rows.qo_indptr[b]; r < rows.qo_indptr[b + 1]; ++r) {
        const std::size_t at = (static_cast<std::size_t>(r) * kv_heads + g) * dim;
        for (std::int32_t c = 0; c < dim; ++c) {
          k.push_back(half_to_float(rows.k[at + c]));
          v.push_back(half_to_float(rows.v[at + c]));
        }
      }
      for (std::int32_t r = rows.qo_indptr[b]; r < rows.qo_indptr[b + 1]; ++r) {
        const std::size_t seen = cached + (r - rows.qo_indptr[b]) + 1;
        for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
          const std::size_t state = static_cast<std::size_t>(r) * q_heads + h;
          std::vector<double> q(dim);
          for (std::int32_t c = 0; c < dim; ++c) q[c] = half_to_float(rows.q[state * dim + c]);
          states[state] = dense_attention(q.data(), k.data(), v.data(), seen, dim, sm_scale);
        }
      }
    }
  }
  return states;
}

struct Errors {
  double out = 0, lse = 0;
};

// Largest relative output error and absolute LSE error over all states.
Errors compare(const Result& got, const std::vector<DenseState>& want, std::int32_t dim) {
  Errors e;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double out = relative_error(&got.out[i * dim], want[i].out);
    EXPECT_TRUE(std::isfinite(out) && std::isfinite(got.lse[i])) << "state " << i;
    e.out = std::max(e.out, out);
    e.lse = std::max(e.lse, std::abs(static_cast<double>(got.lse[i]) - want[i].lse));
  }
  return e;
}

// One problem: cached contexts placed through store_prefill (pools chosen
// at random per window), `counts` new rows per sequence, checked against
// the dense reference.
Errors check_problem(std::int32_t q_heads, std::int32_t kv_heads, std::int32_t dim, std::int32_t block,
                     const std::vector<std::int32_t>& contexts, const std::vector<std::int32_t>& counts,
                     std::uint64_t seed) {
  Rng rng(seed);
  const std::vector<SequenceData> seqs = cached_sequences(rng, contexts, kv_heads, dim, block);
  TestArena arena(kv_heads, dim, block, blocks_needed(seqs, block), seed);
  const PlacedBatch placed = place_batch(arena, seqs);
  const NewRows rows = new_rows(rng, counts, q_heads, kv_heads, dim);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const Result got = cpu_extend(arena, placed.tables, rows, q_heads, sm_scale);
  const Errors e = compare(got, reference(arena, placed.tables, rows, q_heads, sm_scale), dim);
  EXPECT_LE(e.out, 1e-5);
  EXPECT_LE(e.lse, 1e-5);
  return e;
}

// (head_dim, (q heads, kv heads), block_size)
using Sizes = std::tuple<int, std::pair<int, int>, int>;

class ExtendSizes : public ::testing::TestWithParam<Sizes> {};

std::string sizes_name(const ::testing::TestParamInfo<Sizes>& info) {
  const auto [dim, heads, block] = info.param;
  return "D" + std::to_string(dim) + "_Q" + std::to_string(heads.first) + "_KV" + std::to_string(heads.second) + "_S" +
         std::to_string(block);
}

// Cached contexts 0, 1, 31, 33 and chunks of 1, 7, 17, 100 rows (none a
// multiple of a block), paired differently for each size.
TEST_P(ExtendSizes, MixedPoolsMatchDenseFloat64) {
  const auto [dim, heads, block] = GetParam();
  const std::vector<std::int32_t> context_cycle = {0, 1, 31, 33};
  const std::vector<std::int32_t> count_cycle = {1, 7, 17, 100};
  std::vector<std::int32_t> contexts, counts;
  for (int b = 0; b < 4; ++b) {
    contexts.push_back(context_cycle[b]);
    counts.push_back(count_cycle[(b + dim / 64 + heads.first) % 4]);
  }
  check_problem(heads.first, heads.second, dim, block, contexts, counts,
                static_cast<std::uint64_t>(dim * 1000 + heads.first * 10 + block));
}

INSTANTIATE_TEST_SUITE_P(OddSizes, ExtendSizes,
                         ::testing::Combine(::testing::Values(64, 128, 256),
                                            ::testing::Values(std::pair{9, 3}, std::pair{4, 1}, std::pair{2, 2}),
                                            ::testing::Values(16, 32)),
                         sizes_name);

// 4,099 cached tokens: many chunks of every pool merged, new rows crossing
// block boundaries.
TEST(ExtendAttention, LongContextMixedPools) { check_problem(9, 3, 128, 32, {4099, 33}, {17, 100}, 71); }

// Sequences with no cached token at all: pure causal self-attention, where
// row 0 sees only itself and returns its own value row.
TEST(ExtendAttention, EmptyCacheIsCausalSelfAttention) {
  constexpr std::int32_t kQ = 6, kKv = 2, kDim = 64, kBlock = 16;
  Rng rng(72);
  const std::vector<std::int32_t> counts = {1, 5, 40};
  const std::vector<SequenceData> seqs = cached_sequences(rng, {0, 0, 0}, kKv, kDim, kBlock);
  TestArena arena(kKv, kDim, kBlock, {1, 1, 1}, 72);
  const PlacedBatch placed = place_batch(arena, seqs);
  EXPECT_EQ(placed.tables[0].indptr, (std::vector<std::int32_t>{0, 0, 0, 0}));
  const NewRows rows = new_rows(rng, counts, kQ, kKv, kDim);
  const float sm_scale = 0.125f;
  const Result got = cpu_extend(arena, placed.tables, rows, kQ, sm_scale);
  const Errors e = compare(got, reference(arena, placed.tables, rows, kQ, sm_scale), kDim);
  EXPECT_LE(e.out, 1e-5);
  EXPECT_LE(e.lse, 1e-5);
  for (std::size_t b = 0; b < counts.size(); ++b) {
    const std::int32_t r = rows.qo_indptr[b];
    for (std::int32_t h = 0; h < kQ; ++h) {
      const std::size_t state = static_cast<std::size_t>(r) * kQ + h;
      const std::size_t kv = (static_cast<std::size_t>(r) * kKv + h / (kQ / kKv)) * kDim;
      for (std::int32_t c = 0; c < kDim; ++c) {
        EXPECT_EQ(got.out[state * kDim + c], half_to_float(rows.v[kv + c])) << "sequence " << b << " head " << h;
      }
    }
  }
}

// One batch whose sequences bring 3, 1, 100, 7 and 17 rows over contexts of
// every shape (one FP16-only, one INT4-only, one past a chunk).
TEST(ExtendAttention, MixedRowCountsInOneBatch) {
  check_problem(8, 2, 128, 16, {33, 0, 31, 1, 257}, {3, 1, 100, 7, 17}, 73);
  check_problem(28, 4, 128, 32, {300, 64}, {5, 2}, 74);
}

// Each sequence's row appended to its FP16 list (a fresh block where the
// last is full or missing), as the caller does after the op; returns the
// tables that decode then reads.
Tables append_rows(TestArena& arena, const Tables& tables, const NewRows& rows) {
  const std::int32_t block = arena.format(Precision::FP16).block_size;
  const std::size_t batch = rows.qo_indptr.size() - 1;
  PagedPoolTable fp16{{0}, {}, {}};
  std::vector<std::int32_t> slots;
  for (std::size_t b = 0; b < batch; ++b) {
    const PagedPoolTable& old = tables[0];
    std::vector<std::int32_t> list(old.indices.begin() + old.indptr[b], old.indices.begin() + old.indptr[b + 1]);
    std::int32_t len = old.last_block_len[b];
    if (list.empty() || len == block) {
      list.push_back(arena.alloc(Precision::FP16));
      len = 0;
    }
    slots.push_back(list.back() * block + len);
    fp16.indices.insert(fp16.indices.end(), list.begin(), list.end());
    fp16.indptr.push_back(static_cast<std::int32_t>(fp16.indices.size()));
    fp16.last_block_len.push_back(len + 1);
  }
  cpu::append(rows.k, rows.v, slots, arena.view(Precision::FP16));
  Tables out = tables;
  out[0] = fp16;
  return out;
}

// n_i = 1 is decode: one row over the cache plus itself equals decode after
// the row is appended to the FP16 pool.
TEST(ExtendAttention, OneRowEqualsAppendThenDecode) {
  constexpr std::int32_t kQ = 9, kKv = 3, kDim = 128, kBlock = 16;
  Rng rng(75);
  const std::vector<std::int32_t> contexts = {0, 1, 31, 32, 33, 300};
  const std::vector<SequenceData> seqs = cached_sequences(rng, contexts, kKv, kDim, kBlock);
  TestArena arena(kKv, kDim, kBlock, blocks_needed(seqs, kBlock, static_cast<std::int32_t>(contexts.size())), 75);
  const PlacedBatch placed = place_batch(arena, seqs);
  const NewRows rows = new_rows(rng, std::vector<std::int32_t>(contexts.size(), 1), kQ, kKv, kDim);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  const Result extend = cpu_extend(arena, placed.tables, rows, kQ, sm_scale);
  const Errors vs_dense = compare(extend, reference(arena, placed.tables, rows, kQ, sm_scale), kDim);
  EXPECT_LE(vs_dense.out, 1e-5);
  EXPECT_LE(vs_dense.lse, 1e-5);

  PlacedBatch appended{append_rows(arena, placed.tables, rows), {}};
  const DecodeResult decode = cpu_decode(arena, appended, rows.q, kQ, sm_scale);
  for (std::size_t i = 0; i < decode.lse.size(); ++i) {
    const std::vector<double> want(decode.out.begin() + i * kDim, decode.out.begin() + (i + 1) * kDim);
    EXPECT_LE(relative_error(&extend.out[i * kDim], want), 1e-5) << "state " << i;
    EXPECT_NEAR(extend.lse[i], decode.lse[i], 1e-5) << "state " << i;
  }
}

TEST(ExtendAttention, EmptyBatch) {
  TestArena arena(1, 64, 16, {1, 1, 1});
  Tables tables;
  for (auto& t : tables) t.indptr = {0};
  const NewRows rows;
  const Result r = cpu_extend(arena, tables, rows, 1, 1.0f);
  EXPECT_TRUE(r.out.empty());
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Chunks, their merge order and the float32 sums are fixed by the shape:
// 1, 2, 3 or 4 threads (which run whole units or spread one unit's chunks)
// and the AVX2 or portable code give the same bits.
TEST(ExtendAttention, SameBitsForAnyThreadCountAndSimdFlavour) {
  struct Shape {
    std::int32_t q_heads, kv_heads, dim, block;
    std::vector<std::int32_t> contexts, counts;
  };
  const std::vector<Shape> shapes = {
      {9, 3, 128, 32, {4099, 300}, {17, 5}},          // 6 units, many chunks each
      {4, 1, 128, 16, {20000}, {1}},                  // one unit: its chunks on every thread
      {2, 2, 64, 16, {31, 0, 700}, {100, 300, 129}},  // many units, several row tiles
  };
  for (std::size_t s = 0; s < shapes.size(); ++s) {
    const Shape& shape = shapes[s];
    Rng rng(80 + s);
    const std::vector<SequenceData> seqs =
        cached_sequences(rng, shape.contexts, shape.kv_heads, shape.dim, shape.block);
    TestArena arena(shape.kv_heads, shape.dim, shape.block, blocks_needed(seqs, shape.block), 80 + s);
    const PlacedBatch placed = place_batch(arena, seqs);
    const NewRows rows = new_rows(rng, shape.counts, shape.q_heads, shape.kv_heads, shape.dim);
    const float sm_scale = 1.0f / std::sqrt(static_cast<float>(shape.dim));
    const Result one = cpu_extend(arena, placed.tables, rows, shape.q_heads, sm_scale, 1);
    const Errors e = compare(one, reference(arena, placed.tables, rows, shape.q_heads, sm_scale), shape.dim);
    EXPECT_LE(e.out, 1e-5) << "shape " << s;
    EXPECT_LE(e.lse, 1e-5) << "shape " << s;
    for (std::int32_t threads : {2, 3, 4}) {
      const Result r = cpu_extend(arena, placed.tables, rows, shape.q_heads, sm_scale, threads);
      EXPECT_TRUE(same_bits(r.out, one.out)) << "shape " << s << ", " << threads << " threads";
      EXPECT_TRUE(same_bits(r.lse, one.lse)) << "shape " << s << ", " << threads << " threads";
    }
    ::setenv("MIXKV_CPU_SIMD", "portable", 1);
    const Result portable = cpu_extend(arena, placed.tables, rows, shape.q_heads, sm_scale, 4);
    ::unsetenv("MIXKV_CPU_SIMD");
    EXPECT_TRUE(same_bits(portable.out, one.out)) << "shape " << s << ", portable code";
    EXPECT_TRUE(same_bits(portable.lse, one.lse)) << "shape " << s << ", portable code";
  }
}

// Bad input: the typed error naming the argument; out and lse untouched.
class ExtendBadInput : public ::testing::Test {
 protected:
  static constexpr std::int32_t kQ = 6, kKv = 3, kDim = 64, kBlock = 16;
  ExtendBadInput() : arena_(kKv, kDim, kBlock, {8, 4, 4}, 9) {
    Rng rng(91);
    std::vector<SequenceData> seqs = cached_sequences(rng, {40, 16}, kKv, kDim, kBlock);
    seqs[0].windows = {Precision::INT4, Precision::INT2};
    seqs[1].windows = {Precision::FP16};
    placed_ = place_batch(arena_, seqs);
    rows_ = new_rows(rng, {3, 2}, kQ, kKv, kDim);
    out_.assign(5 * kQ * kDim, 42.0f);
    lse_.assign(5 * kQ, 42.0f);
    args_.qo_indptr = rows_.qo_indptr;
    args_.q = rows_.q;
    args_.k = rows_.k;
    args_.v = rows_.v;
    args_.num_q_heads = kQ;
    args_.sm_scale = 0.125f;
    args_.tables = &placed_.tables;
    args_.pools = arena_.views();
    args_.out = out_;
    args_.lse = lse_;
  }

  void expect_untouched(const std::string& name) {
    EXPECT_EQ(out_, std::vector<float>(out_.size(), 42.0f)) << name;
    EXPECT_EQ(lse_, std::vector<float>(lse_.size(), 42.0f)) << name;
  }
  // Expects `mutate(args, tables)` to make extend_attention throw
  // InvalidArgument naming `name`.
  template <typename Mutate>
  void expect_rejected(Mutate mutate, const std::string& name) {
    cpu::ExtendAttentionArgs args = args_;
    Tables tables = placed_.tables;
    args.tables = &tables;
    mutate(args, tables);
    MIXKV_EXPECT_INVALID(cpu::extend_attention(args), name);
    expect_untouched(name);
  }
  // The same for IndexOutOfRange.
  template <typename Mutate>
  void expect_out_of_range(Mutate mutate, const std::string& name) {
    cpu::ExtendAttentionArgs args = args_;
    Tables tables = placed_.tables;
    args.tables = &tables;
    mutate(args, tables);
    MIXKV_EXPECT_OUT_OF_RANGE(cpu::extend_attention(args), name);
    expect_untouched(name);
  }
  // qo_indptr replaced by `qo` (kept alive by the caller).
  void expect_qo_rejected(const std::vector<std::int32_t>& qo, const std::string& name) {
    expect_rejected([&](auto& a, Tables&) { a.qo_indptr = qo; }, name);
  }

  TestArena arena_;
  PlacedBatch placed_;
  NewRows rows_;
  std::vector<float> out_, lse_;
  cpu::ExtendAttentionArgs args_;
};

TEST_F(ExtendBadInput, ValidArgumentsAreAccepted) {
  cpu::extend_attention(args_);
  for (float x : out_) ASSERT_NE(x, 42.0f);
  for (float x : lse_) ASSERT_NE(x, 42.0f);
}

TEST_F(ExtendBadInput, QoIndptr) {
  expect_qo_rejected({}, "qo_indptr is empty");
  expect_qo_rejected({1, 3, 5}, "qo_indptr[0] = 1");
  expect_qo_rejected({0, 4, 3, 5}, "qo_indptr[2] = 3");                  // not monotonic
  expect_qo_rejected({0, 3, 3, 5}, "qo_indptr[2] = 3");                  // n_i = 0
  expect_qo_rejected({0, 0, 5}, "qo_indptr[1] = 0");                     // n_0 = 0
  expect_qo_rejected({0, 3, 4}, "qo_indptr[2] = 4: expected rows = 5");  // last != rows
  expect_qo_rejected({0, 3, 6}, "qo_indptr[2] = 6: expected rows = 5");
}

TEST_F(ExtendBadInput, Tables) {
  expect_rejected([](auto& a, Tables&) { a.tables = nullptr; }, "tables is null");
  // Batch of the tables against qo_indptr's, both ways.
  const std::vector<std::int32_t> three = {0, 1, 3, 5};
  expect_rejected([&](auto& a, Tables&) { a.qo_indptr = three; }, "tables[FP16].indptr has 3 entries");
  expect_rejected([](auto&, Tables& t) { t[1].indptr.push_back(t[1].indptr.back()); }, "tables[INT4].indptr has");
  expect_rejected([](auto&, Tables& t) { t[2].indptr[0] = 1; }, "tables[INT2].indptr[0]");
  expect_rejected([](auto&, Tables& t) { t[0].indices.push_back(0); }, "tables[FP16].indptr[2]");
  expect_rejected([](auto&, Tables& t) { t[2].last_block_len.pop_back(); }, "tables[INT2].last_block_len has");
  expect_rejected([](auto&, Tables& t) { t[0].last_block_len[1] = kBlock + 1; }, "tables[FP16].last_block_len[1]");
  expect_rejected([](auto&, Tables& t) { t[1].last_block_len[0] = kBlock - 1; }, "tables[INT4].last_block_len[0]");
}

TEST_F(ExtendBadInput, BlockIdsOutsideTheirPool) {
  for (Precision p : kAllPrecisions) {
    const int i = pool_index(p);
    const std::int32_t n = arena_.view(p).num_blocks;
    const std::string name = "tables[" + std::string(to_string(p)) + "].indices[0]";
    for (std::int32_t bad : {n, -1, std::numeric_limits<std::int32_t>::max()}) {
      expect_out_of_range([&](auto&, Tables& t) { t[i].indices[0] = bad; },
                          name + " = " + std::to_string(bad) + ", expected 0 <= " + name + " < " + std::to_string(n));
    }
  }
}

TEST_F(ExtendBadInput, ShapesAndValues) {
  expect_rejected([](auto& a, Tables&) { a.num_q_heads = 4; }, "num_q_heads = 4");
  expect_rejected([](auto& a, Tables&) { a.num_q_heads = 0; }, "num_q_heads = 0");
  expect_rejected([](auto& a, Tables&) { a.sm_scale = std::numeric_limits<float>::quiet_NaN(); }, "sm_scale");
  expect_rejected([](auto& a, Tables&) { a.q = a.q.first(a.q.size() - 1); }, "q has");
  expect_rejected([](auto& a, Tables&) { a.k = a.k.first(a.k.size() - kDim); }, "k has");
  expect_rejected([](auto& a, Tables&) { a.v = a.v.subspan(kDim); }, "v has");
  expect_rejected([](auto& a, Tables&) { a.out = a.out.first(a.out.size() - kDim); }, "out has");
  expect_rejected([](auto& a, Tables&) { a.lse = a.lse.first(1); }, "lse has");
  std::vector<Half> bad = rows_.k;
  bad[2 * kKv * kDim + 5] = Half{0x7e00};  // NaN
  expect_rejected([&](auto& a, Tables&) { a.k = bad; }, "k[" + std::to_string(2 * kKv * kDim + 5) + "] is NaN");
  std::vector<Half> bad_q = rows_.q;
  bad_q[7] = Half{0xfc00};  // -inf
  expect_rejected([&](auto& a, Tables&) { a.q = bad_q; }, "q[7]");
  std::vector<Half> bad_v = rows_.v;
  bad_v.back() = Half{0x7c00};  // inf
  expect_rejected([&](auto& a, Tables&) { a.v = bad_v; }, "v[");
}

TEST_F(ExtendBadInput, OverlappingOutputs) {
  std::vector<float> both(out_.size() + lse_.size(), 42.0f);
  const std::span<float> whole(both);
  expect_rejected(
      [&](auto& a, Tables&) {
        a.out = whole.first(out_.size());
        a.lse = whole.subspan(out_.size() - 1, lse_.size());
      },
      "out overlaps lse");
  // out over the tail of q; lse over the head of k.
  std::vector<float> big(out_.size() + rows_.q.size());
  const std::span<Half> q_in_big(reinterpret_cast<Half*>(big.data() + out_.size() - 4), rows_.q.size());
  std::copy(rows_.q.begin(), rows_.q.end(), q_in_big.begin());
  expect_rejected(
      [&](auto& a, Tables&) {
        a.q = q_in_big;
        a.out = std::span<float>(big).first(out_.size());
      },
      "out overlaps q");
  std::vector<float> k_and_lse(rows_.k.size() / 2 + lse_.size());
  const std::span<Half> k_in(reinterpret_cast<Half*>(k_and_lse.data() + lse_.size()), rows_.k.size());
  std::copy(rows_.k.begin(), rows_.k.end(), k_in.begin());
  expect_rejected(
      [&](auto& a, Tables&) {
        a.k = k_in;
        a.lse = std::span<float>(k_and_lse).subspan(1, lse_.size());
      },
      "lse overlaps k");
  EXPECT_EQ(both, std::vector<float>(both.size(), 42.0f));
}

}  // namespace
}  // namespace mixkv::test
