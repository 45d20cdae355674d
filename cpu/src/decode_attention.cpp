#include "mixkv/cpu/decode_attention.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "decode_compute.h"
#include "detail.h"

namespace mixkv::cpu {
namespace {

using detail::invalid;

constexpr std::string_view kFn = "decode_attention";

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
      invalid(kFn, ": ", name, ".indptr[", i + 1, "] = ", table.indptr[i + 1], ": expected >= indptr[", i,
              "] = ", table.indptr[i]);
    }
  }
  if (static_cast<std::size_t>(table.indptr[batch]) != table.indices.size()) {
    invalid(kFn, ": ", name, ".indptr[", batch, "] = ", table.indptr[batch],
            ": expected indices.size() = ", table.indices.size());
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
      if (len != 0)
        invalid(kFn, ": ", name, ".last_block_len[", i, "] = ", len, ": expected 0 (sequence ", i, " has no blocks)");
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

}  // namespace

void decode_attention(const DecodeAttentionArgs& args) {
  if (args.tables == nullptr) invalid(kFn, ": tables is null: expected one layer's three pool tables");
  detail::check_pools(kFn, args.pools);
  const BlockFormat& shape = args.pools[pool_index(Precision::FP16)].format;
  const std::int32_t kv_heads = shape.num_kv_heads;
  const std::int32_t dim = shape.head_dim;
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
  detail::check_dtype(kFn, "q", args.q.dtype(), shape.dtype, "pools[FP16].format.dtype");
  check_size("q", args.q.size(), batch * q_heads * dim, "batch * num_q_heads * head_dim");
  check_size("out", args.out.size(), batch * q_heads * dim, "batch * num_q_heads * head_dim");
  check_size("lse", args.lse.size(), batch * q_heads, "batch * num_q_heads");
  check_disjoint("out", std::as_bytes(args.out), "lse", std::as_bytes(args.lse));
  check_disjoint("out", std::as_bytes(args.out), "q", args.q.as_bytes());
  check_disjoint("lse", std::as_bytes(args.lse), "q", args.q.as_bytes());
  detail::check_finite(kFn, "q", args.q);

  detail::decode_compute(args);
}

}  // namespace mixkv::cpu
