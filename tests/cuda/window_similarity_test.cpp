// The CUDA planner against the CPU planner and the paper's double loop.
#include "mixkv/planner/cuda_window_planner.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <vector>

#include "../planner/planner_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/planner/cuda_plan_source.h"
#include "mixkv/planner/window_planner.h"
#include "pairwise_similarity.h"

namespace mixkv {
namespace {

using test::expect_error;

bool have_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

void cuda_ok(cudaError_t status) { ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status); }

// A host matrix copied to the device, `offset_bytes` past a 256-byte aligned
// allocation (2 makes the rows misaligned for 16-byte loads).
class DeviceMatrix {
 public:
  explicit DeviceMatrix(const test::Matrix& m, std::size_t offset_bytes = 0)
      : type_(m.type), tokens_(m.tokens), hidden_(m.hidden), offset_(offset_bytes) {
    const std::size_t bytes = static_cast<std::size_t>(m.tokens) * m.hidden * (m.type == ElementType::F32 ? 4 : 2);
    EXPECT_EQ(cudaMalloc(&base_, bytes + offset_bytes), cudaSuccess);
    const void* src = m.type == ElementType::F32 ? static_cast<const void*>(m.f32.data()) : m.bits16.data();
    EXPECT_EQ(cudaMemcpy(static_cast<char*>(base_) + offset_bytes, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  DeviceMatrix(const DeviceMatrix&) = delete;
  DeviceMatrix& operator=(const DeviceMatrix&) = delete;
  DeviceMatrix(DeviceMatrix&& other) noexcept
      : type_(other.type_), tokens_(other.tokens_), hidden_(other.hidden_), base_(other.base_), offset_(other.offset_) {
    other.base_ = nullptr;
  }
  ~DeviceMatrix() {
    if (base_ != nullptr) cudaFree(base_);
  }
  EmbeddingsView view() const { return {static_cast<const char*>(base_) + offset_, type_, tokens_, hidden_}; }

 private:
  ElementType type_;
  std::int64_t tokens_;
  std::int32_t hidden_;
  void* base_ = nullptr;
  std::size_t offset_ = 0;
};

class CudaPlannerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    cuda_ok(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

PlannerConfig config_for(std::int32_t window_size, std::int32_t layers, BatchPolicy policy = BatchPolicy::PerRequest) {
  PlannerConfig config;
  config.window_size = window_size;
  for (std::int32_t l = 0; l < layers; ++l) config.sensitivities.push_back(-0.2 + 1.2 * l / std::max(1, layers - 1));
  config.min_precision.assign(static_cast<std::size_t>(layers), Precision::INT2);
  config.min_precision[1 % layers] = Precision::INT4;
  config.batch_policy = policy;
  return config;
}

// A batch with different numbers of frames and text tokens; request 2 has no
// full window.
std::vector<TokenLayout> batch_layouts(std::int32_t window_size) {
  return {
      TokenLayout({{TokenKind::Text, 5}, {TokenKind::Visual, 7 * window_size + 3}, {TokenKind::Text, 11}}),
      TokenLayout({{TokenKind::Visual, 3 * window_size},
                   {TokenKind::Text, 1},
                   {TokenKind::Visual, 2 * window_size + 1},
                   {TokenKind::Text, 4}}),
      TokenLayout({{TokenKind::Text, 2}, {TokenKind::Visual, window_size - 1}}),
      TokenLayout({{TokenKind::Text, 64}, {TokenKind::Visual, 12 * window_size}}),
  };
}

struct Batch {
  std::vector<TokenLayout> layouts;
  std::vector<test::Matrix> host;
  std::vector<DeviceMatrix> device;
  std::vector<EmbeddingsView> host_views, device_views;

  Batch(ElementType type, std::int32_t hidden, std::int32_t window_size, std::size_t offset_bytes = 0)
      : layouts(batch_layouts(window_size)) {
    host.reserve(layouts.size());
    device.reserve(layouts.size());
    for (std::size_t r = 0; r < layouts.size(); ++r) {
      host.push_back(test::random_embeddings(type, layouts[r].num_tokens(), hidden, 300 + static_cast<int>(r)));
    }
    for (const test::Matrix& m : host) {
      device.emplace_back(m, offset_bytes);
      host_views.push_back(m.view());
      device_views.push_back(device.back().view());
    }
  }
};

struct Shape {
  ElementType type;
  std::int32_t hidden;
  std::int32_t window_size;
  std::size_t offset_bytes;
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "type " << static_cast<int>(s.type) << ", hidden " << s.hidden << ", window " << s.window_size << ", offset "
      << s.offset_bytes;
}

class CudaPlannerShapes : public CudaPlannerTest, public ::testing::WithParamInterface<Shape> {};

TEST_P(CudaPlannerShapes, MatchesTheCpuPlannerAndTheDoubleLoop) {
  const Shape s = GetParam();
  const Batch batch(s.type, s.hidden, s.window_size, s.offset_bytes);
  const PlannerConfig config = config_for(s.window_size, 6);
  gpu::CudaWindowPlanner gpu_planner(config);
  const WindowPlanner cpu_planner(config);
  const std::vector<PrecisionPlan> plans = gpu_planner.plan(batch.layouts, batch.device_views, stream_);
  ASSERT_EQ(plans.size(), batch.layouts.size());
  for (std::size_t r = 0; r < plans.size(); ++r) {
    const std::vector<double> exact = test::brute_force_similarity(batch.layouts[r], batch.host[r], s.window_size);
    const std::vector<float> cpu = window_similarity(batch.layouts[r], batch.host_views[r], s.window_size);
    ASSERT_EQ(plans[r].num_windows(), static_cast<std::int32_t>(exact.size())) << "request " << r;
    std::vector<float> scores;
    for (std::int32_t i = 0; i < plans[r].num_windows(); ++i) {
      EXPECT_NEAR(plans[r].score(i), exact[i], 1e-6) << "request " << r << " window " << i;
      EXPECT_NEAR(plans[r].score(i), cpu[i], 1e-6) << "request " << r << " window " << i;
      scores.push_back(plans[r].score(i));
    }
    // Same thresholds and rule as the CPU for the same scores.
    EXPECT_EQ(plans[r], cpu_planner.plan_from_scores(scores)) << "request " << r;
  }
}

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  static const char* const kNames[] = {"F32", "F16", "BF16"};
  return std::string(kNames[static_cast<int>(info.param.type)]) + "_hidden" + std::to_string(info.param.hidden) +
         "_window" + std::to_string(info.param.window_size) + "_offset" + std::to_string(info.param.offset_bytes);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaPlannerShapes,
                         ::testing::Values(Shape{ElementType::F32, 128, 32, 0}, Shape{ElementType::F16, 256, 16, 0},
                                           Shape{ElementType::BF16, 64, 32, 0}, Shape{ElementType::F32, 37, 16, 0},
                                           Shape{ElementType::F16, 128, 32, 2}, Shape{ElementType::BF16, 3584, 32, 0},
                                           Shape{ElementType::F16, 3584, 16, 0}, Shape{ElementType::F32, 1, 16, 0},
                                           Shape{ElementType::F32, 520, 48, 4}),
                         shape_name);

// Plans `layouts` (random embeddings, seeds from `seed`) on the GPU for each
// shape and checks every score and decision against the CPU planner.
void expect_gpu_plans_match_cpu(const std::vector<TokenLayout>& layouts, const std::vector<Shape>& shapes, int seed,
                                cudaStream_t stream) {
  const PlannerConfig config = config_for(32, 3);
  const WindowPlanner cpu_planner(config);
  gpu::CudaWindowPlanner gpu_planner(config);
  for (const Shape s : shapes) {
    std::vector<test::Matrix> host;
    std::vector<DeviceMatrix> device;
    std::vector<EmbeddingsView> views;
    device.reserve(layouts.size());
    for (std::size_t r = 0; r < layouts.size(); ++r) {
      host.push_back(test::random_embeddings(s.type, layouts[r].num_tokens(), s.hidden, seed + static_cast<int>(r)));
      device.emplace_back(host.back(), s.offset_bytes);
      views.push_back(device.back().view());
    }
    const std::vector<PrecisionPlan> plans = gpu_planner.plan(layouts, views, stream);
    ASSERT_EQ(plans.size(), layouts.size());
    for (std::size_t r = 0; r < plans.size(); ++r) {
      const std::vector<float> cpu = window_similarity(layouts[r], host[r].view(), 32);
      ASSERT_EQ(plans[r].num_windows(), static_cast<std::int32_t>(cpu.size())) << "request " << r;
      std::vector<float> scores;
      for (std::int32_t i = 0; i < plans[r].num_windows(); ++i) {
        EXPECT_NEAR(plans[r].score(i), cpu[i], 1e-6)
            << "type " << static_cast<int>(s.type) << " request " << r << " window " << i;
        scores.push_back(plans[r].score(i));
      }
      EXPECT_EQ(plans[r], cpu_planner.plan_from_scores(scores)) << "request " << r;
    }
  }
}

// The shapes above give every block of the row kernel a single row. Here
// (7,360 window rows) each block takes several, a warp more than one, and
// block shares cross request boundaries, on both load paths.
TEST_F(CudaPlannerTest, ManyRowsAcrossRequestsMatchTheCpuPlanner) {
  std::vector<TokenLayout> layouts;
  for (std::int32_t r = 0; r < 5; ++r) {
    layouts.push_back(
        TokenLayout({{TokenKind::Text, 3 + 7 * r}, {TokenKind::Visual, (40 + 3 * r) * 32 + r}, {TokenKind::Text, 2}}));
  }
  expect_gpu_plans_match_cpu(layouts, {Shape{ElementType::F16, 256, 32, 0}, Shape{ElementType::BF16, 72, 32, 2}}, 700,
                             stream_);
}

// Prompts longer than the text kernels' rounds (8 rows a warp, 8 warps a
// block: 64 rows) and rows wider than a round of 16-byte loads (F16 5,000
// channels; F32 1,001 channels on the scalar path) take every text loop more
// than once.
TEST_F(CudaPlannerTest, LongPromptsAndWideRowsMatchTheCpuPlanner) {
  const std::vector<TokenLayout> layouts = {
      TokenLayout({{TokenKind::Text, 300}, {TokenKind::Visual, 4 * 32}, {TokenKind::Text, 7}}),
      TokenLayout({{TokenKind::Visual, 3 * 32}, {TokenKind::Text, 600}}),
      TokenLayout({{TokenKind::Text, 1}, {TokenKind::Visual, 2 * 32}}),
  };
  expect_gpu_plans_match_cpu(layouts, {Shape{ElementType::F16, 5000, 32, 0}, Shape{ElementType::F32, 1001, 32, 0}}, 900,
                             stream_);
}

TEST_F(CudaPlannerTest, ResultsAreReproducibleAndStepsCanBeSplit) {
  const Batch batch(ElementType::F16, 512, 32);
  gpu::CudaWindowPlanner planner(config_for(32, 4));
  const std::vector<PrecisionPlan> first = planner.plan(batch.layouts, batch.device_views, stream_);
  planner.prepare(batch.layouts, batch.device_views, stream_);
  planner.launch(stream_);
  std::vector<float> device_scores(static_cast<std::size_t>(planner.num_windows()));
  cuda_ok(cudaMemcpyAsync(device_scores.data(), planner.device_scores(), device_scores.size() * 4,
                          cudaMemcpyDeviceToHost, stream_));
  const std::vector<PrecisionPlan> second = planner.finish(stream_);
  EXPECT_EQ(first, second);  // bit-identical scores and precisions
  std::size_t w = 0;
  for (const PrecisionPlan& p : second) {
    for (std::int32_t i = 0; i < p.num_windows(); ++i) EXPECT_EQ(device_scores[w++], p.score(i));
  }
  EXPECT_EQ(w, device_scores.size());
}

TEST_F(CudaPlannerTest, MajorityVoteMatchesTheCpuVote) {
  // Requests of equal shape, as in the paper's batches, plus one shorter.
  const Batch batch(ElementType::BF16, 96, 16);
  std::vector<PrecisionPlan> own =
      gpu::CudaWindowPlanner(config_for(16, 5)).plan(batch.layouts, batch.device_views, stream_);
  const std::vector<PrecisionPlan> voted = gpu::CudaWindowPlanner(config_for(16, 5, BatchPolicy::MajorityVote))
                                               .plan(batch.layouts, batch.device_views, stream_);
  majority_vote(own);
  EXPECT_EQ(voted, own);
}

TEST_F(CudaPlannerTest, ReportsNonFiniteEmbeddingsAndStaysUsable) {
  Batch batch(ElementType::F32, 64, 16);
  gpu::CudaWindowPlanner planner(config_for(16, 3));
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    test::Matrix visual = batch.host[1];
    visual.set(20, 5, bad);  // request 1: window 1 spans rows 16..31
    const DeviceMatrix d_visual(visual);
    std::vector<EmbeddingsView> views = batch.device_views;
    views[1] = d_visual.view();
    expect_error<InvalidArgument>([&] { planner.plan(batch.layouts, views, stream_); },
                                  "embeddings[1] row 20 (visual window 1) holds a NaN or infinite value");

    test::Matrix text = batch.host[3];
    text.set(63, 0, bad);
    const DeviceMatrix d_text(text);
    views = batch.device_views;
    views[3] = d_text.view();
    expect_error<InvalidArgument>([&] { planner.plan(batch.layouts, views, stream_); },
                                  "embeddings[3] row 63 (text) holds a NaN or infinite value");
  }
  // Rows outside every window (request 0's visual tail) are not read.
  test::Matrix tail = batch.host[0];
  tail.set(5 + 7 * 16 + 1, 0, std::numeric_limits<float>::quiet_NaN());
  const DeviceMatrix d_tail(tail);
  std::vector<EmbeddingsView> views = batch.device_views;
  views[0] = d_tail.view();
  EXPECT_NO_THROW(planner.plan(batch.layouts, views, stream_));
  EXPECT_EQ(planner.plan(batch.layouts, batch.device_views, stream_).size(), 4u);
}

// The window kernel counts each window's rows and the windows done on the
// device; text_norm_kernel clears the counters at every launch. Batches of
// different sizes in turn, errors in between and the majority vote must
// leave every result as a fresh planner's, and a batch without a full window
// (no window kernel: the error word takes a copy instead) must still report.
TEST_F(CudaPlannerTest, RepeatedLaunchesOfOtherBatchesMatchFreshPlanners) {
  const Batch large(ElementType::F16, 384, 16);
  const std::vector<TokenLayout> small_layouts = {
      TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 2 * 16 + 5}}),
  };
  std::vector<test::Matrix> small_host = {test::random_embeddings(ElementType::F16, 3 + 2 * 16 + 5, 384, 41)};
  const DeviceMatrix small_device(small_host[0]);
  const std::vector<EmbeddingsView> small_views = {small_device.view()};
  // Shorter than a window: text rows only are read.
  const std::vector<TokenLayout> no_window_layouts = {TokenLayout({{TokenKind::Visual, 15}, {TokenKind::Text, 4}})};
  test::Matrix no_window_host = test::random_embeddings(ElementType::F16, 19, 384, 42);
  no_window_host.set(17, 3, std::numeric_limits<float>::infinity());
  const DeviceMatrix no_window_bad(no_window_host);
  const std::vector<EmbeddingsView> no_window_views = {no_window_bad.view()};

  for (const BatchPolicy policy : {BatchPolicy::PerRequest, BatchPolicy::MajorityVote}) {
    const PlannerConfig config = config_for(16, 40, policy);  // more layers than a warp has lanes
    const std::vector<PrecisionPlan> large_fresh =
        gpu::CudaWindowPlanner(config).plan(large.layouts, large.device_views, stream_);
    const std::vector<PrecisionPlan> small_fresh =
        gpu::CudaWindowPlanner(config).plan(small_layouts, small_views, stream_);
    gpu::CudaWindowPlanner planner(config);
    for (int round = 0; round < 3; ++round) {
      EXPECT_EQ(planner.plan(large.layouts, large.device_views, stream_), large_fresh) << "round " << round;
      EXPECT_EQ(planner.plan(small_layouts, small_views, stream_), small_fresh) << "round " << round;
      expect_error<InvalidArgument>([&] { planner.plan(no_window_layouts, no_window_views, stream_); },
                                    "embeddings[0] row 17 (text) holds a NaN or infinite value");
    }
    std::vector<EmbeddingsView> good = no_window_views;
    const DeviceMatrix no_window_good(test::random_embeddings(ElementType::F16, 19, 384, 43));
    good[0] = no_window_good.view();
    const std::vector<PrecisionPlan> empty = planner.plan(no_window_layouts, good, stream_);
    ASSERT_EQ(empty.size(), 1u);
    EXPECT_EQ(empty[0].num_windows(), 0);
    EXPECT_EQ(planner.plan(large.layouts, large.device_views, stream_), large_fresh);
  }
}

TEST_F(CudaPlannerTest, RejectsBadUse) {
  const Batch batch(ElementType::F16, 64, 16);
  gpu::CudaWindowPlanner planner(config_for(16, 2));
  expect_error<InvalidArgument>([&] { planner.launch(stream_); }, "launch() without a prepared batch");
  expect_error<InvalidArgument>([&] { planner.finish(stream_); }, "finish() without a launched batch");
  expect_error<InvalidArgument>([&] { planner.plan({}, {}, stream_); }, "layouts is empty");

  std::vector<EmbeddingsView> mixed = batch.device_views;
  mixed[2].type = ElementType::BF16;
  expect_error<InvalidArgument>([&] { planner.plan(batch.layouts, mixed, stream_); },
                                "embeddings[2].type = 2, expected 1");
  std::vector<EmbeddingsView> short_rows = batch.device_views;
  short_rows[0].num_tokens -= 1;
  expect_error<InvalidArgument>([&] { planner.plan(batch.layouts, short_rows, stream_); }, "embeddings[0].num_tokens");
  const std::vector<TokenLayout> no_text = {TokenLayout({{TokenKind::Visual, 32}})};
  std::vector<EmbeddingsView> one = {batch.device_views[0]};
  one[0].num_tokens = 32;  // the shape matches, so only the missing text is wrong
  expect_error<InvalidArgument>([&] { planner.plan(no_text, one, stream_); }, "layouts[0] has no text tokens");
  std::vector<EmbeddingsView> wide = batch.device_views;
  for (EmbeddingsView& v : wide) v.hidden = 50000;
  expect_error<InvalidArgument>([&] { planner.plan(batch.layouts, wide, stream_); },
                                "embeddings[0].hidden = 50000, expected at most 49152");

  planner.prepare(batch.layouts, batch.device_views, stream_);
  expect_error<InvalidArgument>([&] { planner.prepare(batch.layouts, batch.device_views, stream_); },
                                "prepare() called while a batch is in flight");
  planner.launch(stream_);
  expect_error<InvalidArgument>([&] { planner.launch(stream_); }, "launch() called twice");
  EXPECT_EQ(planner.finish(stream_).size(), 4u);

  PlannerConfig bad = config_for(16, 2);
  bad.alpha = 0.0;
  expect_error<InvalidArgument>([&] { gpu::CudaWindowPlanner{bad}; }, "alpha = 0");
}

TEST_F(CudaPlannerTest, PairwiseCublasSearchAgreesWithNormalizedMeans) {
  const Batch batch(ElementType::F16, 256, 32);
  std::size_t windows = 0;
  for (const TokenLayout& l : batch.layouts) windows += static_cast<std::size_t>(l.num_windows(32));
  float* d_scores = nullptr;
  cuda_ok(cudaMalloc(&d_scores, windows * 4));
  bench::PairwiseSimilarity search;
  search.run(batch.layouts, batch.device_views, 32, d_scores, stream_);
  std::vector<float> pairwise(windows);
  cuda_ok(cudaMemcpyAsync(pairwise.data(), d_scores, windows * 4, cudaMemcpyDeviceToHost, stream_));
  cuda_ok(cudaStreamSynchronize(stream_));
  cudaFree(d_scores);

  std::size_t w = 0;
  for (std::size_t r = 0; r < batch.layouts.size(); ++r) {
    const std::vector<double> exact = test::brute_force_similarity(batch.layouts[r], batch.host[r], 32);
    for (const double e : exact) EXPECT_NEAR(pairwise[w++], e, 1e-5) << "request " << r;
  }
  EXPECT_EQ(w, windows);
}

// What the scheduler sees: plans through the PlanSource interface, from
// device embeddings, with the CPU planner's decisions under either batch
// policy; an empty batch and a failed call as the CPU source has them.
TEST_F(CudaPlannerTest, PlanSourceGivesTheCpuPlannersDecisions) {
  const Batch batch(ElementType::BF16, 320, 16);
  for (const BatchPolicy policy : {BatchPolicy::PerRequest, BatchPolicy::MajorityVote}) {
    const PlannerConfig config = config_for(16, 6, policy);
    const std::shared_ptr<PlanSource> source = gpu::make_cuda_plan_source(config, stream_);
    EXPECT_EQ(source->config().sensitivities, config.sensitivities);
    EXPECT_EQ(source->config().min_precision, config.min_precision);
    EXPECT_EQ(source->config().batch_policy, policy);

    const WindowPlanner cpu_planner(config);
    const std::vector<PrecisionPlan> plans = source->plan(batch.layouts, batch.device_views);
    const std::vector<PrecisionPlan> cpu = cpu_planner.plan(batch.layouts, batch.host_views);
    ASSERT_EQ(plans.size(), cpu.size());
    // The CPU planner's rule (and vote) on the GPU's scores gives the GPU's
    // plans exactly; the scores themselves agree to float rounding.
    std::vector<PrecisionPlan> expected;
    for (std::size_t r = 0; r < plans.size(); ++r) {
      ASSERT_EQ(plans[r].num_windows(), cpu[r].num_windows()) << "request " << r;
      std::vector<float> scores;
      for (std::int32_t i = 0; i < plans[r].num_windows(); ++i) {
        EXPECT_NEAR(plans[r].score(i), cpu[r].score(i), 1e-6) << "request " << r << " window " << i;
        scores.push_back(plans[r].score(i));
      }
      expected.push_back(cpu_planner.plan_from_scores(scores));
    }
    if (policy == BatchPolicy::MajorityVote) majority_vote(expected);
    EXPECT_EQ(plans, expected);

    EXPECT_TRUE(source->plan({}, {}).empty());
    std::vector<EmbeddingsView> short_rows = batch.device_views;
    short_rows[2].num_tokens -= 1;
    expect_error<InvalidArgument>([&] { source->plan(batch.layouts, short_rows); }, "embeddings[2].num_tokens");
    EXPECT_EQ(source->plan(batch.layouts, batch.device_views), plans);
  }
}

TEST_F(CudaPlannerTest, LayerSensitivityMatchesTheCpu) {
  for (const ElementType type : {ElementType::F32, ElementType::F16, ElementType::BF16}) {
    std::vector<test::Matrix> before, after;
    for (int l = 0; l < 7; ++l) {
      before.push_back(test::random_embeddings(type, 45, 72, 500 + l));
      test::Matrix h = test::random_embeddings(type, 45, 72, 600 + l);
      for (std::int64_t t = 0; t < 45; ++t) {
        for (std::int32_t c = 0; c < 72; ++c)
          h.set(t, c, before.back().at(t, c) * (l % 2 ? -1.0f : 1.0f) + 0.4f * l * h.at(t, c));
      }
      after.push_back(std::move(h));
    }
    std::vector<DeviceMatrix> d_before, d_after;
    d_before.reserve(7);
    d_after.reserve(7);
    std::vector<EmbeddingsView> hb, ha, db, da;
    for (int l = 0; l < 7; ++l) {
      d_before.emplace_back(before[l]);
      d_after.emplace_back(after[l]);
      hb.push_back(before[l].view());
      ha.push_back(after[l].view());
      db.push_back(d_before.back().view());
      da.push_back(d_after.back().view());
    }
    for (const SensitivityReduction r : {SensitivityReduction::Flattened, SensitivityReduction::TokenMean}) {
      const std::vector<double> gpu = gpu::layer_sensitivity(db, da, r, stream_);
      const std::vector<double> cpu = layer_sensitivity(hb, ha, r);
      ASSERT_EQ(gpu.size(), cpu.size());
      for (std::size_t l = 0; l < gpu.size(); ++l) EXPECT_NEAR(gpu[l], cpu[l], 1e-12) << "layer " << l;
    }
    test::Matrix bad = after[4];
    bad.set(9, 3, std::numeric_limits<float>::infinity());
    const DeviceMatrix d_bad(bad);
    da[4] = d_bad.view();
    expect_error<InvalidArgument>([&] { gpu::layer_sensitivity(db, da, SensitivityReduction::Flattened, stream_); },
                                  "after[4] row 9 (hidden state) holds a NaN or infinite value");
  }
}

}  // namespace
}  // namespace mixkv
