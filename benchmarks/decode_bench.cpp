// GPU benchmark of the CUDA backend, run on the device machine by
// run_on_device.sh. Shapes: 28 query heads, 4 KV heads, head_dim 128,
// block 32 (--heads Q/KV, --head-dim 64 or 256, --block 16 or 64 for other
// models' shapes; --heads-per-item 8 or 16 forces the plan's item width);
// batch 1, 8, 64; context 4,096, 19,600, 65,536. In one run:
//   - the device's read bandwidth (our own read-and-reduce kernel),
//   - paged decode with all-FP16, all-INT4, all-INT2 and a mixed plan
//     (10% FP16, 30% INT4, 60% INT2 of the full windows; the partial tail
//     window is FP16), block ids shuffled over the arena,
//   - a dense FP16 cuBLAS baseline (GEMM, softmax, GEMM) on the same tokens,
//   - store_prefill of one sequence per plan (GPU time; host time a call).
// L2 is flushed before every timed launch (by reading a buffer 4x its size,
// as FlashInfer's benchmarks do; --flush write uses a memset, which leaves
// dirty lines behind); median of N CUDA-event timings. The launch floor (a
// 4-byte memset timed the same way) is printed for scale. --chunk-sweep
// also times every plan at fixed split-KV chunk counts (1..128 up to batch
// 8, 1..16 above) and at the plan's own choice, with
// L2 flushed and with L2 warm. At batch 1 and 64 every plan is also timed
// with DecodePlanConfig::batch_invariant_blocks = 16, 32, 64 (--invariant-
// blocks LIST, 0 for none), each against the automatic plan of the same run.
// Prints a table and writes JSON (--out).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_event_timing.h"
#include "mixkv/core/block_format.h"
#include "mixkv/core/half.h"
#include "mixkv/kernels/bandwidth.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/dense_reference.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/store.h"

using namespace mixkv;

namespace {

using bench::ok;

struct PlanMix {
  const char* name;
  double fp16, int4;  // fractions of the full windows (rest INT2)
};
constexpr PlanMix kMixes[] = {{"fp16", 1.0, 0.0}, {"int4", 0.0, 1.0}, {"int2", 0.0, 0.0}, {"mixed", 0.1, 0.3}};

template <typename T>
T* device_alloc(std::size_t count, const char* what) {
  void* p = nullptr;
  ok(cudaMalloc(&p, count * sizeof(T)), what);
  return static_cast<T*>(p);
}

template <typename F>
double median_us(int reps, gpu::L2Flusher& flusher, cudaStream_t stream, F&& launch) {
  return bench::median_event_us(reps, stream, launch, [&] { flusher.flush(stream); });
}

std::vector<Half> random_halves(std::size_t n, std::mt19937_64& rng, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<Half> v(n);
  for (auto& h : v) h = float_to_half(d(rng));
  return v;
}

struct Json {
  std::ostringstream s;
  bool first = true;
  void item(const std::string& body) {
    s << (first ? "\n    " : ",\n    ") << "{" << body << "}";
    first = false;
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "decode_bench.json";
  int reps = 50;
  bool quick = false;
  std::vector<int> only_batches, only_contexts;
  std::string only_plans;
  gpu::FlushMode flush_mode = gpu::FlushMode::read;
  bool chunk_sweep = false;
  int block_size = 32;             // --block: 16, 32 or 64
  int q_heads = 28, kv_heads = 4;  // --heads Q/KV
  int head_dim = 128;              // --head-dim: 64, 128 or 256
  int heads_per_item = 0;          // --heads-per-item: 8 or 16 (DecodePlanConfig::max_heads_per_item)
  // --invariant-blocks: the batch-invariant chunk sizes timed beside the
  // automatic plan (16 is the engine's default, docs/kernels.md).
  std::vector<int> invariant_blocks = {16, 32, 64};
  const std::vector<int> invariant_batches = {1, 64};
  auto parse_list = [](const char* text) {
    std::vector<int> v;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) v.push_back(std::atoi(item.c_str()));
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc)
      out_path = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--batches") && i + 1 < argc)
      only_batches = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--contexts") && i + 1 < argc)
      only_contexts = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--plans") && i + 1 < argc)
      only_plans = argv[++i];  // e.g. int2,mixed
    else if (!std::strcmp(argv[i], "--chunk-sweep"))
      chunk_sweep = true;
    else if (!std::strcmp(argv[i], "--block") && i + 1 < argc)
      block_size = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--head-dim") && i + 1 < argc)
      head_dim = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--heads-per-item") && i + 1 < argc)
      heads_per_item = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--invariant-blocks") && i + 1 < argc)
      invariant_blocks = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--heads") && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d/%d", &q_heads, &kv_heads) != 2) q_heads = kv_heads = 0;
    } else if (!std::strcmp(argv[i], "--flush") && i + 1 < argc) {
      const std::string mode = argv[++i];
      if (mode != "read" && mode != "write") {
        std::fprintf(stderr, "--flush: expected read or write, got %s\n", mode.c_str());
        return 2;
      }
      flush_mode = mode == "read" ? gpu::FlushMode::read : gpu::FlushMode::write;
    }
  }
  if (block_size != 16 && block_size != 32 && block_size != 64) {
    std::fprintf(stderr, "--block: expected 16, 32 or 64, got %d\n", block_size);
    return 2;
  }
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
    std::fprintf(stderr, "--head-dim: expected 64, 128 or 256, got %d\n", head_dim);
    return 2;
  }
  if (kv_heads < 1 || q_heads < 1 || q_heads % kv_heads != 0) {
    std::fprintf(stderr, "--heads: expected Q/KV with Q a positive multiple of KV, got %d/%d\n", q_heads, kv_heads);
    return 2;
  }
  std::erase(invariant_blocks, 0);
  if (std::any_of(invariant_blocks.begin(), invariant_blocks.end(), [](int b) { return b < 0; })) {
    std::fprintf(stderr, "--invariant-blocks: expected block counts >= 1 (0: none)\n");
    return 2;
  }
  if (!gpu::cuda_device_available()) {
    std::printf("no CUDA device: benchmark skipped\n");
    return 0;
  }
  cudaStream_t stream;
  ok(cudaStreamCreate(&stream), "stream");
  cudaDeviceProp prop;
  ok(cudaGetDeviceProperties(&prop, 0), "props");

  const double bw = gpu::measure_read_bandwidth(std::size_t{4} << 30, 20, stream);
  std::printf("device: %s, %d SMs, L2 %d MB\nread bandwidth (own kernel, 4 GiB): %.1f GB/s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, bw / 1e9);

  std::vector<int> batches = {1, 8, 64};
  std::vector<int> contexts = {4096, 19600, 65536};
  if (quick) {
    batches = {1, 64};
    contexts = {19600};
  }
  if (!only_batches.empty()) batches = only_batches;
  if (!only_contexts.empty()) contexts = only_contexts;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_ctx = *std::max_element(contexts.begin(), contexts.end());
  const int max_blocks = max_ctx / block_size + 2;

  // Arena: one region per pool, each large enough for max_batch x max_ctx
  // tokens at FP16 (a pool is "slab" p of its PoolView).
  std::array<BlockFormat, 3> formats;
  for (Precision p : kAllPrecisions) formats[pool_index(p)] = {p, kv_heads, head_dim, block_size};
  const std::size_t region = static_cast<std::size_t>(max_batch) * max_blocks * formats[0].block_bytes();
  gpu::DeviceArena arena(3 * region);
  gpu::DevicePools pools;
  for (int p = 0; p < 3; ++p) {
    pools[p].base = arena.base();
    pools[p].slab_bytes = region;
    pools[p].blocks_per_slab = static_cast<std::int32_t>(region / formats[p].block_bytes());
    pools[p].format = formats[p];
    pools[p].num_blocks = 3 * pools[p].blocks_per_slab;  // ids within the whole arena
  }

  // Prompt K/V for one sequence of max_ctx tokens, [token][kv_head][dim].
  std::mt19937_64 rng(2026);
  const std::size_t prompt_values = static_cast<std::size_t>(max_ctx) * kv_heads * head_dim;
  Half* d_k = device_alloc<Half>(prompt_values, "prompt k");
  Half* d_v = device_alloc<Half>(prompt_values, "prompt v");
  {
    const auto k = random_halves(prompt_values, rng, 1.0f);
    const auto v = random_halves(prompt_values, rng, 1.0f);
    ok(cudaMemcpy(d_k, k.data(), prompt_values * 2, cudaMemcpyHostToDevice), "H2D");
    ok(cudaMemcpy(d_v, v.data(), prompt_values * 2, cudaMemcpyHostToDevice), "H2D");
  }
  Half* d_q = device_alloc<Half>(static_cast<std::size_t>(max_batch) * q_heads * head_dim, "q");
  Half* d_out = device_alloc<Half>(static_cast<std::size_t>(max_batch) * q_heads * head_dim, "out");
  {
    const auto q = random_halves(static_cast<std::size_t>(max_batch) * q_heads * head_dim, rng, 1.0f);
    ok(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice), "H2D");
  }

  gpu::L2Flusher flusher(flush_mode);
  // A plain read of as many bytes as each store_prefill moves, timed the
  // same way beside it: the rate a transfer of that size reaches at all
  // (FP16 plans move the most: the prompt K/V read and written once).
  const std::size_t max_store_bytes = prompt_values * 2 * 2 * 2 + (std::size_t{1} << 20);
  auto* d_read = device_alloc<unsigned char>(max_store_bytes, "same-bytes read buffer");
  ok(cudaMemset(d_read, 0, max_store_bytes), "memset read buffer");
  auto* d_sink = device_alloc<unsigned>(1, "read sink");
  const char* flush_name = flush_mode == gpu::FlushMode::read ? "read" : "write";
  const double launch_floor_us =
      median_us(reps, flusher, stream, [&] { ok(cudaMemsetAsync(d_out, 0, 4, stream), "floor memset"); });
  std::printf("L2 flush: %s; launch floor (4-byte memset, same timing): %.1f us\n", flush_name, launch_floor_us);
  gpu::DenseAttention dense;
  Json json;
  Json store_json;
  Json invariant_json;
  std::printf("\n%-6s %-7s %-6s %10s %10s %9s %7s %8s %7s\n", "batch", "context", "plan", "time_us", "MB_read", "GB/s",
              "%BW", "vs_dense", "items");

  for (int ctx : contexts) {
    for (int batch : batches) {
      // Dense FP16 baseline on the same token count: K/V [batch][kv_head][ctx][dim].
      double dense_us = 0.0;
      {
        const std::size_t n = static_cast<std::size_t>(batch) * kv_heads * ctx * head_dim;
        Half* k = device_alloc<Half>(n, "dense k");
        Half* v = device_alloc<Half>(n, "dense v");
        // Random-ish non-zero halves: the prompt pattern repeated.
        for (std::size_t off = 0; off < n; off += prompt_values) {
          const std::size_t len = std::min(prompt_values, n - off);
          ok(cudaMemcpyAsync(k + off, d_k, len * 2, cudaMemcpyDeviceToDevice, stream), "D2D");
          ok(cudaMemcpyAsync(v + off, d_v, len * 2, cudaMemcpyDeviceToDevice, stream), "D2D");
        }
        const gpu::DenseAttentionShape shape{batch, q_heads,  kv_heads,
                                             ctx,   head_dim, 1.0f / std::sqrt(static_cast<float>(head_dim))};
        dense_us = median_us(reps, flusher, stream, [&] { dense.run_fp16(shape, d_q, k, v, d_out, stream); });
        ok(cudaStreamSynchronize(stream), "sync");
        cudaFree(k);
        cudaFree(v);
        const double bytes = 2.0 * n * 2;
        std::printf("%-6d %-7d %-6s %10.1f %10.1f %9.1f %6.1f%% %8s %7s\n", batch, ctx, "dense", dense_us, bytes / 1e6,
                    bytes / dense_us / 1e3, 100.0 * bytes / dense_us * 1e6 / bw, "1.00", "-");
        std::ostringstream o;
        o << "\"batch\": " << batch << ", \"context\": " << ctx
          << ", \"plan\": \"dense_cublas_fp16\", \"time_us\": " << dense_us << ", \"bytes\": " << bytes
          << ", \"gbps\": " << bytes / dense_us / 1e3;
        json.item(o.str());
      }

      for (const PlanMix& mix : kMixes) {
        if (!only_plans.empty() && only_plans.find(mix.name) == std::string::npos) continue;
        // Windows of every sequence: the same precision pattern, shuffled ids.
        const int windows = ctx / block_size;
        const int tail = ctx % block_size;
        std::vector<Precision> plan(windows);
        for (int w = 0; w < windows; ++w) {
          const double u = (w + 0.5) / windows;  // deterministic proportions
          plan[w] = u < mix.fp16 ? Precision::FP16 : (u < mix.fp16 + mix.int4 ? Precision::INT4 : Precision::INT2);
        }
        std::shuffle(plan.begin(), plan.end(), rng);
        std::array<std::vector<std::int32_t>, 3> free_ids;
        for (int p = 0; p < 3; ++p) {
          const int need = batch * max_blocks;
          free_ids[p].resize(need);
          std::iota(free_ids[p].begin(), free_ids[p].end(), p * pools[p].blocks_per_slab);
          std::shuffle(free_ids[p].begin(), free_ids[p].end(), rng);
        }
        gpu::PageTableConfig table_config{1, batch, max_blocks};
        for (int p = 0; p < 3; ++p) table_config.pool_blocks[p] = pools[p].num_blocks;
        gpu::DevicePageTables tables(table_config);
        gpu::DeviceStoreMapping dmap;
        double store_us = 0.0, store_bytes = 0.0, store_host_us = 0.0, read_same_us = 0.0;
        for (int b = 0; b < batch; ++b) {
          StoreMapping m;
          m.fp16_slots.assign(ctx, -1);
          std::array<std::vector<std::int32_t>, 3> lists;
          int fp16_tokens = 0;
          for (int t = 0; t < ctx; ++t) {
            const int w = t / block_size;
            const Precision p = w < windows ? plan[w] : Precision::FP16;
            if (p == Precision::FP16) {
              if (fp16_tokens % block_size == 0) {
                lists[0].push_back(free_ids[0].back());
                free_ids[0].pop_back();
              }
              m.fp16_slots[t] = lists[0].back() * block_size + fp16_tokens % block_size;
              ++fp16_tokens;
            } else if (t % block_size == 0) {
              const int pi = pool_index(p);
              lists[pi].push_back(free_ids[pi].back());
              free_ids[pi].pop_back();
              (p == Precision::INT4 ? m.int4_windows : m.int2_windows).push_back({lists[pi].back(), t});
            }
          }
          dmap.upload(m, block_size, stream);
          gpu::StorePrefillArgs args;
          args.k = d_k;
          args.v = d_v;
          dmap.fill(args);
          args.pools = pools;
          args.stream = stream;
          if (b == 0 && batch == batches.front()) {  // the store is reported once per context and plan
            store_us = median_us(std::max(5, reps / 5), flusher, stream, [&] { gpu::store_prefill(args); });
            // Host time of a call (checks, launch setup, launch), the GPU running behind.
            constexpr int kHostCalls = 100;
            ok(cudaStreamSynchronize(stream), "sync store");
            const auto h0 = std::chrono::steady_clock::now();
            for (int i = 0; i < kHostCalls; ++i) gpu::store_prefill(args);
            store_host_us =
                std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count() / kHostCalls;
            std::size_t written = 0;
            for (int p = 0; p < 3; ++p) written += lists[p].size() * formats[p].block_bytes();
            if (!lists[0].empty())
              written -= (block_size - (fp16_tokens - (lists[0].size() - 1) * block_size)) * kv_heads * head_dim *
                         4;  // tail rows not written
            // K/V rows read, blocks written, and the mapping's FP16 RowSlots and WindowSlots read.
            store_bytes = static_cast<double>(ctx) * kv_heads * head_dim * 2 * 2 + written +
                          8.0 * (fp16_tokens + m.int4_windows.size() + m.int2_windows.size());
            const std::size_t read_bytes = static_cast<std::size_t>(store_bytes) / 16 * 16;
            read_same_us = median_us(std::max(5, reps / 5), flusher, stream,
                                     [&] { gpu::launch_streaming_read(d_read, read_bytes, d_sink, stream); });
          } else {
            gpu::store_prefill(args);
          }
          for (int p = 0; p < 3; ++p) {
            const int fill = p == 0 && fp16_tokens > 0 ? (fp16_tokens - 1) % block_size + 1 : 0;
            tables.set_blocks(b, 0, kAllPrecisions[p], lists[p], fill);
          }
          ok(cudaStreamSynchronize(stream), "sync store");  // dmap is reused
        }
        (void)tail;
        tables.upload(stream);
        gpu::DecodePlanConfig config;
        config.num_layers = 1;
        config.num_q_heads = q_heads;
        config.num_kv_heads = kv_heads;
        config.head_dim = head_dim;
        config.block_size = block_size;
        config.max_batch = batch;
        config.max_heads_per_item = heads_per_item;
        gpu::DecodePlan dplan(config, tables);
        std::vector<std::int32_t> slots(batch);
        std::iota(slots.begin(), slots.end(), 0);
        // Host time of plan(): the median of 21 calls after a first one (which
        // also touches the staging buffers for the first time).
        dplan.plan(slots, stream);
        std::vector<double> plan_times;
        for (int i = 0; i < 21; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          dplan.plan(slots, stream);
          plan_times.push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
        std::nth_element(plan_times.begin(), plan_times.begin() + 10, plan_times.end());
        const double plan_us = plan_times[10];
        gpu::DecodeRunArgs run{0,     d_q,    d_out, nullptr, 1.0f / std::sqrt(static_cast<float>(head_dim)),
                               pools, stream, false};
        const double us = median_us(reps, flusher, stream, [&] { dplan.run(run); });
        if (chunk_sweep) {
          const std::vector<int> small{0, 1, 2, 4, 8, 12, 16, 32, 64, 93, 128};  // 0: the plan's own choice
          const std::vector<int> large{0, 1, 2, 3, 4, 5, 6, 8, 12, 16};
          for (int chunks : batch <= 8 ? small : large) {
            gpu::DecodePlanConfig swept = config;
            swept.chunks_per_sequence = chunks;
            gpu::DecodePlan sweep_plan(swept, tables);
            sweep_plan.plan(slots, stream);
            const double cold = median_us(reps, flusher, stream, [&] { sweep_plan.run(run); });
            const double warm = bench::median_event_us(reps, stream, [&] { sweep_plan.run(run); });
            std::printf("  chunk sweep b%d %-6s chunks %4s items %5d: L2 flushed %7.1f us, L2 warm %7.1f us\n", batch,
                        mix.name, chunks == 0 ? "auto" : std::to_string(chunks).c_str(), sweep_plan.num_items(0), cold,
                        warm);
          }
        }
        // Batch-invariant splits: the same tables and queries, each timed
        // right after the automatic plan above, as a ratio to it.
        if (std::find(invariant_batches.begin(), invariant_batches.end(), batch) != invariant_batches.end()) {
          for (const int blocks : invariant_blocks) {
            gpu::DecodePlanConfig inv = config;
            inv.batch_invariant_blocks = blocks;
            gpu::DecodePlan inv_plan(inv, tables);
            inv_plan.plan(slots, stream);
            const double inv_us = median_us(reps, flusher, stream, [&] { inv_plan.run(run); });
            std::printf("  batch-invariant b%d %-6s blocks %3d: %8.1f us, x auto %.3f, items %5d (auto %d)\n", batch,
                        mix.name, blocks, inv_us, inv_us / us, inv_plan.num_items(0), dplan.num_items(0));
            std::ostringstream io;
            io << "\"batch\": " << batch << ", \"context\": " << ctx << ", \"plan\": \"" << mix.name
               << "\", \"batch_invariant_blocks\": " << blocks << ", \"time_us\": " << inv_us << ", \"auto_us\": " << us
               << ", \"ratio_auto\": " << inv_us / us << ", \"items\": " << inv_plan.num_items(0)
               << ", \"split_items\": " << inv_plan.num_split_items(0) << ", \"auto_items\": " << dplan.num_items(0);
            invariant_json.item(io.str());
          }
          dplan.run(run);  // the output checked below is the automatic plan's
        }
        // Sanity: the output is finite.
        std::vector<Half> out(static_cast<std::size_t>(batch) * q_heads * head_dim);
        ok(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost), "D2H");
        const bool finite = std::all_of(out.begin(), out.end(), [](Half h) { return (h.bits & 0x7c00) != 0x7c00; });
        const double bytes = static_cast<double>(dplan.bytes_read(0));
        const double gbps = bytes / us / 1e3;
        std::printf("%-6d %-7d %-6s %10.1f %10.1f %9.1f %6.1f%% %8.3f %7d%s\n", batch, ctx, mix.name, us, bytes / 1e6,
                    gbps, 100.0 * gbps * 1e9 / bw, us / dense_us, dplan.num_items(0), finite ? "" : "  NON-FINITE");
        std::ostringstream o;
        o << "\"batch\": " << batch << ", \"context\": " << ctx << ", \"plan\": \"" << mix.name
          << "\", \"time_us\": " << us << ", \"bytes\": " << bytes << ", \"gbps\": " << gbps
          << ", \"pct_bw\": " << 100.0 * gbps * 1e9 / bw << ", \"ratio_dense\": " << us / dense_us
          << ", \"items\": " << dplan.num_items(0) << ", \"split_items\": " << dplan.num_split_items(0)
          << ", \"plan_host_us\": " << plan_us << ", \"finite\": " << (finite ? "true" : "false");
        json.item(o.str());
        if (batch == batches.front()) {
          std::ostringstream so;
          so << "\"context\": " << ctx << ", \"plan\": \"" << mix.name << "\", \"time_us\": " << store_us
             << ", \"bytes\": " << store_bytes << ", \"gbps\": " << store_bytes / store_us / 1e3
             << ", \"pct_bw\": " << 100.0 * store_bytes / store_us * 1e6 / bw << ", \"host_us\": " << store_host_us
             << ", \"read_same_bytes_us\": " << read_same_us
             << ", \"ratio_read_same_bytes\": " << read_same_us / store_us;
          store_json.item(so.str());
          std::printf(
              "       store_prefill %-6s ctx %-6d %9.1f us %9.1f GB/s %6.1f%%  host %.2f us a call;"
              " a read of its bytes %.1f us (%.1f%% of BW), store at %.0f%% of its rate\n",
              mix.name, ctx, store_us, store_bytes / store_us / 1e3, 100.0 * store_bytes / store_us * 1e6 / bw,
              store_host_us, read_same_us, 100.0 * store_bytes / read_same_us * 1e6 / bw,
              100.0 * read_same_us / store_us);
        }
      }
    }
  }
  std::ofstream f(out_path);
  f << "{\n  \"device\": \"" << prop.name << "\",\n  \"sms\": " << prop.multiProcessorCount
    << ",\n  \"read_bandwidth_gbps\": " << bw / 1e9 << ",\n  \"shape\": {\"q_heads\": " << q_heads
    << ", \"kv_heads\": " << kv_heads << ", \"head_dim\": " << head_dim << ", \"block_size\": " << block_size
    << "},\n  \"reps\": " << reps << ",\n  \"l2_flush\": \"" << flush_name
    << "\",\n  \"launch_floor_us\": " << launch_floor_us << ",\n  \"decode\": [" << json.s.str()
    << "\n  ],\n  \"store_prefill\": [" << store_json.s.str() << "\n  ],\n  \"batch_invariant\": ["
    << invariant_json.s.str() << "\n  ]\n}\n";
  std::printf("\nwrote %s\n", out_path.c_str());
  return 0;
}
