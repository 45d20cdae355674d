#include "mixkv/cpu/merge_states.h"

#include <cmath>
#include <functional>

#include "detail.h"

namespace mixkv::cpu {
namespace {

using detail::invalid;

bool overlap(std::span<const float> a, std::span<const float> b) {
  if (a.empty() || b.empty()) return false;
  const std::less<const float*> before;
  return before(a.data(), b.data() + b.size()) && before(b.data(), a.data() + a.size());
}

// An output may be exactly one of the inputs (in-place accumulation: each
// element is read before it is written); any other overlap would read
// elements already overwritten.
void check_alias(std::string_view out_name, std::span<const float> out, std::string_view in_name,
                 std::span<const float> in, bool exact_alias_allowed) {
  if (!overlap(out, in)) return;
  if (exact_alias_allowed && out.data() == in.data() && out.size() == in.size()) return;
  invalid("merge_states: ", out_name, " overlaps ", in_name,
          exact_alias_allowed ? ": expected the same span or disjoint memory" : ": expected disjoint memory");
}

void check_lse(std::string_view name, std::span<const float> lse) {
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isnan(lse[i]) || lse[i] == std::numeric_limits<float>::infinity()) {
      invalid("merge_states: ", name, "[", i, "] = ", lse[i], ": expected a finite value or -inf (empty state)");
    }
  }
}

}  // namespace

void merge_states(std::span<const float> out_a, std::span<const float> lse_a, std::span<const float> out_b,
                  std::span<const float> lse_b, std::int32_t head_dim, std::span<float> out, std::span<float> lse) {
  if (head_dim < 1) invalid("merge_states: head_dim = ", head_dim, ": expected >= 1");
  const std::size_t states = lse_a.size();
  const std::size_t values = states * static_cast<std::size_t>(head_dim);
  if (lse_b.size() != states) {
    invalid("merge_states: lse_b has ", lse_b.size(), " values: expected lse_a.size() = ", states);
  }
  if (lse.size() != states) invalid("merge_states: lse has ", lse.size(), " values: expected lse_a.size() = ", states);
  const std::pair<std::string_view, std::size_t> outputs[] = {
      {"out_a", out_a.size()}, {"out_b", out_b.size()}, {"out", out.size()}};
  for (const auto& [name, size] : outputs) {
    if (size != values) {
      invalid("merge_states: ", name, " has ", size, " values: expected lse_a.size() * head_dim = ", states, " * ",
              head_dim, " = ", values);
    }
  }
  check_alias("out", out, "out_a", out_a, true);
  check_alias("out", out, "out_b", out_b, true);
  check_alias("out", out, "lse_a", lse_a, false);
  check_alias("out", out, "lse_b", lse_b, false);
  check_alias("out", out, "lse", lse, false);
  check_alias("lse", lse, "lse_a", lse_a, true);
  check_alias("lse", lse, "lse_b", lse_b, true);
  check_alias("lse", lse, "out_a", out_a, false);
  check_alias("lse", lse, "out_b", out_b, false);
  check_lse("lse_a", lse_a);
  check_lse("lse_b", lse_b);

  for (std::size_t i = 0; i < states; ++i) {
    const std::size_t at = i * head_dim;
    detail::merge_state(static_cast<double>(lse_a[i]), &out_a[at], static_cast<double>(lse_b[i]), &out_b[at], head_dim,
                        &out[at], lse[i]);
  }
}

}  // namespace mixkv::cpu
