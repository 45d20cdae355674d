#include "mixkv/cache/kv_cache_manager.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include <boost/unordered/unordered_flat_map.hpp>
#include <boost/unordered_map.hpp>

#include "mixkv/core/checks.h"
#include "mixkv/cache/arena.h"
#include "mixkv/cache/block_pool.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/page_table.h"

namespace mixkv {

namespace {

using detail::require_index;
using detail::require_precision;

std::size_t at(Precision p) { return static_cast<std::size_t>(pool_index(p)); }

void require_slots_form(AppendSlots form) {
  if (form != AppendSlots::PerLayer && form != AppendSlots::Compact) {
    throw InvalidArgument("form = " + std::to_string(static_cast<int>(form)) +
                          ", expected AppendSlots::PerLayer (0) or AppendSlots::Compact (1)");
  }
}

std::string counts_text(const BlockCounts& counts) {
  return "FP16 " + std::to_string(counts[0]) + ", INT4 " + std::to_string(counts[1]) + ", INT2 " +
         std::to_string(counts[2]);
}

// A prompt is shared by forks; only demotion changes it (its plan), on a
// private copy.
struct Prompt {
  TokenLayout layout;
  PrecisionPlan plan;
};

struct Sequence {
  std::shared_ptr<Prompt> prompt;
  std::int32_t num_tokens = 0;
  PageTable table;       // device block ids, or host swap slots while swapped
  bool swapped = false;
  // Set on both sides of a fork: only such sequences can share blocks, so
  // the others append without looking at ref counts.
  bool forked = false;
  SequenceHandle handle{};
  // Batch validation (require_ids) marks each sequence it has seen with the
  // batch's epoch, instead of hashing the ids a second time; demote() marks
  // the first listing of each sequence the same way.
  mutable std::uint64_t seen_epoch = 0;
  mutable std::size_t seen_index = 0;
};

// Host swap slots of one pool: a stack of free slots (slot 0 on top when
// fresh) and a used flag per slot.
struct SwapPool {
  std::vector<std::int32_t> free;
  std::vector<std::uint8_t> used;
};

// Block ids per pool, indexed by pool_index().
using BlockIds = std::array<std::vector<std::int32_t>, kNumPrecisions>;

// Capacity for `size` elements, doubling: for vectors that grow by one
// element per call, reserved ahead of the change that adds it.
template <typename T>
void reserve_geometric(std::vector<T>& v, std::size_t size) {
  if (v.capacity() < size) v.reserve(std::max(size, 2 * v.capacity()));
}

}  // namespace

struct KVCacheManager::Impl {
  CacheConfig config;
  Arena arena;
  std::array<std::unique_ptr<BlockPool>, kNumPrecisions> pools;
  // Node-based (Boost 1.81 has no unordered_node_map): a sequence's address,
  // and so page_table(), stays valid while other sequences come and go.
  boost::unordered_map<SequenceId, Sequence> sequences;
  std::array<SwapPool, kNumPrecisions> swap;
  mutable std::uint64_t epoch = 0;
  // Handle registry: index -> sequence (null when free), with generations.
  // free_handles has room for every handle (reserve_handle), so that
  // free_sequence allocates nothing.
  std::vector<Sequence*> handles;
  std::vector<std::uint32_t> generations;
  std::vector<std::int32_t> free_handles;

  // append_tokens' scratch, kept between calls so that a decode step at a
  // block boundary allocates nothing for it: the fresh block ids, one
  // sequence's new tails ([layer], sized in the constructor), the sequences
  // of the general path whose tail changed, and the rows of PerLayer slots
  // ([layer], sized in the constructor).
  BlockIds fresh_ids;
  std::vector<std::int32_t> layer_ids;
  std::vector<std::uint8_t> tail_changed;
  std::vector<std::int32_t*> slot_rows;

  void reserve_handle();
  void register_handle(Sequence& seq);
  void release_handle(const Sequence& seq);
  AppendResult append(const std::vector<Sequence*>& all, AppendSlots form);
  BlockCounts count_fresh(const std::vector<Sequence*>& seqs) const;
  void prepare_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general, bool any_forked,
                       std::int64_t fresh_blocks, AppendResult& result);
  void fill_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general, bool any_forked,
                    const std::vector<std::int32_t>& fresh, AppendResult& result);

  explicit Impl(const CacheConfig& c);

  std::int32_t num_layers() const { return config.shape.num_layers; }
  std::int32_t block_size() const { return config.shape.block_size; }
  BlockPool& pool(Precision p) { return *pools[at(p)]; }
  const BlockPool& pool(Precision p) const { return *pools[at(p)]; }

  const Sequence& find(SequenceId id, const char* name) const;
  Sequence& find(SequenceId id, const char* name) { return const_cast<Sequence&>(std::as_const(*this).find(id, name)); }
  // Validates a batch of distinct, device-resident ids; returns the sequences.
  std::vector<const Sequence*> require_ids(std::span<const SequenceId> ids) const;
  const Sequence& resident(SequenceId id, const char* name) const;
  Sequence& resident(SequenceId id, const char* name) {
    return const_cast<Sequence&>(std::as_const(*this).resident(id, name));
  }
  std::int64_t fp16_rank(const Prompt& prompt, std::int32_t layer, std::int32_t window) const;
  std::int32_t block_index(const Prompt& prompt, std::int32_t layer, std::int32_t window, std::int64_t& rank) const;
  std::optional<std::string> why_not(const Sequence& seq, std::int32_t layer, std::int32_t window,
                                     Precision target) const;
  void require_layer(std::int32_t layer) const { require_index("layer", layer, num_layers()); }
  void require_prompt(const TokenLayout& layout, const PrecisionPlan& plan) const;
  BlockCounts prompt_demand(const TokenLayout& layout, const PrecisionPlan& plan) const;

  std::optional<std::string> shortfall(const BlockCounts& need) const;
  void prepare_blocks(const BlockCounts& need, const std::string& what, BlockIds& ids);
  void take_blocks(const BlockCounts& need, BlockIds& ids);
  void grow(Precision p);
};

namespace {

// Checks what the arena and the pools cannot: the shape, and that a slab
// holds at least one block of the largest format (FP16).
const CacheConfig& checked(const CacheConfig& c) {
  validate(c.shape);
  const BlockFormat fp16{Precision::FP16, c.shape.num_kv_heads, c.shape.head_dim, c.shape.block_size};
  if (c.slab_bytes < fp16.block_bytes()) {
    throw InvalidArgument("slab_bytes = " + std::to_string(c.slab_bytes) + ", expected at least one FP16 block (" +
                          std::to_string(fp16.block_bytes()) + " bytes for this shape)");
  }
  // FP16 slots (block_id * block_size + offset) are int32 in every mapping;
  // checked before the arena's bookkeeping is built for a giant arena.
  // (No overflow: at most arena_bytes / 1024 blocks of at most 256 tokens.)
  const std::size_t slots =
      c.arena_bytes / c.slab_bytes * (c.slab_bytes / fp16.block_bytes()) * static_cast<std::size_t>(c.shape.block_size);
  if (slots > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    throw InvalidArgument("arena_bytes = " + std::to_string(c.arena_bytes) + " holds " + std::to_string(slots) +
                          " FP16 token slots, expected fewer than 2^31 (slot ids are int32)");
  }
  for (const Precision p : kAllPrecisions) {
    const std::int64_t n = c.swap_blocks[at(p)];
    if (n < 0 || n > std::numeric_limits<std::int32_t>::max()) {
      throw InvalidArgument("swap_blocks[" + std::string(to_string(p)) + "] = " + std::to_string(n) +
                            ", expected 0 <= swap_blocks < 2^31");
    }
  }
  return c;
}

}  // namespace

KVCacheManager::Impl::Impl(const CacheConfig& c) : config(checked(c)), arena(c.arena_bytes, c.slab_bytes) {
  for (const Precision p : kAllPrecisions) {
    pools[at(p)] = std::make_unique<BlockPool>(
        BlockFormat{p, c.shape.num_kv_heads, c.shape.head_dim, c.shape.block_size}, c.slab_bytes, arena.total_slabs());
    const auto slots = static_cast<std::int32_t>(c.swap_blocks[at(p)]);
    SwapPool& sp = swap[at(p)];
    sp.used.assign(static_cast<std::size_t>(slots), 0);
    sp.free.reserve(static_cast<std::size_t>(slots));
    for (std::int32_t s = slots; s-- > 0;) sp.free.push_back(s);
  }
  layer_ids.resize(static_cast<std::size_t>(num_layers()));
  slot_rows.resize(static_cast<std::size_t>(num_layers()));
}

const Sequence& KVCacheManager::Impl::find(SequenceId id, const char* name) const {
  const auto it = sequences.find(id);
  if (it == sequences.end()) {
    throw UnknownId(std::string(name) + " = " + std::to_string(id) + " is not a sequence of this cache");
  }
  return it->second;
}

// Room for register_handle() and for every later release_handle(): both
// then allocate nothing.
void KVCacheManager::Impl::reserve_handle() {
  if (!free_handles.empty()) return;  // register_handle reuses a freed index
  const std::size_t size = handles.size() + 1;
  reserve_geometric(handles, size);
  reserve_geometric(generations, size);
  reserve_geometric(free_handles, size);
}

void KVCacheManager::Impl::register_handle(Sequence& seq) {
  std::int32_t index = 0;
  if (free_handles.empty()) {
    index = static_cast<std::int32_t>(handles.size());
    handles.push_back(nullptr);
    generations.push_back(0);
  } else {
    index = free_handles.back();
    free_handles.pop_back();
  }
  handles[static_cast<std::size_t>(index)] = &seq;
  seq.handle = SequenceHandle{index, generations[static_cast<std::size_t>(index)]};
}

void KVCacheManager::Impl::release_handle(const Sequence& seq) {
  const auto index = static_cast<std::size_t>(seq.handle.index);
  handles[index] = nullptr;
  ++generations[index];  // every handle to the freed sequence goes stale
  free_handles.push_back(seq.handle.index);
}

const Sequence& KVCacheManager::Impl::resident(SequenceId id, const char* name) const {
  const Sequence& seq = find(id, name);
  if (seq.swapped) {
    throw InvalidArgument(std::string(name) + " = " + std::to_string(id) +
                          " is swapped out, expected a sequence in device memory (swap_in first)");
  }
  return seq;
}

std::vector<const Sequence*> KVCacheManager::Impl::require_ids(std::span<const SequenceId> ids) const {
  std::vector<const Sequence*> seqs;
  seqs.reserve(ids.size());
  const std::uint64_t batch = ++epoch;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto it = sequences.find(ids[i]);
    if (it == sequences.end()) {
      throw UnknownId("ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                      " is not a sequence of this cache");
    }
    const Sequence& seq = it->second;
    if (seq.seen_epoch == batch) {
      throw InvalidArgument("ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) + " repeats ids[" +
                            std::to_string(seq.seen_index) + "], expected distinct ids");
    }
    if (seq.swapped) {
      throw InvalidArgument("ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                            " is swapped out, expected a sequence in device memory (swap_in first)");
    }
    seq.seen_epoch = batch;
    seq.seen_index = i;
    seqs.push_back(&seq);
  }
  return seqs;
}

// FP16 rank (position among the layer's FP16 tokens) of the first token of
// `window`, an FP16 window of `layer`.
std::int64_t KVCacheManager::Impl::fp16_rank(const Prompt& prompt, std::int32_t layer, std::int32_t window) const {
  const std::int32_t bs = block_size();
  std::int64_t rank = 0;
  if (config.fp16_windows_first) {
    for (std::int32_t w = 0; w < window; ++w) rank += prompt.plan.at(layer, w) == Precision::FP16 ? bs : 0;
    return rank;
  }
  std::int32_t w = 0;
  for (const Segment& segment : prompt.layout.segments()) {
    if (segment.kind == TokenKind::Text) {
      rank += segment.length;
      continue;
    }
    const std::int32_t full = segment.length / bs;
    for (std::int32_t i = 0; i < full; ++i, ++w) {
      if (w == window) return rank;
      rank += prompt.plan.at(layer, w) == Precision::FP16 ? bs : 0;
    }
    rank += segment.length - full * bs;
  }
  return rank;
}

// Position of (layer, window)'s block in the list of the window's pool, or
// -1 for an FP16 window whose tokens start inside a block (FP16 rank of its
// first token in `rank`).
std::int32_t KVCacheManager::Impl::block_index(const Prompt& prompt, std::int32_t layer, std::int32_t window,
                                               std::int64_t& rank) const {
  const Precision current = prompt.plan.at(layer, window);
  if (current == Precision::FP16) {
    rank = fp16_rank(prompt, layer, window);
    return rank % block_size() == 0 ? static_cast<std::int32_t>(rank / block_size()) : -1;
  }
  std::int32_t index = 0;
  for (std::int32_t w = 0; w < window; ++w) index += prompt.plan.at(layer, w) == current ? 1 : 0;
  return index;
}

std::optional<std::string> KVCacheManager::Impl::why_not(const Sequence& seq, std::int32_t layer,
                                                         std::int32_t window, Precision target) const {
  const PrecisionPlan& plan = seq.prompt->plan;
  const Precision current = plan.at(layer, window);
  if (bits_of(target) >= bits_of(current)) {
    return "target " + std::string(to_string(target)) + " is not below the window's " +
           std::string(to_string(current));
  }
  std::int64_t rank = 0;
  const std::int32_t index = block_index(*seq.prompt, layer, window, rank);
  if (index < 0) {
    return "its FP16 tokens start at FP16 rank " + std::to_string(rank) + ", inside a block of " +
           std::to_string(block_size()) + " (they share blocks with other tokens; fp16_windows_first avoids this)";
  }
  const std::int32_t block = seq.table.blocks(layer, current)[static_cast<std::size_t>(index)];
  const std::int32_t refs = pool(current).ref_count(block);
  if (refs != 1) {
    return "its " + std::string(to_string(current)) + " block " + std::to_string(block) + " is shared by " +
           std::to_string(refs) + " sequences (a shared block is never demoted in place)";
  }
  return std::nullopt;
}

void KVCacheManager::Impl::require_prompt(const TokenLayout& layout, const PrecisionPlan& plan) const {
  if (layout.num_tokens() < 1) {
    throw InvalidArgument("layout has 0 tokens, expected a TokenLayout with at least one segment");
  }
  if (plan.num_layers() != num_layers()) {
    throw InvalidArgument("plan.num_layers() = " + std::to_string(plan.num_layers()) + ", expected " +
                          std::to_string(num_layers()) + " (shape.num_layers)");
  }
  const std::int32_t windows = layout.num_windows(block_size());
  if (plan.num_windows() != windows) {
    throw InvalidArgument("plan.num_windows() = " + std::to_string(plan.num_windows()) + ", expected " +
                          std::to_string(windows) + " for this layout and block_size " + std::to_string(block_size()));
  }
}

BlockCounts KVCacheManager::Impl::prompt_demand(const TokenLayout& layout, const PrecisionPlan& plan) const {
  BlockCounts need{};
  const std::int64_t bs = block_size();
  for (std::int32_t layer = 0; layer < num_layers(); ++layer) {
    const auto windows = plan.window_counts(layer);
    const std::int64_t fp16_tokens = layout.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * bs;
    need[0] += (fp16_tokens + bs - 1) / bs;
    need[1] += windows[1];
    need[2] += windows[2];
  }
  return need;
}

// Why `need` cannot be allocated now, or nullopt when it can. Exact: each
// pool first uses its own free blocks (partly used slabs first), then the
// pools that still lack blocks share the free slabs plus the empty slabs the
// other pools keep after their own allocation (BlockPool::spare_slabs_after).
std::optional<std::string> KVCacheManager::Impl::shortfall(const BlockCounts& need) const {
  std::int64_t slabs = arena.free_slabs();
  for (const Precision p : kAllPrecisions) slabs += pool(p).spare_slabs_after(need[at(p)]);
  for (const Precision p : kAllPrecisions) {
    const BlockPool& bp = pool(p);
    const std::int64_t missing = need[at(p)] - bp.free_blocks();
    if (missing <= 0) continue;
    const std::int64_t wanted = (missing + bp.blocks_per_slab() - 1) / bp.blocks_per_slab();
    if (wanted > slabs) {
      return "the " + std::string(to_string(p)) + " pool needs " + std::to_string(need[at(p)]) + " blocks, " +
             std::to_string(bp.free_blocks() + slabs * bp.blocks_per_slab()) + " available (" +
             std::to_string(bp.free_blocks()) + " free in its slabs + " + std::to_string(slabs) +
             " obtainable slabs of " + std::to_string(bp.blocks_per_slab()) +
             " blocks); blocks needed: " + counts_text(need);
    }
    slabs -= wanted;
  }
  return std::nullopt;
}

void KVCacheManager::Impl::grow(Precision p) {
  if (arena.free_slabs() == 0) {
    // Lazy reclamation: an entirely free slab of another pool goes back to
    // the arena only now that some pool needs it.
    const BlockPool* donor = nullptr;
    for (const Precision q : kAllPrecisions) {
      if (q != p && pool(q).empty_slabs() > 0) {
        donor = &pool(q);
        break;
      }
    }
    if (donor == nullptr) {
      throw InvariantViolation("grow(" + std::string(to_string(p)) +
                               "): no free or reclaimable slab although the accounting found one");
    }
    const Precision q = donor->format().precision;
    arena.give_back(pool(q).release_empty_slab(), q);
  }
  pool(p).add_slab(arena.take(p));
}

// Taking blocks is split in two so that a mutating call keeps the strong
// guarantee under std::bad_alloc too: prepare_blocks() does everything that
// can fail (OutOfMemory when `need` does not fit, the host memory of `ids`
// and of the slab records grow() will add) and changes nothing the state
// shows; the call then makes its other host allocations, and only then
// take_blocks() moves blocks and slabs, allocating nothing.
void KVCacheManager::Impl::prepare_blocks(const BlockCounts& need, const std::string& what, BlockIds& ids) {
  if (auto reason = shortfall(need)) throw OutOfMemory(what + ": out of memory: " + *reason);
  for (const Precision p : kAllPrecisions) {
    ids[at(p)].clear();
    ids[at(p)].reserve(static_cast<std::size_t>(need[at(p)]));
    // take_blocks() grows a pool once per slab it lacks after its own free
    // blocks; other pools only give it empty slabs they do not need.
    const BlockPool& bp = pool(p);
    const std::int64_t missing = need[at(p)] - bp.free_blocks();
    if (missing > 0) {
      pools[at(p)]->reserve_slabs(static_cast<std::int32_t>((missing + bp.blocks_per_slab() - 1) / bp.blocks_per_slab()));
    }
  }
}

// Takes the blocks prepare_blocks(need, .., ids) made room for, into ids.
// Cannot fail: shortfall() found them, ids has their capacity and every
// slab grow() adds has its record (arena give_back/take allocate nothing).
void KVCacheManager::Impl::take_blocks(const BlockCounts& need, BlockIds& ids) {
  // Every pool takes its own free blocks before any pool grows, so a slab is
  // never reclaimed from a pool that still needs it (the order shortfall()
  // counted in).
  for (const Precision p : kAllPrecisions) {
    const std::int64_t own = std::min(need[at(p)], pool(p).free_blocks());
    for (std::int64_t i = 0; i < own; ++i) ids[at(p)].push_back(pool(p).allocate());
  }
  for (const Precision p : kAllPrecisions) {
    while (static_cast<std::int64_t>(ids[at(p)].size()) < need[at(p)]) {
      if (pool(p).free_blocks() == 0) grow(p);
      ids[at(p)].push_back(pool(p).allocate());
    }
  }
}

KVCacheManager::KVCacheManager(CacheConfig config) : impl_(std::make_unique<Impl>(config)) {}
KVCacheManager::~KVCacheManager() = default;

const CacheConfig& KVCacheManager::config() const { return impl_->config; }

BlockFormat KVCacheManager::format(Precision p) const {
  require_precision(p, "p");
  return impl_->pool(p).format();
}

PoolView KVCacheManager::pool_view(Precision p, std::byte* arena_base) const {
  require_precision(p, "p");
  if (arena_base == nullptr) throw InvalidArgument("arena_base = nullptr, expected the arena's first byte");
  return arena_layout().at(arena_base)[at(p)];
}

PoolLayout KVCacheManager::arena_layout() const {
  PoolLayout layout;
  layout.bytes = impl_->config.arena_bytes;
  for (const Precision p : kAllPrecisions) {
    const BlockPool& bp = impl_->pool(p);
    const auto capacity = static_cast<std::int64_t>(impl_->arena.total_slabs()) * bp.blocks_per_slab();
    layout.pools[at(p)] = PoolView{nullptr, impl_->config.slab_bytes, bp.blocks_per_slab(), bp.format(),
                                   static_cast<std::int32_t>(std::min<std::int64_t>(capacity, INT32_MAX))};
  }
  return layout;
}

PoolStats KVCacheManager::pool_stats(Precision p) const {
  require_precision(p, "p");
  const BlockPool& bp = impl_->pool(p);
  return PoolStats{bp.format().block_bytes(), bp.blocks_per_slab(), bp.num_slabs(), bp.used_blocks(), bp.free_blocks(),
                   bp.empty_slabs()};
}

std::int32_t KVCacheManager::used_in_slab(Precision p, std::int32_t slab) const {
  require_precision(p, "p");
  return impl_->pool(p).used_in_slab(slab);
}

std::int32_t KVCacheManager::total_slabs() const { return impl_->arena.total_slabs(); }
std::int32_t KVCacheManager::free_slabs() const { return impl_->arena.free_slabs(); }

BlockCounts KVCacheManager::demand(const TokenLayout& layout, const PrecisionPlan& plan) const {
  impl_->require_prompt(layout, plan);
  return impl_->prompt_demand(layout, plan);
}

bool KVCacheManager::can_allocate(const BlockCounts& blocks) const {
  for (const Precision p : kAllPrecisions) {
    if (blocks[at(p)] < 0) {
      throw InvalidArgument("blocks[" + std::string(to_string(p)) + "] = " + std::to_string(blocks[at(p)]) +
                            ", expected >= 0");
    }
  }
  return !impl_->shortfall(blocks).has_value();
}

void KVCacheManager::add_sequence(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan) {
  Impl& m = *impl_;
  if (m.sequences.contains(id)) {
    throw InvalidArgument("id = " + std::to_string(id) + " is already a sequence of this cache, expected a new id");
  }
  m.require_prompt(layout, plan);
  const BlockCounts need = m.prompt_demand(layout, plan);
  const std::int32_t bs = m.block_size();

  // Prepare: every host allocation (the block ids, slab records, the
  // prompt, the page lists at their final size, the handle, the map node)
  // before any block moves, so that std::bad_alloc leaves nothing taken.
  // (Slab records first, as before this split: the heap order changed
  // append_tokens' speed in scheduler_bench by up to 10%.)
  BlockIds ids;
  m.prepare_blocks(need, "add_sequence(id = " + std::to_string(id) + ")", ids);
  Sequence seq{.prompt = std::make_shared<Prompt>(Prompt{layout, plan}),
               .num_tokens = layout.num_tokens(),
               .table = PageTable(m.num_layers(), m.block_size())};
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    const auto windows = plan.window_counts(layer);
    const std::int64_t fp16_tokens = layout.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * bs;
    seq.table.reserve(layer, Precision::FP16, static_cast<std::size_t>((fp16_tokens + bs - 1) / bs));
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      seq.table.reserve(layer, p, static_cast<std::size_t>(windows[at(p)]));
    }
  }
  m.reserve_handle();
  // Last: emplace either inserts or changes nothing (Boost's strong guarantee).
  Sequence& added = m.sequences.emplace(id, std::move(seq)).first->second;

  // Commit: nothing below allocates or throws. The blocks go out layer by
  // layer, in allocation order.
  m.take_blocks(need, ids);
  std::array<std::size_t, kNumPrecisions> next{};
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    const auto windows = plan.window_counts(layer);
    std::int64_t fp16_tokens = layout.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * bs;
    while (fp16_tokens > 0) {
      const auto fill = static_cast<std::int32_t>(std::min<std::int64_t>(fp16_tokens, bs));
      added.table.push_block(layer, Precision::FP16, ids[0][next[0]++], fill);
      fp16_tokens -= fill;
    }
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      for (std::int32_t w = 0; w < windows[at(p)]; ++w) added.table.push_block(layer, p, ids[at(p)][next[at(p)]++], bs);
    }
  }
  m.register_handle(added);
}

bool KVCacheManager::contains(SequenceId id) const { return impl_->sequences.contains(id); }

std::vector<SequenceId> KVCacheManager::sequence_ids() const {
  std::vector<SequenceId> ids;
  ids.reserve(impl_->sequences.size());
  for (const auto& [id, seq] : impl_->sequences) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::int32_t KVCacheManager::num_tokens(SequenceId id) const { return impl_->find(id, "id").num_tokens; }
const TokenLayout& KVCacheManager::layout(SequenceId id) const { return impl_->find(id, "id").prompt->layout; }
const PrecisionPlan& KVCacheManager::plan(SequenceId id) const { return impl_->find(id, "id").prompt->plan; }

StoreMapping KVCacheManager::prefill_mapping(SequenceId id, std::int32_t layer) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.resident(id, "id");
  m.require_layer(layer);
  const TokenLayout& layout = seq.prompt->layout;
  const PrecisionPlan& plan = seq.prompt->plan;
  const std::int32_t bs = m.block_size();
  const auto int4 = seq.table.blocks(layer, Precision::INT4);
  const auto int2 = seq.table.blocks(layer, Precision::INT2);

  StoreMapping mapping;
  mapping.fp16_slots.reserve(static_cast<std::size_t>(layout.num_tokens()));
  // FP16 tokens are packed densely: in prompt order, or with
  // fp16_windows_first the FP16 windows first (one block each), then the rest.
  std::int64_t window_rank = 0;
  std::int64_t fp16_rank = 0;
  if (m.config.fp16_windows_first) fp16_rank = std::int64_t{plan.window_counts(layer)[0]} * bs;
  std::int32_t window = 0;
  std::int32_t row = 0;
  auto add_fp16 = [&](std::int32_t count) {
    for (std::int32_t i = 0; i < count; ++i, ++row)
      mapping.fp16_slots.push_back(seq.table.fp16_slot(layer, fp16_rank++));
  };
  for (const Segment& segment : layout.segments()) {
    if (segment.kind == TokenKind::Text) {
      add_fp16(segment.length);
      continue;
    }
    const std::int32_t full = segment.length / bs;
    for (std::int32_t w = 0; w < full; ++w, ++window) {
      const Precision p = plan.at(layer, window);
      if (p == Precision::FP16) {
        if (!m.config.fp16_windows_first) {
          add_fp16(bs);
          continue;
        }
        for (std::int32_t i = 0; i < bs; ++i, ++row)
          mapping.fp16_slots.push_back(seq.table.fp16_slot(layer, window_rank++));
        continue;
      }
      auto& windows = p == Precision::INT4 ? mapping.int4_windows : mapping.int2_windows;
      const auto blocks = p == Precision::INT4 ? int4 : int2;
      windows.push_back({blocks[windows.size()], row});
      mapping.fp16_slots.insert(mapping.fp16_slots.end(), static_cast<std::size_t>(bs), -1);
      row += bs;
    }
    add_fp16(segment.length - full * bs);  // the visual tail stays FP16
  }
  return mapping;
}

AppendResult KVCacheManager::append_tokens(std::span<const SequenceId> ids, AppendSlots form) {
  Impl& m = *impl_;
  require_slots_form(form);
  std::vector<Sequence*> seqs;
  {
    const std::vector<const Sequence*> found = m.require_ids(ids);
    seqs.reserve(found.size());
    for (std::size_t i = 0; i < found.size(); ++i) {
      if (found[i]->num_tokens == std::numeric_limits<std::int32_t>::max()) {
        throw InvalidArgument("ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                              " holds 2^31 - 1 tokens, expected room for one more");
      }
      seqs.push_back(const_cast<Sequence*>(found[i]));  // the manager's own, non-const
    }
  }
  return m.append(seqs, form);
}

SequenceHandle KVCacheManager::handle(SequenceId id) const { return impl_->find(id, "id").handle; }

AppendResult KVCacheManager::append_tokens(std::span<const SequenceHandle> handles, AppendSlots form) {
  Impl& m = *impl_;
  require_slots_form(form);
  std::vector<Sequence*> seqs;
  seqs.reserve(handles.size());
  const std::uint64_t batch = ++m.epoch;
  // The argument's name is built only for an error: this loop runs once per
  // sequence and step.
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
    if (seq.num_tokens == std::numeric_limits<std::int32_t>::max()) {
      throw InvalidArgument(name(i) + " holds 2^31 - 1 tokens, expected room for one more");
    }
    seq.seen_epoch = batch;
    seq.seen_index = i;
    seqs.push_back(&seq);
  }
  return m.append(seqs, form);
}

// A sequence's new token sits at offset num_tokens % block_size of its FP16
// tail in every layer (FP16 tokens = tokens - whole quantized windows). A
// sequence outside forks with a nonzero offset has room in every tail: the
// fast path, O(1) with AppendSlots::Compact. The others (a new block in
// every layer, or forked tails that may need copy-on-write) take the
// general path, O(num_layers), once per block_size tokens outside forks.
AppendResult KVCacheManager::Impl::append(const std::vector<Sequence*>& all, AppendSlots form) {
  const std::int32_t bs = block_size();
  const auto layers = static_cast<std::size_t>(num_layers());
  const std::size_t n = all.size();
  const bool per_layer = form == AppendSlots::PerLayer;
  AppendResult result;
  if (per_layer) result.slots.assign(layers, std::vector<std::int32_t>(n));
  result.offsets.resize(n);
  std::vector<std::size_t> general;  // batch indices, ascending
  std::vector<Sequence*> forked;
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& seq = *all[i];
    const std::int32_t offset = seq.num_tokens % bs;
    result.offsets[i] = offset;
    if (!seq.forked && offset != 0) continue;
    general.push_back(i);
    if (seq.forked) forked.push_back(all[i]);
  }
  // The new FP16 blocks, counted exactly (all or nothing): a sequence
  // outside forks opens a block in every layer.
  BlockCounts need = count_fresh(forked);
  need[0] += static_cast<std::int64_t>(general.size() - forked.size()) * num_layers();
  // Every host allocation of the call comes before any block or table
  // changes (the result above, the block ids, slab records, the general
  // path's room), so that std::bad_alloc leaves every sequence as it was.
  const bool any_forked = !forked.empty();
  prepare_blocks(need, "append_tokens", fresh_ids);
  if (!general.empty()) prepare_general(all, general, any_forked, need[0], result);

  // Commit: nothing below allocates or throws.
  take_blocks(need, fresh_ids);
  fill_general(all, general, any_forked, fresh_ids[0], result);

  std::size_t next_general = 0;
  if (per_layer) {
    // Memory-latency bound (a sequence's record, then its tails): both are
    // fetched a few sequences ahead of the one being written.
    constexpr std::size_t kAhead = 8;
    std::int32_t* const* out = slot_rows.data();
    for (std::size_t l = 0; l < layers; ++l) slot_rows[l] = result.slots[l].data();
    for (std::size_t i = 0; i < std::min(n, 2 * kAhead); ++i) __builtin_prefetch(&all[i]->table);
    for (std::size_t i = 0; i < std::min(n, kAhead); ++i) __builtin_prefetch(all[i]->table.fp16_tails().data());
    for (std::size_t i = 0; i < n; ++i) {
      if (i + 2 * kAhead < n) __builtin_prefetch(&all[i + 2 * kAhead]->table);
      if (i + kAhead < n) __builtin_prefetch(all[i + kAhead]->table.fp16_tails().data());
      if (next_general < general.size() && general[next_general] == i) {
        ++next_general;
      } else {
        PageTable& table = all[i]->table;
        table.fill_all_fp16_tails();
        // The offset is the same in every layer (check_invariants holds the
        // fills to it).
        const std::int32_t offset = result.offsets[i];
        const std::int32_t* tails = table.fp16_tails().data();
        for (std::size_t l = 0; l < layers; ++l) out[l][i] = tails[l] * bs + offset;
      }
      ++all[i]->num_tokens;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      if (next_general < general.size() && general[next_general] == i) {
        ++next_general;
      } else {
        all[i]->table.fill_all_fp16_tails();
      }
      ++all[i]->num_tokens;
    }
  }
  return result;
}

BlockCounts KVCacheManager::Impl::count_fresh(const std::vector<Sequence*>& seqs) const {
  Impl& m = const_cast<Impl&>(*this);
  const BlockPool& fp16 = m.pool(Precision::FP16);
  const std::int32_t bs = m.block_size();
  auto needs_block = [&](const PageTable& t, std::int32_t layer, auto&& shared) {
    const auto tail = t.blocks(layer, Precision::FP16);
    return tail.empty() || t.fp16_tail_fill(layer) == bs || shared(tail.back());
  };
  BlockCounts need{};
  if (seqs.empty()) return need;
  boost::unordered_flat_map<std::int32_t, std::int32_t> copied;  // tail block -> holders that left it
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Sequence* seq : seqs) {
      const bool fresh = needs_block(seq->table, layer, [&](std::int32_t block) {
        if (fp16.ref_count(block) <= 1) return false;  // the common case: no map look-up
        std::int32_t& left = copied[block];
        if (fp16.ref_count(block) - left <= 1) return false;
        ++left;
        return true;
      });
      need[0] += fresh ? 1 : 0;
    }
  }
  return need;
}

// The host memory fill_general() needs, so that it allocates nothing: the
// result's changed tails and copy-on-write copies (at most one per fresh
// block), the per-sequence flags, room for one more FP16 block in every
// layer of each sequence on the general path.
void KVCacheManager::Impl::prepare_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general,
                                           bool any_forked, std::int64_t fresh_blocks, AppendResult& result) {
  result.tails_changed.reserve(general.size());
  result.tail_blocks.reserve(general.size() * static_cast<std::size_t>(num_layers()));
  if (any_forked) {
    result.copies.reserve(static_cast<std::size_t>(fresh_blocks));
    tail_changed.assign(general.size(), 0);
  }
  for (const std::size_t i : general) all[i]->table.reserve_fp16_tails();
}

// The general path for the batch indices `general` (prepared by
// prepare_general). Fresh ids are handed out in layer order, then batch
// order (the order of earlier versions, so the ids a call gives are
// unchanged).
void KVCacheManager::Impl::fill_general(const std::vector<Sequence*>& all, const std::vector<std::size_t>& general,
                                        bool any_forked, const std::vector<std::int32_t>& fresh,
                                        AppendResult& result) {
  BlockPool& fp16 = pool(Precision::FP16);
  const std::int32_t bs = block_size();
  const auto layers = static_cast<std::size_t>(num_layers());
  const bool per_layer = !result.slots.empty();
  if (!any_forked) {
    // Every tail is full (or the layer has none): a new block in every
    // layer, the id of (layer l, k-th sequence) at l * general.size() + k.
    std::vector<std::int32_t>& ids = layer_ids;
    for (std::size_t k = 0; k < general.size(); ++k) {
      const std::size_t i = general[k];
      for (std::size_t l = 0; l < layers; ++l) ids[l] = fresh[l * general.size() + k];
      all[i]->table.open_fp16_tails(ids);
      if (per_layer) {
        for (std::size_t l = 0; l < layers; ++l) result.slots[l][i] = ids[l] * bs;
      }
      result.tails_changed.push_back(static_cast<std::int32_t>(i));
      result.tail_blocks.insert(result.tail_blocks.end(), ids.begin(), ids.end());
    }
    return;
  }
  std::vector<std::uint8_t>& changed = tail_changed;
  std::size_t next = 0;
  for (std::int32_t layer = 0; layer < num_layers(); ++layer) {
    for (std::size_t k = 0; k < general.size(); ++k) {
      const std::size_t i = general[k];
      PageTable& table = all[i]->table;
      const auto tail = table.blocks(layer, Precision::FP16);
      std::int32_t slot = 0;
      if (tail.empty() || table.fp16_tail_fill(layer) == bs) {
        const std::int32_t block = fresh[next++];
        table.push_block(layer, Precision::FP16, block, 1);
        slot = block * bs;
        changed[k] = 1;
      } else if (fp16.ref_count(tail.back()) > 1) {
        // Copy-on-write: this holder moves to a private copy of the tail;
        // the others keep the original.
        const std::int32_t src = tail.back();
        const std::int32_t dst = fresh[next++];
        result.copies.push_back({src, dst});
        fp16.release(src);
        table.replace_fp16_tail(layer, dst);
        slot = table.fill_fp16_tail(layer);
        changed[k] = 1;
      } else {
        slot = table.fill_fp16_tail(layer);
      }
      if (per_layer) result.slots[static_cast<std::size_t>(layer)][i] = slot;
    }
  }
  for (std::size_t k = 0; k < general.size(); ++k) {
    if (!changed[k]) continue;
    const auto tails = all[general[k]]->table.fp16_tails();
    result.tails_changed.push_back(static_cast<std::int32_t>(general[k]));
    result.tail_blocks.insert(result.tail_blocks.end(), tails.begin(), tails.end());
  }
}

void KVCacheManager::fork(SequenceId parent, SequenceId child) {
  Impl& m = *impl_;
  const Sequence& source = m.resident(parent, "parent");
  if (m.sequences.contains(child)) {
    throw InvalidArgument("child = " + std::to_string(child) +
                          " is already a sequence of this cache, expected a new id");
  }
  // Prepare (host memory: the copy, the handle, the map node), then commit.
  Sequence copy = source;
  copy.forked = true;
  m.reserve_handle();
  Sequence& added = m.sequences.emplace(child, std::move(copy)).first->second;  // inserts or changes nothing
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      for (const std::int32_t block : added.table.blocks(layer, p)) m.pool(p).retain(block);
    }
  }
  const_cast<Sequence&>(source).forked = true;
  m.register_handle(added);
}

void KVCacheManager::free_sequence(SequenceId id) {
  Impl& m = *impl_;
  const auto it = m.sequences.find(id);
  if (it == m.sequences.end()) {
    throw UnknownId("id = " + std::to_string(id) + " is not a sequence of this cache");
  }
  const PageTable& table = it->second.table;
  // In reverse, so the LIFO free lists hand the blocks out again in the
  // order this sequence took them.
  for (std::int32_t layer = m.num_layers(); layer-- > 0;) {
    for (const Precision p : {Precision::INT2, Precision::INT4, Precision::FP16}) {
      const auto blocks = table.blocks(layer, p);
      for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) {
        if (it->second.swapped) {
          SwapPool& sp = m.swap[at(p)];
          sp.used[static_cast<std::size_t>(*b)] = 0;
          sp.free.push_back(*b);
        } else {
          m.pool(p).release(*b);
        }
      }
    }
  }
  m.release_handle(it->second);
  m.sequences.erase(it);
}

std::span<const std::int32_t> KVCacheManager::blocks(SequenceId id, std::int32_t layer, Precision p) const {
  const Sequence& seq = impl_->resident(id, "id");
  impl_->require_layer(layer);
  require_precision(p, "p");
  return seq.table.blocks(layer, p);
}

std::int32_t KVCacheManager::window_block(SequenceId id, std::int32_t layer, std::int32_t window) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.resident(id, "id");
  m.require_layer(layer);
  require_index("window", window, seq.prompt->plan.num_windows());
  std::int64_t rank = 0;
  const std::int32_t index = m.block_index(*seq.prompt, layer, window, rank);
  if (index < 0) return -1;
  return seq.table.blocks(layer, seq.prompt->plan.at(layer, window))[static_cast<std::size_t>(index)];
}

std::int32_t KVCacheManager::fp16_tail_fill(SequenceId id, std::int32_t layer) const {
  const Sequence& seq = impl_->resident(id, "id");
  impl_->require_layer(layer);
  return seq.table.fp16_tail_fill(layer);
}

std::int32_t KVCacheManager::ref_count(Precision p, std::int32_t block_id) const {
  require_precision(p, "p");
  return impl_->pool(p).ref_count(block_id);
}

DecodeMetadata KVCacheManager::decode_metadata(std::span<const SequenceId> ids) const {
  const Impl& m = *impl_;
  const std::vector<const Sequence*> seqs = m.require_ids(ids);

  DecodeMetadata meta;
  meta.batch_size = static_cast<std::int32_t>(ids.size());
  meta.layers.resize(static_cast<std::size_t>(m.num_layers()));
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      PagedPoolTable& t = meta.layers[static_cast<std::size_t>(layer)][at(p)];
      t.indptr.reserve(seqs.size() + 1);
      t.last_block_len.reserve(seqs.size());
      t.indptr.push_back(0);
      for (const Sequence* seq : seqs) {
        const auto blocks = seq->table.blocks(layer, p);
        t.indices.insert(t.indices.end(), blocks.begin(), blocks.end());
        t.indptr.push_back(static_cast<std::int32_t>(t.indices.size()));
        const std::int32_t last = p == Precision::FP16 ? seq->table.fp16_tail_fill(layer) : m.block_size();
        t.last_block_len.push_back(blocks.empty() ? 0 : last);
      }
    }
  }
  return meta;
}

const PageTable& KVCacheManager::page_table(SequenceId id) const { return impl_->resident(id, "id").table; }

BlockCounts KVCacheManager::blocks_held(SequenceId id) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.find(id, "id");
  BlockCounts held{};
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) held[at(p)] += static_cast<std::int64_t>(seq.table.blocks(layer, p).size());
  }
  return held;
}

BlockCounts KVCacheManager::free_swap_slots() const {
  BlockCounts free{};
  for (const Precision p : kAllPrecisions) free[at(p)] = static_cast<std::int64_t>(impl_->swap[at(p)].free.size());
  return free;
}

std::size_t KVCacheManager::swap_bytes() const {
  std::size_t bytes = 0;
  for (const Precision p : kAllPrecisions) {
    bytes += static_cast<std::size_t>(impl_->config.swap_blocks[at(p)]) * impl_->pool(p).format().block_bytes();
  }
  return bytes;
}

PoolView KVCacheManager::swap_view(Precision p, std::byte* host_base) const {
  require_precision(p, "p");
  if (host_base == nullptr) throw InvalidArgument("host_base = nullptr, expected the host swap buffer's first byte");
  return swap_layout().at(host_base)[at(p)];
}

PoolLayout KVCacheManager::swap_layout() const {
  PoolLayout layout;
  std::size_t offset = 0;
  for (const Precision p : kAllPrecisions) {
    const BlockFormat f = impl_->pool(p).format();
    const std::int64_t count = impl_->config.swap_blocks[at(p)];
    // All slots of the pool form one "slab", so block(slot) = base + slot * block_bytes.
    const auto slots = static_cast<std::int32_t>(std::max<std::int64_t>(count, 1));
    layout.offsets[at(p)] = offset;
    layout.pools[at(p)] =
        PoolView{nullptr, static_cast<std::size_t>(slots) * f.block_bytes(), slots, f, static_cast<std::int32_t>(count)};
    offset += static_cast<std::size_t>(count) * f.block_bytes();
  }
  layout.bytes = offset;
  return layout;
}

bool KVCacheManager::is_swapped(SequenceId id) const { return impl_->find(id, "id").swapped; }

std::vector<SwapCopy> KVCacheManager::swap_out(SequenceId id) {
  Impl& m = *impl_;
  Sequence& seq = m.resident(id, "id");
  const BlockCounts held = blocks_held(id);
  for (const Precision p : kAllPrecisions) {
    const auto free = static_cast<std::int64_t>(m.swap[at(p)].free.size());
    if (held[at(p)] > free) {
      throw OutOfMemory("swap_out(id = " + std::to_string(id) + "): out of host swap memory: the " +
                        std::string(to_string(p)) + " swap pool has " + std::to_string(free) + " free slots of " +
                        std::to_string(m.config.swap_blocks[at(p)]) + ", the sequence holds " +
                        std::to_string(held[at(p)]) + " " + std::string(to_string(p)) + " blocks");
    }
  }
  // Prepare the host memory (the copies, the host-slot table at its final
  // size), then commit: nothing below allocates or throws.
  std::vector<SwapCopy> copies;
  copies.reserve(static_cast<std::size_t>(held[0] + held[1] + held[2]));
  PageTable host(m.num_layers(), m.block_size());
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) host.reserve(layer, p, seq.table.blocks(layer, p).size());
  }
  const std::int32_t bs = m.block_size();
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      const auto blocks = seq.table.blocks(layer, p);
      SwapPool& sp = m.swap[at(p)];
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const std::int32_t slot = sp.free.back();
        sp.free.pop_back();
        sp.used[static_cast<std::size_t>(slot)] = 1;
        copies.push_back({p, blocks[i], slot});
        const bool tail = p == Precision::FP16 && i + 1 == blocks.size();
        host.push_block(layer, p, slot, tail ? seq.table.fp16_tail_fill(layer) : bs);
      }
    }
  }
  // Released only now: the copies above read the blocks before anyone reuses them.
  for (const SwapCopy& c : copies) m.pool(c.pool).release(c.device_block);
  seq.table = std::move(host);
  seq.swapped = true;
  return copies;
}

std::vector<SwapCopy> KVCacheManager::swap_in(SequenceId id) {
  Impl& m = *impl_;
  Sequence& seq = m.find(id, "id");
  if (!seq.swapped) {
    throw InvalidArgument("id = " + std::to_string(id) + " is not swapped out, expected a swapped-out sequence");
  }
  const BlockCounts held = blocks_held(id);
  // Prepare the host memory (the copies, the device table at its final
  // size, the block ids, slab records), then commit: nothing below
  // take_blocks() allocates or throws.
  std::vector<SwapCopy> copies;
  copies.reserve(static_cast<std::size_t>(held[0] + held[1] + held[2]));
  PageTable device(m.num_layers(), m.block_size());
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) device.reserve(layer, p, seq.table.blocks(layer, p).size());
  }
  BlockIds ids;
  m.prepare_blocks(held, "swap_in(id = " + std::to_string(id) + ")", ids);
  m.take_blocks(held, ids);
  const std::int32_t bs = m.block_size();
  std::array<std::size_t, kNumPrecisions> next{};
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    for (const Precision p : kAllPrecisions) {
      const auto slots = seq.table.blocks(layer, p);
      for (std::size_t i = 0; i < slots.size(); ++i) {
        const std::int32_t block = ids[at(p)][next[at(p)]++];
        copies.push_back({p, block, slots[i]});
        const bool tail = p == Precision::FP16 && i + 1 == slots.size();
        device.push_block(layer, p, block, tail ? seq.table.fp16_tail_fill(layer) : bs);
      }
    }
  }
  // In reverse, so the host pool hands the slots out again in the same order.
  for (auto c = copies.rbegin(); c != copies.rend(); ++c) {
    SwapPool& sp = m.swap[at(c->pool)];
    sp.used[static_cast<std::size_t>(c->host_slot)] = 0;
    sp.free.push_back(c->host_slot);
  }
  seq.table = std::move(device);
  seq.swapped = false;
  return copies;
}

std::optional<std::string> KVCacheManager::why_not_demotable(SequenceId id, std::int32_t layer, std::int32_t window,
                                                              Precision target) const {
  const Impl& m = *impl_;
  const Sequence& seq = m.resident(id, "id");
  m.require_layer(layer);
  require_index("window", window, seq.prompt->plan.num_windows());
  require_precision(target, "target");
  if (window == 0) return std::string("window 0 (the first visual window) always stays FP16");
  return m.why_not(seq, layer, window, target);
}

std::vector<DemoteOp> KVCacheManager::demote(std::span<const Demotion> demotions) {
  Impl& m = *impl_;
  // Validate everything first: a throwing call changes nothing.
  std::vector<Sequence*> seqs;
  seqs.reserve(demotions.size());
  BlockCounts need{};
  std::vector<std::tuple<SequenceId, std::int32_t, std::int32_t, std::size_t>> keys;
  keys.reserve(demotions.size());
  for (std::size_t i = 0; i < demotions.size(); ++i) {
    const Demotion& d = demotions[i];
    const std::string name = "demotions[" + std::to_string(i) + "]";
    const auto it = m.sequences.find(d.id);
    if (it == m.sequences.end()) {
      throw UnknownId(name + ".id = " + std::to_string(d.id) + " is not a sequence of this cache");
    }
    Sequence& seq = it->second;
    if (seq.swapped) {
      throw InvalidArgument(name + ".id = " + std::to_string(d.id) +
                            " is swapped out, expected a sequence in device memory");
    }
    require_index(name + ".layer", d.layer, m.num_layers());
    require_index(name + ".window", d.window, seq.prompt->plan.num_windows());
    require_precision(d.target, name + ".target");
    if (d.window == 0) {
      throw InvalidArgument(name + ".window = 0: the first visual window always stays FP16, expected >= 1");
    }
    if (auto reason = m.why_not(seq, d.layer, d.window, d.target)) {
      throw InvalidArgument(name + " (id " + std::to_string(d.id) + ", layer " + std::to_string(d.layer) +
                            ", window " + std::to_string(d.window) + ") cannot be demoted: " + *reason);
    }
    keys.emplace_back(d.id, d.layer, d.window, i);
    ++need[at(d.target)];
    seqs.push_back(&seq);
  }
  std::sort(keys.begin(), keys.end());
  for (std::size_t k = 1; k < keys.size(); ++k) {
    if (std::get<0>(keys[k]) == std::get<0>(keys[k - 1]) && std::get<1>(keys[k]) == std::get<1>(keys[k - 1]) &&
        std::get<2>(keys[k]) == std::get<2>(keys[k - 1])) {
      throw InvalidArgument("demotions[" + std::to_string(std::max(std::get<3>(keys[k]), std::get<3>(keys[k - 1]))) +
                            "] repeats demotions[" +
                            std::to_string(std::min(std::get<3>(keys[k]), std::get<3>(keys[k - 1]))) +
                            "], expected each (id, layer, window) once");
    }
  }
  // Prepare every host allocation before any block moves: the ops, a
  // private copy of each listed sequence's prompt that forks share (they
  // keep theirs; the first listing of a sequence holds its copy), room in
  // each target list (a quantized list never holds more than one block per
  // window), the block ids and slab records.
  std::vector<DemoteOp> ops;
  ops.reserve(demotions.size());
  std::vector<std::shared_ptr<Prompt>> private_prompts(demotions.size());
  const std::uint64_t batch = ++m.epoch;
  for (std::size_t i = 0; i < demotions.size(); ++i) {
    const Demotion& d = demotions[i];
    Sequence& seq = *seqs[i];
    const auto size = seq.table.blocks(d.layer, d.target).size();
    seq.table.reserve(d.layer, d.target,
                      std::min(size + demotions.size(), static_cast<std::size_t>(seq.prompt->plan.num_windows())));
    if (seq.seen_epoch == batch) continue;
    seq.seen_epoch = batch;
    seq.seen_index = i;
    if (seq.prompt.use_count() > 1) private_prompts[i] = std::make_shared<Prompt>(*seq.prompt);
  }
  BlockIds fresh;
  m.prepare_blocks(need, "demote", fresh);

  // Commit: nothing below allocates or throws. Every destination is taken
  // before any source is released, so no op's destination overlaps another
  // op's source.
  m.take_blocks(need, fresh);
  std::array<std::size_t, kNumPrecisions> next{};
  const std::int32_t bs = m.block_size();
  for (std::size_t i = 0; i < demotions.size(); ++i) {
    const Demotion& d = demotions[i];
    Sequence& seq = *seqs[i];
    if (auto& copy = private_prompts[seq.seen_index]) seq.prompt = std::move(copy);  // moved-from: taken once
    Prompt& prompt = *seq.prompt;
    const Precision current = prompt.plan.at(d.layer, d.window);
    std::int32_t src_index = 0;
    std::int32_t dst_index = 0;
    if (current == Precision::FP16) {
      src_index = static_cast<std::int32_t>(m.fp16_rank(prompt, d.layer, d.window) / bs);
    }
    for (std::int32_t w = 0; w < d.window; ++w) {
      const Precision p = prompt.plan.at(d.layer, w);
      src_index += current != Precision::FP16 && p == current ? 1 : 0;
      dst_index += p == d.target ? 1 : 0;
    }
    const std::int32_t src = seq.table.remove_block(d.layer, current, src_index);
    const std::int32_t dst = fresh[at(d.target)][next[at(d.target)]++];
    seq.table.insert_block(d.layer, d.target, dst_index, dst);
    prompt.plan.set(d.layer, d.window, d.target);
    ops.push_back({d.id, d.layer, d.window, current, src, d.target, dst});
  }
  for (const DemoteOp& op : ops) m.pool(op.src_precision).release(op.src_block);
  return ops;
}

void KVCacheManager::check_invariants() const {
  const Impl& m = *impl_;
  auto fail = [](const std::string& what) { throw InvariantViolation(what); };

  m.arena.check_invariants();
  for (const Precision p : kAllPrecisions) m.pool(p).check_invariants();
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
  for (const Precision p : kAllPrecisions) {
    if (m.pool(p).num_slabs() != m.arena.owned_slabs(p)) {
      fail(std::string(to_string(p)) + " pool holds " + std::to_string(m.pool(p).num_slabs()) +
           " slabs, the arena counts " + std::to_string(m.arena.owned_slabs(p)));
    }
  }

  // Ref counts must equal the number of page tables holding each block.
  const std::int32_t bs = m.block_size();
  std::array<boost::unordered_flat_map<std::int32_t, std::int32_t>, kNumPrecisions> holders;
  std::array<boost::unordered_flat_map<std::int32_t, std::int32_t>, kNumPrecisions> swapped_holders;
  for (const auto& [id, seq] : m.sequences) {
    const std::string name = "sequence " + std::to_string(id);
    const PageTable& table = seq.table;
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
            if (block < 0 || static_cast<std::size_t>(block) >= sp.used.size() || !sp.used[static_cast<std::size_t>(block)]) {
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
        if (is_quantized(p) && static_cast<std::int64_t>(table.blocks(layer, p).size()) != windows[at(p)]) {
          fail(where + std::to_string(table.blocks(layer, p).size()) + " " + std::string(to_string(p)) +
               " blocks, the plan has " + std::to_string(windows[at(p)]) + " windows");
        }
      }
      const std::int32_t fill = table.fp16_tail_fill(layer);
      const bool has_fp16 = !table.blocks(layer, Precision::FP16).empty();
      if (has_fp16 ? (fill < 1 || fill > bs) : fill != 0) {
        fail(where + "FP16 tail fill " + std::to_string(fill) + " with " +
             std::to_string(table.blocks(layer, Precision::FP16).size()) + " FP16 blocks of " + std::to_string(bs));
      }
      const std::int64_t tokens = table.fp16_tokens(layer) + (std::int64_t{windows[1]} + windows[2]) * bs;
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
  for (const Precision p : kAllPrecisions) {
    const BlockPool& bp = m.pool(p);
    for (const auto& [block, count] : holders[at(p)]) {
      if (bp.ref_count(block) != count) {
        fail(std::string(to_string(p)) + " block " + std::to_string(block) + " has ref count " +
             std::to_string(bp.ref_count(block)) + " but " + std::to_string(count) + " page tables hold it");
      }
    }
    // Every used block is held: otherwise it leaked.
    if (static_cast<std::int64_t>(holders[at(p)].size()) != bp.used_blocks()) {
      fail(std::string(to_string(p)) + " pool has " + std::to_string(bp.used_blocks()) +
           " used blocks but page tables hold " + std::to_string(holders[at(p)].size()));
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
      put(" | fill ", seq.table.fp16_tail_fill(layer));
      out += "\n";
    }
  }
  return out;
}

}  // namespace mixkv
