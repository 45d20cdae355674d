// KVCacheManager for speculative decoding: several decode tokens per
// sequence in one call (the last sampled token and its drafts), and
// truncate(), which takes the rejected drafts back.
#include "manager_impl.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include <boost/unordered/unordered_flat_map.hpp>

namespace mixkv {

namespace {

constexpr std::int32_t kMaxTokens = std::numeric_limits<std::int32_t>::max();

// FP16 blocks a layer opens for `count` tokens after a tail holding
// `offset` tokens of block_size (0: full or absent).
std::int64_t opened(std::int32_t offset, std::int32_t count, std::int32_t bs) {
  return (std::int64_t{offset} + count + bs - 1) / bs - (offset + bs - 1) / bs;
}

void require_counts(std::span<const std::int32_t> counts, std::size_t batch, const char* batch_name) {
  if (counts.size() != batch) {
    throw InvalidArgument("counts has " + std::to_string(counts.size()) + " entries, expected " + batch_name +
                          ".size() = " + std::to_string(batch));
  }
}

// counts[i] tokens fit sequence i: at least one, and the token count stays
// below 2^31.
void require_count(std::span<const std::int32_t> counts, std::size_t i, const Sequence& seq) {
  const std::int32_t count = counts[i];
  if (count < 1 || count > kMaxTokens - seq.num_tokens) {
    throw InvalidArgument("counts[" + std::to_string(i) + "] = " + std::to_string(count) +
                          ", expected 1 <= count <= " + std::to_string(kMaxTokens - seq.num_tokens) +
                          " (the sequence holds " + std::to_string(seq.num_tokens) + " of at most 2^31 - 1 tokens)");
  }
}

}  // namespace

AppendResult KVCacheManager::append_tokens(std::span<const SequenceId> ids, std::span<const std::int32_t> counts,
                                           AppendSlots form) {
  Impl& m = *impl_;
  require_slots_form(form);
  require_counts(counts, ids.size(), "ids");
  const std::vector<const Sequence*> found = m.require_ids(ids);
  std::vector<Sequence*> seqs;
  seqs.reserve(found.size());
  for (std::size_t i = 0; i < found.size(); ++i) {
    require_count(counts, i, *found[i]);
    seqs.push_back(const_cast<Sequence*>(found[i]));  // the manager's own, non-const
  }
  return m.append_rows(seqs, counts, form);
}

AppendResult KVCacheManager::append_tokens(std::span<const SequenceHandle> handles,
                                           std::span<const std::int32_t> counts, AppendSlots form) {
  Impl& m = *impl_;
  require_slots_form(form);
  require_counts(counts, handles.size(), "handles");
  std::vector<Sequence*> seqs;
  seqs.reserve(handles.size());
  const std::uint64_t batch = ++m.epoch;
  auto name = [](std::size_t i) { return "handles[" + std::to_string(i) + "]"; };
  for (std::size_t i = 0; i < handles.size(); ++i) {
    const SequenceHandle h = handles[i];
    const auto index = static_cast<std::size_t>(h.index);
    if (h.index < 0 || index >= m.handles.size() || m.handles[index] == nullptr ||
        m.generations[index] != h.generation) {
      throw UnknownId(name(i) + " = (" + std::to_string(h.index) + ", " + std::to_string(h.generation) +
                      ") names no sequence of this cache (stale or never handed out)");
    }
    Sequence& seq = *m.handles[index];
    if (seq.seen_epoch == batch) {
      throw InvalidArgument(name(i) + " repeats handles[" + std::to_string(seq.seen_index) +
                            "], expected distinct sequences");
    }
    if (seq.swapped) throw InvalidArgument(name(i) + " names a swapped-out sequence, expected one in device memory");
    require_count(counts, i, seq);
    seq.seen_epoch = batch;
    seq.seen_index = i;
    seqs.push_back(&seq);
  }
  return m.append_rows(seqs, counts, form);
}

// Sequence i's tokens go at FP16 positions num_tokens .. num_tokens +
// counts[i] - 1 of every layer: the rest of its tail, then new blocks.
// Outside forks, tokens that all fit every layer's tail take the decode
// fast path (O(counts[i]) with AppendSlots::Compact); the others, forked
// sequences and those that open blocks, are filled layer by layer. Fresh
// block ids go in layer order, then batch order, within a sequence in
// token order (a copy-on-write copy first): the order truncate() releases
// in reverse.
AppendResult KVCacheManager::Impl::append_rows(const std::vector<Sequence*>& all, std::span<const std::int32_t> counts,
                                               AppendSlots form) {
  if (std::all_of(counts.begin(), counts.end(), [](std::int32_t c) { return c == 1; })) return append(all, form);
  const std::int32_t bs = block_size();
  const auto layers = static_cast<std::size_t>(num_layers());
  const std::size_t n = all.size();
  const bool per_layer = form == AppendSlots::PerLayer;
  BlockPool& fp16 = pool(Precision::FP16);

  // The FP16 blocks the call takes, exactly (all or nothing).
  std::vector<std::size_t> general;  // batch indices, ascending
  bool any_forked = false;
  BlockCounts need{};
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& seq = *all[i];
    const std::int32_t offset = seq.num_tokens % bs;
    if (!seq.forked && offset != 0 && offset + counts[i] <= bs) continue;
    general.push_back(i);
    any_forked = any_forked || seq.forked;
    // Outside forks every layer's tail is at the same offset (full or absent at 0).
    if (!seq.forked) need[0] += opened(offset, counts[i], bs) * num_layers();
  }
  if (any_forked) {
    // Layer by layer in batch order, like the fill below: of a shared tail's
    // holders in the batch, all but the last one left copy it.
    boost::unordered_flat_map<std::int32_t, std::int32_t> left;  // tail block -> holders that copied it
    for (std::int32_t layer = 0; layer < num_layers(); ++layer) {
      for (const std::size_t i : general) {
        const PageTable& t = all[i]->table;
        if (!all[i]->forked) continue;
        const auto tail = t.blocks(layer, Precision::FP16);
        const std::int32_t room = tail.empty() ? 0 : bs - t.fp16_tail_fill(layer);
        if (room > 0 && fp16.ref_count(tail.back()) > 1) {
          std::int32_t& gone = left[tail.back()];
          if (fp16.ref_count(tail.back()) - gone > 1) {
            ++gone;
            ++need[0];
          }
        }
        need[0] += opened(room == 0 ? 0 : bs - room, counts[i], bs);
      }
    }
  }
  prepare_blocks(need, "append_tokens", fresh_ids);

  // Every host allocation before any block or table changes, so that
  // std::bad_alloc leaves every sequence as it was.
  std::vector<std::size_t> first(n + 1, 0);  // row of sequence i's first token
  for (std::size_t i = 0; i < n; ++i) first[i + 1] = first[i] + static_cast<std::size_t>(counts[i]);
  AppendResult result;
  if (per_layer) result.slots.assign(layers, std::vector<std::int32_t>(first[n]));
  result.offsets.resize(n);
  result.tails_changed.reserve(general.size());
  result.tail_blocks.reserve(general.size() * layers);
  result.copies.reserve(any_forked ? static_cast<std::size_t>(need[0]) : 0);
  std::vector<std::uint8_t> changed(general.size(), 0);
  for (const std::size_t i : general) {
    PageTable& t = all[i]->table;
    const std::int64_t more = opened(all[i]->num_tokens % bs, counts[i], bs);
    if (more <= 1) {
      t.reserve_fp16_tails();
    } else {
      for (std::int32_t layer = 0; layer < num_layers(); ++layer) {
        t.reserve(layer, Precision::FP16, t.blocks(layer, Precision::FP16).size() + static_cast<std::size_t>(more));
      }
    }
  }

  // Commit: nothing below allocates or throws.
  take_blocks(need, fresh_ids);
  const std::vector<std::int32_t>& fresh = fresh_ids[0];
  std::size_t next = 0;
  for (std::int32_t layer = 0; layer < num_layers(); ++layer) {
    std::int32_t* out = per_layer ? result.slots[static_cast<std::size_t>(layer)].data() : nullptr;
    for (std::size_t k = 0; k < general.size(); ++k) {
      const std::size_t i = general[k];
      PageTable& t = all[i]->table;
      const std::int32_t count = counts[i];
      std::int32_t j = 0;
      const auto tail = t.blocks(layer, Precision::FP16);
      if (!tail.empty() && t.fp16_tail_fill(layer) < bs) {
        if (all[i]->forked && fp16.ref_count(tail.back()) > 1) {
          // Copy-on-write: this holder moves to a private copy of the tail.
          const std::int32_t src = tail.back();
          const std::int32_t dst = fresh[next++];
          result.copies.push_back({src, dst});
          fp16.release(src);
          t.replace_fp16_tail(layer, dst);
          changed[k] = 1;
        }
        for (; j < count && t.fp16_tail_fill(layer) < bs; ++j) {
          const std::int32_t slot = t.fill_fp16_tail(layer);
          if (out != nullptr) out[first[i] + static_cast<std::size_t>(j)] = slot;
        }
      }
      while (j < count) {
        const std::int32_t block = fresh[next++];
        const std::int32_t fill = std::min(bs, count - j);
        t.push_block(layer, Precision::FP16, block, fill);
        changed[k] = 1;
        for (std::int32_t q = 0; q < fill && out != nullptr; ++q) {
          out[first[i] + static_cast<std::size_t>(j + q)] = block * bs + q;
        }
        j += fill;
      }
    }
  }
  std::size_t next_general = 0;
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = *all[i];
    result.offsets[i] = seq.num_tokens % bs;
    if (next_general < general.size() && general[next_general] == i) {
      if (changed[next_general]) {
        const auto tails = seq.table.fp16_tails();
        result.tails_changed.push_back(static_cast<std::int32_t>(i));
        result.tail_blocks.insert(result.tail_blocks.end(), tails.begin(), tails.end());
      }
      ++next_general;
    } else {
      // Every tail has room for all the tokens (fast path).
      for (std::int32_t j = 0; j < counts[i]; ++j) seq.table.fill_all_fp16_tails();
      if (per_layer) {
        const std::int32_t* tails = seq.table.fp16_tails().data();
        for (std::size_t l = 0; l < layers; ++l) {
          for (std::int32_t j = 0; j < counts[i]; ++j) {
            result.slots[l][first[i] + static_cast<std::size_t>(j)] = tails[l] * bs + result.offsets[i] + j;
          }
        }
      }
    }
    seq.num_tokens += counts[i];
  }
  return result;
}

namespace {

// The prompt stays: only appended tokens can be truncated.
void require_target(const Sequence& seq, std::int32_t num_tokens, const std::string& name) {
  const std::int32_t prompt = seq.prompt->layout.num_tokens();
  if (num_tokens < prompt || num_tokens > seq.num_tokens) {
    throw InvalidArgument(name + " = " + std::to_string(num_tokens) + ", expected " + std::to_string(prompt) +
                          " <= num_tokens <= " + std::to_string(seq.num_tokens) +
                          " (from the prompt's length to the tokens held: only appended tokens can be truncated)");
  }
  // Demoted stream blocks (age tiers) hold no FP16 token to drop.
  std::int32_t kept = 0;  // stream blocks up to the last demoted one of any layer
  for (const detail::AgedStream& a : seq.aged) {
    for (std::size_t k = a.blocks.size(); k-- > 0;) {
      if (a.blocks[k] != Precision::FP16) {
        kept = std::max(kept, static_cast<std::int32_t>(k) + 1);
        break;
      }
    }
  }
  const std::int64_t bs = seq.table.block_size();
  const std::int64_t lowest = std::int64_t{seq.prompt->plan.num_windows()} * bs + kept * bs;
  if (num_tokens < lowest) {
    throw InvalidArgument(name + " = " + std::to_string(num_tokens) + ", expected >= " + std::to_string(lowest) +
                          ": the tokens below are in stream blocks demoted by age tiers");
  }
}

}  // namespace

void KVCacheManager::truncate(SequenceId id, std::int32_t num_tokens) {
  Impl& m = *impl_;
  Sequence& seq = m.resident(id, "id");
  require_target(seq, num_tokens, "num_tokens");
  Sequence* one = &seq;
  m.drop_tokens(std::span<Sequence* const>(&one, 1), std::span<const std::int32_t>(&num_tokens, 1));
}

void KVCacheManager::truncate(std::span<const SequenceId> ids, std::span<const std::int32_t> num_tokens) {
  Impl& m = *impl_;
  if (num_tokens.size() != ids.size()) {
    throw InvalidArgument("num_tokens has " + std::to_string(num_tokens.size()) +
                          " entries, expected ids.size() = " + std::to_string(ids.size()));
  }
  const std::vector<const Sequence*> found = m.require_ids(ids);
  std::vector<Sequence*> seqs;
  seqs.reserve(found.size());
  for (std::size_t i = 0; i < found.size(); ++i) {
    require_target(*found[i], num_tokens[i], "num_tokens[" + std::to_string(i) + "]");
    seqs.push_back(const_cast<Sequence*>(found[i]));  // the manager's own, non-const
  }
  m.drop_tokens(seqs, num_tokens);
}

// Releases, in the reverse of append_rows' order (layers from the last,
// sequences from the last, blocks from the back), every FP16 block that
// holds only dropped tokens, then shortens the tables. A stack free list
// then hands the blocks out again as the append took them.
void KVCacheManager::Impl::drop_tokens(std::span<Sequence* const> seqs, std::span<const std::int32_t> targets) {
  BlockPool& fp16 = pool(Precision::FP16);
  const std::int64_t bs = block_size();
  for (std::int32_t layer = num_layers(); layer-- > 0;) {
    for (std::size_t s = seqs.size(); s-- > 0;) {
      const PageTable& t = seqs[s]->table;
      const std::int64_t left = t.fp16_tokens(layer) - (seqs[s]->num_tokens - targets[s]);
      const auto keep = static_cast<std::size_t>((left + bs - 1) / bs);
      const auto blocks = t.blocks(layer, Precision::FP16);
      for (std::size_t b = blocks.size(); b-- > keep;) fp16.release(blocks[b]);
    }
  }
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    seqs[s]->table.drop_fp16_tokens(seqs[s]->num_tokens - targets[s]);
    seqs[s]->num_tokens = targets[s];
  }
}

}  // namespace mixkv
