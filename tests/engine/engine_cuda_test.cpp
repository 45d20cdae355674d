// The Engine on the CUDA backend against the CPU backend: the same workload
// (chunked prefill, forks, cancels, swaps, demotions) gives the same
// scheduler decisions and outputs within FP16 rounding for FP16 plans and
// within the quantized kernels' tolerance (tests/cuda) for mixed plans.
// Every test skips visibly without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "engine_loop.h"
#include "mixkv/core/errors.h"
#include "mixkv/kernels/device_arena.h"

namespace mixkv {
namespace {

#define MIXKV_REQUIRE_CUDA()                                                      \
  do {                                                                            \
    if (!::mixkv::gpu::cuda_device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

void ok(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

// Device copies of the loop's arrays, freed after each step.
class DeviceMemory : public test::Memory {
 public:
  ~DeviceMemory() override { release(); }
  TensorView input(const std::vector<Half>& host, std::initializer_list<std::int64_t> shape) override {
    TensorView t = allocate(DType::F16, shape);
    if (!host.empty()) ok(cudaMemcpy(t.data, host.data(), host.size() * sizeof(Half), cudaMemcpyHostToDevice), "H2D");
    return t;
  }
  TensorView output(DType dtype, std::initializer_list<std::int64_t> shape) override {
    TensorView t = allocate(dtype, shape);
    ok(cudaMemset(t.data, 0x7f, std::max<std::size_t>(t.bytes(), 1)), "memset");  // NaN until written
    return t;
  }
  std::vector<float> read(const TensorView& t) override {
    ok(cudaDeviceSynchronize(), "sync");
    std::vector<std::byte> bytes(t.bytes());
    if (!bytes.empty()) ok(cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost), "D2H");
    std::vector<float> r(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (t.dtype == DType::F16) {
        Half h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        r[i] = half_to_float(h);
      } else {
        std::memcpy(&r[i], bytes.data() + 4 * i, 4);
      }
    }
    return r;
  }
  void release() override {
    cudaDeviceSynchronize();
    for (void* p : owned_) cudaFree(p);
    owned_.clear();
  }

 private:
  TensorView allocate(DType dtype, std::initializer_list<std::int64_t> shape) {
    TensorView t = test::HostMemory::view(nullptr, dtype, shape);
    t.device = DeviceKind::CUDA;
    void* p = nullptr;
    ok(cudaMalloc(&p, std::max<std::size_t>(t.bytes(), 16)), "cudaMalloc");
    owned_.push_back(p);
    t.data = p;
    return t;
  }
  std::vector<void*> owned_;
};

EngineConfig config(BackendKind kind, bool demote) {
  EngineConfig c;
  c.cache.shape = CacheShape{2, 2, 64, 32};  // a built decode instance (head_dim 64, block 32)
  c.cache.slab_bytes = 64 << 10;
  c.cache.arena_bytes = 6 * c.cache.slab_bytes;
  c.cache.swap_blocks = {96, 96, 96};
  c.cache.fp16_windows_first = true;
  c.scheduler.max_num_seqs = 8;
  c.scheduler.max_num_batched_tokens = 96;
  c.scheduler.watermark = 0.0;
  c.scheduler.preemption = PreemptionMode::Swap;
  c.scheduler.demote_under_pressure = demote;
  c.scheduler.build_metadata = false;
  c.scheduler.per_layer_slots = false;
  c.num_q_heads = 4;
  c.backend = kind;
  return c;
}

class CudaLoop : public ::testing::TestWithParam<bool> {};

TEST_P(CudaLoop, MatchesTheCpuBackend) {
  MIXKV_REQUIRE_CUDA();
  const bool mixed = GetParam();
  for (const std::uint32_t seed : {1u, 2u}) {
    test::WorkloadOptions o;
    o.seed = seed;
    o.requests = 18;
    o.max_new_tokens = 40;
    o.mixed_plans = mixed;
    const test::Workload workload(CacheShape{2, 2, 64, 32}, o);
    Engine cpu(config(BackendKind::CPU, mixed));
    Engine gpu(config(BackendKind::CUDA, mixed));
    test::HostMemory host;
    DeviceMemory device;
    test::Outputs want, got;
    const test::RunStats sc = test::run_engine(cpu, workload, host, want);
    const test::RunStats sg = test::run_engine(gpu, workload, device, got);
    EXPECT_NO_THROW(gpu.backend().synchronize());  // no id out of range on the device
    EXPECT_EQ(sg.steps, sc.steps);
    EXPECT_EQ(sg.demotions, sc.demotions);
    EXPECT_EQ(sg.swaps_out, sc.swaps_out);
    EXPECT_GT(sg.swaps_out, 0);
    if (mixed) {
      EXPECT_GT(sg.demotions, 0);
    }
    const test::Diff d = test::compare(got, want);
    std::printf("seed %u %s: %lld decode tokens, max |out| difference %.2e, max |lse| difference %.2e\n", seed,
                mixed ? "mixed" : "fp16", static_cast<long long>(sg.decode_tokens), d.out, d.lse);
    // FP16: rounding of the output only; mixed: the tests/cuda bound.
    EXPECT_LE(d.out, mixed ? 5e-3 : 2e-3) << "seed " << seed;
    EXPECT_LE(d.lse, 1e-3) << "seed " << seed;
    test::expect_empty(gpu.cache());
  }
}

// Prefill through the cache (extend attention over the prefix pages) and
// speculative decoding (3 drafts a decode, verified by extend attention):
// the same decisions and outputs as the CPU backend.
TEST_P(CudaLoop, PrefillAndDraftsMatchTheCpuBackend) {
  MIXKV_REQUIRE_CUDA();
  const bool mixed = GetParam();
  for (const std::uint32_t seed : {1u, 2u}) {
    test::WorkloadOptions o;
    o.seed = seed;
    o.requests = 18;
    o.max_new_tokens = 40;
    o.mixed_plans = mixed;
    const test::Workload workload(CacheShape{2, 2, 64, 32}, o);
    EngineConfig cc = config(BackendKind::CPU, mixed), gc = config(BackendKind::CUDA, mixed);
    cc.scheduler.num_speculative_tokens = gc.scheduler.num_speculative_tokens = 3;
    Engine cpu(cc);
    Engine gpu(gc);
    test::HostMemory host;
    DeviceMemory device;
    test::Outputs want, got;
    const test::RunStats sc = test::run_engine(cpu, workload, host, want, /*through_cache=*/true);
    const test::RunStats sg = test::run_engine(gpu, workload, device, got, /*through_cache=*/true);
    EXPECT_NO_THROW(gpu.backend().synchronize());
    EXPECT_EQ(sg.steps, sc.steps);
    EXPECT_EQ(sg.drafts, sc.drafts);
    EXPECT_GT(sg.drafts, 0);
    const test::Diff d = test::compare(got, want);
    const test::Diff p = test::compare(got.prefill, want.prefill);
    std::printf("seed %u %s: %lld drafts, decode |out| %.2e |lse| %.2e, prefill |out| %.2e |lse| %.2e\n", seed,
                mixed ? "mixed" : "fp16", static_cast<long long>(sg.drafts), d.out, d.lse, p.out, p.lse);
    EXPECT_LE(d.out, mixed ? 5e-3 : 2e-3) << "seed " << seed;
    EXPECT_LE(d.lse, 1e-3) << "seed " << seed;
    EXPECT_LE(p.out, mixed ? 5e-3 : 2e-3) << "seed " << seed;
    EXPECT_LE(p.lse, 1e-3) << "seed " << seed;
    test::expect_empty(gpu.cache());
  }
}

// Age tiers (text, prompt tails and generated tokens demoted as they age,
// INT4 in layer 0 and INT2 in layer 1): the stream blocks' demotions, the
// page tables they change and the decodes over them match the CPU backend.
TEST_P(CudaLoop, AgeTiersMatchTheCpuBackend) {
  MIXKV_REQUIRE_CUDA();
  const bool mixed = GetParam();
  test::WorkloadOptions o;
  o.seed = 3;
  o.requests = 18;
  o.max_new_tokens = 40;
  o.mixed_plans = mixed;
  const test::Workload workload(CacheShape{2, 2, 64, 32}, o);
  EngineConfig cc = config(BackendKind::CPU, mixed), gc = config(BackendKind::CUDA, mixed);
  for (EngineConfig* c : {&cc, &gc}) {
    c->scheduler.age_tiers.enabled = true;
    c->scheduler.age_tiers.recent_windows = 1;
    c->scheduler.age_tiers.layer_floor = {Precision::INT4, Precision::INT2};
  }
  Engine cpu(cc);
  Engine gpu(gc);
  test::HostMemory host;
  DeviceMemory device;
  test::Outputs want, got;
  const test::RunStats sc = test::run_engine(cpu, workload, host, want);
  const test::RunStats sg = test::run_engine(gpu, workload, device, got);
  EXPECT_NO_THROW(gpu.backend().synchronize());
  EXPECT_EQ(sg.steps, sc.steps);
  EXPECT_EQ(sg.demotions, sc.demotions);
  EXPECT_GT(gpu.scheduler().stats().age_demotions, 0);
  EXPECT_EQ(gpu.scheduler().stats().age_demotions, cpu.scheduler().stats().age_demotions);
  const test::Diff d = test::compare(got, want);
  std::printf("age tiers %s: %lld age demotions, max |out| difference %.2e, max |lse| difference %.2e\n",
              mixed ? "mixed" : "fp16", static_cast<long long>(gpu.scheduler().stats().age_demotions), d.out, d.lse);
  EXPECT_LE(d.out, 5e-3);
  EXPECT_LE(d.lse, 1e-3);
  test::expect_empty(gpu.cache());
}

INSTANTIATE_TEST_SUITE_P(Plans, CudaLoop, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("Mixed") : std::string("Fp16"); });

TEST(EngineCuda, HostArraysAreRefusedByName) {
  MIXKV_REQUIRE_CUDA();
  Engine engine(config(BackendKind::CUDA, true));
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 20}});
  r.max_new_tokens = 2;
  engine.add_request(r);
  engine.step();
  test::HostMemory host;
  const std::vector<Half> rows(20 * 2 * 64);
  const TensorView k = host.input(rows, {20, 2, 64});
  try {
    engine.store(0, k, k);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Engine::store: k: expected dtype float16 on cuda:0"), std::string::npos)
        << e.what();
  }
  DeviceMemory device;
  TensorView dk = device.input(rows, {20, 2, 64});
  TensorView misaligned = dk;
  misaligned.data = static_cast<std::byte*>(dk.data) + 2;
  try {
    engine.store(0, misaligned, dk);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
  }
  engine.store(0, dk, dk);
  engine.store(1, dk, dk);
  engine.backend().synchronize();
}

TEST(EngineCuda, BadDeviceIsNamed) {
  MIXKV_REQUIRE_CUDA();
  EngineConfig c = config(BackendKind::CUDA, true);
  c.cuda_device = 64;
  try {
    Engine e(c);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cuda_device = 64"), std::string::npos) << e.what();
  }
}

// A BF16 cache runs on the CUDA backend; float16 arrays for it are refused
// naming the argument before anything is enqueued, and bfloat16 ones are
// stored (tests/cuda/bf16_*_test.cpp check the kernels against the CPU).
TEST(EngineCuda, Bf16CacheTakesBf16ArraysOnly) {
  MIXKV_REQUIRE_CUDA();
  EngineConfig c = config(BackendKind::CUDA, true);
  c.cache.shape.dtype = DType::BF16;
  Engine engine(c);
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 20}});
  r.max_new_tokens = 2;
  engine.add_request(r);
  engine.step();
  DeviceMemory device;
  const std::vector<Half> rows(20 * 2 * 64);
  const TensorView f16 = device.input(rows, {20, 2, 64});
  try {
    engine.store(0, f16, f16);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Engine::store: k: expected dtype bfloat16"), std::string::npos) << e.what();
  }
  TensorView bf16 = f16;  // zeros: the same bytes in either type
  bf16.dtype = DType::BF16;
  engine.store(0, bf16, bf16);
  engine.store(1, bf16, bf16);
  engine.backend().synchronize();
}

}  // namespace
}  // namespace mixkv
