#pragma once
// A step's new rows for the extend tests, and the two references they are
// checked against: float64 attention over the placed blocks' expected
// values, and cpu::extend_attention over the same blocks. Templated on the
// cache's 16-bit type (FP16 and BF16 tests share them).
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda_test_util.h"
#include "mixkv/cpu/extend_attention.h"

namespace mixkv::test {

// A step's new rows: qo_indptr, q [rows][q_heads][dim], k and v [rows][kv_heads][dim].
template <Float16Element T>
struct BasicNewRows {
  std::vector<std::int32_t> indptr;
  std::vector<T> q, k, v;
  std::int32_t rows() const { return indptr.back(); }
};

template <Float16Element T>
BasicNewRows<T> make_new_rows(const std::vector<int>& chunks, int q_heads, int kv_heads, int dim, Rng& rng) {
  BasicNewRows<T> n;
  n.indptr.push_back(0);
  for (int c : chunks) n.indptr.push_back(n.indptr.back() + c);
  n.q = random_values<T>(rng, static_cast<std::size_t>(n.rows()) * q_heads * dim);
  n.k = random_values<T>(rng, static_cast<std::size_t>(n.rows()) * kv_heads * dim);
  n.v = random_values<T>(rng, n.k.size());
  return n;
}

// Float64 attention of every new row over its sequence's cached tokens
// (prompt order, quantized windows as their reference dequantization) and
// its causal prefix of new rows.
template <Float16Element T>
DecodeResult dense_extend(const PlacedBatch& placed, int kv_heads, int dim, int q_heads, float scale,
                          const BasicNewRows<T>& rows) {
  const int kvh = kv_heads, qh = q_heads, group = qh / kvh;
  DecodeResult r{std::vector<float>(static_cast<std::size_t>(rows.rows()) * qh * dim),
                 std::vector<float>(static_cast<std::size_t>(rows.rows()) * qh)};
  const std::vector<float> k_new = widen(rows.k), v_new = widen(rows.v), q = widen(rows.q);
  for (std::size_t b = 0; b + 1 < rows.indptr.size(); ++b) {
    const int n = rows.indptr[b + 1] - rows.indptr[b];
    for (int h = 0; h < kvh; ++h) {
      std::vector<float> keys = placed.expected[b].k[h], values = placed.expected[b].v[h];
      const std::size_t cached = keys.size() / dim;
      for (int j = 0; j < n; ++j) {
        const std::size_t at = (static_cast<std::size_t>(rows.indptr[b] + j) * kvh + h) * dim;
        keys.insert(keys.end(), k_new.begin() + at, k_new.begin() + at + dim);
        values.insert(values.end(), v_new.begin() + at, v_new.begin() + at + dim);
      }
      for (int j = 0; j < n; ++j) {
        for (int g = 0; g < group; ++g) {
          const std::size_t row = static_cast<std::size_t>(rows.indptr[b] + j) * qh + h * group + g;
          const std::vector<double> qd(q.begin() + row * dim, q.begin() + (row + 1) * dim);
          const DenseState s = dense_attention(qd.data(), keys.data(), values.data(), cached + j + 1, dim, scale);
          for (int c = 0; c < dim; ++c) r.out[row * dim + c] = static_cast<float>(s.out[c]);
          r.lse[row] = static_cast<float>(s.lse);
        }
      }
    }
  }
  return r;
}

// cpu::extend_attention over the same blocks; outputs start as NaN.
template <Float16Element T>
DecodeResult cpu_extend(const TestArena& arena, const PlacedBatch& placed, int q_heads, float scale,
                        const BasicNewRows<T>& rows) {
  const int dim = arena.format(Precision::FP16).head_dim;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  DecodeResult r{std::vector<float>(static_cast<std::size_t>(rows.rows()) * q_heads * dim, nan),
                 std::vector<float>(static_cast<std::size_t>(rows.rows()) * q_heads, nan)};
  cpu::ExtendAttentionArgs args;
  args.qo_indptr = rows.indptr;
  args.q = rows.q;
  args.k = rows.k;
  args.v = rows.v;
  args.num_q_heads = q_heads;
  args.sm_scale = scale;
  args.tables = &placed.tables;
  args.pools = arena.views();
  args.out = r.out;
  args.lse = r.lse;
  cpu::extend_attention(args);
  return r;
}

}  // namespace mixkv::test
