#include "mixkv/cpu/extend_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "detail.h"
#include "simd.h"
#include "thread_pool.h"

#if MIXKV_HAVE_AVX2_PATH
#include <cpuid.h>
#endif

namespace mixkv::cpu {
namespace {

using detail::invalid;

constexpr std::string_view kFn = "extend_attention";

std::string table_name(Precision p) { return "tables[" + std::string(to_string(p)) + "]"; }

// CSR well-formedness, the batch of qo_indptr, block ids in
// [0, pool.num_blocks), and last_block_len: FP16 lists end in a block
// holding 1..block_size tokens; quantized blocks are always full (the rules
// of decode_attention's tables).
void check_table(const PagedPoolTable& table, Precision p, std::size_t batch, const PoolView& pool) {
  const std::int32_t block_size = pool.format.block_size;
  const std::string name = table_name(p);
  if (table.indptr.size() != batch + 1) {
    invalid(kFn, ": ", name, ".indptr has ", table.indptr.size(), " entries: expected batch + 1 = ", batch + 1,
            " (batch from qo_indptr)");
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

// qo_indptr[0] = 0 and strictly increasing: every sequence brings a row.
void check_qo_indptr(std::span<const std::int32_t> qo_indptr) {
  if (qo_indptr.empty()) invalid(kFn, ": qo_indptr is empty: expected batch + 1 entries");
  if (qo_indptr[0] != 0) invalid(kFn, ": qo_indptr[0] = ", qo_indptr[0], ": expected 0");
  for (std::size_t i = 1; i < qo_indptr.size(); ++i) {
    if (qo_indptr[i] <= qo_indptr[i - 1]) {
      invalid(kFn, ": qo_indptr[", i, "] = ", qo_indptr[i], ": expected > qo_indptr[", i - 1, "] = ", qo_indptr[i - 1],
              " (sequence ", i - 1, " brings at least one row)");
    }
  }
}

// Outputs are written while q, k, v and qo_indptr are still read, and out
// and lse unit by unit: any overlap would read or keep elements already
// overwritten.
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

void validate(const ExtendAttentionArgs& args) {
  if (args.tables == nullptr) invalid(kFn, ": tables is null: expected one layer's three pool tables");
  detail::check_pools(kFn, args.pools);
  const BlockFormat& shape = args.pools[pool_index(Precision::FP16)].format;
  const std::int32_t kv_heads = shape.num_kv_heads;
  const std::size_t dim = static_cast<std::size_t>(shape.head_dim);

  check_qo_indptr(args.qo_indptr);
  const std::size_t batch = args.qo_indptr.size() - 1;
  for (Precision p : kAllPrecisions) check_table((*args.tables)[pool_index(p)], p, batch, args.pools[pool_index(p)]);

  if (args.num_q_heads < 1 || args.num_q_heads % kv_heads != 0) {
    invalid(kFn, ": num_q_heads = ", args.num_q_heads, ": expected a positive multiple of num_kv_heads = ", kv_heads);
  }
  if (!std::isfinite(args.sm_scale) || !(args.sm_scale > 0.0f)) {
    invalid(kFn, ": sm_scale = ", args.sm_scale, ": expected a finite value > 0 (usually 1/sqrt(head_dim))");
  }
  for (const auto& [name, values] : {std::pair{"q", args.q}, std::pair{"k", args.k}, std::pair{"v", args.v}}) {
    detail::check_dtype(kFn, name, values.dtype(), shape.dtype, "pools[FP16].format.dtype");
  }
  const std::size_t q_row = static_cast<std::size_t>(args.num_q_heads) * dim;
  const std::size_t kv_row = static_cast<std::size_t>(kv_heads) * dim;
  if (args.q.size() % q_row != 0) {
    invalid(kFn, ": q has ", args.q.size(), " values: expected a multiple of num_q_heads * head_dim = ", q_row);
  }
  const std::size_t rows = args.q.size() / q_row;
  if (static_cast<std::size_t>(args.qo_indptr[batch]) != rows) {
    invalid(kFn, ": qo_indptr[", batch, "] = ", args.qo_indptr[batch], ": expected rows = ", rows,
            " (q.size() / (num_q_heads * head_dim))");
  }
  check_size("k", args.k.size(), rows * kv_row, "rows * num_kv_heads * head_dim");
  check_size("v", args.v.size(), rows * kv_row, "rows * num_kv_heads * head_dim");
  check_size("out", args.out.size(), rows * q_row, "rows * num_q_heads * head_dim");
  check_size("lse", args.lse.size(), rows * static_cast<std::size_t>(args.num_q_heads), "rows * num_q_heads");

  const std::pair<std::string_view, std::span<const std::byte>> inputs[] = {
      {"q", args.q.as_bytes()},
      {"k", args.k.as_bytes()},
      {"v", args.v.as_bytes()},
      {"qo_indptr", std::as_bytes(args.qo_indptr)}};
  check_disjoint("out", std::as_bytes(args.out), "lse", std::as_bytes(args.lse));
  for (const auto& [name, bytes] : inputs) {
    check_disjoint("out", std::as_bytes(args.out), name, bytes);
    check_disjoint("lse", std::as_bytes(args.lse), name, bytes);
  }
  detail::check_finite(kFn, "q", args.q);
  detail::check_finite(kFn, "k", args.k);
  detail::check_finite(kFn, "v", args.v);
}

}  // namespace

namespace detail {
namespace {

// The key/value sources of a (sequence, KV head), in merge order: the three
// pools' page lists, then the new rows.
constexpr std::int32_t kNewRows = kNumPrecisions;

// Each source is cut into chunks of about this many tokens (whole blocks;
// the new rows in blocks of block_size): a chunk's state starts empty and
// the chunks merge in double in a fixed order, so that a long context can
// be spread over threads with the same result as on one.
constexpr std::int32_t kChunkTokens = 256;

// Query rows x heads of a unit: about this many queries, so that each
// dequantized block is applied to enough of them to repay its decoding.
constexpr std::int32_t kTileQueries = 128;

// Chunk states kept at once when chunks of a unit run on different threads;
// past it, each thread runs whole units and keeps two states.
constexpr std::size_t kMaxStateBytes = std::size_t{256} << 20;

struct Job {
  int dim = 0, block = 0, group = 0, q_heads = 0, kv_heads = 0;
  float sm_scale = 0.0f;
  DType dtype = DType::F16;  // the cache's 16-bit type: q, k, v and FP16 rows
  int score_stride = 0;      // floats per query of a tile's scores
  const ExtendAttentionArgs* args = nullptr;
};

// Rows [row0, row0 + rows) of sequence b (seq_rows rows in all) with the
// query heads of KV head g; its items are [first_item, last_item).
struct Unit {
  std::int32_t b = 0, g = 0, row0 = 0, rows = 0, seq_rows = 0;
  std::size_t first_item = 0, last_item = 0;
};

// Blocks [first, last) of one source: positions in tables[source].indices,
// or blocks of block_size new rows (kNewRows).
struct Item {
  std::int32_t unit = 0, source = 0, first = 0, last = 0;
};

// Per query: running max (a float value), sum of weights, and sum_t w_t v_t.
struct ItemState {
  double* m;
  double* s;
  double* acc;
};

struct Scratch {
  std::vector<float> q, k, v, scores;
  Scratch(const Job& job, int max_queries) {
    const std::size_t block = static_cast<std::size_t>(job.block) * job.dim;
    q.resize(static_cast<std::size_t>(max_queries) * job.dim);
    k.resize(block);
    v.resize(block);
    scores.resize(4 * static_cast<std::size_t>(job.score_stride));
  }
};

}  // namespace

// The flavour's vector type and operations, declared in the flavour's
// namespace so that the kernel's unqualified names find them first.
#define MIXKV_USE_SIMD(ns)  \
  using ns::F8;             \
  using ns::zero;           \
  using ns::set1;           \
  using ns::load;           \
  using ns::store;          \
  using ns::load_halves;    \
  using ns::load16;         \
  using ns::add;            \
  using ns::sub;            \
  using ns::mul;            \
  using ns::max;            \
  using ns::fma;            \
  using ns::hsum;           \
  using ns::hsum8;          \
  using ns::add_to_doubles; \
  using ns::exp_nonpositive

namespace extend_portable {
MIXKV_USE_SIMD(simd::portable);
#define MIXKV_KERNEL
#include "extend_compute.inc"
#undef MIXKV_KERNEL
}  // namespace extend_portable

#if MIXKV_HAVE_AVX2_PATH
namespace extend_avx2 {
MIXKV_USE_SIMD(simd::avx2);
#define MIXKV_KERNEL MIXKV_AVX2_TARGET
#include "extend_compute.inc"
#undef MIXKV_KERNEL
}  // namespace extend_avx2
#endif
#undef MIXKV_USE_SIMD

namespace {

using RunItem = void (*)(const Job&, const Unit&, const Item&, Scratch&, ItemState);

// AVX2 + FMA + F16C when the CPU has all three, else the portable code (the
// same results); MIXKV_CPU_SIMD=portable forces the latter, as for decode.
RunItem select_kernel() {
#if MIXKV_HAVE_AVX2_PATH
  const char* forced = std::getenv("MIXKV_CPU_SIMD");
  const bool portable_only = forced != nullptr && std::string_view(forced) == "portable";
  __builtin_cpu_init();
  // F16C from CPUID (leaf 1, ECX bit 29): clang 14's __builtin_cpu_supports
  // does not know it.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  if (!portable_only && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return &extend_avx2::run_item;
  }
#endif
  return &extend_portable::run_item;
}

int round_up(int x, int m) { return (x + m - 1) / m * m; }

ItemState state_at(double* base, int queries) {
  return {base, base + queries, base + 2 * static_cast<std::size_t>(queries)};
}

std::size_t state_doubles(int queries, int dim) { return static_cast<std::size_t>(queries) * (2 + dim); }

// run <- the exact merge of run and an item's state, per query, in double.
// An empty item (a query that sees none of its tokens: m = -inf) leaves run
// as it is, and an empty run takes the item as it is, so skipping a chunk
// nobody sees and merging its empty state give the same bits.
void merge_into(ItemState run, ItemState item, int queries, int dim) {
  constexpr double kEmpty = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < queries; ++i) {
    if (item.m[i] == kEmpty) continue;
    double* acc = run.acc + static_cast<std::size_t>(i) * dim;
    const double* add = item.acc + static_cast<std::size_t>(i) * dim;
    if (run.m[i] == kEmpty) {
      run.m[i] = item.m[i];
      run.s[i] = item.s[i];
      std::copy(add, add + dim, acc);
      continue;
    }
    const double m = std::max(run.m[i], item.m[i]);
    const double a = std::exp(run.m[i] - m);
    const double b = std::exp(item.m[i] - m);
    run.m[i] = m;
    run.s[i] = run.s[i] * a + item.s[i] * b;
    for (int c = 0; c < dim; ++c) acc[c] = acc[c] * a + add[c] * b;
  }
}

void clear(ItemState state, int queries, int dim) {
  std::fill(state.m, state.m + queries, -std::numeric_limits<double>::infinity());
  std::fill(state.s, state.s + queries, 0.0);
  std::fill(state.acc, state.acc + static_cast<std::size_t>(queries) * dim, 0.0);
}

// Writes a unit's outputs and LSEs from its merged state. Every query has
// seen at least its own row, so s >= 1.
void finish(const Job& job, const Unit& unit, ItemState run) {
  const ExtendAttentionArgs& args = *job.args;
  for (int r = 0; r < unit.rows; ++r) {
    const std::size_t row = static_cast<std::size_t>(args.qo_indptr[unit.b]) + unit.row0 + r;
    for (int h = 0; h < job.group; ++h) {
      const int i = r * job.group + h;
      const std::size_t at = row * job.q_heads + static_cast<std::size_t>(unit.g) * job.group + h;
      const double* acc = run.acc + static_cast<std::size_t>(i) * job.dim;
      float* out = &args.out[at * job.dim];
      for (int c = 0; c < job.dim; ++c) out[c] = static_cast<float>(acc[c] / run.s[i]);
      args.lse[at] = static_cast<float>(run.m[i] + std::log(run.s[i]));
    }
  }
}

void extend_compute(const ExtendAttentionArgs& args) {
  const BlockFormat& shape = args.pools[pool_index(Precision::FP16)].format;
  const auto& tables = *args.tables;
  const std::size_t batch = args.qo_indptr.size() - 1;
  Job job;
  job.dim = shape.head_dim;
  job.block = shape.block_size;
  job.kv_heads = shape.num_kv_heads;
  job.dtype = shape.dtype;
  job.group = args.num_q_heads / shape.num_kv_heads;
  job.q_heads = args.num_q_heads;
  job.sm_scale = args.sm_scale;
  job.score_stride = round_up(job.block, 8);
  job.args = &args;

  // Units and their items in merge order. The chunks of a source depend
  // only on the sequence; a unit leaves out the new-row blocks that start
  // after its last row (nothing in them is visible to it).
  const std::int32_t chunk_blocks = std::max(1, kChunkTokens / job.block);
  const std::int32_t tile_rows = std::max(1, kTileQueries / job.group);
  std::vector<Unit> units;
  std::vector<Item> items;
  double work = 0.0;  // query-tokens
  for (std::size_t b = 0; b < batch; ++b) {
    const std::int32_t seq_rows = args.qo_indptr[b + 1] - args.qo_indptr[b];
    for (std::int32_t g = 0; g < job.kv_heads; ++g) {
      for (std::int32_t row0 = 0; row0 < seq_rows; row0 += tile_rows) {
        Unit unit{static_cast<std::int32_t>(b), g, row0, std::min(tile_rows, seq_rows - row0), seq_rows};
        unit.first_item = items.size();
        const auto u = static_cast<std::int32_t>(units.size());
        for (std::int32_t p = 0; p < kNumPrecisions; ++p) {
          const PagedPoolTable& table = tables[p];
          for (std::int32_t j = table.indptr[b]; j < table.indptr[b + 1]; j += chunk_blocks) {
            items.push_back({u, p, j, std::min(j + chunk_blocks, table.indptr[b + 1])});
          }
        }
        const std::int32_t new_blocks = (row0 + unit.rows + job.block - 1) / job.block;
        for (std::int32_t j = 0; j < new_blocks; j += chunk_blocks) {
          items.push_back({u, kNewRows, j, std::min(j + chunk_blocks, new_blocks)});
        }
        unit.last_item = items.size();
        for (std::size_t i = unit.first_item; i < unit.last_item; ++i) {
          work += static_cast<double>(items[i].last - items[i].first) * job.block * unit.rows * job.group;
        }
        units.push_back(unit);
      }
    }
  }
  const int max_queries = tile_rows * job.group;
  const RunItem run_item = select_kernel();

  // Threads only where the layer is large enough to repay waking them (as
  // decode: ~64 blocks of 32 tokens x 128 channels for 4 queries each).
  int threads = args.num_threads > 0 ? args.num_threads : default_num_threads();
  const double min_work_per_thread = 64.0 * 32 * 4;
  threads = static_cast<int>(std::clamp(work * job.dim / 128 / min_work_per_thread, 1.0, static_cast<double>(threads)));

  // Enough units: a task is a unit (its items one after another, each merged
  // into the unit's state as it ends). Else items run on any thread, their
  // states kept, then the units merge them in the same order: the same
  // arithmetic either way.
  std::size_t stored = 0;
  std::vector<std::size_t> offset(items.size() + 1, 0);
  for (std::size_t i = 0; i < items.size(); ++i) {
    offset[i] = stored;
    stored += state_doubles(units[items[i].unit].rows * job.group, job.dim);
  }
  offset[items.size()] = stored;
  const bool by_unit =
      units.size() >= static_cast<std::size_t>(4 * threads) || stored * sizeof(double) > kMaxStateBytes;
  const std::size_t unit_doubles = state_doubles(max_queries, job.dim);
  std::atomic<std::size_t> next{0};
  if (by_unit) {
    run_parallel(threads, [&] {
      Scratch scratch(job, max_queries);
      std::vector<double> run_buffer(unit_doubles), item_buffer(unit_doubles);
      for (std::size_t u = next++; u < units.size(); u = next++) {
        const Unit& unit = units[u];
        const int queries = unit.rows * job.group;
        const ItemState run = state_at(run_buffer.data(), queries);
        const ItemState item = state_at(item_buffer.data(), queries);
        clear(run, queries, job.dim);
        for (std::size_t i = unit.first_item; i < unit.last_item; ++i) {
          run_item(job, unit, items[i], scratch, item);
          merge_into(run, item, queries, job.dim);
        }
        finish(job, unit, run);
      }
    });
    return;
  }
  std::vector<double> states(stored);
  run_parallel(threads, [&] {
    Scratch scratch(job, max_queries);
    for (std::size_t i = next++; i < items.size(); i = next++) {
      const Unit& unit = units[items[i].unit];
      run_item(job, unit, items[i], scratch, state_at(&states[offset[i]], unit.rows * job.group));
    }
  });
  next = 0;
  run_parallel(threads, [&] {
    std::vector<double> run_buffer(unit_doubles);
    for (std::size_t u = next++; u < units.size(); u = next++) {
      const Unit& unit = units[u];
      const int queries = unit.rows * job.group;
      const ItemState run = state_at(run_buffer.data(), queries);
      clear(run, queries, job.dim);
      for (std::size_t i = unit.first_item; i < unit.last_item; ++i) {
        merge_into(run, state_at(&states[offset[i]], queries), queries, job.dim);
      }
      finish(job, unit, run);
    }
  });
}

}  // namespace
}  // namespace detail

void extend_attention(const ExtendAttentionArgs& args) {
  validate(args);
  detail::extend_compute(args);
}

}  // namespace mixkv::cpu
