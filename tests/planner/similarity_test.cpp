// Eq. 8 through normalized means against the paper's double loop.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <ostream>
#include <vector>

#include "mixkv/core/errors.h"
#include "mixkv/planner/window_planner.h"
#include "planner_test_util.h"

namespace mixkv {
namespace {

using test::brute_force_similarity;
using test::expect_error;
using test::random_embeddings;

void expect_matches_brute_force(const TokenLayout& layout, const test::Matrix& m, std::int32_t window_size,
                                double tolerance = 1e-6) {
  const std::vector<float> fast = window_similarity(layout, m.view(), window_size);
  const std::vector<double> slow = brute_force_similarity(layout, m, window_size);
  ASSERT_EQ(fast.size(), slow.size());
  for (std::size_t i = 0; i < fast.size(); ++i) {
    EXPECT_NEAR(fast[i], slow[i], tolerance) << "window " << i;
  }
}

struct Case {
  ElementType type;
  std::int32_t hidden;
  std::int32_t window_size;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "type " << static_cast<int>(c.type) << ", hidden " << c.hidden << ", window " << c.window_size;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  static const char* const kNames[] = {"F32", "F16", "BF16"};
  return std::string(kNames[static_cast<int>(info.param.type)]) + "_hidden" + std::to_string(info.param.hidden) +
         "_window" + std::to_string(info.param.window_size);
}

class SimilarityVsBruteForce : public ::testing::TestWithParam<Case> {};

TEST_P(SimilarityVsBruteForce, MatchesTheDoubleLoop) {
  const Case c = GetParam();
  // System text, two visual segments (each with a tail), a question: the
  // windows are cut from each segment's own start.
  const TokenLayout layout({{TokenKind::Text, 5},
                            {TokenKind::Visual, 3 * c.window_size + 3},
                            {TokenKind::Text, 2},
                            {TokenKind::Visual, 2 * c.window_size + c.window_size - 1},
                            {TokenKind::Text, 9}});
  const test::Matrix m = random_embeddings(c.type, layout.num_tokens(), c.hidden, 7 + c.hidden);
  expect_matches_brute_force(layout, m, c.window_size);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SimilarityVsBruteForce,
                         ::testing::Values(Case{ElementType::F32, 1, 1}, Case{ElementType::F32, 7, 3},
                                           Case{ElementType::F32, 31, 4}, Case{ElementType::F32, 33, 16},
                                           Case{ElementType::F32, 128, 32}, Case{ElementType::F32, 257, 5},
                                           Case{ElementType::F16, 96, 8}, Case{ElementType::F16, 37, 3},
                                           Case{ElementType::BF16, 64, 16}, Case{ElementType::BF16, 19, 2}),
                         case_name);

TEST(Similarity, QwenHiddenSizeMatchesBruteForce) {
  const TokenLayout layout({{TokenKind::Text, 3}, {TokenKind::Visual, 96}, {TokenKind::Text, 4}});
  const test::Matrix m = random_embeddings(ElementType::F32, layout.num_tokens(), 3584, 11);
  expect_matches_brute_force(layout, m, 32);
}

// Enough windows (600) for the window loop to be split over the host's
// threads (ranges of at least 64 windows): the scores must not depend on the
// split, and of two bad windows in different ranges the first is reported.
TEST(Similarity, ManyWindowsSplitOverThreadsMatchBruteForce) {
  const TokenLayout layout({{TokenKind::Text, 5}, {TokenKind::Visual, 600 * 4 + 3}, {TokenKind::Text, 2}});
  test::Matrix m = random_embeddings(ElementType::F16, layout.num_tokens(), 64, 21);
  expect_matches_brute_force(layout, m, 4);
  m.set(5 + 4 * 590, 7, std::numeric_limits<float>::quiet_NaN());
  expect_error<InvalidArgument>([&] { window_similarity(layout, m.view(), 4); },
                                "embeddings row 2365 (visual window 590) holds a NaN or infinite value");
  m.set(5 + 4 * 10 + 2, 0, std::numeric_limits<float>::infinity());
  expect_error<InvalidArgument>([&] { window_similarity(layout, m.view(), 4); },
                                "embeddings row 47 (visual window 10) holds a NaN or infinite value");
}

TEST(Similarity, BatchOfDifferentRequestsEqualsOneByOne) {
  // Different numbers of frames and text tokens per request.
  const std::vector<TokenLayout> layouts = {
      TokenLayout({{TokenKind::Text, 4}, {TokenKind::Visual, 5 * 16}, {TokenKind::Text, 3}}),
      TokenLayout({{TokenKind::Visual, 2 * 16 + 7}, {TokenKind::Text, 1}}),
      TokenLayout({{TokenKind::Text, 17}}),  // no visual tokens: no windows
      TokenLayout({{TokenKind::Text, 2}, {TokenKind::Visual, 9 * 16}, {TokenKind::Text, 30}}),
  };
  std::vector<test::Matrix> matrices;
  std::vector<EmbeddingsView> views;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    matrices.push_back(random_embeddings(ElementType::F32, layouts[r].num_tokens(), 48, 100 + r));
  }
  for (const auto& m : matrices) views.push_back(m.view());
  const std::vector<std::vector<float>> batch = window_similarity(layouts, views, 16);
  ASSERT_EQ(batch.size(), layouts.size());
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    EXPECT_EQ(batch[r], window_similarity(layouts[r], views[r], 16)) << "request " << r;
    EXPECT_EQ(batch[r].size(), static_cast<std::size_t>(layouts[r].num_windows(16)));
    expect_matches_brute_force(layouts[r], matrices[r], 16);
  }
  EXPECT_TRUE(window_similarity(std::span<const TokenLayout>{}, std::span<const EmbeddingsView>{}, 16).empty());
}

TEST(Similarity, ZeroRowsCountAsCosineZero) {
  const TokenLayout layout({{TokenKind::Text, 3}, {TokenKind::Visual, 8}});
  test::Matrix m = random_embeddings(ElementType::F32, layout.num_tokens(), 40, 3);
  for (std::int32_t c = 0; c < 40; ++c) {
    m.set(1, c, 0.0f);                                        // a text row
    m.set(5, c, 0.0f);                                        // a row of window 0
    for (std::int64_t r = 7; r < 11; ++r) m.set(r, c, 0.0f);  // window 1 entirely
  }
  expect_matches_brute_force(layout, m, 4);
  EXPECT_EQ(window_similarity(layout, m.view(), 4)[1], 0.0f);
}

TEST(Similarity, ExtremeButFiniteMagnitudes) {
  // Squares overflow (1e30) or underflow (1e-25) in float: the exact path
  // takes over and the cosine is scale-free.
  const TokenLayout layout({{TokenKind::Text, 2}, {TokenKind::Visual, 12}});
  test::Matrix m = random_embeddings(ElementType::F32, layout.num_tokens(), 24, 5);
  test::Matrix scaled = m;
  for (std::int64_t r = 0; r < m.tokens; ++r) {
    const float scale = r % 3 == 0 ? 1e30f : (r % 3 == 1 ? 1e-25f : 1.0f);
    for (std::int32_t c = 0; c < m.hidden; ++c) scaled.set(r, c, m.at(r, c) * scale);
  }
  const std::vector<float> a = window_similarity(layout, m.view(), 4);
  const std::vector<float> b = window_similarity(layout, scaled.view(), 4);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6) << "window " << i;
}

TEST(Similarity, HandComputed) {
  // hidden 2, window 2. Text (1, 0) and (0, 2): normalized mean (0.5, 0.5).
  const TokenLayout layout({{TokenKind::Text, 1}, {TokenKind::Visual, 5}, {TokenKind::Text, 1}});
  test::Matrix m = test::make_matrix(ElementType::F32, 7, 2);
  const float rows[7][2] = {{1, 0}, {3, 0}, {0, 5}, {-1, 0}, {-0.6f, 0.8f}, {9, 9}, {0, 2}};
  for (int r = 0; r < 7; ++r) {
    for (int c = 0; c < 2; ++c) m.set(r, c, rows[r][c]);
  }
  const std::vector<float> s = window_similarity(layout, m.view(), 2);
  ASSERT_EQ(s.size(), 2u);        // row 5 is the visual tail
  EXPECT_NEAR(s[0], 0.5, 1e-7);   // window mean (0.5, 0.5)
  EXPECT_NEAR(s[1], -0.2, 1e-7);  // window mean (-0.8, 0.4)
}

TEST(Similarity, RejectsBadInput) {
  const TokenLayout layout({{TokenKind::Text, 2}, {TokenKind::Visual, 8}});
  const test::Matrix m = random_embeddings(ElementType::F32, layout.num_tokens(), 16, 1);
  EmbeddingsView view = m.view();

  expect_error<InvalidArgument>([&] { window_similarity(layout, view, 0); }, "window_size = 0");
  expect_error<InvalidArgument>([&] { window_similarity(layout, view, -4); }, "window_size = -4");

  EmbeddingsView wrong_rows = view;
  wrong_rows.num_tokens = 9;
  expect_error<InvalidArgument>([&] { window_similarity(layout, wrong_rows, 4); },
                                "embeddings.num_tokens = 9, expected 10");
  EmbeddingsView no_hidden = view;
  no_hidden.hidden = 0;
  expect_error<InvalidArgument>([&] { window_similarity(layout, no_hidden, 4); }, "embeddings.hidden = 0");
  EmbeddingsView null_data = view;
  null_data.data = nullptr;
  expect_error<InvalidArgument>([&] { window_similarity(layout, null_data, 4); }, "embeddings.data is null");
  EmbeddingsView bad_type = view;
  bad_type.type = static_cast<ElementType>(7);
  expect_error<InvalidArgument>([&] { window_similarity(layout, bad_type, 4); }, "embeddings.type = 7");

  const TokenLayout visual_only({{TokenKind::Visual, 10}});
  expect_error<InvalidArgument>([&] { window_similarity(visual_only, view, 4); }, "layout has no text tokens");

  // Batch: counts and hidden sizes must agree.
  const std::vector<TokenLayout> layouts = {layout, layout};
  const test::Matrix other = random_embeddings(ElementType::F32, layout.num_tokens(), 8, 2);
  const std::vector<EmbeddingsView> one = {view};
  expect_error<InvalidArgument>([&] { window_similarity(layouts, one, 4); },
                                "embeddings holds 1 requests, expected one per layout (2)");
  const std::vector<EmbeddingsView> mixed = {view, other.view()};
  expect_error<InvalidArgument>([&] { window_similarity(layouts, mixed, 4); }, "embeddings[1].hidden = 8, expected 16");
  const std::vector<TokenLayout> second_visual_only = {layout, visual_only};
  const std::vector<EmbeddingsView> two = {view, view};
  expect_error<InvalidArgument>([&] { window_similarity(second_visual_only, two, 4); },
                                "layouts[1] has no text tokens");
}

TEST(Similarity, RejectsNonFiniteEmbeddings) {
  const TokenLayout layout({{TokenKind::Text, 2}, {TokenKind::Visual, 9}});
  for (const ElementType type : {ElementType::F32, ElementType::F16, ElementType::BF16}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
      test::Matrix text_bad = random_embeddings(type, layout.num_tokens(), 40, 4);
      text_bad.set(1, 39, bad);
      expect_error<InvalidArgument>([&] { window_similarity(layout, text_bad.view(), 4); },
                                    "embeddings row 1 (text) holds a NaN or infinite value");
      test::Matrix window_bad = random_embeddings(type, layout.num_tokens(), 40, 4);
      window_bad.set(7, 3, bad);
      expect_error<InvalidArgument>([&] { window_similarity(layout, window_bad.view(), 4); },
                                    "embeddings row 7 (visual window 1) holds a NaN or infinite value");
    }
  }
  // In a batch the message names the request.
  test::Matrix good = random_embeddings(ElementType::F32, layout.num_tokens(), 16, 4);
  test::Matrix bad = good;
  bad.set(4, 0, std::numeric_limits<float>::quiet_NaN());
  const std::vector<TokenLayout> layouts = {layout, layout};
  const std::vector<EmbeddingsView> views = {good.view(), bad.view()};
  expect_error<InvalidArgument>([&] { window_similarity(layouts, views, 4); }, "embeddings[1] row 4 (visual window 0)");
}

}  // namespace
}  // namespace mixkv
