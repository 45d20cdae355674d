// Host time of DecodePlan::plan, the decode step's planning: every layer's
// page-list lengths read from the tables' host mirror, work items cut,
// staged and uploaded (one asynchronous copy), with layers sharing items
// (DecodePlanConfig::layer_sharing kAuto, the default, and kAlways) and
// with sharing off (kNever).
// Shapes: SmolLM2-135M (30 layers, 9 query / 3 KV heads, head_dim 64,
// block 16) and a 28-layer model of 28 query / 4 KV heads, head_dim 128,
// block 32. Batches 1, 64, 600, 2000 of ~1,000-token sequences (900 +
// (37 i mod 200) tokens). Page lists:
//   fp16:   every window FP16 (every layer alike);
//   mixed:  a sink and 4 recent windows FP16, the middle INT4 / INT2 at a
//           share of INT4 that differs by layer (no two layers alike);
//   tiered: odd layers whole-INT4 (alike), even layers as mixed.
// Each plan() is timed alone (std::chrono); the stream is synchronized
// after it, outside the timed region, as a decode step's kernels separate
// two plans in the engine. Median of up to --reps calls after 3 warm-ups
// (fewer when the calls pass 0.25 s).
// Usage: mixkv_decode_plan_bench [--out PATH] [--reps N] [--quick]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <boost/json.hpp>
#include <boost/json/src.hpp>

#include "cuda_event_timing.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"

using namespace mixkv;

namespace {

namespace json = boost::json;
using bench::ok;

struct Shape {
  const char* name;
  int layers, q_heads, kv_heads, head_dim, block;
};
constexpr Shape kShapes[] = {{"smollm2_135m", 30, 9, 3, 64, 16}, {"l28_kv4_d128_b32", 28, 28, 4, 128, 32}};
constexpr int kMaxBatch = 2000;
constexpr int kWorkItemBytes = 72;  // sizeof(DecodeWorkItem), kernels/src/decode_params.cuh

enum class Lists { FP16, Mixed, Tiered };
const char* name(Lists l) { return l == Lists::FP16 ? "fp16" : (l == Lists::Mixed ? "mixed" : "tiered"); }
const char* name(gpu::LayerSharing s) {
  return s == gpu::LayerSharing::kAuto ? "auto" : (s == gpu::LayerSharing::kNever ? "never" : "always");
}

int tokens_of(int slot) { return 900 + (37 * slot) % 200; }

// Block counts {FP16, INT4, INT2} and FP16 fill of one (layer, sequence).
struct Lengths {
  std::int32_t n[3];
  std::int32_t fill;
};
Lengths lengths_of(const Shape& s, Lists lists, int layer, int slot) {
  const int tokens = tokens_of(slot);
  const int full = tokens / s.block, tail = tokens % s.block;
  const std::int32_t tail_blocks = tail > 0 ? 1 : 0;
  const std::int32_t fill = tail > 0 ? tail : s.block;
  if (lists == Lists::FP16) return {{full + tail_blocks, 0, 0}, fill};
  if (lists == Lists::Tiered && layer % 2 == 1) return {{tail_blocks, full, 0}, tail};
  // A sink and 4 recent windows FP16; of the middle, INT4 from 15% at layer
  // 0 to 75% at the last layer, the rest INT2.
  const int fp16_windows = std::min(full, 5);
  const int middle = full - fp16_windows;
  const double int4_share = 0.15 + 0.6 * layer / (s.layers - 1);
  const auto int4 = static_cast<std::int32_t>(std::lround(int4_share * middle));
  return {{fp16_windows + tail_blocks, int4, middle - int4}, tail > 0 ? tail : (fp16_windows > 0 ? s.block : 0)};
}

// Page tables of kMaxBatch sequences in every layer (ids distinct per pool;
// plan() reads lengths and ids, never the blocks).
std::unique_ptr<gpu::DevicePageTables> make_tables(const Shape& s, Lists lists, cudaStream_t stream) {
  const int longest = (1100 + s.block - 1) / s.block + 1;
  auto tables = std::make_unique<gpu::DevicePageTables>(gpu::PageTableConfig{s.layers, kMaxBatch, longest});
  std::int32_t next_id[3] = {0, 0, 0};
  std::vector<std::int32_t> ids;
  for (int layer = 0; layer < s.layers; ++layer) {
    for (int slot = 0; slot < kMaxBatch; ++slot) {
      const Lengths l = lengths_of(s, lists, layer, slot);
      for (int p = 0; p < 3; ++p) {
        ids.resize(l.n[p]);
        std::iota(ids.begin(), ids.end(), next_id[p]);
        next_id[p] += l.n[p];
        tables->set_blocks(slot, layer, kAllPrecisions[p], ids, p == 0 ? l.fill : 0);
      }
    }
  }
  tables->upload(stream);
  ok(cudaStreamSynchronize(stream), "tables upload");
  return tables;
}

struct Timing {
  double median_us = 0, min_us = 0;
  int reps = 0;
};

Timing time_plan(gpu::DecodePlan& plan, const std::vector<std::int32_t>& slots, cudaStream_t stream, int max_reps) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> us;
  double spent = 0;
  for (int i = -3; i < max_reps && (i < 5 || spent < 0.25e6); ++i) {
    const auto t0 = Clock::now();
    plan.plan(slots, stream);
    const auto t1 = Clock::now();
    ok(cudaStreamSynchronize(stream), "plan upload");
    const double t = std::chrono::duration<double, std::micro>(t1 - t0).count();
    if (i >= 0) {
      us.push_back(t);
      spent += t;
    }
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us.front(), static_cast<int>(us.size())};
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "benchmarks/results/decode_plan_bench.json";
  int reps = 50;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if ((!std::strcmp(argv[i], "--out") || !std::strcmp(argv[i], "--json")) && i + 1 < argc) {
      out_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--out PATH] [--reps N] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (!gpu::cuda_device_available()) {
    std::printf("no CUDA device: benchmark skipped\n");
    return 0;
  }
  if (quick) reps = std::min(reps, 10);
  cudaStream_t stream;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaDeviceProp prop;
  ok(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  const std::vector<int> batches = quick ? std::vector<int>{1, 600} : std::vector<int>{1, 64, 600, 2000};
  const gpu::LayerSharing modes[] = {gpu::LayerSharing::kAuto, gpu::LayerSharing::kAlways, gpu::LayerSharing::kNever};
  json::array rows;
  std::printf("\n%-17s %-7s %5s %-7s %7s %10s %10s %11s %11s %5s\n", "shape", "lists", "batch", "sharing", "planned",
              "items/l0", "staged_KB", "median_us", "min_us", "reps");
  for (const Shape& s : kShapes) {
    for (const Lists lists : {Lists::FP16, Lists::Mixed, Lists::Tiered}) {
      const auto tables = make_tables(s, lists, stream);
      for (const gpu::LayerSharing mode : modes) {
        gpu::DecodePlanConfig config{s.layers, s.q_heads, s.kv_heads, s.head_dim, s.block, kMaxBatch};
        config.layer_sharing = mode;
        gpu::DecodePlan plan(config, *tables);
        for (const int batch : batches) {
          std::vector<std::int32_t> slots(batch);
          std::iota(slots.begin(), slots.end(), 0);
          const Timing t = time_plan(plan, slots, stream, reps);
          // Bytes of the one upload: the ranges, then each planned set once.
          std::int64_t staged = 8LL * s.layers;
          for (int l = 0; l < s.layers; ++l) {
            if (plan.planned_layer(l) == l) staged += static_cast<std::int64_t>(plan.num_items(l)) * kWorkItemBytes;
          }
          std::printf("%-17s %-7s %5d %-7s %7d %10d %10.1f %11.1f %11.1f %5d\n", s.name, name(lists), batch, name(mode),
                      plan.num_planned_layers(), plan.num_items(0), staged / 1024.0, t.median_us, t.min_us, t.reps);
          rows.push_back(json::object{{"shape", s.name},
                                      {"layers", s.layers},
                                      {"q_heads", s.q_heads},
                                      {"kv_heads", s.kv_heads},
                                      {"head_dim", s.head_dim},
                                      {"block_size", s.block},
                                      {"lists", name(lists)},
                                      {"batch", batch},
                                      {"sharing", name(mode)},
                                      {"planned_layers", plan.num_planned_layers()},
                                      {"items_layer0", plan.num_items(0)},
                                      {"staged_bytes", staged},
                                      {"median_us", t.median_us},
                                      {"min_us", t.min_us},
                                      {"reps", t.reps}});
        }
      }
    }
  }
  json::object doc;
  doc["device"] = prop.name;
  doc["sms"] = prop.multiProcessorCount;
  doc["max_batch"] = kMaxBatch;
  doc["tokens"] = "900 + (37 i mod 200) a sequence";
  doc["timing"] = "std::chrono around plan(), median; stream synchronized after each call, untimed";
  doc["rows"] = std::move(rows);
  std::ofstream f(out_path);
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
    return 1;
  }
  f << json::serialize(doc) << "\n";
  std::printf("\nwrote %s\n", out_path.c_str());
  cudaStreamDestroy(stream);
  return 0;
}
