#include "decode_compute.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "simd.h"
#include "thread_pool.h"

#if MIXKV_HAVE_AVX2_PATH
#include <cpuid.h>
#endif

namespace mixkv::cpu::detail {
namespace {

// Where a quantized format's codes land in the kernel's vectors: 8 code
// bytes become CPB (codes per byte) vectors, vector j holding the codes at
// shift j * bits of the 8 bytes. Identity tables for FP16.
struct QuantFormat {
  int cpb = 1;
  std::int32_t offset = 0;  // codes are centred: code - offset
  int k_chunks = 0;         // 8-byte chunks of one channel's K codes
  int v_chunks = 0;         // 8-byte chunks of one token's V codes
  std::size_t v_token_bytes = 0;
  std::vector<int> k_scale_at, k_min_at;  // channel -> index among the K parameter halves
  std::vector<int> token_pos;             // token -> index in the K partial sums
  std::vector<int> v_pos;                 // channel -> index in the V accumulator
};

struct Job {
  int dim = 0, block = 0, group = 0, q_heads = 0;
  float sm_scale = 0.0f;
  int score_stride = 0;          // floats per head: scores, weights
  int score_stride_q = 0;        // floats per head: K partial sums in code order
  int acc_stride = 0;            // floats per head: value accumulator
  const std::byte* q = nullptr;  // [batch][q_heads][dim] values of `dtype`
  DType dtype = DType::F16;      // the cache's 16-bit type: q, FP16 rows, (scale, min)
  const std::array<PagedPoolTable, kNumPrecisions>* tables = nullptr;
  PoolViews pools{};
  QuantFormat quant[kNumPrecisions];
};

// Blocks [first, last) of one pool's list for sequence b, KV head g.
struct ChunkItem {
  std::int32_t b = 0, g = 0, pool = 0, first = 0, last = 0;
};

// A chunk's softmax state per query head of the group: running max (a
// float), sum of weights, and sum_t w_t v_t as the centre part (minacc, one
// number) plus the per-channel part (acc, in the pool's v_pos order). Each
// block's sums are float32 and are added here in double, so that rounding
// grows with a block's 16-256 tokens, not with the chunk's.
struct ChunkState {
  double* m;
  double* s;
  double* minacc;
  double* acc;
};

struct Scratch {
  std::vector<float> q, scores, params, scale, centre, qs, bias, partial, ws;
  std::vector<std::uint8_t> codes;
  explicit Scratch(const Job& job) {
    const std::size_t g = static_cast<std::size_t>(job.group);
    const std::size_t longest = static_cast<std::size_t>(std::max(job.dim, job.block));
    q.resize(g * job.dim);
    scores.resize(g * job.score_stride);
    params.resize(2 * longest);
    scale.resize(longest);
    centre.resize(longest);
    qs.resize(g * job.dim);
    bias.resize(g);
    partial.resize(g * job.score_stride_q);
    ws.resize(g * job.score_stride);
    codes.resize(static_cast<std::size_t>(job.dim) * 8);
  }
};
}  // namespace

// The flavour's vector type and operations, declared in the flavour's
// namespace so that the kernel's unqualified names find them first.
#define MIXKV_USE_SIMD(ns)  \
  using ns::F8;             \
  using ns::I8;             \
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
  using ns::load_bytes;     \
  using ns::code_values;    \
  using ns::exp_nonpositive

namespace portable {
MIXKV_USE_SIMD(simd::portable);
#define MIXKV_KERNEL
#define MIXKV_KERNEL_IS_AVX2 0
#include "decode_compute.inc"
#undef MIXKV_KERNEL
#undef MIXKV_KERNEL_IS_AVX2
}  // namespace portable

#if MIXKV_HAVE_AVX2_PATH
namespace avx2 {
MIXKV_USE_SIMD(simd::avx2);
#define MIXKV_KERNEL MIXKV_AVX2_TARGET
#define MIXKV_KERNEL_IS_AVX2 1
#include "decode_compute.inc"
#undef MIXKV_KERNEL
#undef MIXKV_KERNEL_IS_AVX2
}  // namespace avx2
#endif

namespace {

using RunChunk = void (*)(const Job&, const ChunkItem&, Scratch&, ChunkState);

// AVX2 + FMA + F16C when the CPU has all three, else the portable code (the
// same results); MIXKV_CPU_SIMD=portable forces the latter, for testing.
RunChunk select_kernel() {
#if MIXKV_HAVE_AVX2_PATH
  const char* forced = std::getenv("MIXKV_CPU_SIMD");
  const bool portable_only = forced != nullptr && std::string_view(forced) == "portable";
  __builtin_cpu_init();
  // F16C from CPUID (leaf 1, ECX bit 29): clang 14's __builtin_cpu_supports
  // does not know it; avx2 there also checks that the OS saves the registers.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  if (!portable_only && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return &avx2::run_chunk;
  }
#endif
  return &portable::run_chunk;
}

QuantFormat quant_format(const BlockFormat& f) {
  QuantFormat q;
  if (f.precision == Precision::FP16) {
    for (int c = 0; c < f.head_dim; ++c) q.v_pos.push_back(c);
    return q;
  }
  const int bits = f.bits();
  q.cpb = 8 / bits;
  q.offset = 1 << (bits - 1);
  const std::size_t k_bytes = f.k_runs_are_bytes() ? 8 : f.k_channel_bytes();
  q.k_chunks = static_cast<int>((k_bytes + 7) / 8);
  q.v_token_bytes = f.v_token_bytes();
  q.v_chunks = static_cast<int>((q.v_token_bytes + 7) / 8);
  for (int c = 0; c < f.head_dim; ++c) {
    q.k_scale_at.push_back(static_cast<int>((f.k_scale_offset(c) - f.k_params_offset()) / 2));
    q.k_min_at.push_back(static_cast<int>((f.k_min_offset(c) - f.k_params_offset()) / 2));
  }
  // Lane l of vector j of chunk i holds the code of byte 8 i + l at shift j.
  auto pos = [&](int n) {
    const int byte = n / q.cpb;
    return (byte / 8 * q.cpb + n % q.cpb) * 8 + byte % 8;
  };
  for (int t = 0; t < f.block_size; ++t) q.token_pos.push_back(pos(t));
  for (int c = 0; c < f.head_dim; ++c) q.v_pos.push_back(pos(c));
  return q;
}

int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Merges the chunk states [first, last) of one (sequence, KV head) pair in
// double, in their order, and writes the group's outputs and LSEs.
void merge_pair(const Job& job, const std::vector<ChunkItem>& items, std::size_t first, std::size_t last,
                const std::vector<double>& states, std::size_t state_floats, std::size_t b, std::int32_t g,
                const DecodeAttentionArgs& args, std::vector<double>& acc) {
  const int dim = job.dim;
  const int group = job.group;
  for (int h = 0; h < group; ++h) {
    const std::size_t at = (b * static_cast<std::size_t>(job.q_heads) + static_cast<std::size_t>(g) * group + h);
    double max = -std::numeric_limits<double>::infinity();
    for (std::size_t i = first; i < last; ++i) {
      max = std::max(max, states[i * state_floats + h]);
    }
    float* out = &args.out[at * dim];
    if (first == last) {
      std::fill(out, out + dim, 0.0f);
      args.lse[at] = -std::numeric_limits<float>::infinity();
      continue;
    }
    double sum = 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::size_t i = first; i < last; ++i) {
      const double* st = &states[i * state_floats];
      const double e = std::exp(st[h] - max);
      sum += st[group + h] * e;
      const double centre = st[2 * group + h];
      const double* a = st + 3 * group + static_cast<std::size_t>(h) * job.acc_stride;
      const std::vector<int>& pos = job.quant[items[i].pool].v_pos;
      for (int c = 0; c < dim; ++c) acc[c] += (a[pos[c]] + centre) * e;
    }
    for (int c = 0; c < dim; ++c) out[c] = static_cast<float>(acc[c] / sum);
    args.lse[at] = static_cast<float>(max + std::log(sum));
  }
}

}  // namespace

void decode_compute(const DecodeAttentionArgs& args) {
  const auto& tables = *args.tables;
  const BlockFormat& shape = args.pools[pool_index(Precision::FP16)].format;
  const std::size_t batch = tables[0].indptr.size() - 1;
  Job job;
  job.dim = shape.head_dim;
  job.block = shape.block_size;
  job.group = args.num_q_heads / shape.num_kv_heads;
  job.q_heads = args.num_q_heads;
  job.sm_scale = args.sm_scale;
  job.score_stride = round_up(job.block, 8);
  job.acc_stride = round_up(job.dim, 32);
  job.q = args.q.data();
  job.dtype = shape.dtype;
  job.tables = args.tables;
  job.pools = args.pools;
  job.score_stride_q = 8;
  for (Precision p : kAllPrecisions) {
    QuantFormat& q = job.quant[pool_index(p)];
    q = quant_format(args.pools[pool_index(p)].format);
    job.score_stride_q = std::max(job.score_stride_q, q.k_chunks * 8 * q.cpb);
  }

  // Chunks in merge order: sequence, KV head, pool, position in the list.
  const std::int32_t chunk_blocks = std::max(1, kChunkTokens / job.block);
  const std::int32_t kv_heads = shape.num_kv_heads;
  const std::size_t pairs = batch * static_cast<std::size_t>(kv_heads);
  std::vector<ChunkItem> items;
  std::vector<std::size_t> pair_first(pairs + 1, 0);
  double work = 0.0;  // block-heads, for the thread count
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::int32_t g = 0; g < kv_heads; ++g) {
      pair_first[b * kv_heads + g] = items.size();
      for (Precision p : kAllPrecisions) {
        const PagedPoolTable& table = tables[pool_index(p)];
        for (std::int32_t j = table.indptr[b]; j < table.indptr[b + 1]; j += chunk_blocks) {
          items.push_back({static_cast<std::int32_t>(b), g, static_cast<std::int32_t>(pool_index(p)), j,
                           std::min(j + chunk_blocks, table.indptr[b + 1])});
          work += items.back().last - items.back().first;
        }
      }
    }
  }
  pair_first[pairs] = items.size();

  const std::size_t state_floats = static_cast<std::size_t>(job.group) * (3 + job.acc_stride);
  std::vector<double> states(items.size() * state_floats);
  const RunChunk run_chunk = select_kernel();

  // Threads only where the layer is large enough to repay waking them
  // (~64 block-heads of 32 x 128 is ~0.1 ms of one core).
  int threads = args.num_threads > 0 ? args.num_threads : default_num_threads();
  const double unit = static_cast<double>(job.block) * job.dim * args.num_q_heads / kv_heads;
  const double min_work_per_thread = 64.0 * 32 * 128 * 4;
  threads = static_cast<int>(std::clamp(work * unit / min_work_per_thread, 1.0, static_cast<double>(threads)));

  auto chunk_state = [&](std::size_t i) {
    double* st = &states[i * state_floats];
    return ChunkState{st, st + job.group, st + 2 * job.group, st + 3 * job.group};
  };
  // Enough pairs: a task is a pair (its chunks, then its merge); else chunks
  // first, then the merges. The arithmetic is the same either way.
  const bool by_pair = pairs >= static_cast<std::size_t>(4 * threads);
  std::atomic<std::size_t> next{0};
  if (by_pair) {
    run_parallel(threads, [&] {
      Scratch scratch(job);
      std::vector<double> acc(job.dim);
      for (std::size_t pair = next++; pair < pairs; pair = next++) {
        for (std::size_t i = pair_first[pair]; i < pair_first[pair + 1]; ++i) {
          run_chunk(job, items[i], scratch, chunk_state(i));
        }
        merge_pair(job, items, pair_first[pair], pair_first[pair + 1], states, state_floats, pair / kv_heads,
                   static_cast<std::int32_t>(pair % kv_heads), args, acc);
      }
    });
    return;
  }
  run_parallel(threads, [&] {
    Scratch scratch(job);
    for (std::size_t i = next++; i < items.size(); i = next++) run_chunk(job, items[i], scratch, chunk_state(i));
  });
  next = 0;
  run_parallel(threads, [&] {
    std::vector<double> acc(job.dim);
    for (std::size_t pair = next++; pair < pairs; pair = next++) {
      merge_pair(job, items, pair_first[pair], pair_first[pair + 1], states, state_floats, pair / kv_heads,
                 static_cast<std::int32_t>(pair % kv_heads), args, acc);
    }
  });
}

}  // namespace mixkv::cpu::detail
