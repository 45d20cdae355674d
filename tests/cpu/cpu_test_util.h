#pragma once
// Helpers shared by the CPU backend tests: seeded data, a hand-made arena of
// interleaved pool slabs (the manager is not needed), an independent
// reference quantizer, placement of sequences into pools through
// store_prefill, and a dense float64 attention to compare against.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/bfloat16.h"
#include "mixkv/core/block_format.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/half.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/core/precision.h"
#include "mixkv/core/quant_math.h"
#include "mixkv/core/span16.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/quantize.h"
#include "mixkv/cpu/store.h"

namespace mixkv::test {

using Rng = std::mt19937_64;

inline double normal(Rng& rng, double mean = 0.0, double sd = 1.0) {
  return std::normal_distribution<double>(mean, sd)(rng);
}

inline std::vector<Half> random_halves(Rng& rng, std::size_t n, double sd = 1.0) {
  std::vector<Half> values(n);
  for (Half& h : values) h = float_to_half(static_cast<float>(normal(rng, 0.0, sd)));
  return values;
}

inline std::vector<BFloat16> random_bfloats(Rng& rng, std::size_t n, double sd = 1.0) {
  std::vector<BFloat16> values(n);
  for (BFloat16& b : values) b = float_to_bfloat16(static_cast<float>(normal(rng, 0.0, sd)));
  return values;
}

// Random values of a cache's 16-bit type T (Half or BFloat16).
template <Float16Element T>
std::vector<T> random_values(Rng& rng, std::size_t n, double sd = 1.0) {
  if constexpr (std::is_same_v<T, Half>) {
    return random_halves(rng, n, sd);
  } else {
    return random_bfloats(rng, n, sd);
  }
}

inline float to_float(Half h) { return half_to_float(h); }
inline float to_float(BFloat16 b) { return bfloat16_to_float(b); }

template <Float16Element T>
std::vector<float> widen(const std::vector<T>& values) {
  std::vector<float> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = to_float(values[i]);
  return out;
}

// x rounded to a cache's 16-bit type, as a stored scale or minimum is.
inline float round_to(DType dtype, float x) { return float16_value(dtype, float16_bits(dtype, x)); }

// The byte an arena is filled with before a test: 0x7e7e is an FP16 NaN, so
// a kernel that reads a token nobody wrote produces NaN and fails loudly.
inline constexpr std::byte kPoison{0x7e};

// One host arena cut into slabs that the three pools own in turn (slab i
// belongs to the pool whose turn it is, as in the manager, where pools grow
// slab by slab), so block ids exercise PoolView's slab arithmetic.
class TestArena {
 public:
  // blocks[p]: how many blocks pool p must be able to hand out.
  // dtype: the cache's 16-bit type.
  TestArena(std::int32_t num_kv_heads, std::int32_t head_dim, std::int32_t block_size,
            std::array<std::int32_t, kNumPrecisions> blocks, std::uint64_t seed = 1, DType dtype = DType::F16)
      : rng_(seed) {
    std::array<BlockFormat, kNumPrecisions> formats;
    for (Precision p : kAllPrecisions) formats[pool_index(p)] = {p, num_kv_heads, head_dim, block_size, dtype};
    // Four FP16 blocks a slab, plus an odd tail so no slab is a multiple of a block.
    slab_bytes_ = formats[0].block_bytes() * 4 + 48;
    std::array<std::int32_t, kNumPrecisions> slabs_needed{};
    for (Precision p : kAllPrecisions) {
      const int i = pool_index(p);
      const auto per_slab = static_cast<std::int32_t>(slab_bytes_ / formats[i].block_bytes());
      views_[i] = PoolView{nullptr, slab_bytes_, per_slab, formats[i]};
      slabs_needed[i] = std::max<std::int32_t>(1, (blocks[i] + per_slab - 1) / per_slab);
    }
    std::vector<int> owner;
    while (std::any_of(slabs_needed.begin(), slabs_needed.end(), [](std::int32_t n) { return n > 0; })) {
      for (int i = 0; i < kNumPrecisions; ++i) {
        if (slabs_needed[i] > 0) {
          --slabs_needed[i];
          const auto slab = static_cast<std::int32_t>(owner.size());
          for (std::int32_t b = 0; b < views_[i].blocks_per_slab; ++b)
            free_[i].push_back(slab * views_[i].blocks_per_slab + b);
          owner.push_back(i);
        }
      }
    }
    bytes_.assign(owner.size() * slab_bytes_, kPoison);
    // Every id of every slab addresses bytes inside the arena, as the
    // manager's pool_view() bounds it: slabs * blocks_per_slab.
    for (PoolView& view : views_) {
      view.base = bytes_.data();
      view.num_blocks = static_cast<std::int32_t>(owner.size()) * view.blocks_per_slab;
    }
    for (auto& ids : free_) std::shuffle(ids.begin(), ids.end(), rng_);
  }

  const PoolViews& views() const { return views_; }
  const PoolView& view(Precision p) const { return views_[pool_index(p)]; }
  const BlockFormat& format(Precision p) const { return views_[pool_index(p)].format; }
  std::vector<std::byte>& bytes() { return bytes_; }
  Rng& rng() { return rng_; }

  // A free block of pool p, in shuffled order.
  std::int32_t alloc(Precision p) {
    auto& ids = free_[pool_index(p)];
    if (ids.empty()) throw std::runtime_error("TestArena: pool " + std::string(to_string(p)) + " exhausted");
    const std::int32_t id = ids.back();
    ids.pop_back();
    return id;
  }

 private:
  Rng rng_;
  std::size_t slab_bytes_ = 0;
  PoolViews views_{};
  std::array<std::vector<std::int32_t>, kNumPrecisions> free_;
  std::vector<std::byte> bytes_;
};

// Independent reference of the quantization rule (quant_math.h applied
// group by group, written without BlockFormat): the dequantized values of
// one head of one window, x [block_size][head_dim] at `stride` floats a row,
// (scale, min) rounded to the cache's type `dtype`.
inline std::vector<float> reference_dequant_k(const float* x, std::size_t stride, int tokens, int dim, Precision p,
                                              DType dtype = DType::F16) {
  std::vector<float> out(static_cast<std::size_t>(tokens) * dim);
  const int qmax = max_code(p);
  for (int c = 0; c < dim; ++c) {
    float lo = x[c];
    float hi = x[c];
    for (int t = 0; t < tokens; ++t) {
      lo = std::min(lo, x[t * stride + c]);
      hi = std::max(hi, x[t * stride + c]);
    }
    const float scale = round_to(dtype, quant_step(lo, hi, qmax));
    const float min = round_to(dtype, lo);
    const float inverse = quant_inverse_step(scale);
    const float bias = quant_bias(min, inverse);
    for (int t = 0; t < tokens; ++t)
      out[t * dim + c] = dequant(quant_code(x[t * stride + c], inverse, bias, qmax), scale, min);
  }
  return out;
}

inline std::vector<float> reference_dequant_v(const float* x, std::size_t stride, int tokens, int dim, Precision p,
                                              DType dtype = DType::F16) {
  std::vector<float> out(static_cast<std::size_t>(tokens) * dim);
  const int qmax = max_code(p);
  for (int t = 0; t < tokens; ++t) {
    const float* row = x + t * stride;
    const float lo = *std::min_element(row, row + dim);
    const float hi = *std::max_element(row, row + dim);
    const float scale = round_to(dtype, quant_step(lo, hi, qmax));
    const float min = round_to(dtype, lo);
    const float inverse = quant_inverse_step(scale);
    const float bias = quant_bias(min, inverse);
    for (int c = 0; c < dim; ++c) out[t * dim + c] = dequant(quant_code(row[c], inverse, bias, qmax), scale, min);
  }
  return out;
}

// A sequence's prompt K/V, [tokens][num_kv_heads][head_dim] values of the
// cache's 16-bit type T, and where each full window goes (the trailing
// partial window stays FP16).
template <Float16Element T>
struct BasicSequenceData {
  std::int32_t tokens = 0;
  std::vector<T> k;
  std::vector<T> v;
  std::vector<Precision> windows;  // size tokens / block_size
};
using SequenceData = BasicSequenceData<Half>;
using SequenceDataBF16 = BasicSequenceData<BFloat16>;

// Blocks each pool must hand out to place `seqs` (a full window of a
// quantized precision takes one block of its pool, every other token an
// FP16 row), plus `spare_fp16` FP16 blocks.
template <Float16Element T>
std::array<std::int32_t, kNumPrecisions> blocks_needed(const std::vector<BasicSequenceData<T>>& seqs,
                                                       std::int32_t block, std::int32_t spare_fp16 = 0) {
  std::array<std::int32_t, kNumPrecisions> needed{spare_fp16, 0, 0};
  for (const BasicSequenceData<T>& seq : seqs) {
    std::int32_t fp16_tokens = seq.tokens;
    for (Precision p : seq.windows) {
      if (p != Precision::FP16) {
        ++needed[pool_index(p)];
        fp16_tokens -= block;
      }
    }
    needed[0] += (fp16_tokens + block - 1) / block;
  }
  return needed;
}

// The values a decode kernel must see for one sequence: per KV head,
// [tokens][head_dim] floats (quantized windows replaced by their
// reference dequantization). Token order is the prompt's.
struct ExpectedKV {
  std::vector<std::vector<float>> k;  // [head]
  std::vector<std::vector<float>> v;
};

struct PlacedBatch {
  std::array<PagedPoolTable, kNumPrecisions> tables;
  std::vector<ExpectedKV> expected;  // [sequence]
};

// Stores every sequence through one store_prefill call (rows concatenated,
// FP16 rows in shuffled slots, block ids and page-list orders shuffled) and
// builds the layer's page tables.
template <Float16Element T>
PlacedBatch place_batch(TestArena& arena, const std::vector<BasicSequenceData<T>>& seqs) {
  const BlockFormat f = arena.format(Precision::FP16);
  const std::int32_t S = f.block_size;
  const std::int32_t H = f.num_kv_heads;
  const std::int32_t D = f.head_dim;
  const std::size_t row = static_cast<std::size_t>(H) * D;
  PlacedBatch placed;
  for (auto& table : placed.tables) table.indptr.push_back(0);
  StoreMapping mapping;
  std::vector<T> k_rows;
  std::vector<T> v_rows;
  for (const BasicSequenceData<T>& seq : seqs) {
    const auto first_row = static_cast<std::int32_t>(mapping.fp16_slots.size());
    k_rows.insert(k_rows.end(), seq.k.begin(), seq.k.end());
    v_rows.insert(v_rows.end(), seq.v.begin(), seq.v.end());
    mapping.fp16_slots.resize(mapping.fp16_slots.size() + seq.tokens, -1);
    std::vector<std::int32_t> fp16_rows;
    std::array<std::vector<std::int32_t>, kNumPrecisions> lists;
    for (std::int32_t t = 0; t < seq.tokens; ++t) {
      const std::int32_t w = t / S;
      const Precision p = w < static_cast<std::int32_t>(seq.windows.size()) ? seq.windows[w] : Precision::FP16;
      if (p == Precision::FP16) {
        fp16_rows.push_back(first_row + t);
      } else if (t % S == 0) {
        const std::int32_t id = arena.alloc(p);
        lists[pool_index(p)].push_back(id);
        (p == Precision::INT4 ? mapping.int4_windows : mapping.int2_windows).push_back({id, first_row + t});
      }
    }
    std::shuffle(fp16_rows.begin(), fp16_rows.end(), arena.rng());
    for (std::size_t i = 0; i < fp16_rows.size(); ++i) {
      if (i % S == 0) lists[0].push_back(arena.alloc(Precision::FP16));
      mapping.fp16_slots[fp16_rows[i]] = lists[0].back() * S + static_cast<std::int32_t>(i % S);
    }
    std::shuffle(lists[1].begin(), lists[1].end(), arena.rng());
    std::shuffle(lists[2].begin(), lists[2].end(), arena.rng());
    for (int p = 0; p < kNumPrecisions; ++p) {
      auto& table = placed.tables[p];
      table.indices.insert(table.indices.end(), lists[p].begin(), lists[p].end());
      table.indptr.push_back(static_cast<std::int32_t>(table.indices.size()));
      std::int32_t last = lists[p].empty() ? 0 : S;
      if (p == 0 && !fp16_rows.empty()) last = static_cast<std::int32_t>((fp16_rows.size() - 1) % S) + 1;
      table.last_block_len.push_back(last);
    }

    ExpectedKV expected;
    const std::vector<float> k = widen(seq.k);
    const std::vector<float> v = widen(seq.v);
    for (std::int32_t h = 0; h < H; ++h) {
      std::vector<float> kh(static_cast<std::size_t>(seq.tokens) * D);
      std::vector<float> vh(kh.size());
      for (std::int32_t t = 0; t < seq.tokens; ++t) {
        std::copy_n(&k[t * row + h * D], D, &kh[static_cast<std::size_t>(t) * D]);
        std::copy_n(&v[t * row + h * D], D, &vh[static_cast<std::size_t>(t) * D]);
      }
      for (std::size_t w = 0; w < seq.windows.size(); ++w) {
        if (seq.windows[w] == Precision::FP16) continue;
        const std::size_t at = w * S * row + h * D;
        const auto kq = reference_dequant_k(&k[at], row, S, D, seq.windows[w], f.dtype);
        const auto vq = reference_dequant_v(&v[at], row, S, D, seq.windows[w], f.dtype);
        std::copy(kq.begin(), kq.end(), kh.begin() + w * S * D);
        std::copy(vq.begin(), vq.end(), vh.begin() + w * S * D);
      }
      expected.k.push_back(std::move(kh));
      expected.v.push_back(std::move(vh));
    }
    placed.expected.push_back(std::move(expected));
  }
  cpu::store_prefill(k_rows, v_rows, mapping, arena.views());
  return placed;
}

// Softmax attention of one query over n rows, entirely in double.
struct DenseState {
  std::vector<double> out;
  double lse = -std::numeric_limits<double>::infinity();
};
inline DenseState dense_attention(const double* q, const float* k, const float* v, std::size_t n, int dim,
                                  double sm_scale) {
  DenseState state;
  state.out.assign(dim, 0.0);
  if (n == 0) return state;
  std::vector<double> scores(n);
  for (std::size_t t = 0; t < n; ++t) {
    double dot = 0.0;
    for (int c = 0; c < dim; ++c) dot += q[c] * static_cast<double>(k[t * dim + c]);
    scores[t] = dot * sm_scale;
  }
  const double max = *std::max_element(scores.begin(), scores.end());
  double sum = 0.0;
  for (std::size_t t = 0; t < n; ++t) {
    const double w = std::exp(scores[t] - max);
    sum += w;
    for (int c = 0; c < dim; ++c) state.out[c] += w * static_cast<double>(v[t * dim + c]);
  }
  for (double& o : state.out) o /= sum;
  state.lse = max + std::log(sum);
  return state;
}

// ||a - b|| / ||b||.
inline double relative_error(const float* a, const std::vector<double>& b) {
  double num = 0.0;
  double den = 0.0;
  for (std::size_t c = 0; c < b.size(); ++c) {
    num += (a[c] - b[c]) * (a[c] - b[c]);
    den += b[c] * b[c];
  }
  return std::sqrt(num / den);
}

// The data of testing.md's quality bars (item 5): Gaussian K with a few
// outlier channels (sd 10, mean +-5), Gaussian V, D = 128, 2,048 tokens, one
// KV head, 32-token windows.
struct QualityData {
  static constexpr int kDim = 128;
  static constexpr int kTokens = 2048;
  static constexpr int kBlock = 32;
  static constexpr std::array<int, 4> kOutliers = {3, 40, 77, 101};
  std::vector<Half> k, v;  // [token][channel]
};

inline QualityData quality_data() {
  QualityData data;
  Rng rng(2024);
  std::vector<double> mean(QualityData::kDim, 0.0), sd(QualityData::kDim, 1.0);
  for (std::size_t i = 0; i < QualityData::kOutliers.size(); ++i) {
    mean[QualityData::kOutliers[i]] = i % 2 ? -5.0 : 5.0;
    sd[QualityData::kOutliers[i]] = 10.0;
  }
  data.k.resize(QualityData::kTokens * QualityData::kDim);
  data.v.resize(data.k.size());
  for (int t = 0; t < QualityData::kTokens; ++t) {
    for (int c = 0; c < QualityData::kDim; ++c) {
      data.k[t * QualityData::kDim + c] = float_to_half(static_cast<float>(normal(rng, mean[c], sd[c])));
      data.v[t * QualityData::kDim + c] = float_to_half(static_cast<float>(normal(rng)));
    }
  }
  return data;
}

// Asserts that a call throws IndexOutOfRange whose message names `name`.
#define MIXKV_EXPECT_OUT_OF_RANGE(call, name)                              \
  do {                                                                     \
    try {                                                                  \
      call;                                                                \
      ADD_FAILURE() << #call << " did not throw";                          \
    } catch (const ::mixkv::IndexOutOfRange& error) {                      \
      EXPECT_NE(std::string(error.what()).find(name), std::string::npos)   \
          << "message does not name '" << (name) << "': " << error.what(); \
    }                                                                      \
  } while (0)

// Asserts that a call throws InvalidArgument whose message names `name`.
#define MIXKV_EXPECT_INVALID(call, name)                                   \
  do {                                                                     \
    try {                                                                  \
      call;                                                                \
      ADD_FAILURE() << #call << " did not throw";                          \
    } catch (const ::mixkv::InvalidArgument& error) {                      \
      EXPECT_NE(std::string(error.what()).find(name), std::string::npos)   \
          << "message does not name '" << (name) << "': " << error.what(); \
    }                                                                      \
  } while (0)

// Decode attention outputs of a batch: out [batch][q_heads][head_dim], lse [batch][q_heads].
struct DecodeResult {
  std::vector<float> out;
  std::vector<float> lse;
};

// The CPU reference over one placed batch; outputs start as NaN so an
// element the reference failed to write cannot pass.
template <Float16Element T>
DecodeResult cpu_decode(const TestArena& arena, const PlacedBatch& placed, const std::vector<T>& q,
                        std::int32_t num_q_heads, float sm_scale) {
  const std::size_t batch = placed.tables[0].indptr.size() - 1;
  const std::int32_t dim = arena.format(Precision::FP16).head_dim;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  DecodeResult r{std::vector<float>(batch * num_q_heads * dim, nan), std::vector<float>(batch * num_q_heads, nan)};
  cpu::DecodeAttentionArgs args;
  args.q = q;
  args.num_q_heads = num_q_heads;
  args.sm_scale = sm_scale;
  args.tables = &placed.tables;
  args.pools = arena.views();
  args.out = r.out;
  args.lse = r.lse;
  cpu::decode_attention(args);
  return r;
}

}  // namespace mixkv::test
