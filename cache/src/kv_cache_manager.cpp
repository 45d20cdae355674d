// KVCacheManager: construction, config validation, accounting, add_sequence and
// prefill mappings, inspection.
#include "manager_impl.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>

#include <unistd.h>
#include <boost/unordered/unordered_flat_map.hpp>

namespace mixkv {

namespace {

constexpr std::size_t kInt32Limit = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());

// Bytes of physical memory of this host, or 0 when the system cannot say.
std::size_t host_physical_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<std::size_t>(pages), static_cast<std::size_t>(page), &bytes)) {
    return std::numeric_limits<std::size_t>::max();
  }
  return bytes;
}

// The arena's size limits, checked before its bookkeeping (a byte and an
// int32 per slab, a pointer per slab and pool) is allocated: a slab count
// and block ids of every pool that fit in int32, and FP16 slots
// (block_id * block_size + offset, int32 in every mapping) too.
void check_arena(const CacheConfig& c) {
  const std::size_t slabs = c.arena_bytes / c.slab_bytes;
  if (slabs > kInt32Limit) {
    throw InvalidArgument("arena_bytes = " + std::to_string(c.arena_bytes) + " gives " + std::to_string(slabs) +
                          " slabs of slab_bytes = " + std::to_string(c.slab_bytes) +
                          ", expected fewer than 2^31 slabs (raise slab_bytes)");
  }
  for (const Precision p : kAllPrecisions) {
    const BlockFormat f{p, c.shape.num_kv_heads, c.shape.head_dim, c.shape.block_size};
    const std::size_t per_slab = c.slab_bytes / f.block_bytes();
    if (per_slab > kInt32Limit) {
      throw InvalidArgument("slab_bytes = " + std::to_string(c.slab_bytes) + " holds " + std::to_string(per_slab) +
                            " " + std::string(to_string(p)) +
                            " blocks, expected fewer than 2^31 (block ids are int32)");
    }
    // No overflow: slabs * per_slab * block_bytes <= arena_bytes.
    if (slabs * per_slab > kInt32Limit) {
      throw InvalidArgument("arena_bytes = " + std::to_string(c.arena_bytes) + " gives " +
                            std::to_string(slabs * per_slab) + " " + std::string(to_string(p)) + " block ids (" +
                            std::to_string(slabs) + " slabs of " + std::to_string(per_slab) +
                            "), expected fewer than 2^31 (block ids are int32)");
    }
  }
  const BlockFormat fp16{Precision::FP16, c.shape.num_kv_heads, c.shape.head_dim, c.shape.block_size};
  // No overflow: fewer than 2^31 blocks of at most 256 tokens.
  const std::size_t slots = slabs * (c.slab_bytes / fp16.block_bytes()) * static_cast<std::size_t>(c.shape.block_size);
  if (slots > kInt32Limit) {
    throw InvalidArgument("arena_bytes = " + std::to_string(c.arena_bytes) + " holds " + std::to_string(slots) +
                          " FP16 token slots, expected fewer than 2^31 (slot ids are int32)");
  }
}

// The host swap pool's limits, checked before its bookkeeping (5 bytes a
// slot) is allocated: slots per pool below 2^31 (slot ids are int32), and
// the caller's swap buffer (swap_bytes()) within the host's physical memory,
// which a buffer that cannot exist would exceed long before its bookkeeping.
void check_swap(const CacheConfig& c) {
  std::size_t total = 0;
  bool overflow = false;
  for (const Precision p : kAllPrecisions) {
    const std::int64_t n = c.swap_blocks[at(p)];
    if (n < 0 || n > std::numeric_limits<std::int32_t>::max()) {
      throw InvalidArgument("swap_blocks[" + std::string(to_string(p)) + "] = " + std::to_string(n) +
                            ", expected 0 <= swap_blocks < 2^31");
    }
    const BlockFormat f{p, c.shape.num_kv_heads, c.shape.head_dim, c.shape.block_size};
    std::size_t bytes = 0;
    overflow = overflow || __builtin_mul_overflow(static_cast<std::size_t>(n), f.block_bytes(), &bytes) ||
               __builtin_add_overflow(total, bytes, &total);
  }
  const std::size_t host = host_physical_bytes();
  if (overflow || (host > 0 && total > host)) {
    throw InvalidArgument("swap_blocks = [" + counts_text(c.swap_blocks) + "] needs " +
                          (overflow ? std::string("more than 2^64") : std::to_string(total)) +
                          " bytes of host swap buffer, expected at most the host's physical memory (" +
                          std::to_string(host) + " bytes)");
  }
}

// Checks what the arena and the pools cannot, before anything is allocated:
// the shape, a slab holding at least one block of the largest format
// (FP16), the arena's and the swap pool's size limits.
const CacheConfig& checked(const CacheConfig& c) {
  validate(c.shape);
  const BlockFormat fp16{Precision::FP16, c.shape.num_kv_heads, c.shape.head_dim, c.shape.block_size};
  if (c.slab_bytes < fp16.block_bytes()) {
    throw InvalidArgument("slab_bytes = " + std::to_string(c.slab_bytes) + ", expected at least one FP16 block (" +
                          std::to_string(fp16.block_bytes()) + " bytes for this shape)");
  }
  check_arena(c);
  check_swap(c);
  const auto identity = static_cast<int>(c.prefix_cache.identity);
  if (identity < 0 || identity > static_cast<int>(PrefixIdentity::Content)) {
    throw InvalidArgument("prefix_cache.identity = " + std::to_string(identity) + ", expected Precision or Content");
  }
  const auto higher = static_cast<int>(c.prefix_cache.higher);
  if (higher < 0 || higher > static_cast<int>(PrefixHigher::Keep)) {
    throw InvalidArgument("prefix_cache.higher = " + std::to_string(higher) + ", expected Demote or Keep");
  }
  // A block's rows sit where the layout alone puts them only when FP16
  // windows are blocks of their own: a node's copies then agree in rows.
  if (c.prefix_cache.identity == PrefixIdentity::Content && !c.fp16_windows_first) {
    throw InvalidArgument(
        "prefix_cache.identity = Content needs fp16_windows_first = true (a window's copies at "
        "every precision must hold the same rows)");
  }
  return c;
}

}  // namespace

KVCacheManager::Impl::Impl(const CacheConfig& c) : config(checked(c)), arena(c.arena_bytes, c.slab_bytes) {
  for (const Precision p : kAllPrecisions) {
    const BlockFormat format{p, c.shape.num_kv_heads, c.shape.head_dim, c.shape.block_size, c.shape.dtype};
    pools[at(p)] = std::make_unique<BlockPool>(format, c.slab_bytes, arena.total_slabs());
    const auto slots = static_cast<std::int32_t>(c.swap_blocks[at(p)]);
    SwapPool& sp = swap[at(p)];
    sp.used.assign(static_cast<std::size_t>(slots), 0);
    sp.free.reserve(static_cast<std::size_t>(slots));
    for (std::int32_t s = slots; s-- > 0;) sp.free.push_back(s);
  }
  layer_ids.resize(static_cast<std::size_t>(num_layers()));
  slot_rows.resize(static_cast<std::size_t>(num_layers()));
  if (c.prefix_cache.enabled) {
    index = std::make_unique<PrefixIndex>(
        num_layers(), std::array<BlockPool*, kNumPrecisions>{pools[0].get(), pools[1].get(), pools[2].get()},
        c.prefix_cache.identity);
  }
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

namespace {

// Exact: each pool first uses its own free blocks (partly used slabs first),
// then the pools that still lack blocks share the free slabs plus the empty
// slabs the other pools keep after their own allocation (what
// BlockPool::spare_slabs_after counts). The first pool that lacks blocks,
// or -1; `slabs` ends as the slabs obtainable before it.
int lacking(const Supplies& pools, std::int64_t free_slabs, const BlockCounts& need, std::int64_t& slabs) {
  slabs = free_slabs;
  for (std::size_t p = 0; p < pools.size(); ++p) {
    const detail::Supply& s = pools[p];
    const std::int64_t blocks = need[p];
    if (blocks < 0 || blocks > s.free) continue;
    const std::int64_t in_partial = s.free - s.empty * s.per_slab;
    slabs += blocks <= in_partial ? s.empty : s.empty - (blocks - in_partial + s.per_slab - 1) / s.per_slab;
  }
  for (std::size_t p = 0; p < pools.size(); ++p) {
    const std::int64_t missing = need[p] - pools[p].free;
    if (missing <= 0) continue;
    const std::int64_t wanted = (missing + pools[p].per_slab - 1) / pools[p].per_slab;
    if (wanted > slabs) return static_cast<int>(p);
    slabs -= wanted;
  }
  return -1;
}

}  // namespace

Supplies KVCacheManager::Impl::supplies() const {
  Supplies s;
  for (const Precision p : kAllPrecisions) {
    const BlockPool& bp = pool(p);
    s[at(p)] = {bp.free_blocks(), bp.empty_slabs(), bp.blocks_per_slab()};
  }
  return s;
}

// Why `need` cannot be allocated now, or nullopt when it can: first as the
// pools stand, then as they would stand with every cached block no
// sequence holds evicted (less those `match` would share): free blocks of
// their pools, and slabs whose used blocks all go empty.
std::optional<std::string> KVCacheManager::Impl::shortfall(const BlockCounts& need, const PrefixMatch* match) const {
  const Supplies plain = supplies();
  std::int64_t slabs = 0;
  const int short_pool = lacking(plain, arena.free_slabs(), need, slabs);
  if (short_pool < 0) return std::nullopt;
  const std::int64_t cached = index ? index->evictable_total() : 0;
  if (cached > 0) {
    // First without the walk below, which is linear in the cached blocks:
    // evicted blocks as free blocks of their pools, no slab going empty.
    // More free blocks or empty slabs never make `need` lack more, so when
    // this lower bound fits, the exact view fits too.
    Supplies lower = plain;
    for (const Precision p : kAllPrecisions) {
      lower[at(p)].free += index->evictable()[at(p)] - (match ? match->revived[at(p)] : 0);
    }
    std::int64_t unused = 0;
    if (lacking(lower, arena.free_slabs(), need, unused) < 0) return std::nullopt;
    Supplies view = plain;
    boost::unordered_flat_map<std::int64_t, std::int32_t> in_slab;  // (pool << 32 | slab) -> evictable blocks
    auto slab_key = [&](Precision p, std::int32_t block) {
      return (std::int64_t{pool_index(p)} << 32) | (block / pool(p).blocks_per_slab());
    };
    index->for_each_evictable([&](Precision p, std::int32_t block) {
      ++in_slab[slab_key(p, block)];
      ++view[at(p)].free;
    });
    for (const Precision p : kAllPrecisions) {
      if (match == nullptr) break;
      for (const std::int32_t block : match->revived_ids[at(p)]) {
        const auto it = in_slab.find(slab_key(p, block));
        if (it == in_slab.end() || it->second == 0) continue;
        --it->second;
        --view[at(p)].free;
      }
    }
    for (const auto& [key, count] : in_slab) {
      const auto p = static_cast<Precision>(key >> 32);
      if (count > 0 && count == pool(p).used_in_slab(static_cast<std::int32_t>(key & 0xffffffff))) ++view[at(p)].empty;
    }
    std::int64_t ignored = 0;
    if (lacking(view, arena.free_slabs(), need, ignored) < 0) return std::nullopt;
  }
  const Precision p = kAllPrecisions[static_cast<std::size_t>(short_pool)];
  const BlockPool& bp = pool(p);
  std::string reason = "the " + std::string(to_string(p)) + " pool needs " + std::to_string(need[at(p)]) + " blocks, " +
                       std::to_string(bp.free_blocks() + slabs * bp.blocks_per_slab()) + " available (" +
                       std::to_string(bp.free_blocks()) + " free in its slabs + " + std::to_string(slabs) +
                       " obtainable slabs of " + std::to_string(bp.blocks_per_slab()) +
                       " blocks); blocks needed: " + counts_text(need);
  if (cached > 0)
    reason += "; evicting the " + std::to_string(cached) + " cached blocks no sequence holds is not enough";
  return reason;
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
void KVCacheManager::Impl::prepare_blocks(const BlockCounts& need, const std::string& what, BlockIds& ids,
                                          const PrefixMatch* match) {
  if (auto reason = shortfall(need, match)) throw OutOfMemory(what + ": out of memory: " + *reason);
  for (const Precision p : kAllPrecisions) {
    ids[at(p)].clear();
    ids[at(p)].reserve(static_cast<std::size_t>(need[at(p)]));
    // take_blocks() grows a pool once per slab it lacks after its own free
    // blocks (eviction only adds to them); other pools only give it empty
    // slabs they do not need.
    const BlockPool& bp = pool(p);
    const std::int64_t missing = need[at(p)] - bp.free_blocks();
    if (missing > 0) {
      pools[at(p)]->reserve_slabs(
          static_cast<std::int32_t>((missing + bp.blocks_per_slab() - 1) / bp.blocks_per_slab()));
    }
  }
}

// Takes the blocks prepare_blocks(need, .., ids) made room for, into ids.
// Cannot fail: shortfall() found them, ids has their capacity and every
// slab grow() adds has its record (arena give_back/take allocate nothing).
void KVCacheManager::Impl::take_blocks(const BlockCounts& need, BlockIds& ids) {
  if (index && index->evictable_total() > 0) {
    std::int64_t slabs = 0;
    while (lacking(supplies(), arena.free_slabs(), need, slabs) >= 0 && index->evict_one()) {
    }
  }
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
  return PoolStats{bp.format().block_bytes(), bp.blocks_per_slab(), bp.num_slabs(),
                   bp.used_blocks(),          bp.free_blocks(),     bp.empty_slabs()};
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
  impl_->add(id, layout, plan, nullptr);
}

void KVCacheManager::Impl::add(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan,
                               const PrefixShares* shares) {
  Impl& m = *this;
  if (m.sequences.contains(id)) {
    throw InvalidArgument("id = " + std::to_string(id) + " is already a sequence of this cache, expected a new id");
  }
  m.require_prompt(layout, plan);
  const bool sharing = shares != nullptr && !shares->lists.empty();
  const BlockCounts need = sharing ? shares->match.demand : m.prompt_demand(layout, plan);
  const std::int32_t bs = m.block_size();

  // Prepare: every host allocation (the block ids, slab records, the
  // prompt, the page lists at their final size, the handle, the map node)
  // before any block moves, so that std::bad_alloc leaves nothing taken.
  // (Slab records first: the heap layout that order leaves keeps
  // append_tokens up to 10% faster in scheduler_bench.)
  BlockIds ids;
  m.prepare_blocks(need, "add_sequence(id = " + std::to_string(id) + ")", ids, sharing ? &shares->match : nullptr);
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
  if (shares != nullptr) seq.publish_rows = shares->publish_rows;
  m.reserve_handle();
  // Last: emplace either inserts or changes nothing (Boost's strong guarantee).
  Sequence& added = m.sequences.emplace(id, std::move(seq)).first->second;

  // Commit: nothing below allocates or throws. Shared blocks are retained
  // first, so that making room evicts none of them. Fresh blocks go out
  // layer by layer, in allocation order.
  if (sharing) {
    for (const BlockIds& lists : shares->lists) {
      for (const Precision p : kAllPrecisions) {
        for (const std::int32_t block : lists[at(p)]) {
          if (block < 0) continue;
          m.pool(p).retain(block);
          m.holders_changed(p, block);
        }
      }
    }
  }
  m.take_blocks(need, ids);
  std::array<std::size_t, kNumPrecisions> next{};
  auto block_at = [&](std::int32_t layer, Precision p, std::size_t position) {
    const std::int32_t shared = sharing ? shares->lists[static_cast<std::size_t>(layer)][at(p)][position] : -1;
    return shared >= 0 ? shared : ids[at(p)][next[at(p)]++];
  };
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    const auto windows = plan.window_counts(layer);
    std::int64_t fp16_tokens = layout.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * bs;
    for (std::size_t j = 0; fp16_tokens > 0; ++j) {
      const auto fill = static_cast<std::int32_t>(std::min<std::int64_t>(fp16_tokens, bs));
      added.table.push_block(layer, Precision::FP16, block_at(layer, Precision::FP16, j), fill);
      fp16_tokens -= fill;
    }
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      for (std::int32_t w = 0; w < windows[at(p)]; ++w) {
        added.table.push_block(layer, p, block_at(layer, p, static_cast<std::size_t>(w)), bs);
      }
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
  if (Impl::has_aged(seq)) {
    throw InvalidArgument("id = " + std::to_string(id) +
                          " has demoted stream blocks (age tiers), expected a sequence whose prompt is still being "
                          "stored");
  }
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

}  // namespace mixkv
