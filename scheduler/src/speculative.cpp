// Speculative decoding: draft rows for Running requests in a decode step
// (the engine verifies them with one attention call) and accept(), which
// truncates the rejected ones.
#include <algorithm>
#include <string>
#include <vector>

#include "mixkv/core/errors.h"
#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::Entry;

namespace {

// FP16 blocks a layer opens for `rows` tokens appended to `tokens` tokens.
std::int64_t opened(std::int32_t tokens, std::int32_t rows, std::int32_t bs) {
  const std::int32_t offset = tokens % bs;
  return (std::int64_t{offset} + rows + bs - 1) / bs - (offset + bs - 1) / bs;
}

}  // namespace

// Drafts in batch order while the budget lasts; then, from the back of the
// batch, requests whose drafts open blocks lose them until the blocks the
// drafts add (beyond the plain step's `need`) fit with the demotion
// headroom to spare: drafts are a bet, never worth a demotion or a
// preemption. Drafts that fit the tails cost no block and stay.
bool Scheduler::Impl::assign_drafts(const std::vector<Entry*>& decodes, std::int64_t need, bool relieved) {
  std::int64_t left = std::int64_t{config.max_num_batched_tokens} - static_cast<std::int64_t>(decodes.size());
  std::int64_t extra = 0;  // FP16 blocks the drafts add
  bool any = false;
  auto cost = [&](const Entry* e) {
    return (opened(e->num_tokens, 1 + e->drafts, block_size) - opened(e->num_tokens, 1, block_size)) * num_layers;
  };
  for (Entry* e : decodes) {
    std::int32_t want = config.num_speculative_tokens;
    if (e->next_drafts >= 0) {
      want = e->next_drafts;
      e->next_drafts = -1;
      --overrides;
    }
    const std::int64_t k = relieved ? 0 : std::min<std::int64_t>({want, e->max_new_tokens - e->generated - 1, left});
    e->drafts = static_cast<std::int32_t>(std::max<std::int64_t>(k, 0));
    left -= e->drafts;
    extra += cost(e);
    any = any || e->drafts > 0;
  }
  for (auto it = decodes.rbegin(); extra > 0 && it != decodes.rend(); ++it) {
    if (cache.can_allocate({need + extra + demote_headroom, 0, 0})) break;
    Entry* e = *it;
    const std::int64_t blocks = cost(e);
    if (blocks == 0) continue;
    extra -= blocks;
    e->drafts = 0;
  }
  return any && std::any_of(decodes.begin(), decodes.end(), [](const Entry* e) { return e->drafts > 0; });
}

std::vector<std::int32_t> Scheduler::Impl::draft_counts(const std::vector<Entry*>& decodes) const {
  std::vector<std::int32_t> counts;
  counts.reserve(decodes.size());
  for (const Entry* e : decodes) counts.push_back(1 + e->drafts);
  return counts;
}

// decode_rows stays empty when no draft is left (the requests that had them
// vanished before the append): a plain step.
std::int32_t Scheduler::Impl::commit_drafts(const std::vector<Entry*>& decodes, StepOutput& out) {
  std::int32_t drafts = 0;
  for (const Entry* e : decodes) drafts += e->drafts;
  if (drafts == 0) return 0;
  out.decode_rows.reserve(decodes.size() + 1);
  out.decode_rows.push_back(0);
  for (Entry* e : decodes) {
    e->num_tokens += e->drafts;
    out.decode_rows.push_back(out.decode_rows.back() + 1 + e->drafts);
    if (e->drafts > 0) speculating.push_back(e->id);
  }
  stats.draft_tokens += drafts;
  return drafts;
}

// Truncates the drafts of `e` after the first `accepted`; the step then
// generated accepted + 1 tokens (the one counted at step() time first).
void Scheduler::Impl::settle_drafts(Entry& e, std::int32_t accepted) {
  const std::int32_t rejected = e.drafts - accepted;
  // The tail left is private, so shares_tail stays as the append left it:
  // the step's first row went into the block that holds the new last token
  // (copied then if shared), and fork() refuses a parent with drafts.
  if (rejected > 0) {
    cache.truncate(e.id, e.num_tokens - rejected);
    e.num_tokens -= rejected;
  }
  e.generated += accepted;
  e.drafts = 0;
  stats.accepted_tokens += accepted;
  if (e.generated >= e.max_new_tokens && !e.done) {
    e.done = true;
    done.push_back(&e);
  }
}

void Scheduler::Impl::reject_drafts() {
  for (const RequestId id : speculating) {
    const auto it = entries.find(id);
    if (it == entries.end() || it->second.drafts == 0) continue;  // gone, or accepted
    Entry& e = it->second;
    if (vanished(e)) {
      e.drafts = 0;  // retired by this step's sweep; its memory is not the scheduler's
      continue;
    }
    settle_drafts(e, 0);
  }
  speculating.clear();
}

void Scheduler::speculate(RequestId id, std::int32_t num_drafts) {
  Impl& s = *impl_;
  Entry& e = s.live(id, "id");
  if (num_drafts < 0) {
    throw InvalidArgument("num_drafts = " + std::to_string(num_drafts) + ", expected >= 0 (draft tokens for request " +
                          std::to_string(id) + "'s next decode step)");
  }
  if (e.next_drafts < 0) ++s.overrides;
  e.next_drafts = num_drafts;
}

void Scheduler::accept(RequestId id, std::int32_t num_accepted) {
  Impl& s = *impl_;
  Entry& e = s.live(id, "id");
  if (e.drafts == 0) {
    throw InvalidArgument("id = " + std::to_string(id) +
                          " has no draft tokens awaiting accept(), expected a request that decoded with drafts in "
                          "the last step and was not accepted since");
  }
  if (num_accepted < 0 || num_accepted > e.drafts) {
    throw InvalidArgument("num_accepted = " + std::to_string(num_accepted) + ", expected 0 <= num_accepted <= " +
                          std::to_string(e.drafts) + " (request " + std::to_string(id) + "'s drafts)");
  }
  if (s.vanished(e)) {
    throw InvalidArgument("id = " + std::to_string(id) +
                          ": its sequence left the cache outside the scheduler, expected it in the cache (the next "
                          "step retires it)");
  }
  s.settle_drafts(e, num_accepted);
}

}  // namespace mixkv
