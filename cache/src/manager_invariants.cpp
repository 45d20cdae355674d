// KVCacheManager: check_invariants and describe_state.
#include "manager_impl.h"

#include <algorithm>
#include <string>
#include <vector>

#include <boost/unordered/unordered_flat_map.hpp>

namespace mixkv {

// The handle table beside the sequences' own handles (checked per
// sequence): each free index listed once and empty, and every index either
// free or naming a live sequence, so that no stale handle can resolve.
void KVCacheManager::Impl::check_handles() const {
  const Impl& m = *this;
  auto fail = [](const std::string& what) { throw InvariantViolation("handle table: " + what); };
  if (m.generations.size() != m.handles.size()) {
    fail(std::to_string(m.handles.size()) + " entries but " + std::to_string(m.generations.size()) + " generations");
  }
  std::vector<std::uint8_t> listed(m.handles.size(), 0);
  for (const std::int32_t index : m.free_handles) {
    const auto i = static_cast<std::size_t>(index);
    if (index < 0 || i >= m.handles.size() || m.handles[i] != nullptr || listed[i]) {
      fail("free index " + std::to_string(index) + " is out of range, names a sequence or is listed twice");
    }
    listed[i] = 1;
  }
  if (m.free_handles.size() + m.sequences.size() != m.handles.size()) {
    fail(std::to_string(m.free_handles.size()) + " free + " + std::to_string(m.sequences.size()) + " sequences, but " +
         std::to_string(m.handles.size()) + " entries");
  }
}

void KVCacheManager::check_invariants() const {
  const Impl& m = *impl_;
  auto fail = [](const std::string& what) { throw InvariantViolation(what); };

  m.arena.check_invariants();
  for (const Precision p : kAllPrecisions) m.pool(p).check_invariants();
  // Counts first: a slab claimed by two pools (or none) shows in them.
  for (const Precision p : kAllPrecisions) {
    if (m.pool(p).num_slabs() != m.arena.owned_slabs(p)) {
      fail(std::string(to_string(p)) + " pool holds " + std::to_string(m.pool(p).num_slabs()) +
           " slabs, the arena counts " + std::to_string(m.arena.owned_slabs(p)));
    }
  }
  for (std::int32_t s = 0; s < m.arena.total_slabs(); ++s) {
    const std::optional<Precision> owner = m.arena.owner(s);
    for (const Precision p : kAllPrecisions) {
      if (m.pool(p).owns_slab(s) != (owner == p)) {
        fail("slab " + std::to_string(s) + ": the arena says " +
             (owner ? std::string(to_string(*owner)) : std::string("free")) + " but the " + std::string(to_string(p)) +
             " pool " + (m.pool(p).owns_slab(s) ? "holds" : "does not hold") + " it");
      }
    }
  }
  m.check_handles();

  // Ref counts must equal the number of page tables holding each block.
  const std::int32_t bs = m.block_size();
  std::array<boost::unordered_flat_map<std::int32_t, std::int32_t>, kNumPrecisions> holders;
  std::array<boost::unordered_flat_map<std::int32_t, std::int32_t>, kNumPrecisions> swapped_holders;
  for (const auto& [id, seq] : m.sequences) {
    const std::string name = "sequence " + std::to_string(id);
    const PageTable& table = seq.table;
    const auto index = static_cast<std::size_t>(seq.handle.index);
    if (seq.handle.index < 0 || index >= m.handles.size() || m.handles[index] != &seq ||
        m.generations[index] != seq.handle.generation) {
      fail(name + ": handle (" + std::to_string(seq.handle.index) + ", " + std::to_string(seq.handle.generation) +
           ") does not name it in the handle table");
    }
    if (table.num_layers() != m.num_layers() || table.block_size() != bs) {
      fail(name + ": page table shaped for " + std::to_string(table.num_layers()) + " layers");
    }
    if (seq.num_tokens < seq.prompt->layout.num_tokens()) {
      fail(name + ": " + std::to_string(seq.num_tokens) + " tokens, fewer than its prompt");
    }
    std::array<boost::unordered_flat_map<std::int32_t, std::int32_t>, kNumPrecisions> mine;
    std::int32_t room = bs;
    for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
      const std::string where = name + " layer " + std::to_string(layer) + ": ";
      const auto windows = seq.prompt->plan.window_counts(layer);
      for (const Precision p : kAllPrecisions) {
        for (const std::int32_t block : table.blocks(layer, p)) {
          if (seq.swapped) {
            // Host slots: each used by exactly one swapped sequence.
            const SwapPool& sp = m.swap[at(p)];
            if (block < 0 || static_cast<std::size_t>(block) >= sp.used.size() ||
                !sp.used[static_cast<std::size_t>(block)]) {
              fail(where + std::string(to_string(p)) + " host slot " + std::to_string(block) +
                   " is out of range or marked free");
            }
            if (++swapped_holders[at(p)][block] > 1) {
              fail(where + std::string(to_string(p)) + " host slot " + std::to_string(block) + " is held twice");
            }
            continue;
          }
          if (block < 0 || block >= m.pool(p).id_limit() || !m.pool(p).owns_slab(block / m.pool(p).blocks_per_slab())) {
            fail(where + std::string(to_string(p)) + " block " + std::to_string(block) +
                 " is outside the pool's slabs");
          }
          if (++mine[at(p)][block] > 1) {
            fail(where + std::string(to_string(p)) + " block " + std::to_string(block) + " appears twice in one table");
          }
          ++holders[at(p)][block];
        }
        const std::int64_t aged = Impl::aged_blocks(seq, layer, p);
        if (is_quantized(p) && static_cast<std::int64_t>(table.blocks(layer, p).size()) != windows[at(p)] + aged) {
          fail(where + std::to_string(table.blocks(layer, p).size()) + " " + std::string(to_string(p)) +
               " blocks, the plan has " + std::to_string(windows[at(p)]) + " windows and " + std::to_string(aged) +
               " demoted stream blocks");
        }
      }
      const std::int32_t fill = table.fp16_tail_fill(layer);
      const bool has_fp16 = !table.blocks(layer, Precision::FP16).empty();
      if (has_fp16 ? (fill < 1 || fill > bs) : fill != 0) {
        fail(where + "FP16 tail fill " + std::to_string(fill) + " with " +
             std::to_string(table.blocks(layer, Precision::FP16).size()) + " FP16 blocks of " + std::to_string(bs));
      }
      if (!seq.aged.empty()) {
        const detail::AgedStream& a = seq.aged[static_cast<std::size_t>(layer)];
        if (static_cast<std::int64_t>(a.blocks.size()) > m.stream_blocks(seq)) {
          fail(where + std::to_string(a.blocks.size()) + " stream blocks recorded, the stream has " +
               std::to_string(m.stream_blocks(seq)) + " full blocks");
        }
        for (const Precision q : {Precision::INT4, Precision::INT2}) {
          if (std::count(a.blocks.begin(), a.blocks.end(), q) != a.counts[at(q)]) {
            fail(where + "demoted stream blocks at " + std::string(to_string(q)) + " counted as " +
                 std::to_string(a.counts[at(q)]) + ", the list holds another number");
          }
        }
        if (!m.config.fp16_windows_first && windows[0] > 0 && a.counts[1] + a.counts[2] > 0) {
          fail(where + "demoted stream blocks in prompt order beside FP16 windows");
        }
      }
      const std::int64_t quantized = windows[1] + windows[2] + Impl::aged_blocks(seq, layer, Precision::INT4) +
                                     Impl::aged_blocks(seq, layer, Precision::INT2);
      const std::int64_t tokens = table.fp16_tokens(layer) + quantized * bs;
      if (tokens != seq.num_tokens) {
        fail(where + "blocks hold " + std::to_string(tokens) + " tokens, the sequence has " +
             std::to_string(seq.num_tokens));
      }
      // The decode fast path and the compact slots read these two.
      const std::int32_t tail = table.fp16_tails()[static_cast<std::size_t>(layer)];
      if (tail != (has_fp16 ? table.blocks(layer, Precision::FP16).back() : -1)) {
        fail(where + "FP16 tail recorded as block " + std::to_string(tail) + ", the page list ends otherwise");
      }
      room = std::min(room, has_fp16 ? bs - fill : 0);
    }
    if (table.fp16_room() != room) {
      fail(name + ": FP16 room recorded as " + std::to_string(table.fp16_room()) + ", the tails leave " +
           std::to_string(room));
    }
  }
  // The prefix index holds one reference on each block it files (each
  // filed once: its map is keyed by block).
  std::array<boost::unordered_flat_map<std::int32_t, std::int32_t>, kNumPrecisions> cached;
  if (m.index) {
    m.index->check();
    m.index->for_each_block([&](Precision p, std::int32_t block) {
      if (block >= m.pool(p).id_limit() || !m.pool(p).owns_slab(block / m.pool(p).blocks_per_slab())) {
        fail("prefix index: " + std::string(to_string(p)) + " block " + std::to_string(block) +
             " is outside the pool's slabs");
      }
      ++cached[at(p)][block];
      ++holders[at(p)][block];
    });
  } else if (m.config.prefix_cache.enabled) {
    fail("prefix caching is on but the manager has no prefix index");
  }
  for (const Precision p : kAllPrecisions) {
    const BlockPool& bp = m.pool(p);
    for (const auto& [block, count] : holders[at(p)]) {
      if (bp.ref_count(block) != count) {
        const std::int32_t tables = count - (cached[at(p)].contains(block) ? 1 : 0);
        fail(std::string(to_string(p)) + " block " + std::to_string(block) + " has ref count " +
             std::to_string(bp.ref_count(block)) + " but " + std::to_string(tables) + " page tables hold it" +
             (tables != count ? " and the prefix index" : ""));
      }
    }
    // Every used block is held: otherwise it leaked.
    if (static_cast<std::int64_t>(holders[at(p)].size()) != bp.used_blocks()) {
      fail(std::string(to_string(p)) + " pool has " + std::to_string(bp.used_blocks()) +
           " used blocks but page tables " + (m.index ? "and the prefix index " : "") + "hold " +
           std::to_string(holders[at(p)].size()));
    }
    // Host swap pool: free + held == capacity, each free slot listed once.
    const SwapPool& sp = m.swap[at(p)];
    std::vector<std::uint8_t> listed(sp.used.size(), 0);
    for (const std::int32_t slot : sp.free) {
      if (slot < 0 || static_cast<std::size_t>(slot) >= sp.used.size() || sp.used[static_cast<std::size_t>(slot)] ||
          listed[static_cast<std::size_t>(slot)]) {
        fail(std::string(to_string(p)) + " swap pool: free slot " + std::to_string(slot) +
             " is out of range, used or listed twice");
      }
      listed[static_cast<std::size_t>(slot)] = 1;
    }
    if (sp.free.size() + swapped_holders[at(p)].size() != sp.used.size()) {
      fail(std::string(to_string(p)) + " swap pool: " + std::to_string(sp.free.size()) + " free + " +
           std::to_string(swapped_holders[at(p)].size()) + " held slots, capacity " + std::to_string(sp.used.size()));
    }
  }
}

std::string KVCacheManager::describe_state() const {
  const Impl& m = *impl_;
  std::string out;
  auto put = [&out](const char* label, std::int64_t value) {
    out += label;
    out += std::to_string(value);
  };
  put("arena: slabs ", m.arena.total_slabs());
  out += ", owners";
  for (std::int32_t s = 0; s < m.arena.total_slabs(); ++s) {
    const auto owner = m.arena.owner(s);
    out += ' ';
    out += owner ? to_string(*owner) : "-";
  }
  out += "\n  free slabs:";
  for (const std::int32_t s : m.arena.free_list()) put(" ", s);
  out += "\n";
  for (const Precision p : kAllPrecisions) m.pool(p).describe(out);
  for (const Precision p : kAllPrecisions) {
    if (m.config.swap_blocks[at(p)] == 0) continue;  // no host pool: nothing to show
    out += "swap ";
    out += to_string(p);
    out += " free:";
    for (const std::int32_t slot : m.swap[at(p)].free) put(" ", slot);
    out += "\n";
  }
  if (m.index) m.index->describe(out);
  for (const SequenceId id : sequence_ids()) {
    const Sequence& seq = m.sequences.at(id);
    put("sequence ", id);
    if (seq.swapped) out += " (swapped: host slots)";
    put(": tokens ", seq.num_tokens);
    out += ", prompt";
    for (const Segment& s : seq.prompt->layout.segments()) put(s.kind == TokenKind::Text ? " T" : " V", s.length);
    out += "\n";
    for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
      put("  layer ", layer);
      out += " plan ";
      for (std::int32_t w = 0; w < seq.prompt->plan.num_windows(); ++w) {
        out += "F42"[pool_index(seq.prompt->plan.at(layer, w))];
      }
      for (const Precision p : kAllPrecisions) {
        out += " | ";
        out += to_string(p);
        out += ':';
        for (const std::int32_t b : seq.table.blocks(layer, p)) put(" ", b);
      }
      if (Impl::has_aged(seq)) {
        // Trailing FP16 entries say nothing: demote() may grow a list first.
        out += " stream ";
        const auto& list = seq.aged[static_cast<std::size_t>(layer)].blocks;
        std::size_t n = list.size();
        while (n > 0 && list[n - 1] == Precision::FP16) --n;
        for (std::size_t k = 0; k < n; ++k) out += "F42"[pool_index(list[k])];
      }
      put(" | fill ", seq.table.fp16_tail_fill(layer));
      out += "\n";
    }
  }
  return out;
}

}  // namespace mixkv
