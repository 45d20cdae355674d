#include "mixkv/cpu/decode_attention.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "detail.h"

namespace mixkv::cpu {
namespace {

using detail::invalid;

constexpr std::string_view kFn = "decode_attention";
constexpr double kEmpty = -std::numeric_limits<double>::infinity();

std::string table_name(Precision p) { return "tables[" + std::string(to_string(p)) + "]"; }

// CSR well-formedness, the batch size shared by all pools, block ids in
// [0, pool.num_blocks), and last_block_len: FP16 lists end in a block
// holding 1..block_size tokens; quantized blocks are always full.
void check_table(const PagedPoolTable& table, Precision p, std::size_t batch, const PoolView& pool) {
  const std::int32_t block_size = pool.format.block_size;
  const std::string name = table_name(p);
  if (table.indptr.size() != batch + 1) {
    invalid(kFn, ": ", name, ".indptr has ", table.indptr.size(), " entries: expected batch + 1 = ", batch + 1,
            " (batch from tables[FP16].indptr)");
  }
  if (table.indptr[0] != 0) invalid(kFn, ": ", name, ".indptr[0] = ", table.indptr[0], ": expected 0");
  for (std::size_t i = 0; i < batch; ++i) {
    if (table.indptr[i + 1] < table.indptr[i]) {
      invalid(kFn, ": ", name, ".indptr[", i + 1, "] = ", table.indptr[i + 1], ": expected >= indptr[", i, "] = ",
              table.indptr[i]);
    }
  }
  if (static_cast<std::size_t>(table.indptr[batch]) != table.indices.size()) {
    invalid(kFn, ": ", name, ".indptr[", batch, "] = ", table.indptr[batch], ": expected indices.size() = ",
            table.indices.size());
  }
  const std::string pool_name = detail::pool_name(p);
  for (std::size_t j = 0; j < table.indices.size(); ++j) {
    detail::check_block(kFn, table.indices[j], pool, pool_name, name, ".indices[", j, "]");
  }
  if (table.last_block_len.size() != batch) {
    invalid(kFn, ": ", name, ".last_block_len has ", table.last_block_len.size(), " entries: expected batch = ", batch);
  }
  for (std::size_t i = 0; i < batch; ++i) {
    const std::int32_t len = table.last_block_len[i];
    const bool has_blocks = table.indptr[i + 1] > table.indptr[i];
    if (!has_blocks) {
      if (len != 0) invalid(kFn, ": ", name, ".last_block_len[", i, "] = ", len, ": expected 0 (sequence ", i, " has no blocks)");
    } else if (p == Precision::FP16) {
      if (len < 1 || len > block_size) {
        invalid(kFn, ": ", name, ".last_block_len[", i, "] = ", len, ": expected a fill in [1, ", block_size, "]");
      }
    } else if (len != block_size) {
      invalid(kFn, ": ", name, ".last_block_len[", i, "] = ", len, ": expected block_size = ", block_size,
              " (quantized blocks are full)");
    }
  }
}

// Outputs are written while q is still read, and out and lse row by row:
// any overlap would read or keep elements already overwritten.
void check_disjoint(std::string_view a_name, std::span<const std::byte> a, std::string_view b_name,
                    std::span<const std::byte> b) {
  if (a.empty() || b.empty()) return;
  const std::less<const std::byte*> before;
  if (before(a.data(), b.data() + b.size()) && before(b.data(), a.data() + a.size())) {
    invalid(kFn, ": ", a_name, " overlaps ", b_name, ": expected disjoint memory");
  }
}

void check_size(std::string_view name, std::size_t size, std::size_t expected, std::string_view expected_text) {
  if (size != expected) invalid(kFn, ": ", name, " has ", size, " values: expected ", expected_text, " = ", expected);
}

// The two hot loops, compiled for AVX2 as well as the baseline and chosen
// when the program loads (target_clones, x86 only). Both clones do the same
// operations in the same order (four partial sums, one vector of four in the
// AVX2 clone; no fused multiply-add, which "avx2" does not enable), so they
// give the same bits. dim is a multiple of 16 (CacheShape).
#if defined(__x86_64__)
#define MIXKV_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#else
#define MIXKV_AVX2_CLONE
#endif

MIXKV_AVX2_CLONE double dot(const double* q, const float* k, std::int32_t dim) {
  double d0 = 0.0, d1 = 0.0, d2 = 0.0, d3 = 0.0;
  for (std::int32_t c = 0; c < dim; c += 4) {
    d0 += q[c] * static_cast<double>(k[c]);
    d1 += q[c + 1] * static_cast<double>(k[c + 1]);
    d2 += q[c + 2] * static_cast<double>(k[c + 2]);
    d3 += q[c + 3] * static_cast<double>(k[c + 3]);
  }
  return (d0 + d1) + (d2 + d3);
}

MIXKV_AVX2_CLONE void add_scaled(double* acc, double w, const float* v, std::int32_t dim) {
  for (std::int32_t c = 0; c < dim; ++c) acc[c] += w * static_cast<double>(v[c]);
}

// Running softmax state of one query head over one pool, in double.
struct PartialState {
  double max = kEmpty;
  double sum = 0.0;
  std::vector<double> acc;
};

}  // namespace

void decode_attention(const DecodeAttentionArgs& args) {
  if (args.tables == nullptr) invalid(kFn, ": tables is null: expected one layer's three pool tables");
  detail::check_pools(kFn, args.pools);
  const BlockFormat& shape = args.pools[pool_index(Precision::FP16)].format;
  const std::int32_t kv_heads = shape.num_kv_heads;
  const std::int32_t dim = shape.head_dim;
  const std::int32_t block_size = shape.block_size;
  const auto& tables = *args.tables;

  if (tables[0].indptr.empty()) invalid(kFn, ": tables[FP16].indptr is empty: expected batch + 1 entries");
  const std::size_t batch = tables[0].indptr.size() - 1;
  for (Precision p : kAllPrecisions) check_table(tables[pool_index(p)], p, batch, args.pools[pool_index(p)]);

  if (args.num_q_heads < 1 || args.num_q_heads % kv_heads != 0) {
    invalid(kFn, ": num_q_heads = ", args.num_q_heads, ": expected a positive multiple of num_kv_heads = ", kv_heads);
  }
  if (!std::isfinite(args.sm_scale) || !(args.sm_scale > 0.0f)) {
    invalid(kFn, ": sm_scale = ", args.sm_scale, ": expected a finite value > 0 (usually 1/sqrt(head_dim))");
  }
  const std::size_t q_heads = static_cast<std::size_t>(args.num_q_heads);
  check_size("q", args.q.size(), batch * q_heads * dim, "batch * num_q_heads * head_dim");
  check_size("out", args.out.size(), batch * q_heads * dim, "batch * num_q_heads * head_dim");
  check_size("lse", args.lse.size(), batch * q_heads, "batch * num_q_heads");
  check_disjoint("out", std::as_bytes(args.out), "lse", std::as_bytes(args.lse));
  check_disjoint("out", std::as_bytes(args.out), "q", std::as_bytes(args.q));
  check_disjoint("lse", std::as_bytes(args.lse), "q", std::as_bytes(args.q));
  detail::check_finite(kFn, "q", args.q);

  const std::int32_t group = args.num_q_heads / kv_heads;
  const std::size_t head_values = static_cast<std::size_t>(block_size) * dim;
  std::vector<float> k(head_values);
  std::vector<float> v(head_values);
  std::vector<double> q(static_cast<std::size_t>(group) * dim);
  std::vector<double> scores(static_cast<std::size_t>(group) * block_size);  // [head][token]
  std::vector<PartialState> partial(group);
  std::vector<double> merged_out(static_cast<std::size_t>(group) * dim);
  std::vector<double> merged_lse(group);
  std::vector<double> pool_out(dim);

  for (std::size_t b = 0; b < batch; ++b) {
    for (std::int32_t g = 0; g < kv_heads; ++g) {
      // Query heads g * group .. g * group + group - 1 read KV head g.
      const std::size_t first_q = b * q_heads + static_cast<std::size_t>(g) * group;
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = half_to_float(args.q[first_q * dim + i]);
      std::fill(merged_out.begin(), merged_out.end(), 0.0);
      std::fill(merged_lse.begin(), merged_lse.end(), kEmpty);

      for (Precision p : kAllPrecisions) {
        const PagedPoolTable& table = tables[pool_index(p)];
        const PoolView& pool = args.pools[pool_index(p)];
        for (PartialState& s : partial) {
          s.max = kEmpty;
          s.sum = 0.0;
          s.acc.assign(dim, 0.0);
        }

        for (std::int32_t j = table.indptr[b]; j < table.indptr[b + 1]; ++j) {
          const std::int32_t tokens = j + 1 == table.indptr[b + 1] ? table.last_block_len[b] : block_size;
          const std::byte* head = pool.block(table.indices[j]) + pool.format.head_offset(g);
          detail::read_head_unchecked(pool.format, head, k.data(), v.data());
          for (std::int32_t t = 0; t < tokens; ++t) {
            const float* kt = &k[static_cast<std::size_t>(t) * dim];
            for (std::int32_t h = 0; h < group; ++h) {
              scores[static_cast<std::size_t>(h) * block_size + t] =
                  dot(&q[static_cast<std::size_t>(h) * dim], kt, dim) * args.sm_scale;
            }
          }
          // Online softmax per head: rescale what was accumulated to the new max.
          for (std::int32_t h = 0; h < group; ++h) {
            PartialState& s = partial[h];
            double* sh = &scores[static_cast<std::size_t>(h) * block_size];
            double block_max = kEmpty;
            for (std::int32_t t = 0; t < tokens; ++t) block_max = std::max(block_max, sh[t]);
            const double new_max = std::max(s.max, block_max);
            const double rescale = std::exp(s.max - new_max);  // exp(-inf) = 0 on the first block
            s.sum *= rescale;
            for (double& a : s.acc) a *= rescale;
            for (std::int32_t t = 0; t < tokens; ++t) {
              sh[t] = std::exp(sh[t] - new_max);  // the token's weight from here on
              s.sum += sh[t];
            }
            s.max = new_max;
          }
          for (std::int32_t t = 0; t < tokens; ++t) {
            const float* vt = &v[static_cast<std::size_t>(t) * dim];
            for (std::int32_t h = 0; h < group; ++h) {
              add_scaled(partial[h].acc.data(), scores[static_cast<std::size_t>(h) * block_size + t], vt, dim);
            }
          }
        }

        for (std::int32_t h = 0; h < group; ++h) {
          const PartialState& s = partial[h];
          // A pool without tokens for this sequence is the empty state (the
          // max token of a non-empty pool has weight exactly 1, so sum >= 1).
          const bool empty = s.sum == 0.0;
          for (std::int32_t c = 0; c < dim; ++c) pool_out[c] = empty ? 0.0 : s.acc[c] / s.sum;
          const double pool_lse = empty ? kEmpty : s.max + std::log(s.sum);
          double* out_h = &merged_out[static_cast<std::size_t>(h) * dim];
          detail::merge_state(merged_lse[h], out_h, pool_lse, pool_out.data(), dim, out_h, merged_lse[h]);
        }
      }

      for (std::int32_t h = 0; h < group; ++h) {
        const std::size_t at = first_q + h;
        args.lse[at] = static_cast<float>(merged_lse[h]);
        for (std::int32_t c = 0; c < dim; ++c) {
          args.out[at * dim + c] = static_cast<float>(merged_out[static_cast<std::size_t>(h) * dim + c]);
        }
      }
    }
  }
}

}  // namespace mixkv::cpu
