// A BF16 cache on the CPU backend: store and quantize round (scale, min) to
// bfloat16 (no overflow past FP16's 65504), decode and extend read q, k, v
// and the pools as bfloat16 and match a float64 attention on the same
// values, demotion requantizes in bfloat16, and every op refuses an input
// of the other 16-bit type, naming it.
#include <gtest/gtest.h>

#include <cstring>

#include "cpu_test_util.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/extend_attention.h"

namespace mixkv::test {
namespace {

using Tables = std::array<PagedPoolTable, kNumPrecisions>;

std::vector<SequenceDataBF16> bf16_sequences(Rng& rng, const std::vector<std::int32_t>& contexts, std::int32_t kv_heads,
                                             std::int32_t dim, std::int32_t block, double sd = 1.0) {
  std::vector<SequenceDataBF16> seqs;
  for (std::int32_t n : contexts) {
    const std::size_t values = static_cast<std::size_t>(n) * kv_heads * dim;
    SequenceDataBF16 seq{n, random_bfloats(rng, values, sd), random_bfloats(rng, values, sd), {}};
    for (std::int32_t w = 0; w < n / block; ++w) seq.windows.push_back(kAllPrecisions[rng() % kNumPrecisions]);
    seqs.push_back(std::move(seq));
  }
  return seqs;
}

// Largest ||out - ref|| / ||ref|| and |lse - ref| over the states.
std::pair<double, double> errors(const std::vector<float>& out, const std::vector<float>& lse,
                                 const std::vector<DenseState>& want, std::int32_t dim) {
  double e_out = 0, e_lse = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i].lse)) {
      EXPECT_EQ(lse[i], -std::numeric_limits<float>::infinity()) << "state " << i;
      continue;
    }
    e_out = std::max(e_out, relative_error(&out[i * dim], want[i].out));
    e_lse = std::max(e_lse, std::abs(static_cast<double>(lse[i]) - want[i].lse));
  }
  return {e_out, e_lse};
}

TEST(Bf16Quantize, ParamsAreBfloat16AndCodesFollowTheRule) {
  for (Precision p : {Precision::INT4, Precision::INT2}) {
    for (std::int32_t block : {16, 32, 64}) {
      constexpr std::int32_t kDim = 64;
      const BlockFormat f{p, 1, kDim, block, DType::BF16};
      Rng rng(7 + block);
      // Values far past FP16's 65504: a BF16 cache stores them and their
      // (scale, min) without overflow.
      const auto k = random_bfloats(rng, static_cast<std::size_t>(block) * kDim, 1e6);
      const auto v = random_bfloats(rng, k.size(), 1e6);
      std::vector<std::byte> head(f.head_bytes());
      cpu::write_head(f, k.data(), v.data(), kDim, head.data());
      std::vector<float> k_out(k.size()), v_out(v.size());
      cpu::read_head(f, head.data(), k_out.data(), v_out.data());
      const std::vector<float> kf = widen(k), vf = widen(v);
      const auto k_ref = reference_dequant_k(kf.data(), kDim, block, kDim, p, DType::BF16);
      const auto v_ref = reference_dequant_v(vf.data(), kDim, block, kDim, p, DType::BF16);
      for (std::size_t i = 0; i < k.size(); ++i) {
        ASSERT_EQ(k_out[i], k_ref[i]) << to_string(p) << " block " << block << " K " << i;
        ASSERT_EQ(v_out[i], v_ref[i]) << to_string(p) << " block " << block << " V " << i;
        ASSERT_TRUE(std::isfinite(k_out[i]) && std::isfinite(v_out[i]));
      }
      // Token 0's V minimum is the bfloat16 of its row's smallest value.
      std::uint16_t min_bits;
      std::memcpy(&min_bits, head.data() + f.v_min_offset(0), 2);
      const float lo = *std::min_element(vf.begin(), vf.begin() + kDim);
      EXPECT_EQ(min_bits, float_to_bfloat16(lo).bits);
    }
  }
}

TEST(Bf16Quantize, Fp16RowsAreCopiedBitForBit) {
  const BlockFormat f{Precision::FP16, 1, 128, 32, DType::BF16};
  Rng rng(3);
  const auto k = random_bfloats(rng, 32 * 128, 1e5);
  const auto v = random_bfloats(rng, k.size());
  std::vector<std::byte> head(f.head_bytes());
  cpu::write_head(f, k.data(), v.data(), 128, head.data());
  EXPECT_EQ(std::memcmp(head.data() + f.k_offset(), k.data(), k.size() * 2), 0);
  EXPECT_EQ(std::memcmp(head.data() + f.v_offset(), v.data(), v.size() * 2), 0);
  std::vector<float> k_out(k.size()), v_out(v.size());
  cpu::read_head(f, head.data(), k_out.data(), v_out.data());
  EXPECT_EQ(k_out, widen(k));
  EXPECT_EQ(v_out, widen(v));
}

TEST(Bf16Quantize, WriteHeadRefusesTheOtherType) {
  const std::vector<Half> halves(32 * 64);
  const std::vector<BFloat16> bfloats(32 * 64);
  std::vector<std::byte> head(BlockFormat{Precision::INT4, 1, 64, 32}.head_bytes());
  MIXKV_EXPECT_INVALID(
      cpu::write_head({Precision::INT4, 1, 64, 32, DType::BF16}, halves.data(), halves.data(), 64, head.data()),
      "k: dtype float16: expected bfloat16");
  MIXKV_EXPECT_INVALID(cpu::write_head({Precision::INT4, 1, 64, 32}, bfloats.data(), bfloats.data(), 64, head.data()),
                       "k: dtype bfloat16: expected float16");
}

TEST(Bf16Decode, MatchesDenseFloat64OnBfloat16Values) {
  struct Case {
    std::int32_t q_heads, kv_heads, dim, block;
    std::vector<std::int32_t> contexts;
  };
  for (const Case& c : {Case{4, 1, 64, 16, {1, 31, 97}}, Case{9, 3, 128, 32, {33, 0, 250}},
                        Case{28, 4, 128, 64, {1000}}, Case{8, 1, 256, 32, {65, 7}}}) {
    Rng rng(11 + c.dim + c.block);
    const auto seqs = bf16_sequences(rng, c.contexts, c.kv_heads, c.dim, c.block);
    TestArena arena(c.kv_heads, c.dim, c.block, blocks_needed(seqs, c.block, 1), 5, DType::BF16);
    const PlacedBatch placed = place_batch(arena, seqs);
    const auto q = random_bfloats(rng, seqs.size() * c.q_heads * c.dim);
    const float sm_scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
    const DecodeResult got = cpu_decode(arena, placed, q, c.q_heads, sm_scale);
    std::vector<DenseState> want;
    const std::int32_t group = c.q_heads / c.kv_heads;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      for (std::int32_t h = 0; h < c.q_heads; ++h) {
        std::vector<double> qh(c.dim);
        for (std::int32_t i = 0; i < c.dim; ++i) qh[i] = to_float(q[(b * c.q_heads + h) * c.dim + i]);
        const ExpectedKV& e = placed.expected[b];
        want.push_back(dense_attention(qh.data(), e.k[h / group].data(), e.v[h / group].data(),
                                       e.k[h / group].size() / c.dim, c.dim, sm_scale));
      }
    }
    const auto [e_out, e_lse] = errors(got.out, got.lse, want, c.dim);
    EXPECT_LE(e_out, 1e-5) << "D" << c.dim << " S" << c.block;
    EXPECT_LE(e_lse, 1e-5) << "D" << c.dim << " S" << c.block;
  }
}

TEST(Bf16Extend, MatchesDenseFloat64OnBfloat16Values) {
  constexpr std::int32_t kQ = 6, kKv = 2, kDim = 128, kBlock = 32;
  Rng rng(21);
  const auto seqs = bf16_sequences(rng, {0, 45, 200}, kKv, kDim, kBlock);
  TestArena arena(kKv, kDim, kBlock, blocks_needed(seqs, kBlock, 1), 9, DType::BF16);
  const PlacedBatch placed = place_batch(arena, seqs);
  const std::vector<std::int32_t> qo_indptr{0, 5, 6, 40};
  const auto rows = static_cast<std::size_t>(qo_indptr.back());
  const auto q = random_bfloats(rng, rows * kQ * kDim);
  const auto k = random_bfloats(rng, rows * kKv * kDim);
  const auto v = random_bfloats(rng, rows * kKv * kDim);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  std::vector<float> out(rows * kQ * kDim, std::numeric_limits<float>::quiet_NaN()), lse(rows * kQ);
  cpu::ExtendAttentionArgs args;
  args.qo_indptr = qo_indptr;
  args.q = q;
  args.k = k;
  args.v = v;
  args.num_q_heads = kQ;
  args.sm_scale = sm_scale;
  args.tables = &placed.tables;
  args.pools = arena.views();
  args.out = out;
  args.lse = lse;
  cpu::extend_attention(args);

  std::vector<DenseState> want(rows * kQ);
  for (std::size_t b = 0; b + 1 < qo_indptr.size(); ++b) {
    for (std::int32_t g = 0; g < kKv; ++g) {
      std::vector<float> kk = placed.expected[b].k[g], vv = placed.expected[b].v[g];
      const std::size_t cached = kk.size() / kDim;
      for (std::int32_t r = qo_indptr[b]; r < qo_indptr[b + 1]; ++r) {
        for (std::int32_t c = 0; c < kDim; ++c) {
          kk.push_back(to_float(k[(static_cast<std::size_t>(r) * kKv + g) * kDim + c]));
          vv.push_back(to_float(v[(static_cast<std::size_t>(r) * kKv + g) * kDim + c]));
        }
      }
      for (std::int32_t r = qo_indptr[b]; r < qo_indptr[b + 1]; ++r) {
        for (std::int32_t h = g * (kQ / kKv); h < (g + 1) * (kQ / kKv); ++h) {
          const std::size_t state = static_cast<std::size_t>(r) * kQ + h;
          std::vector<double> qh(kDim);
          for (std::int32_t c = 0; c < kDim; ++c) qh[c] = to_float(q[state * kDim + c]);
          want[state] =
              dense_attention(qh.data(), kk.data(), vv.data(), cached + (r - qo_indptr[b]) + 1, kDim, sm_scale);
        }
      }
    }
  }
  const auto [e_out, e_lse] = errors(out, lse, want, kDim);
  EXPECT_LE(e_out, 1e-5);
  EXPECT_LE(e_lse, 1e-5);
}

TEST(Bf16Demote, RequantizesInBfloat16) {
  constexpr std::int32_t kKv = 2, kDim = 64, kBlock = 32;
  TestArena arena(kKv, kDim, kBlock, {4, 4, 4}, 3, DType::BF16);
  Rng rng(13);
  const auto k = random_bfloats(rng, static_cast<std::size_t>(kBlock) * kKv * kDim, 3e5);
  const auto v = random_bfloats(rng, k.size(), 3e5);
  // The window stored FP16, then demoted to INT4 and INT2; and stored INT4
  // and INT2 directly: FP16 -> INT4/INT2 must give store_prefill's bytes.
  const std::int32_t fp16 = arena.alloc(Precision::FP16);
  const std::int32_t direct4 = arena.alloc(Precision::INT4), direct2 = arena.alloc(Precision::INT2);
  StoreMapping m;
  for (std::int32_t t = 0; t < kBlock; ++t) m.fp16_slots.push_back(fp16 * kBlock + t);
  cpu::store_prefill(k, v, m, arena.views());
  StoreMapping q;
  q.fp16_slots.assign(2 * kBlock, -1);
  q.int4_windows.push_back({direct4, 0});
  q.int2_windows.push_back({direct2, kBlock});
  std::vector<BFloat16> k2 = k, v2 = v;
  k2.insert(k2.end(), k.begin(), k.end());
  v2.insert(v2.end(), v.begin(), v.end());
  cpu::store_prefill(k2, v2, q, arena.views());
  const std::int32_t to4 = arena.alloc(Precision::INT4), to2 = arena.alloc(Precision::INT2);
  const std::int32_t from4 = arena.alloc(Precision::INT2);
  const std::vector<DemoteOp> ops{{0, 0, 0, Precision::FP16, fp16, Precision::INT4, to4},
                                  {0, 0, 0, Precision::FP16, fp16, Precision::INT2, to2},
                                  {0, 0, 0, Precision::INT4, direct4, Precision::INT2, from4}};
  cpu::demote(ops, arena.views());
  const PoolView& p4 = arena.view(Precision::INT4);
  const PoolView& p2 = arena.view(Precision::INT2);
  EXPECT_EQ(std::memcmp(p4.block(to4), p4.block(direct4), p4.format.block_bytes()), 0);
  EXPECT_EQ(std::memcmp(p2.block(to2), p2.block(direct2), p2.format.block_bytes()), 0);
  // INT4 -> INT2: the INT4 values quantized again with bfloat16 parameters.
  std::vector<float> k4(kBlock * kDim), v4(k4.size()), k_got(k4.size()), v_got(k4.size());
  for (std::int32_t h = 0; h < kKv; ++h) {
    cpu::read_head(p4.format, p4.block(direct4) + p4.format.head_offset(h), k4.data(), v4.data());
    cpu::read_head(p2.format, p2.block(from4) + p2.format.head_offset(h), k_got.data(), v_got.data());
    const auto k_ref = reference_dequant_k(k4.data(), kDim, kBlock, kDim, Precision::INT2, DType::BF16);
    const auto v_ref = reference_dequant_v(v4.data(), kDim, kBlock, kDim, Precision::INT2, DType::BF16);
    EXPECT_EQ(k_got, k_ref) << "head " << h;
    EXPECT_EQ(v_got, v_ref) << "head " << h;
  }
}

TEST(Bf16BadInput, EveryOpNamesTheMismatchedArgument) {
  constexpr std::int32_t kKv = 1, kDim = 64, kBlock = 16;
  TestArena bf16(kKv, kDim, kBlock, {2, 1, 1}, 1, DType::BF16);
  TestArena fp16(kKv, kDim, kBlock, {2, 1, 1}, 1, DType::F16);
  const std::vector<Half> h(static_cast<std::size_t>(kBlock) * kKv * kDim);
  const std::vector<BFloat16> b(h.size());
  StoreMapping m;
  for (std::int32_t t = 0; t < kBlock; ++t) m.fp16_slots.push_back(t);
  MIXKV_EXPECT_INVALID(cpu::store_prefill(h, b, m, bf16.views()), "store_prefill: k: dtype float16: expected bfloat16");
  MIXKV_EXPECT_INVALID(cpu::store_prefill(b, h, m, bf16.views()), "store_prefill: v: dtype float16");
  MIXKV_EXPECT_INVALID(cpu::store_prefill(b, b, m, fp16.views()), "store_prefill: k: dtype bfloat16: expected float16");
  const std::vector<std::int32_t> slots{0};
  const std::vector<BFloat16> b1(kKv * kDim);
  const std::vector<Half> h1(kKv * kDim);
  MIXKV_EXPECT_INVALID(cpu::append(h1, b1, slots, bf16.view(Precision::FP16)), "append: k: dtype float16");
  MIXKV_EXPECT_INVALID(cpu::append(b1, h1, slots, bf16.view(Precision::FP16)), "append: v: dtype float16");
  cpu::store_prefill(b, b, m, bf16.views());

  // Pools that disagree on the dtype are refused too.
  PoolViews mixed = bf16.views();
  mixed[pool_index(Precision::INT2)].format.dtype = DType::F16;
  MIXKV_EXPECT_INVALID(cpu::store_prefill(b, b, m, mixed), "pools[INT2].format.dtype");

  Tables tables;
  tables[0] = {{0, 1}, {0}, {kBlock}};
  tables[1] = tables[2] = {{0, 0}, {}, {0}};
  std::vector<float> out(kDim), lse(1);
  cpu::DecodeAttentionArgs d;
  d.q = h1;
  d.num_q_heads = 1;
  d.sm_scale = 0.125f;
  d.tables = &tables;
  d.pools = bf16.views();
  d.out = out;
  d.lse = lse;
  MIXKV_EXPECT_INVALID(cpu::decode_attention(d), "decode_attention: q: dtype float16: expected bfloat16");
  d.q = b1;
  cpu::decode_attention(d);
  EXPECT_TRUE(std::isfinite(lse[0]));

  const std::vector<std::int32_t> qo{0, 1};
  cpu::ExtendAttentionArgs e;
  e.qo_indptr = qo;
  e.q = b1;
  e.k = b1;
  e.v = h1;
  e.num_q_heads = 1;
  e.sm_scale = 0.125f;
  e.tables = &tables;
  e.pools = bf16.views();
  e.out = out;
  e.lse = lse;
  MIXKV_EXPECT_INVALID(cpu::extend_attention(e), "extend_attention: v: dtype float16: expected bfloat16");
  e.v = b1;
  e.q = h1;
  MIXKV_EXPECT_INVALID(cpu::extend_attention(e), "extend_attention: q: dtype float16");
  e.q = b1;
  cpu::extend_attention(e);
}

// NaN and infinity in bfloat16 (exponent 0xff) are refused as in FP16.
TEST(Bf16BadInput, NonFiniteValues) {
  TestArena arena(1, 64, 16, {2, 1, 1}, 1, DType::BF16);
  std::vector<BFloat16> k(16 * 64), v(k.size());
  StoreMapping m;
  for (std::int32_t t = 0; t < 16; ++t) m.fp16_slots.push_back(t);
  k[70] = BFloat16{0x7f80};  // +inf
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k, v, m, arena.views()), "k[70] is NaN or inf");
  k[70] = BFloat16{0x3f80};
  v[3] = BFloat16{0xffc1};  // NaN
  MIXKV_EXPECT_INVALID(cpu::store_prefill(k, v, m, arena.views()), "v[3] is NaN or inf");
  v[3] = BFloat16{0x7f7f};  // the largest finite bfloat16 is stored
  cpu::store_prefill(k, v, m, arena.views());
}

}  // namespace
}  // namespace mixkv::test
