// GPU benchmark of extend (chunked-prefill / verification) attention,
// gpu::ExtendPlan, run on the device machine by extend_on_device.sh beside
// FlashInfer's paged prefill (flashinfer_prefill_bench.py). Shapes of the
// issue: 28 query heads, 4 KV heads, head_dim 128, block 32;
//   chunk2048_b1  one sequence, 2,048 new rows over 19,600 cached tokens,
//   chunk2048_b8  the same at batch 8,
//   chunk512_b32  32 sequences, 512 new rows over 4,096 cached tokens,
//   verify8_b64   64 sequences, 8 new rows (speculative verification) over 19,600.
// For each, the cache all-FP16, all-INT4, all-INT2 and mixed (10% FP16, 30%
// INT4, 60% INT2 of the full windows; the partial tail window is FP16),
// block ids shuffled over the arena, every sequence its own blocks. New row
// j of a sequence attends to all its cached tokens and causally to new rows
// 0..j (their K/V are inputs, not in the cache).
// L2 is flushed before every timed launch (a read of 4x its size, as
// FlashInfer's benchmarks do; --flush write uses a memset); median of
// --reps CUDA-event timings; plan() is not timed (its host time is reported).
// Reported per (shape, plan): microseconds,
//   TFLOP/s = 4 * num_q_heads * head_dim * sum_i n_i * (ctx_i + (n_i + 1) / 2) / time
//     (Q.K^T and P.V, 2 flops a multiply-add, over the ctx_i + j + 1 keys row j sees),
//   bytes read (each byte once: cached blocks with their page-table entries,
//     q, and the new rows' k and v; the output's writes are reported apart),
//   GB/s and % of the read bandwidth measured in the same program
//     (gpu::measure_read_bandwidth, 4 GiB), the time a plain read of as many
//     bytes takes (gpu::launch_streaming_read), and the ratio to FP16.
// Prints a table and writes JSON (--out).
//   mixkv_extend_bench [--out PATH] [--reps N] [--quick] [--shapes NAME,...]
//                      [--plans fp16,int4,int2,mixed] [--flush read|write]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_event_timing.h"
#include "mixkv/core/block_format.h"
#include "mixkv/core/half.h"
#include "mixkv/kernels/bandwidth.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/extend_plan.h"
#include "mixkv/kernels/store.h"

using namespace mixkv;

namespace {

using bench::ok;

struct PlanMix {
  const char* name;
  double fp16, int4;  // fractions of the full windows (rest INT2)
};
constexpr PlanMix kMixes[] = {{"fp16", 1.0, 0.0}, {"int4", 0.0, 1.0}, {"int2", 0.0, 0.0}, {"mixed", 0.1, 0.3}};

struct Shape {
  const char* name;
  int batch;
  int n_new;    // new rows per sequence
  int context;  // cached tokens per sequence
};
constexpr Shape kShapes[] = {{"chunk2048_b1", 1, 2048, 19600},
                             {"chunk2048_b8", 8, 2048, 19600},
                             {"chunk512_b32", 32, 512, 4096},
                             {"verify8_b64", 64, 8, 19600}};

constexpr int kQHeads = 28, kKvHeads = 4, kHeadDim = 128, kBlock = 32;
constexpr int kTileRows = 64;  // ExtendPlan's tile: 64 (new row, query head) rows

template <typename T>
T* device_alloc(std::size_t count, const char* what) {
  void* p = nullptr;
  ok(cudaMalloc(&p, count * sizeof(T)), what);
  return static_cast<T*>(p);
}

std::vector<Half> random_halves(std::size_t n, std::mt19937_64& rng, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<Half> v(n);
  for (auto& h : v) h = float_to_half(d(rng));
  return v;
}

// `count` device halves filled with a random pattern of `pattern` values
// repeated (enough variety for timing; generating 60M normals on the host
// would cost seconds).
Half* device_random(std::size_t count, const std::vector<Half>& pattern, cudaStream_t stream, const char* what) {
  Half* d = device_alloc<Half>(count, what);
  const std::size_t first = std::min(count, pattern.size());
  ok(cudaMemcpy(d, pattern.data(), first * 2, cudaMemcpyHostToDevice), what);
  for (std::size_t off = first; off < count; off += first) {
    ok(cudaMemcpyAsync(d + off, d, std::min(first, count - off) * 2, cudaMemcpyDeviceToDevice, stream), what);
  }
  ok(cudaStreamSynchronize(stream), what);
  return d;
}

std::vector<std::string> split(const char* text) {
  std::vector<std::string> v;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) v.push_back(item);
  }
  return v;
}

bool listed(const std::vector<std::string>& list, const char* name) {
  return list.empty() || std::find(list.begin(), list.end(), name) != list.end();
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
  std::string out_path = "extend_bench.json";
  int reps = 20;
  bool quick = false;
  std::vector<std::string> only_shapes, only_plans;
  gpu::FlushMode flush_mode = gpu::FlushMode::read;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--shapes") && i + 1 < argc) {
      only_shapes = split(argv[++i]);
    } else if (!std::strcmp(argv[i], "--plans") && i + 1 < argc) {
      only_plans = split(argv[++i]);
    } else if (!std::strcmp(argv[i], "--flush") && i + 1 < argc) {
      const std::string mode = argv[++i];
      if (mode != "read" && mode != "write") {
        std::fprintf(stderr, "--flush: expected read or write, got %s\n", mode.c_str());
        return 2;
      }
      flush_mode = mode == "read" ? gpu::FlushMode::read : gpu::FlushMode::write;
    } else {
      std::fprintf(stderr,
                   "unknown argument %s\nusage: mixkv_extend_bench [--out PATH] [--reps N] [--quick] "
                   "[--shapes chunk2048_b1,chunk2048_b8,chunk512_b32,verify8_b64] "
                   "[--plans fp16,int4,int2,mixed] [--flush read|write]\n",
                   argv[i]);
      return 2;
    }
  }
  for (const std::string& s : only_shapes) {
    if (std::none_of(std::begin(kShapes), std::end(kShapes), [&](const Shape& k) { return s == k.name; })) {
      std::fprintf(stderr, "--shapes: unknown shape %s\n", s.c_str());
      return 2;
    }
  }
  for (const std::string& p : only_plans) {
    if (std::none_of(std::begin(kMixes), std::end(kMixes), [&](const PlanMix& m) { return p == m.name; })) {
      std::fprintf(stderr, "--plans: unknown plan %s\n", p.c_str());
      return 2;
    }
  }
  if (quick) {
    reps = std::min(reps, 5);
    if (only_plans.empty()) only_plans = {"fp16", "int4", "int2"};
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

  gpu::L2Flusher flusher(flush_mode);
  const char* flush_name = flush_mode == gpu::FlushMode::read ? "read" : "write";
  auto median_us = [&](int n, auto&& launch) {
    return bench::median_event_us(n, stream, launch, [&] { flusher.flush(stream); });
  };
  {
    unsigned* d_tiny = device_alloc<unsigned>(1, "tiny");
    const double floor_us = median_us(reps, [&] { ok(cudaMemsetAsync(d_tiny, 0, 4, stream), "floor memset"); });
    std::printf("L2 flush: %s; launch floor (4-byte memset, same timing): %.1f us; reps %d\n", flush_name, floor_us,
                reps);
    cudaFree(d_tiny);
  }

  std::array<BlockFormat, 3> formats;
  for (Precision p : kAllPrecisions) formats[pool_index(p)] = {p, kKvHeads, kHeadDim, kBlock};
  std::array<std::int64_t, 3> head_bytes;  // one KV head of one block
  for (Precision p : kAllPrecisions) {
    head_bytes[pool_index(p)] = static_cast<std::int64_t>(BlockFormat{p, 1, kHeadDim, kBlock}.head_bytes());
  }
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));

  std::mt19937_64 rng(2026);
  const auto pattern = random_halves(std::size_t{1} << 22, rng, 1.0f);  // new rows' q, k, v
  Json json;
  // Rewritten after every shape: a run cut short by a timeout keeps what it measured.
  auto write_json = [&] {
    std::ofstream f(out_path);
    f << "{\n  \"device\": \"" << prop.name << "\",\n  \"sms\": " << prop.multiProcessorCount
      << ",\n  \"read_bandwidth_gbps\": " << bw / 1e9 << ",\n  \"shape\": {\"q_heads\": " << kQHeads
      << ", \"kv_heads\": " << kKvHeads << ", \"head_dim\": " << kHeadDim << ", \"block_size\": " << kBlock
      << "},\n  \"reps\": " << reps << ",\n  \"l2_flush\": \"" << flush_name
      << "\",\n  \"flops_formula\": \"4 * num_q_heads * head_dim * sum_i n_i * (ctx_i + (n_i + 1) / 2)\""
      << ",\n  \"bytes_read_formula\": \"cached K/V (FP16 rows, INT4/INT2 blocks with their parameters) + 4 B a "
         "page-table entry, per KV head, once; + q, k, v of the new rows\""
      << ",\n  \"extend\": [" << json.s.str() << "\n  ]\n}\n";
  };
  std::printf("\n%-13s %-6s %10s %8s %10s %9s %7s %8s %8s %6s %6s\n", "shape", "plan", "time_us", "TFLOP/s", "MB_read",
              "GB/s", "%BW", "%read", "vs_fp16", "items", "split");

  for (const Shape& shape : kShapes) {
    if (!listed(only_shapes, shape.name)) continue;
    const int batch = shape.batch, n = shape.n_new, ctx = shape.context;
    const int rows = batch * n;
    const int max_blocks = ctx / kBlock + 2;
    const int group = kQHeads / kKvHeads;

    // Arena: one region per pool, each large enough for the whole batch at FP16.
    const std::size_t region = static_cast<std::size_t>(batch) * max_blocks * formats[0].block_bytes();
    gpu::DeviceArena arena(3 * region);
    gpu::DevicePools pools;
    for (int p = 0; p < 3; ++p) {
      pools[p].base = arena.base();
      pools[p].slab_bytes = region;
      pools[p].blocks_per_slab = static_cast<std::int32_t>(region / formats[p].block_bytes());
      pools[p].format = formats[p];
      pools[p].num_blocks = 3 * pools[p].blocks_per_slab;  // ids within the whole arena
    }
    // The cached prompt of one sequence, [token][kv_head][dim] (stored into every sequence's blocks).
    const std::size_t prompt_values = static_cast<std::size_t>(ctx) * kKvHeads * kHeadDim;
    Half* d_pk = device_alloc<Half>(prompt_values, "prompt k");
    Half* d_pv = device_alloc<Half>(prompt_values, "prompt v");
    {
      const auto k = random_halves(prompt_values, rng, 1.0f);
      const auto v = random_halves(prompt_values, rng, 1.0f);
      ok(cudaMemcpy(d_pk, k.data(), prompt_values * 2, cudaMemcpyHostToDevice), "H2D");
      ok(cudaMemcpy(d_pv, v.data(), prompt_values * 2, cudaMemcpyHostToDevice), "H2D");
    }
    // The step's new rows.
    const std::size_t q_values = static_cast<std::size_t>(rows) * kQHeads * kHeadDim;
    const std::size_t kv_values = static_cast<std::size_t>(rows) * kKvHeads * kHeadDim;
    Half* d_q = device_random(q_values, pattern, stream, "q");
    Half* d_k = device_random(kv_values, pattern, stream, "k");
    Half* d_v = device_random(kv_values, pattern, stream, "v");
    Half* d_out = device_alloc<Half>(q_values, "out");
    std::vector<std::int32_t> qo_indptr(batch + 1);
    for (int b = 0; b <= batch; ++b) qo_indptr[b] = b * n;
    std::vector<std::int32_t> slots(batch);
    std::iota(slots.begin(), slots.end(), 0);

    // Work: flops of Q.K^T and P.V over the keys each row sees; the new rows' bytes.
    const double flops = 4.0 * kQHeads * kHeadDim * batch * static_cast<double>(n) * (ctx + (n + 1) / 2.0);
    const double new_row_bytes = 2.0 * (q_values + 2 * kv_values);
    const double out_bytes = 2.0 * q_values;
    const int tiles_per_head = (n * group + kTileRows - 1) / kTileRows;

    // A plain read of as many bytes as the largest plan reads, for the same-size read timings.
    const std::size_t max_read = static_cast<std::size_t>(
        batch * (static_cast<double>(max_blocks) * head_bytes[0] * kKvHeads + 4.0 * max_blocks * kKvHeads) +
        new_row_bytes + (1 << 20));
    auto* d_read = device_alloc<unsigned char>(max_read, "same-bytes read buffer");
    ok(cudaMemset(d_read, 0, max_read), "memset read buffer");
    auto* d_sink = device_alloc<unsigned>(1, "read sink");

    double fp16_us = 0.0;
    for (const PlanMix& mix : kMixes) {
      if (!listed(only_plans, mix.name)) continue;
      // Windows of every sequence: the same precision pattern, shuffled; block ids shuffled.
      const int windows = ctx / kBlock;
      std::vector<Precision> plan(windows);
      for (int w = 0; w < windows; ++w) {
        const double u = (w + 0.5) / windows;  // deterministic proportions
        plan[w] = u < mix.fp16 ? Precision::FP16 : (u < mix.fp16 + mix.int4 ? Precision::INT4 : Precision::INT2);
      }
      std::shuffle(plan.begin(), plan.end(), rng);
      std::array<std::vector<std::int32_t>, 3> free_ids;
      for (int p = 0; p < 3; ++p) {
        free_ids[p].resize(static_cast<std::size_t>(batch) * max_blocks);
        std::iota(free_ids[p].begin(), free_ids[p].end(), p * pools[p].blocks_per_slab);
        std::shuffle(free_ids[p].begin(), free_ids[p].end(), rng);
      }
      gpu::PageTableConfig table_config{1, batch, max_blocks};
      for (int p = 0; p < 3; ++p) table_config.pool_blocks[p] = pools[p].num_blocks;
      gpu::DevicePageTables tables(table_config);
      gpu::DeviceStoreMapping dmap;
      double cache_bytes = 0.0, tile_bytes = 0.0;
      for (int b = 0; b < batch; ++b) {
        StoreMapping m;
        m.fp16_slots.assign(ctx, -1);
        std::array<std::vector<std::int32_t>, 3> lists;
        int fp16_tokens = 0;
        for (int t = 0; t < ctx; ++t) {
          const int w = t / kBlock;
          const Precision p = w < windows ? plan[w] : Precision::FP16;
          if (p == Precision::FP16) {
            if (fp16_tokens % kBlock == 0) {
              lists[0].push_back(free_ids[0].back());
              free_ids[0].pop_back();
            }
            m.fp16_slots[t] = lists[0].back() * kBlock + fp16_tokens % kBlock;
            ++fp16_tokens;
          } else if (t % kBlock == 0) {
            const int pi = pool_index(p);
            lists[pi].push_back(free_ids[pi].back());
            free_ids[pi].pop_back();
            (p == Precision::INT4 ? m.int4_windows : m.int2_windows).push_back({lists[pi].back(), t});
          }
        }
        dmap.upload(m, kBlock, stream);
        gpu::StorePrefillArgs args;
        args.k = d_pk;
        args.v = d_pv;
        dmap.fill(args);
        args.pools = pools;
        args.stream = stream;
        gpu::store_prefill(args);
        const int fill = fp16_tokens > 0 ? (fp16_tokens - 1) % kBlock + 1 : 0;
        for (int p = 0; p < 3; ++p) tables.set_blocks(b, 0, kAllPrecisions[p], lists[p], p == 0 ? fill : 0);
        ok(cudaStreamSynchronize(stream), "sync store");  // dmap is reused
        // Bytes of this sequence's cache: FP16 rows (K and V), quantized blocks, page-table entries; per KV head.
        const double fp16_rows = fp16_tokens;
        const double seq_head_bytes = fp16_rows * kHeadDim * 4 + lists[1].size() * static_cast<double>(head_bytes[1]) +
                                      lists[2].size() * static_cast<double>(head_bytes[2]);
        const double seq_blocks = static_cast<double>(lists[0].size() + lists[1].size() + lists[2].size());
        cache_bytes += (seq_head_bytes + 4.0 * seq_blocks) * kKvHeads;
        tile_bytes += seq_head_bytes * kKvHeads * tiles_per_head;
      }
      tables.upload(stream);
      gpu::ExtendPlanConfig config;
      config.num_layers = 1;
      config.num_q_heads = kQHeads;
      config.num_kv_heads = kKvHeads;
      config.head_dim = kHeadDim;
      config.block_size = kBlock;
      config.max_batch = batch;
      config.max_rows = rows;
      gpu::ExtendPlan xplan(config, tables);
      xplan.plan(slots, qo_indptr, stream);
      std::vector<double> plan_times;
      for (int i = 0; i < 11; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        xplan.plan(slots, qo_indptr, stream);
        plan_times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      std::nth_element(plan_times.begin(), plan_times.begin() + 5, plan_times.end());
      const double plan_us = plan_times[5];
      ok(cudaStreamSynchronize(stream), "sync plan");

      gpu::ExtendRunArgs run;
      run.layer = 0;
      run.q = d_q;
      run.k = d_k;
      run.v = d_v;
      run.out = d_out;
      run.sm_scale = sm_scale;
      run.pools = pools;
      run.stream = stream;
      ok(cudaMemsetAsync(d_out, 0xff, q_values * 2, stream), "poison out");  // NaN halves until written
      const double us = median_us(reps, [&] { xplan.run(run); });
      const double bytes = cache_bytes + new_row_bytes;
      const std::size_t read_bytes = std::min(max_read, static_cast<std::size_t>(bytes)) / 16 * 16;
      const double read_us =
          median_us(std::max(5, reps / 2), [&] { gpu::launch_streaming_read(d_read, read_bytes, d_sink, stream); });

      std::vector<Half> out(q_values);
      ok(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost), "D2H");
      const bool finite = std::all_of(out.begin(), out.end(), [](Half h) { return (h.bits & 0x7c00) != 0x7c00; });
      if (std::strcmp(mix.name, "fp16") == 0) fp16_us = us;
      const double tflops = flops / us / 1e6;
      const double gbps = bytes / us / 1e3;
      const double pct_bw = 100.0 * gbps * 1e9 / bw;
      const double pct_read = 100.0 * read_us / us;  // share of a plain read's speed
      char vs_fp16[16] = "-";
      if (fp16_us > 0) std::snprintf(vs_fp16, sizeof vs_fp16, "%.3f", us / fp16_us);
      std::printf("%-13s %-6s %10.1f %8.1f %10.1f %9.1f %6.1f%% %7.1f%% %8s %6d %6d%s\n", shape.name, mix.name, us,
                  tflops, bytes / 1e6, gbps, pct_bw, pct_read, vs_fp16, xplan.num_items(0), xplan.num_split_tiles(0),
                  finite ? "" : "  NON-FINITE");
      std::ostringstream o;
      o << "\"shape\": \"" << shape.name << "\", \"batch\": " << batch << ", \"n_new\": " << n
        << ", \"context\": " << ctx << ", \"plan\": \"" << mix.name << "\", \"time_us\": " << us
        << ", \"flops\": " << flops << ", \"tflops\": " << tflops << ", \"bytes_read\": " << bytes
        << ", \"cache_bytes\": " << cache_bytes << ", \"bytes_written\": " << out_bytes
        << ", \"tile_bytes\": " << tile_bytes << ", \"gbps\": " << gbps << ", \"pct_bw\": " << pct_bw
        << ", \"read_same_bytes_us\": " << read_us << ", \"pct_of_plain_read\": " << pct_read
        << ", \"ratio_fp16\": " << (fp16_us > 0 ? us / fp16_us : 0.0) << ", \"items\": " << xplan.num_items(0)
        << ", \"split_tiles\": " << xplan.num_split_tiles(0) << ", \"plan_host_us\": " << plan_us
        << ", \"finite\": " << (finite ? "true" : "false");
      json.item(o.str());
    }
    cudaFree(d_read);
    cudaFree(d_sink);
    cudaFree(d_pk);
    cudaFree(d_pv);
    cudaFree(d_q);
    cudaFree(d_k);
    cudaFree(d_v);
    cudaFree(d_out);
    write_json();
  }
  write_json();
  std::printf("\nwrote %s\n", out_path.c_str());
  return 0;
}
