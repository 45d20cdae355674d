// Paged decode attention on the device against cpu::decode_attention on the
// same (dequantized) blocks: mean normalized error <= 1e-3, max <= 5e-3
// (testing.md item 3), LSE within 1e-3, no NaN; odd sizes; empty pools and
// empty sequences; invariance to the split-KV chunking; graph capture; and
// a cuBLAS dense reference for a shape too large for the CPU.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <functional>
#include <numeric>

#include "cuda_test_util.h"
#include "decode_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/dense_reference.h"

namespace mixkv::test {
namespace {

// Fractions of full windows in FP16 / INT4 (the rest INT2) of the mixed cases.
constexpr Mix kMixed{0.1, 0.3};

struct Batch {
  std::vector<SequenceData> seqs;
  PlacedBatch placed;
  std::vector<Half> q;
  std::int32_t max_blocks = 1;
};

void expect_close(const DecodeResult& got, const DecodeResult& ref, int dim, const std::string& what) {
  const ErrorStats e = row_errors(got.out, ref.out, dim);
  EXPECT_TRUE(e.finite) << what << ": non-finite output";
  EXPECT_LE(e.mean, 1e-3) << what;
  EXPECT_LE(e.max, 5e-3) << what;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_TRUE(std::isinf(got.lse[i]) && got.lse[i] < 0) << what << ": lse[" << i << "] = " << got.lse[i];
    } else {
      EXPECT_NEAR(got.lse[i], ref.lse[i], 1e-3 * std::max(1.0f, std::abs(ref.lse[i]))) << what << ": lse[" << i << "]";
    }
  }
}

struct DecodeCase {
  std::vector<int> contexts;  // one per sequence
  int q_heads, kv_heads, dim, block;
  Mix mix;
  const char* name;
  int max_heads_per_item = 0;
};

class DecodeCuda : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeCuda, MatchesCpuReference) {
  MIXKV_REQUIRE_CUDA();
  const DecodeCase c = GetParam();
  Rng rng(42);
  TestArena arena(c.kv_heads, c.dim, c.block, blocks_needed(c.contexts, c.block), 17);
  const auto seqs = mixed_sequences<Half>(c.contexts, c.kv_heads, c.dim, c.block, c.mix, rng);
  const PlacedBatch placed = place_batch(arena, seqs);
  const auto q = random_halves(rng, c.contexts.size() * c.q_heads * c.dim);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
  const DecodeResult ref = cpu_decode(arena, placed, q, c.q_heads, scale);
  const int heads = c.max_heads_per_item;
  expect_close(run_gpu(arena, placed, q, c.q_heads, scale, 0, 1, 0, 0, nullptr, heads), ref, c.dim, "auto split");
  expect_close(run_gpu(arena, placed, q, c.q_heads, scale, 3, 1, 0, 0, nullptr, heads), ref, c.dim, "3 chunks");
}

std::vector<int> cycle(std::initializer_list<int> lengths, int batch) {
  std::vector<int> out;
  for (int i = 0; i < batch; ++i) out.push_back(*(lengths.begin() + i % lengths.size()));
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    OddSizes, DecodeCuda,
    ::testing::Values(DecodeCase{{1}, 28, 4, 128, 32, kMixed, "b1_ctx1_gqa7"},
                      DecodeCase{{31}, 28, 4, 128, 32, kMixed, "b1_ctx31"},
                      DecodeCase{{33}, 28, 4, 128, 32, kAllInt2, "b1_ctx33_int2"},
                      DecodeCase{{97, 33, 31}, 9, 3, 128, 32, kMixed, "b3_gqa3"},
                      DecodeCase{cycle({1, 31, 33, 97, 500}, 17), 8, 2, 128, 32, kMixed, "b17_gqa4"},
                      DecodeCase{cycle({97, 33, 64}, 3), 4, 4, 64, 32, kMixed, "b3_d64_mha"},
                      DecodeCase{cycle({97, 130}, 3), 28, 4, 256, 32, kMixed, "b3_d256"},
                      DecodeCase{cycle({97, 200}, 3), 28, 4, 128, 16, kMixed, "b3_block16"},
                      DecodeCase{cycle({97, 300}, 3), 28, 4, 128, 64, kMixed, "b3_block64"},
                      DecodeCase{cycle({256, 97}, 3), 28, 4, 128, 32, kAllFp16, "all_fp16"},
                      DecodeCase{cycle({256, 97}, 3), 28, 4, 128, 32, kAllInt4, "all_int4"},
                      DecodeCase{cycle({256, 97}, 3), 28, 4, 128, 32, kAllInt2, "all_int2"},
                      DecodeCase{{19600}, 28, 4, 128, 32, kMixed, "b1_ctx19600"},
                      DecodeCase{{19600, 97, 19600}, 9, 3, 128, 32, kMixed, "b3_ctx19600_gqa3"},
                      // Groups over 8 query heads: items of two n-tiles at head_dim 128,
                      // block 32 (16 heads; 11 with 5 padded), head tiles of <= 8 at a
                      // small batch's default (3 x 2 pairs: 2 x 8, 11 x 1) and where no
                      // two-tile instance is built (unless all are: 2 x 8 at block 16,
                      // 2 x 6 at head_dim 64).
                      DecodeCase{{97, 33, 300}, 32, 2, 128, 32, kMixed, "b3_gqa16", 16},
                      DecodeCase{{97, 33, 300}, 32, 2, 128, 32, kMixed, "b3_gqa16_tiles"},
                      DecodeCase{{130, 31}, 11, 1, 128, 32, kMixed, "b2_gqa11", 16},
                      DecodeCase{{130, 31}, 11, 1, 128, 32, kMixed, "b2_gqa11_tiles"},
                      DecodeCase{{19600}, 64, 4, 128, 32, kMixed, "b1_ctx19600_gqa16", 16},
                      DecodeCase{cycle({256, 97}, 3), 32, 2, 128, 32, kAllInt2, "all_int2_gqa16", 16},
                      DecodeCase{{97, 500}, 32, 1, 128, 32, kMixed, "b2_mqa32", 16},  // 2 tiles of 16
                      DecodeCase{{97, 200}, 32, 2, 128, 16, kMixed, "b2_block16_gqa16"},
                      DecodeCase{cycle({97, 200}, 3), 24, 2, 64, 32, kMixed, "b3_d64_gqa12"}),
    [](const auto& info) { return std::string(info.param.name); });

// Mixed-plan sequences whose block b of K sits at bits(b) of score (each
// K channel at that level, noise sd 0.1; q ~ 0.5 in every channel, so a
// score is about scale * 64 * the level), V of sd 100 (so P' = p * vscale
// is large too): the GPU against the CPU reference, auto split and 1 chunk.
void expect_scores_match(const std::vector<int>& contexts, std::uint64_t seed, const std::function<double(int)>& bits) {
  const int kvh = 4, qh = 28, dim = 128, block = 32;
  Rng rng(seed);
  TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 6);
  std::vector<SequenceData> seqs = mixed_sequences<Half>(contexts, kvh, dim, block, kMixed, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const double bits_per_level = scale * 0.5 * dim / std::log(2.0);
  for (SequenceData& s : seqs) {
    for (int t = 0; t < s.tokens; ++t) {
      for (int i = 0; i < kvh * dim; ++i) {
        s.k[static_cast<std::size_t>(t) * kvh * dim + i] =
            float_to_half(static_cast<float>(bits(t / block) / bits_per_level + normal(rng, 0.0, 0.1)));
      }
    }
    s.v = random_halves(rng, s.v.size(), 100.0);
  }
  const PlacedBatch placed = place_batch(arena, seqs);
  std::vector<Half> q(contexts.size() * qh * dim);
  for (Half& h : q) h = float_to_half(static_cast<float>(normal(rng, 0.5, 0.05)));
  const DecodeResult ref = cpu_decode(arena, placed, q, qh, scale);
  expect_close(run_gpu(arena, placed, q, qh, scale), ref, dim, "auto split");
  expect_close(run_gpu(arena, placed, q, qh, scale, /*chunks=*/1), ref, dim, "1 chunk");
}

// Scores that climb along the context, in small steps (a block's max a
// fraction of a bit above the last, under the kernel's rescale slack) and
// in jumps of 3 bits every 10 blocks, over 25 bits in all; the blocks are
// visited in shuffled page order, so the running max meets both kinds of
// rise in every order.
TEST(DecodeCudaSoftmax, ClimbingScoresMatchCpuReference) {
  MIXKV_REQUIRE_CUDA();
  expect_scores_match({1500, 700, 2000}, 11, [](int b) { return 0.3 * b + 3.0 * (b / 10); });
}

// Every score ~150 bits below zero (and some blocks far lower): a warp's
// first block must set the running max (a softmax against 0 would
// underflow every exponent), and a later, higher block must rescale from it.
TEST(DecodeCudaSoftmax, FarNegativeScoresMatchCpuReference) {
  MIXKV_REQUIRE_CUDA();
  expect_scores_match({900, 33, 1300}, 13, [](int b) { return b % 7 == 3 ? -400.0 : -150.0 + 0.5 * (b % 5); });
}

// With a (sequence, KV head) pair for every SM the plan cuts the layer's
// work into one equal share per resident CTA, pairs cut where shares end,
// and launches the pieces in the order that lets each CTA slot run one
// share (pieces of pairs, whole short pairs, an empty sequence). Each plan
// for `sms` SMs against the CPU reference; `tiles` items per piece.
void expect_shares_match(int kvh, int qh, int batch, std::uint64_t seed, std::initializer_list<int> sms_counts,
                         int tiles) {
  const int dim = 128, block = 32;
  Rng rng(seed);
  std::vector<int> contexts = cycle({1, 97, 500, 1000, 33, 2000, 31, 0, 64}, batch);
  TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 9);
  const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(contexts, kvh, dim, block, kMixed, rng));
  const auto q = random_halves(rng, contexts.size() * qh * dim);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const DecodeResult ref = cpu_decode(arena, placed, q, qh, scale);
  for (int sms : sms_counts) {
    std::int32_t items = 0;
    expect_close(run_gpu(arena, placed, q, qh, scale, 0, 1, 0, sms, &items), ref, dim, std::to_string(sms) + " SMs");
    EXPECT_GT(items, batch * kvh * tiles) << sms << " SMs: shares cut pairs";
    EXPECT_EQ(items % tiles, 0) << sms << " SMs: an item per tile of every piece";
  }
}

// A group of 16 as one item of two n-tiles or two items of one, by
// max_heads_per_item, whole and split. The default: 8 heads an item for
// 3 x 2 (sequence, KV head) pairs, 16 for 8 x 2.
TEST(DecodeCudaHeads, ItemWidthsMatchCpuReference) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 2, qh = 32, dim = 128, block = 32;
  for (int batch : {3, 8}) {
    Rng rng(21);
    const std::vector<int> contexts = cycle({1, 700, 2000}, batch);
    TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 7);
    const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(contexts, kvh, dim, block, kMixed, rng));
    const auto q = random_halves(rng, contexts.size() * qh * dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    const DecodeResult ref = cpu_decode(arena, placed, q, qh, scale);
    for (int heads : {0, 8, 16}) {
      for (int chunks : {1, 5}) {
        std::int32_t items = 0;
        const std::string what = std::to_string(batch) + " sequences, " + std::to_string(heads) + " heads an item, " +
                                 std::to_string(chunks) + " chunks";
        expect_close(run_gpu(arena, placed, q, qh, scale, chunks, 1, 0, 0, &items, heads), ref, dim, what);
        const int tiles = heads == 16 || (heads == 0 && batch * kvh >= 16) ? 1 : 2;
        int pieces = 0;  // a 1-token sequence is one piece
        for (int tokens : contexts) pieces += tokens == 1 ? 1 : chunks;
        EXPECT_EQ(items, pieces * kvh * tiles) << what;
      }
    }
  }
}

// 57 pairs planned for 8 and for 40 SMs: 24 and 120 shares.
TEST(DecodeCudaBalanced, OneWaveOfSharesMatchesCpuReference) {
  MIXKV_REQUIRE_CUDA();
  expect_shares_match(3, 9, 19, 12, {8, 40}, 1);
}

// A group of 18 query heads runs as 2 tiles of 9 (two n-tiles each):
// every piece of a share once per tile, each tile's pieces merged on
// their own.
TEST(DecodeCudaBalanced, SharesOfHeadTilesMatchCpuReference) {
  MIXKV_REQUIRE_CUDA();
  expect_shares_match(2, 36, 11, 13, {8, 20}, 2);
}

// Pairs that fill 2 CTAs on every SM (16 pairs planned for 8 SMs) with
// equal work that waits on memory (INT4) or is short get one item each, no
// split; long INT2 pairs (bound by instructions) and unequal pairs keep
// their shares. Each plan against the CPU reference.
TEST(DecodeCudaBalanced, WholePairsWhenTheyFillTheSmsEvenly) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 4, qh = 28, dim = 128, block = 32, sms = 8;
  struct Case {
    std::vector<int> contexts;
    Mix mix;
    bool whole;
    const char* name;
  };
  for (const Case& c : {Case{{1000, 1000, 1000, 1000}, kAllInt4, true, "equal INT4"},
                        Case{{1000, 1000, 1000, 1000}, kAllInt2, true, "equal short INT2"},
                        Case{{8000, 8000, 8000, 8000}, kAllInt2, false, "equal long INT2"},
                        Case{{1000, 600, 1000, 1000}, kAllInt4, false, "unequal INT4"}}) {
    Rng rng(31);
    TestArena arena(kvh, dim, block, blocks_needed(c.contexts, block), 7);
    const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(c.contexts, kvh, dim, block, c.mix, rng));
    const auto q = random_halves(rng, c.contexts.size() * qh * dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    const DecodeResult ref = cpu_decode(arena, placed, q, qh, scale);
    std::int32_t items = 0;
    expect_close(run_gpu(arena, placed, q, qh, scale, 0, 1, 0, sms, &items), ref, dim, c.name);
    const auto pairs = static_cast<std::int32_t>(c.contexts.size()) * kvh;
    if (c.whole) {
      EXPECT_EQ(items, pairs) << c.name << ": one item per pair";
    } else {
      EXPECT_GT(items, pairs) << c.name << ": shares cut pairs";
    }
  }
}

// A sequence with no tokens at all, and one whose quantized pools are empty
// and one with only INT2: outputs finite, the empty one (0, -inf).
TEST(DecodeCudaEmpty, EmptySequencesAndPoolsMakeNoNaN) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 4, qh = 28, dim = 128, block = 32;
  Rng rng(3);
  TestArena arena(kvh, dim, block, {8, 8, 8}, 5);
  std::vector<SequenceData> seqs = mixed_sequences<Half>({64, 20, 64}, kvh, dim, block, kAllInt2, rng);
  seqs[1].windows.clear();  // 20 tokens: FP16 only
  SequenceData empty;
  seqs.insert(seqs.begin() + 1, empty);
  const PlacedBatch placed = place_batch(arena, seqs);
  const auto q = random_halves(rng, seqs.size() * qh * dim);
  const float scale = 1.0f / std::sqrt(128.0f);
  const DecodeResult ref = cpu_decode(arena, placed, q, qh, scale);
  for (int chunks : {0, 2}) {
    const DecodeResult got = run_gpu(arena, placed, q, qh, scale, chunks);
    expect_close(got, ref, dim, "chunks " + std::to_string(chunks));
    for (int h = 0; h < qh; ++h) {
      EXPECT_TRUE(std::isinf(got.lse[qh + h]) && got.lse[qh + h] < 0);
      for (int c = 0; c < dim; ++c) EXPECT_EQ(got.out[(qh + h) * dim + c], 0.0f);
    }
  }
}

// The same windows split into different numbers of chunks give the same
// output (testing.md item 4), and layer > 0 of a multi-layer table works.
TEST(DecodeCudaInvariance, SplitAndLayerDoNotChangeTheResult) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 4, qh = 28, dim = 128, block = 32;
  Rng rng(8);
  const std::vector<int> contexts = {2000, 1500};
  TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 2);
  const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(contexts, kvh, dim, block, kMixed, rng));
  const auto q = random_halves(rng, contexts.size() * qh * dim);
  const float scale = 1.0f / std::sqrt(128.0f);
  // Chunks differ only in rounding: P is rounded to FP16 relative to each
  // chunk's own running max, and the output to FP16 (2.4e-4 of the row's
  // largest value per rounding), hence mean <= 1e-3 and max <= 2.5e-3.
  const DecodeResult one = run_gpu(arena, placed, q, qh, scale, 1);
  for (int chunks : {2, 7, 40}) {
    const DecodeResult other = run_gpu(arena, placed, q, qh, scale, chunks);
    const ErrorStats e = row_errors(other.out, one.out, dim);
    EXPECT_LE(e.mean, 1e-3) << chunks << " chunks";
    EXPECT_LE(e.max, 2.5e-3) << chunks << " chunks";
  }
  const DecodeResult layer2 = run_gpu(arena, placed, q, qh, scale, 0, /*layers=*/3, /*layer=*/2);
  EXPECT_LE(row_errors(layer2.out, one.out, dim).mean, 1e-3);
  EXPECT_LE(row_errors(layer2.out, one.out, dim).max, 2.5e-3);
}

// Sequences `order` of `placed`, in that order.
PlacedBatch select(const PlacedBatch& placed, const std::vector<std::size_t>& order) {
  PlacedBatch out;
  for (int p = 0; p < kNumPrecisions; ++p) {
    const PagedPoolTable& from = placed.tables[p];
    PagedPoolTable& to = out.tables[p];
    to.indptr.assign(1, 0);
    for (const std::size_t i : order) {
      to.indices.insert(to.indices.end(), from.indices.begin() + from.indptr[i],
                        from.indices.begin() + from.indptr[i + 1]);
      to.indptr.push_back(static_cast<std::int32_t>(to.indices.size()));
      to.last_block_len.push_back(from.last_block_len[i]);
    }
  }
  for (const std::size_t i : order) out.expected.push_back(placed.expected[i]);
  return out;
}

// Batch-invariant decode: a sequence's output and LSE are bitwise the same
// decoded alone, inside a batch of 17 and in that batch reversed, at 8 KV
// heads and mixed pools (where the automatic split depends on the batch),
// and stay within the usual bounds of the automatic split's result.
TEST(DecodeCudaInvariance, BatchInvariantBlocksMakeTheBatchIrrelevant) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 8, qh = 32, dim = 128, block = 32, n = 17;
  Rng rng(21);
  std::vector<int> contexts;
  for (int i = 0; i < n; ++i) contexts.push_back(40 + std::uniform_int_distribution<int>(0, 3000)(rng));
  TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 2);
  const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(contexts, kvh, dim, block, kMixed, rng));
  const auto q = random_halves(rng, contexts.size() * qh * dim);
  const float scale = 1.0f / std::sqrt(128.0f);
  const std::size_t row = static_cast<std::size_t>(qh) * dim;
  const auto q_of = [&](const std::vector<std::size_t>& order) {
    std::vector<Half> out;
    for (const std::size_t i : order) out.insert(out.end(), q.begin() + i * row, q.begin() + (i + 1) * row);
    return out;
  };
  constexpr int kInvariantBlocks = 16;
  std::vector<std::size_t> forward(n), backward(n);
  std::iota(forward.begin(), forward.end(), 0);
  std::iota(backward.rbegin(), backward.rend(), 0);
  const auto run = [&](const std::vector<std::size_t>& order) {
    return run_gpu(arena, select(placed, order), q_of(order), qh, scale, 0, 1, 0, 0, nullptr, 0, kInvariantBlocks, n);
  };
  const DecodeResult all = run(forward);
  const DecodeResult reversed = run(backward);
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
    const DecodeResult alone = run({i});
    const std::size_t j = static_cast<std::size_t>(n) - 1 - i;  // its place when reversed
    for (std::size_t e = 0; e < row; ++e) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(all.out[i * row + e]), std::bit_cast<std::uint32_t>(alone.out[e]))
          << "sequence " << i << " element " << e;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(reversed.out[j * row + e]), std::bit_cast<std::uint32_t>(alone.out[e]))
          << "sequence " << i << " element " << e;
    }
    for (int h = 0; h < qh; ++h) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(all.lse[i * qh + h]), std::bit_cast<std::uint32_t>(alone.lse[h]));
      ASSERT_EQ(std::bit_cast<std::uint32_t>(reversed.lse[j * qh + h]), std::bit_cast<std::uint32_t>(alone.lse[h]));
    }
  }
  const DecodeResult automatic = run_gpu(arena, placed, q, qh, scale);
  const ErrorStats e = row_errors(all.out, automatic.out, dim);
  EXPECT_LE(e.mean, 1e-3);
  EXPECT_LE(e.max, 2.5e-3);
  gpu::DecodePlanConfig both;
  both.num_layers = 1;
  both.num_q_heads = qh;
  both.num_kv_heads = kvh;
  both.head_dim = dim;
  both.block_size = block;
  both.max_batch = 1;
  both.chunks_per_sequence = 2;
  both.batch_invariant_blocks = kInvariantBlocks;
  gpu::DevicePageTables tables({1, 1, 8});
  MIXKV_EXPECT_INVALID((gpu::DecodePlan{both, tables}), "batch_invariant_blocks");
}

// A captured graph of run() (fixed grids) replays correctly after the
// tables and the plan changed underneath it.
TEST(DecodeCudaGraph, CapturedRunSurvivesReplanning) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 4, qh = 28, dim = 128, block = 32;
  Rng rng(12);
  const std::vector<int> contexts = {700, 300};
  TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 4);
  const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(contexts, kvh, dim, block, kMixed, rng));
  const auto q = random_halves(rng, contexts.size() * qh * dim);
  const float scale = 1.0f / std::sqrt(128.0f);
  const DecodeResult ref = cpu_decode(arena, placed, q, qh, scale);

  DeviceArenaCopy device(arena);
  gpu::DevicePageTables tables({1, 2, longest_list(placed)}, layout_of(arena));
  gpu::DecodePlanConfig config{1, qh, kvh, dim, block, 2, 0, 0, 0};
  gpu::DecodePlan plan(config, tables);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  // First plan: the two sequences swapped between slots.
  PlacedBatch swapped = placed;
  for (auto& t : swapped.tables) {
    PagedPoolTable s;
    s.indptr = {0};
    for (int b : {1, 0}) {
      s.indices.insert(s.indices.end(), t.indices.begin() + t.indptr[b], t.indices.begin() + t.indptr[b + 1]);
      s.indptr.push_back(static_cast<std::int32_t>(s.indices.size()));
      s.last_block_len.push_back(t.last_block_len[b]);
    }
    t = s;
  }
  fill_tables(tables, swapped, 0);
  tables.upload(stream);
  const std::vector<std::int32_t> slots = {0, 1};
  plan.plan(slots, stream);
  DeviceVector<Half> dq(q), dout(q.size());
  DeviceVector<float> dlse(2 * qh);
  gpu::DecodeRunArgs run{0, dq.get(), dout.get(), dlse.get(), scale, device.pools, stream, true};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  plan.run(run);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  // Now the real order, uploaded and planned again; the graph is replayed.
  fill_tables(tables, placed, 0);
  const std::size_t sent = tables.upload(stream);
  EXPECT_GT(sent, 0u);
  plan.plan(slots, stream);
  cuda_ok(cudaGraphLaunch(exec, stream), "replay");
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  DecodeResult got{halves_to_floats(dout.to_host()), dlse.to_host()};
  expect_close(got, ref, dim, "graph replay");
  // Again over poisoned outputs: the split merge's arrival counters must
  // have been reset by the first replay, or no CTA would write the output.
  dout.fill_bytes(0x7e);
  dlse.fill_bytes(0x7f);
  cuda_ok(cudaGraphLaunch(exec, stream), "second replay");
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  DecodeResult again{halves_to_floats(dout.to_host()), dlse.to_host()};
  expect_close(again, ref, dim, "second graph replay");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Batch 8 x 19,600 tokens, GQA 7:1 (1.6 GB of float K/V for the
// reference): the kernel against cuBLAS FP32 dense attention over the same
// dequantized values, in prompt order.
TEST(DecodeCudaDense, LargeBatchMatchesCublasReference) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 4, qh = 28, dim = 128, block = 32, batch = 8, tokens = 19600;
  Rng rng(99);
  const std::vector<int> contexts(batch, tokens);
  TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 6);
  const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(contexts, kvh, dim, block, kMixed, rng));
  const auto q = random_halves(rng, static_cast<std::size_t>(batch) * qh * dim);
  const float scale = 1.0f / std::sqrt(128.0f);
  const DecodeResult got = run_gpu(arena, placed, q, qh, scale);

  std::vector<float> k(static_cast<std::size_t>(batch) * kvh * tokens * dim), v(k.size());
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < kvh; ++h) {
      const std::size_t at = (static_cast<std::size_t>(b) * kvh + h) * tokens * dim;
      std::copy(placed.expected[b].k[h].begin(), placed.expected[b].k[h].end(), k.begin() + at);
      std::copy(placed.expected[b].v[h].begin(), placed.expected[b].v[h].end(), v.begin() + at);
    }
  }
  DeviceVector<float> dq(widen(q)), dk(k), dv(v), dout(q.size());
  gpu::DenseAttention dense;
  dense.run_fp32({batch, qh, kvh, tokens, dim, scale}, dq.get(), dk.get(), dv.get(), dout.get(), nullptr);
  const ErrorStats e = row_errors(got.out, dout.to_host(), dim);
  EXPECT_TRUE(e.finite);
  EXPECT_LE(e.mean, 1e-3);
  EXPECT_LE(e.max, 5e-3);
}

// A plan() that fails on a later layer leaves every layer's plan as it was.
TEST(DecodeCudaPlan, FailedPlanChangesNothing) {
  MIXKV_REQUIRE_CUDA();  // DevicePageTables allocates device memory
  gpu::DevicePageTables tables({2, 2, 8});
  const std::vector<std::int32_t> one = {0};
  const std::vector<std::int32_t> eight = {0, 1, 2, 3, 4, 5, 6, 7};
  for (std::int32_t slot = 0; slot < 2; ++slot) {
    tables.set_blocks(slot, 0, Precision::INT4, one);    // layer 0: one block, never split
    tables.set_blocks(slot, 1, Precision::INT4, eight);  // layer 1: two chunks a sequence
  }
  gpu::DecodePlanConfig config{2, 7, 1, 128, 32, 2, 3, 0, 2};  // at most 3 items a layer
  gpu::DecodePlan plan(config, tables);
  const std::vector<std::int32_t> first = {1};
  plan.plan(first, nullptr);
  auto state = [&] {
    std::vector<std::int64_t> v = {plan.batch_size()};
    for (int layer = 0; layer < 2; ++layer) {
      v.insert(v.end(), {plan.num_items(layer), plan.num_split_items(layer), plan.bytes_read(layer)});
    }
    return v;
  };
  const std::vector<std::int64_t> before = state();
  EXPECT_EQ(before[1], 1);                        // layer 0: one item
  EXPECT_EQ(before[4], 2);                        // layer 1: two chunks
  const std::vector<std::int32_t> both = {0, 1};  // layer 0 fits (2 items), layer 1 does not (4)
  EXPECT_THROW(plan.plan(both, nullptr), OutOfMemory);
  EXPECT_EQ(state(), before);
}

TEST(DecodeCudaBadInput, UnsupportedShapesAreNamed) {
  MIXKV_REQUIRE_CUDA();  // DevicePageTables allocates device memory
  gpu::DevicePageTables tables({1, 2, 4});
  const gpu::DecodePlanConfig valid{1, 28, 4, 128, 32, 2, 0, 0, 0};
  const std::vector<std::pair<std::function<void(gpu::DecodePlanConfig&)>, std::string>> changes = {
      {[](gpu::DecodePlanConfig& c) { c.head_dim = 96; }, "Unsupported head_dim: 96"},
      {[](gpu::DecodePlanConfig& c) { c.block_size = 48; }, "Unsupported block_size: 48"},
      {[](gpu::DecodePlanConfig& c) { c.num_q_heads = 30; }, "num_q_heads"},
      {[](gpu::DecodePlanConfig& c) { c.max_heads_per_item = 12; }, "max_heads_per_item = 12: expected 0, 8 or 16"},
      {[](gpu::DecodePlanConfig& c) { c.head_dim = 256, c.max_heads_per_item = 16; },
       "no two-tile instance is built for head_dim 256"}};
  for (const auto& [change, message] : changes) {
    gpu::DecodePlanConfig config = valid;
    change(config);
    MIXKV_EXPECT_INVALID(gpu::DecodePlan(config, tables), message);
  }
  gpu::DecodePlan plan(valid, tables);
  const std::vector<std::int32_t> bad_slots = {0, 5};
  MIXKV_EXPECT_INVALID(plan.plan(bad_slots, nullptr), "slots[1]");
  gpu::DecodeRunArgs run;
  MIXKV_EXPECT_INVALID(plan.run(run), "plan()");
}

}  // namespace
}  // namespace mixkv::test
