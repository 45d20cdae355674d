#include "mixkv/core/precision_plan.h"

#include <gtest/gtest.h>

#include <limits>
#include <span>
#include <vector>

#include "../cache/cache_test_util.h"
#include "mixkv/core/cache_shape.h"

namespace mixkv {
namespace {

using test::expect_error;

TEST(PrecisionPlan, FillSetAndCount) {
  PrecisionPlan plan(3, 4, Precision::INT4);
  EXPECT_EQ(plan.num_layers(), 3);
  EXPECT_EQ(plan.num_windows(), 4);
  EXPECT_EQ(plan.at(2, 3), Precision::INT4);
  plan.set(1, 0, Precision::FP16);
  plan.set(1, 2, Precision::INT2);
  plan.set(1, 3, Precision::INT2);
  EXPECT_EQ(plan.at(1, 0), Precision::FP16);
  EXPECT_EQ(plan.at(0, 0), Precision::INT4);  // other layers untouched
  EXPECT_EQ(plan.window_counts(1), (std::array<std::int32_t, 3>{1, 1, 2}));
  EXPECT_EQ(plan.window_counts(0), (std::array<std::int32_t, 3>{0, 4, 0}));
  const std::span<const Precision> row = plan.layer(1);
  EXPECT_EQ(std::vector<Precision>(row.begin(), row.end()),
            (std::vector<Precision>{Precision::FP16, Precision::INT4, Precision::INT2, Precision::INT2}));
  EXPECT_EQ(plan.score(2), 0.0f);
  plan.set_score(2, 0.75f);
  EXPECT_EQ(plan.score(2), 0.75f);
}

TEST(PrecisionPlan, ZeroWindowsAndEquality) {
  const PrecisionPlan a(2, 0);
  EXPECT_EQ(a.window_counts(1), (std::array<std::int32_t, 3>{0, 0, 0}));
  PrecisionPlan b(2, 3);
  PrecisionPlan c(2, 3);
  EXPECT_EQ(b, c);
  c.set(0, 1, Precision::INT2);
  EXPECT_NE(b, c);
}

TEST(PrecisionPlan, RejectsBadArguments) {
  expect_error<InvalidArgument>([] { PrecisionPlan(0, 3); }, "num_layers = 0");
  expect_error<InvalidArgument>([] { PrecisionPlan(2, -1); }, "num_windows = -1");
  expect_error<InvalidArgument>([] { PrecisionPlan(2, 1, static_cast<Precision>(9)); }, "fill = 9");
  PrecisionPlan plan(2, 3);
  const PrecisionPlan before = plan;
  expect_error<IndexOutOfRange>([&] { (void)plan.at(2, 0); }, "layer = 2");
  expect_error<IndexOutOfRange>([&] { (void)plan.at(-1, 0); }, "layer = -1");
  expect_error<IndexOutOfRange>([&] { (void)plan.at(0, 3); }, "window = 3");
  expect_error<IndexOutOfRange>([&] { (void)plan.layer(2); }, "layer = 2");
  expect_error<IndexOutOfRange>([&] { plan.set(0, -1, Precision::INT2); }, "window = -1");
  expect_error<IndexOutOfRange>([&] { plan.set(5, 0, Precision::INT2); }, "layer = 5");
  expect_error<InvalidArgument>([&] { plan.set(0, 0, static_cast<Precision>(3)); }, "precision = 3");
  expect_error<IndexOutOfRange>([&] { (void)plan.score(3); }, "window = 3");
  expect_error<IndexOutOfRange>([&] { plan.set_score(-2, 0.5f); }, "window = -2");
  expect_error<InvalidArgument>([&] { plan.set_score(0, std::numeric_limits<float>::quiet_NaN()); }, "score");
  expect_error<IndexOutOfRange>([&] { (void)plan.window_counts(2); }, "layer = 2");
  EXPECT_EQ(plan, before);
}

TEST(CacheShape, ValidateNamesTheField) {
  EXPECT_NO_THROW(validate(CacheShape{28, 4, 128, 32}));
  EXPECT_NO_THROW(validate(CacheShape{1, 1, 16, 16}));
  EXPECT_NO_THROW(validate(CacheShape{1, 1, 512, 256}));
  expect_error<InvalidArgument>([] { validate(CacheShape{0, 4, 128, 32}); }, "num_layers = 0");
  expect_error<InvalidArgument>([] { validate(CacheShape{2, 0, 128, 32}); }, "num_kv_heads = 0");
  expect_error<InvalidArgument>([] { validate(CacheShape{2, 4, 100, 32}); }, "head_dim = 100");
  expect_error<InvalidArgument>([] { validate(CacheShape{2, 4, 528, 32}); }, "head_dim = 528");
  expect_error<InvalidArgument>([] { validate(CacheShape{2, 4, 128, 8}); }, "block_size = 8");
  expect_error<InvalidArgument>([] { validate(CacheShape{2, 4, 128, 272}); }, "block_size = 272");
  expect_error<InvalidArgument>([] { validate(CacheShape{2, 4, 128, 40}); }, "multiple of 16");
}

}  // namespace
}  // namespace mixkv
