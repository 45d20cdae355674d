// Eqs. 9-11: layer sensitivity and the thresholds derived from it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "mixkv/core/errors.h"
#include "mixkv/planner/window_planner.h"
#include "mixkv/planner/window_rules.h"
#include "planner_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;

const double kAlphas[] = {1e-3, 0.1, 0.5, 1.0, 2.0, 4.0, 10.0, 50.0, 700.0, 1e4};

TEST(Thresholds, LowNeverAboveHighOnTheUnitInterval) {
  for (const double alpha : kAlphas) {
    for (int i = 0; i <= 1000; ++i) {
      const double s = i / 1000.0;
      const double low = window_threshold_low(s, alpha);
      const double high = window_threshold_high(s, alpha);
      ASSERT_TRUE(std::isfinite(low) && std::isfinite(high)) << "alpha " << alpha << " s " << s;
      EXPECT_GE(low, 0.0) << "alpha " << alpha << " s " << s;
      EXPECT_LE(low, high) << "alpha " << alpha << " s " << s;
      EXPECT_LE(high, 1.0) << "alpha " << alpha << " s " << s;
      const LayerThresholds t = layer_thresholds(s, alpha);
      EXPECT_LE(t.low, t.high) << "alpha " << alpha << " s " << s;
    }
  }
}

TEST(Thresholds, LimitsAtZeroAndOne) {
  for (const double alpha : kAlphas) {
    EXPECT_EQ(window_threshold_low(0.0, alpha), 0.0) << alpha;
    EXPECT_EQ(window_threshold_high(0.0, alpha), 0.0) << alpha;
    EXPECT_NEAR(window_threshold_low(1.0, alpha), 1.0, 1e-15) << alpha;
    EXPECT_NEAR(window_threshold_high(1.0, alpha), 1.0, 1e-15) << alpha;
  }
  // Continuity at both ends for the paper's range of alpha.
  for (const double alpha : {0.5, 1.0, 2.0, 4.0, 10.0}) {
    EXPECT_LT(window_threshold_high(1e-9, alpha), 1e-7) << alpha;
    EXPECT_GT(window_threshold_low(1.0 - 1e-9, alpha), 1.0 - 1e-7) << alpha;
  }
}

TEST(Thresholds, MatchTheFormulasAsWritten) {
  for (const double alpha : {0.5, 1.0, 2.0, 4.0, 10.0}) {
    for (int i = 0; i <= 20; ++i) {
      const double s = i / 20.0;
      EXPECT_NEAR(window_threshold_low(s, alpha), (std::exp(alpha * s) - 1) / (std::exp(alpha) - 1), 1e-12);
      EXPECT_NEAR(window_threshold_high(s, alpha), (std::exp(-alpha * s) - 1) / (std::exp(-alpha) - 1), 1e-12);
    }
  }
  // alpha 2, s 0.5: (e - 1) / (e^2 - 1) = 1 / (e + 1) and its mirror e / (e + 1).
  EXPECT_NEAR(window_threshold_low(0.5, 2.0), 1.0 / (std::exp(1.0) + 1.0), 1e-15);
  EXPECT_NEAR(window_threshold_high(0.5, 2.0), std::exp(1.0) / (std::exp(1.0) + 1.0), 1e-15);
  // alpha -> 0: both tend to s (no band).
  EXPECT_NEAR(window_threshold_low(0.3, 1e-9), 0.3, 1e-8);
  EXPECT_NEAR(window_threshold_high(0.3, 1e-9), 0.3, 1e-8);
}

TEST(Thresholds, LargerAlphaWidensTheBand) {
  for (int i = 1; i < 100; ++i) {
    const double s = i / 100.0;
    for (std::size_t a = 0; a + 1 < std::size(kAlphas); ++a) {
      const double small = kAlphas[a], large = kAlphas[a + 1];
      EXPECT_LE(window_threshold_low(s, large), window_threshold_low(s, small)) << s << " " << large;
      EXPECT_GE(window_threshold_high(s, large), window_threshold_high(s, small)) << s << " " << large;
      if (large <= 50.0) {  // beyond, both bands are 1 - (under 1e-16): equal in double
        EXPECT_GT(window_threshold_high(s, large) - window_threshold_low(s, large),
                  window_threshold_high(s, small) - window_threshold_low(s, small))
            << s << " " << large;
      }
    }
  }
}

TEST(Thresholds, NegativeSensitivityClampsToZero) {
  for (const double alpha : {0.5, 2.0, 10.0}) {
    for (const double s : {-1e-9, -0.3, -1.0}) {
      EXPECT_EQ(layer_thresholds(s, alpha), (LayerThresholds{0.0f, 0.0f})) << s;
    }
    EXPECT_EQ(layer_thresholds(0.0, alpha), (LayerThresholds{0.0f, 0.0f}));
  }
  // The formulas used as written below 0 would cross: T_high < T_low, T_high < -1.
  EXPECT_LT(window_threshold_high(-0.5, 2.0), window_threshold_low(-0.5, 2.0));
  EXPECT_LT(window_threshold_high(-0.5, 2.0), -1.0);
}

TEST(Thresholds, RuleAtAndAroundTheThresholds) {
  const LayerThresholds t{0.25f, 0.75f};
  EXPECT_EQ(window_precision(0.8f, t, Precision::INT2, false), Precision::FP16);
  EXPECT_EQ(window_precision(0.75f, t, Precision::INT2, false), Precision::INT4);  // not above T_high
  EXPECT_EQ(window_precision(0.5f, t, Precision::INT2, false), Precision::INT4);
  EXPECT_EQ(window_precision(0.25f, t, Precision::INT2, false), Precision::INT4);  // not below T_low
  EXPECT_EQ(window_precision(0.2f, t, Precision::INT2, false), Precision::INT2);
  EXPECT_EQ(window_precision(-0.9f, t, Precision::INT2, false), Precision::INT2);
  EXPECT_EQ(window_precision(-0.9f, t, Precision::INT4, false), Precision::INT4);  // layer minimum
  EXPECT_EQ(window_precision(0.5f, t, Precision::FP16, false), Precision::FP16);
  EXPECT_EQ(window_precision(0.8f, t, Precision::INT4, false), Precision::FP16);  // a minimum never lowers
  EXPECT_EQ(window_precision(-0.9f, t, Precision::INT2, true), Precision::FP16);  // first window
  // Zero thresholds (s <= 0): the sign of the similarity decides.
  const LayerThresholds zero{0.0f, 0.0f};
  EXPECT_EQ(window_precision(1e-6f, zero, Precision::INT2, false), Precision::FP16);
  EXPECT_EQ(window_precision(0.0f, zero, Precision::INT2, false), Precision::INT4);
  EXPECT_EQ(window_precision(-1e-6f, zero, Precision::INT2, false), Precision::INT2);
}

// Eq. 9 in double, both reductions.
double reference_sensitivity(const test::Matrix& a, const test::Matrix& b, SensitivityReduction reduction) {
  double dot = 0, na = 0, nb = 0, mean = 0;
  for (std::int64_t t = 0; t < a.tokens; ++t) {
    double d = 0, x2 = 0, y2 = 0;
    for (std::int32_t c = 0; c < a.hidden; ++c) {
      d += static_cast<double>(a.at(t, c)) * b.at(t, c);
      x2 += static_cast<double>(a.at(t, c)) * a.at(t, c);
      y2 += static_cast<double>(b.at(t, c)) * b.at(t, c);
    }
    dot += d;
    na += x2;
    nb += y2;
    if (x2 > 0 && y2 > 0) mean += d / std::sqrt(x2 * y2);
  }
  return reduction == SensitivityReduction::Flattened ? dot / std::sqrt(na * nb) : mean / a.tokens;
}

TEST(LayerSensitivity, MatchesEquationNineForEveryLayer) {
  for (const ElementType type : {ElementType::F32, ElementType::F16, ElementType::BF16}) {
    std::vector<test::Matrix> before, after;
    std::vector<EmbeddingsView> bv, av;
    for (int l = 0; l < 5; ++l) {
      before.push_back(test::random_embeddings(type, 13, 40, 10 + l));
      test::Matrix h = test::random_embeddings(type, 13, 40, 50 + l);
      for (std::int64_t t = 0; t < 13; ++t) {  // after = before + l-dependent change
        for (std::int32_t c = 0; c < 40; ++c) h.set(t, c, before.back().at(t, c) + 0.3f * l * h.at(t, c));
      }
      after.push_back(h);
    }
    for (int l = 0; l < 5; ++l) {
      bv.push_back(before[l].view());
      av.push_back(after[l].view());
    }
    for (const SensitivityReduction r : {SensitivityReduction::Flattened, SensitivityReduction::TokenMean}) {
      const std::vector<double> s = layer_sensitivity(bv, av, r);
      ASSERT_EQ(s.size(), 5u);
      for (int l = 0; l < 5; ++l) EXPECT_NEAR(s[l], reference_sensitivity(before[l], after[l], r), 1e-12) << l;
      EXPECT_DOUBLE_EQ(s[0], 1.0);  // after == before
    }
  }
}

TEST(LayerSensitivity, ReversedOrthogonalAndZeroStates) {
  test::Matrix a = test::make_matrix(ElementType::F32, 2, 2);
  test::Matrix reversed = a, orthogonal = a, zero = a;
  a.set(0, 0, 1.0f);
  a.set(1, 1, 2.0f);
  reversed.set(0, 0, -3.0f);  // -3 a
  reversed.set(1, 1, -6.0f);
  orthogonal.set(0, 1, 1.0f);
  orthogonal.set(1, 0, 5.0f);
  const std::vector<EmbeddingsView> before = {a.view(), a.view(), a.view()};
  const std::vector<EmbeddingsView> after = {reversed.view(), orthogonal.view(), zero.view()};
  for (const SensitivityReduction r : {SensitivityReduction::Flattened, SensitivityReduction::TokenMean}) {
    const std::vector<double> s = layer_sensitivity(before, after, r);
    EXPECT_NEAR(s[0], -1.0, 1e-15);
    EXPECT_EQ(s[1], 0.0);
    EXPECT_EQ(s[2], 0.0);
  }
}

TEST(LayerSensitivity, RejectsBadInput) {
  const test::Matrix a = test::random_embeddings(ElementType::F32, 4, 8, 1);
  const test::Matrix narrow = test::random_embeddings(ElementType::F32, 4, 6, 2);
  const test::Matrix short_ = test::random_embeddings(ElementType::F32, 3, 8, 3);
  const std::vector<EmbeddingsView> one = {a.view()};
  const std::vector<EmbeddingsView> two = {a.view(), a.view()};
  expect_error<InvalidArgument>([&] { layer_sensitivity({}, {}); }, "before is empty");
  expect_error<InvalidArgument>([&] { layer_sensitivity(one, two); }, "after holds 2 layers, expected 1");
  const std::vector<EmbeddingsView> with_narrow = {a.view(), narrow.view()};
  expect_error<InvalidArgument>([&] { layer_sensitivity(two, with_narrow); }, "after[1].hidden differs");
  const std::vector<EmbeddingsView> with_short = {a.view(), short_.view()};
  expect_error<InvalidArgument>([&] { layer_sensitivity(with_short, two); }, "before[1].num_tokens = 3, expected 4");
  test::Matrix nan = a;
  nan.set(2, 5, std::numeric_limits<float>::quiet_NaN());
  const std::vector<EmbeddingsView> with_nan = {a.view(), nan.view()};
  expect_error<InvalidArgument>([&] { layer_sensitivity(two, with_nan); },
                                "after[1] row 2 (hidden state) holds a NaN or infinite value");
  expect_error<InvalidArgument>([&] { layer_sensitivity(one, one, static_cast<SensitivityReduction>(5)); },
                                "reduction = 5");
}

}  // namespace
}  // namespace mixkv
