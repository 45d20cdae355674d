// merge_states: the exact combination of attention states over disjoint key
// sets, including the empty state (lse = -inf) that a pool with no blocks for
// a sequence produces.
#include <gtest/gtest.h>

#include <cmath>

#include "cpu_test_util.h"
#include "mixkv/cpu/merge_states.h"

namespace mixkv::test {
namespace {

constexpr float kEmpty = -std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

struct States {
  std::vector<float> out, lse;
};

States merge(const States& a, const States& b, std::int32_t dim) {
  States m{std::vector<float>(a.out.size()), std::vector<float>(a.lse.size())};
  cpu::merge_states(a.out, a.lse, b.out, b.lse, dim, m.out, m.lse);
  return m;
}

// Attention states of `states` random queries over the keys [first, last)
// of a shared random K/V, computed densely in double.
struct Problem {
  static constexpr int kDim = 32;
  static constexpr int kKeys = 90;
  static constexpr int kStates = 5;
  std::vector<double> q;
  std::vector<float> k, v;
  Problem() {
    Rng rng(31);
    for (int i = 0; i < kStates * kDim; ++i) q.push_back(normal(rng, 0.0, 2.0));
    for (int i = 0; i < kKeys * kDim; ++i) {
      k.push_back(static_cast<float>(normal(rng)));
      v.push_back(static_cast<float>(normal(rng)));
    }
  }
  States states(int first, int last) const {
    States s;
    for (int i = 0; i < kStates; ++i) {
      const DenseState d = dense_attention(&q[i * kDim], &k[first * kDim], &v[first * kDim], last - first, kDim, 0.3);
      s.out.insert(s.out.end(), d.out.begin(), d.out.end());
      s.lse.push_back(static_cast<float>(d.lse));
    }
    return s;
  }
};

void expect_near(const States& a, const States& b, double tolerance) {
  ASSERT_EQ(a.out.size(), b.out.size());
  for (std::size_t i = 0; i < a.out.size(); ++i) EXPECT_NEAR(a.out[i], b.out[i], tolerance) << "out " << i;
  for (std::size_t i = 0; i < a.lse.size(); ++i) EXPECT_NEAR(a.lse[i], b.lse[i], tolerance) << "lse " << i;
}

TEST(MergeStates, EqualsAttentionOverTheUnion) {
  const Problem p;
  expect_near(merge(p.states(0, 37), p.states(37, 90), Problem::kDim), p.states(0, 90), 1e-5);
  expect_near(merge(p.states(0, 1), p.states(1, 90), Problem::kDim), p.states(0, 90), 1e-5);
}

TEST(MergeStates, IsAssociativeAndCommutative) {
  const Problem p;
  const States a = p.states(0, 10), b = p.states(10, 55), c = p.states(55, 90);
  const States left = merge(merge(a, b, Problem::kDim), c, Problem::kDim);
  const States right = merge(a, merge(b, c, Problem::kDim), Problem::kDim);
  expect_near(left, right, 1e-6);
  expect_near(merge(a, b, Problem::kDim), merge(b, a, Problem::kDim), 1e-6);
}

TEST(MergeStates, EmptyPlusEmptyIsEmptyWithoutNan) {
  // The outputs of empty states are garbage on purpose: they must not leak.
  const States a{{kNan, 1.0f, kNan, 2.0f}, {kEmpty, kEmpty}};
  const States b{{3.0f, kNan, 4.0f, kNan}, {kEmpty, kEmpty}};
  const States m = merge(a, b, 2);
  EXPECT_EQ(m.out, std::vector<float>(4, 0.0f));
  EXPECT_EQ(m.lse, std::vector<float>(2, kEmpty));
}

TEST(MergeStates, EmptyIsTheIdentity) {
  const Problem p;
  const States x = p.states(3, 70);
  States empty{std::vector<float>(x.out.size(), kNan), std::vector<float>(x.lse.size(), kEmpty)};
  const States left = merge(empty, x, Problem::kDim);
  const States right = merge(x, empty, Problem::kDim);
  EXPECT_EQ(left.out, x.out);
  EXPECT_EQ(left.lse, x.lse);
  EXPECT_EQ(right.out, x.out);
  EXPECT_EQ(right.lse, x.lse);
}

TEST(MergeStates, InPlaceAccumulation) {
  const Problem p;
  const States a = p.states(0, 40), b = p.states(40, 90);
  const States expected = merge(a, b, Problem::kDim);
  States acc = a;
  cpu::merge_states(acc.out, acc.lse, b.out, b.lse, Problem::kDim, acc.out, acc.lse);
  EXPECT_EQ(acc.out, expected.out);
  EXPECT_EQ(acc.lse, expected.lse);
  States acc_b = b;  // aliasing the second operand works the same way
  cpu::merge_states(a.out, a.lse, acc_b.out, acc_b.lse, Problem::kDim, acc_b.out, acc_b.lse);
  EXPECT_EQ(acc_b.out, expected.out);
  EXPECT_EQ(acc_b.lse, expected.lse);
}

TEST(MergeStates, FarApartLsesDoNotOverflow) {
  const States a{{1.0f, 2.0f}, {-80.0f}};
  const States b{{5.0f, 7.0f}, {80.0f}};
  const States m = merge(a, b, 2);
  EXPECT_FLOAT_EQ(m.lse[0], 80.0f);
  EXPECT_FLOAT_EQ(m.out[0], 5.0f);
  EXPECT_FLOAT_EQ(m.out[1], 7.0f);
  const States c{{1.0f, 2.0f}, {3.0f}};
  const States same = merge(c, c, 2);  // two equal halves: lse + log 2, same output
  EXPECT_FLOAT_EQ(same.lse[0], 3.0f + std::log(2.0f));
  EXPECT_FLOAT_EQ(same.out[1], 2.0f);
}

TEST(MergeStates, BadInputThrowsAndWritesNothing) {
  std::vector<float> a(8, 1.0f), la(2, 0.5f), b(8, 2.0f), lb(2, 0.25f);
  std::vector<float> out(8, -7.0f), lse(2, -7.0f);
  const std::vector<float> out_before = out, lse_before = lse;
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, la, b, lb, 0, out, lse), "head_dim");
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, la, b, lb, 3, out, lse), "out_a");
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, la, std::span(b).first(6), lb, 4, out, lse), "out_b");
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, la, b, lb, 4, std::span(out).first(4), lse), "out has");
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, la, b, std::span(lb).first(1), 4, out, lse), "lse_b");
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, la, b, lb, 4, out, std::span(lse).first(1)), "lse has");
  std::vector<float> bad = la;
  bad[1] = kNan;
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, bad, b, lb, 4, out, lse), "lse_a[1]");
  bad[1] = std::numeric_limits<float>::infinity();
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, la, b, bad, 4, out, lse), "lse_b[1]");
  EXPECT_EQ(out, out_before);
  EXPECT_EQ(lse, lse_before);

  // Partial overlap would read values already overwritten.
  std::vector<float> buffer(12, 1.0f);
  const std::span<float> shifted(buffer.data() + 4, 8);
  MIXKV_EXPECT_INVALID(cpu::merge_states(std::span(buffer).first(8), la, b, lb, 4, shifted, lse), "out overlaps out_a");
  std::vector<float> l3(3, 0.0f);
  MIXKV_EXPECT_INVALID(cpu::merge_states(a, std::span(l3).first(2), b, lb, 4, out, std::span(l3).subspan(1, 2)),
                       "lse overlaps lse_a");
  EXPECT_EQ(buffer, std::vector<float>(12, 1.0f));
}

TEST(MergeStates, NoStatesIsANoOp) { cpu::merge_states({}, {}, {}, {}, 64, {}, {}); }

}  // namespace
}  // namespace mixkv::test
