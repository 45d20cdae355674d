// GPU swap path: gpu::swap_blocks moving the lists that
// KVCacheManager::swap_out / swap_in return, against the PCIe ceiling a
// user would compare with: ONE contiguous cudaMemcpyAsync of the same bytes
// between the device and pinned host memory. Also shown: one cudaMemcpyAsync
// per block (what a backend without the kernel would issue).
// Blocks: 16 tokens x 8 KV heads x 128 dims (FP16 block 64 KiB, INT4
// 20.5 KiB, INT2 12.5 KiB). Cases: 1,000 and 10,000 FP16 blocks, and a mixed
// list of 10% FP16, 30% INT4, 60% INT2 blocks (decode_bench's mixed plan).
// Each list comes from the manager: one sequence whose prompt fills N
// blocks, swapped out (device -> host) and back in (host -> device); the
// same list is then timed again and again (the copies are idempotent).
// Median of --reps CUDA-event timings after 3 warm-ups.
// Usage: mixkv_swap_bench [--json PATH] [--reps N] [--blocks 1000,10000] [--quick]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_event_timing.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/swap.h"

using namespace mixkv;

namespace {

using bench::ok;

constexpr int kKVHeads = 8, kDim = 128, kBlock = 16;

struct Case {
  std::string name;
  int blocks;
  double fp16, int4;  // fractions of the blocks (rest INT2)
};

struct Result {
  double kernel_us, memcpy_us, per_block_us, upload_us;
};

std::size_t list_bytes(const KVCacheManager& m, const std::vector<SwapCopy>& list) {
  std::size_t bytes = 0;
  for (const SwapCopy& c : list) bytes += m.format(c.pool).block_bytes();
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "swap_bench.json";
  int reps = 20;
  bool quick = false;
  std::vector<int> sizes = {1000, 10000};
  for (int i = 1; i < argc; ++i) {
    if ((!std::strcmp(argv[i], "--json") || !std::strcmp(argv[i], "--out")) && i + 1 < argc)
      json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--blocks") && i + 1 < argc) {
      sizes.clear();
      std::stringstream ss(argv[++i]);
      std::string item;
      while (std::getline(ss, item, ',')) sizes.push_back(std::atoi(item.c_str()));
    } else {
      std::fprintf(stderr, "usage: %s [--json PATH] [--reps N] [--blocks 1000,10000] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (!gpu::cuda_device_available()) {
    std::printf("no CUDA device: benchmark skipped\n");
    return 0;
  }
  if (quick) sizes = {1000};
  cudaStream_t stream;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaDeviceProp prop;
  ok(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  std::vector<Case> cases;
  for (int n : sizes) cases.push_back({"fp16", n, 1.0, 0.0});
  for (int n : sizes) cases.push_back({"mixed", n, 0.1, 0.3});

  std::ostringstream json;
  bool first = true;
  std::printf("\n%-6s %7s %-4s %9s %10s %9s %10s %9s %12s %9s %10s\n", "list", "blocks", "dir", "MB", "kernel_us",
              "GB/s", "memcpy_us", "GB/s", "per_block_us", "GB/s", "upload_us");
  for (const Case& c : cases) {
    // One sequence of c.blocks visual windows in one layer: window w takes
    // one block of the pool its precision says.
    CacheConfig config;
    config.shape = CacheShape{1, kKVHeads, kDim, kBlock};
    config.slab_bytes = std::size_t{2} << 20;
    std::mt19937_64 rng(7);
    PrecisionPlan plan(1, c.blocks);
    BlockCounts count{};
    for (int w = 0; w < c.blocks; ++w) {
      const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      const Precision p = u < c.fp16 ? Precision::FP16 : (u < c.fp16 + c.int4 ? Precision::INT4 : Precision::INT2);
      plan.set(0, w, p);
      ++count[pool_index(p)];
    }
    std::size_t slabs = 0;
    for (const Precision p : kAllPrecisions) {
      const std::size_t per_slab = config.slab_bytes / BlockFormat{p, kKVHeads, kDim, kBlock}.block_bytes();
      slabs += (static_cast<std::size_t>(count[pool_index(p)]) + per_slab - 1) / per_slab;
    }
    config.arena_bytes = (slabs + 1) * config.slab_bytes;
    config.swap_blocks = count;
    KVCacheManager manager(config);
    gpu::DeviceArena arena(config.arena_bytes);
    ok(cudaMemset(arena.base(), 0x3c, config.arena_bytes), "memset");
    gpu::PinnedSwapBuffer host(manager.swap_layout());
    const gpu::DevicePools pools = arena.pool_views(manager.arena_layout());
    const gpu::DevicePools host_pools = host.device_views(manager.swap_layout());
    const gpu::DevicePools host_cpu = host.host_views(manager.swap_layout());
    manager.add_sequence(1, TokenLayout({{TokenKind::Visual, c.blocks * kBlock}}), plan);
    gpu::DeviceSwapList list;

    for (const SwapDirection dir : {SwapDirection::DeviceToHost, SwapDirection::HostToDevice}) {
      const bool out = dir == SwapDirection::DeviceToHost;
      const std::vector<SwapCopy> copies = out ? manager.swap_out(1) : manager.swap_in(1);
      const std::size_t bytes = list_bytes(manager, copies);
      const auto t0 = std::chrono::steady_clock::now();
      list.upload(copies, dir, manager.arena_layout(), manager.swap_layout(), stream);
      const double upload_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      gpu::SwapBlocksArgs args;
      list.fill(args);
      args.device = pools;
      args.host = host_pools;
      args.stream = stream;
      Result r{};
      r.upload_us = upload_us;
      r.kernel_us = bench::median_event_us(reps, stream, [&] { gpu::swap_blocks(args); });
      // The ceiling: the same bytes in one transfer by the copy engines.
      r.memcpy_us = bench::median_event_us(reps, stream, [&] {
        ok(out ? cudaMemcpyAsync(host.host(), arena.base(), bytes, cudaMemcpyDeviceToHost, stream)
               : cudaMemcpyAsync(arena.base(), host.host(), bytes, cudaMemcpyHostToDevice, stream),
           "cudaMemcpyAsync");
      });
      r.per_block_us = bench::median_event_us(std::min(reps, 5), stream, [&] {
        for (const SwapCopy& s : copies) {
          const int p = pool_index(s.pool);
          const std::size_t n = pools[p].format.block_bytes();
          ok(out ? cudaMemcpyAsync(host_cpu[p].block(s.host_slot), pools[p].block(s.device_block), n,
                                   cudaMemcpyDeviceToHost, stream)
                 : cudaMemcpyAsync(pools[p].block(s.device_block), host_cpu[p].block(s.host_slot), n,
                                   cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync per block");
        }
      });
      const double mb = bytes / 1e6;
      auto gbps = [&](double us) { return bytes / us / 1e3; };
      std::printf("%-6s %7d %-4s %9.1f %10.1f %9.1f %10.1f %9.1f %12.1f %9.1f %10.1f\n", c.name.c_str(), c.blocks,
                  out ? "D2H" : "H2D", mb, r.kernel_us, gbps(r.kernel_us), r.memcpy_us, gbps(r.memcpy_us),
                  r.per_block_us, gbps(r.per_block_us), r.upload_us);
      json << (first ? "\n    " : ",\n    ") << "{\"list\": \"" << c.name << "\", \"blocks\": " << c.blocks
           << ", \"fp16_blocks\": " << count[0] << ", \"int4_blocks\": " << count[1]
           << ", \"int2_blocks\": " << count[2] << ", \"direction\": \"" << (out ? "device_to_host" : "host_to_device")
           << "\", \"bytes\": " << bytes << ", \"kernel_us\": " << r.kernel_us
           << ", \"kernel_gbps\": " << gbps(r.kernel_us) << ", \"memcpy_us\": " << r.memcpy_us
           << ", \"memcpy_gbps\": " << gbps(r.memcpy_us) << ", \"kernel_vs_memcpy\": " << r.memcpy_us / r.kernel_us
           << ", \"per_block_memcpy_us\": " << r.per_block_us << ", \"per_block_memcpy_gbps\": " << gbps(r.per_block_us)
           << ", \"upload_host_us\": " << r.upload_us << "}";
      first = false;
    }
  }
  std::ofstream f(json_path);
  f << "{\n  \"device\": \"" << prop.name << "\",\n  \"sms\": " << prop.multiProcessorCount
    << ",\n  \"shape\": {\"kv_heads\": " << kKVHeads << ", \"head_dim\": " << kDim << ", \"block_size\": " << kBlock
    << "},\n  \"reps\": " << reps << ",\n  \"swap\": [" << json.str() << "\n  ]\n}\n";
  std::printf("\nwrote %s\n", json_path.c_str());
  cudaStreamDestroy(stream);
  return 0;
}
