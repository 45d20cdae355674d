// gpu::swap_blocks (issue 5, the GPU swap path) against the CPU backend:
// a device cache filled through the manager with store_prefill and append
// in all three pools; one sequence swapped out must leave in the pinned
// buffer exactly the bytes cpu::swap_blocks copies from a host mirror of the
// arena; after its freed device blocks are overwritten, swap_in must bring
// the sequence back bit for bit and decode attention over it must give the
// same output as before. Long random lists of both directions (more copies
// than the kernel's grid), bad lists (named, nothing changed, nothing
// launched) and the empty list. GPU cases skip visibly without a device.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <set>
#include <utility>

#include "cuda_test_util.h"
#include "mixkv/cpu/swap.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/device_status.h"
#include "mixkv/kernels/store.h"
#include "mixkv/kernels/swap.h"

namespace mixkv::test {
namespace {

constexpr int kLayers = 2, kKVHeads = 2, kQHeads = 4, kDim = 128, kBlock = 32;

// Two layers, 2 x 128 x 32 blocks (FP16 block: 32 KiB), 4 FP16 blocks a
// slab, room for every sequence of the round-trip test at once.
CacheConfig round_trip_config() {
  CacheConfig c;
  c.shape = CacheShape{kLayers, kKVHeads, kDim, kBlock};
  c.slab_bytes = std::size_t{4} * kKVHeads * kDim * kBlock * 2 * 2;
  c.arena_bytes = c.slab_bytes * 96;
  c.swap_blocks = {64, 64, 64};
  return c;
}

// Text, three visual windows, text: 112 prompt tokens.
TokenLayout prompt_layout() {
  return TokenLayout({{TokenKind::Text, 7}, {TokenKind::Visual, 3 * kBlock}, {TokenKind::Text, 9}});
}

// Every layer holds blocks of all three pools, each layer a different mix.
PrecisionPlan mixed_plan(std::int32_t rotate) {
  PrecisionPlan plan(kLayers, 3);
  for (std::int32_t layer = 0; layer < kLayers; ++layer) {
    for (std::int32_t w = 0; w < 3; ++w) plan.set(layer, w, kAllPrecisions[(layer + w + rotate) % kNumPrecisions]);
  }
  return plan;
}

std::vector<std::byte> download(const std::byte* device, std::size_t bytes) {
  std::vector<std::byte> host(bytes);
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), "D2H");
  return host;
}

PoolViews views_over(const KVCacheManager& manager, std::byte* base, bool swap_pool) {
  PoolViews views{};
  for (const Precision p : kAllPrecisions) {
    views[pool_index(p)] = swap_pool ? manager.swap_view(p, base) : manager.pool_view(p, base);
  }
  return views;
}

// The manager, its device arena and pinned swap buffer, with K/V written
// by the CUDA store and append kernels from seeded random values.
class DeviceCache {
 public:
  explicit DeviceCache(const CacheConfig& config)
      : manager(config),
        arena(config.arena_bytes),
        pinned(manager.swap_layout()),
        pools(arena.pool_views(manager.arena_layout())) {
    // Poison: a block the test forgets to write reads as NaN, not as zeros.
    cuda_ok(cudaMemset(arena.base(), 0x7e, arena.bytes()), "memset arena");
  }

  void add(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan) {
    manager.add_sequence(id, layout, plan);
    for (std::int32_t layer = 0; layer < kLayers; ++layer) {
      const StoreMapping mapping = manager.prefill_mapping(id, layer);
      const std::size_t values = mapping.fp16_slots.size() * kKVHeads * kDim;
      DeviceVector<Half> k(random_halves(rng, values, 1.0)), v(random_halves(rng, values, 1.0));
      gpu::DeviceStoreMapping dmap;
      dmap.upload(mapping, kBlock, nullptr);
      gpu::StorePrefillArgs args;
      args.k = k.get();
      args.v = v.get();
      dmap.fill(args);
      args.pools = pools;
      gpu::store_prefill(args);
      cuda_ok(cudaDeviceSynchronize(), "store_prefill");
    }
  }

  void append(const std::vector<SequenceId>& ids) {
    const AppendResult r = manager.append_tokens(ids);
    ASSERT_TRUE(r.copies.empty());  // no forks here
    const auto batch = static_cast<std::int32_t>(ids.size());
    for (std::int32_t layer = 0; layer < kLayers; ++layer) {
      const std::size_t values = static_cast<std::size_t>(batch) * kKVHeads * kDim;
      DeviceVector<Half> k(random_halves(rng, values, 1.0)), v(random_halves(rng, values, 1.0));
      DeviceVector<std::int32_t> slots(r.slots[static_cast<std::size_t>(layer)]);
      gpu::append({k.get(), v.get(), slots.get(), batch, pools[0], nullptr});
      cuda_ok(cudaDeviceSynchronize(), "append");
    }
  }

  // Runs one list through DeviceSwapList + gpu::swap_blocks on `stream`.
  void run_swap(const std::vector<SwapCopy>& copies, SwapDirection direction, cudaStream_t stream = nullptr) {
    list.upload(copies, direction, manager.arena_layout(), manager.swap_layout(), stream);
    gpu::SwapBlocksArgs args;
    list.fill(args);
    args.device = pools;
    args.host = pinned.device_views(manager.swap_layout());
    args.stream = stream;
    gpu::swap_blocks(args);
    cuda_ok(cudaStreamSynchronize(stream), "swap_blocks");
  }

  std::vector<std::byte> arena_bytes() const { return download(arena.base(), manager.config().arena_bytes); }
  std::vector<std::byte> swap_bytes() const { return {pinned.host(), pinned.host() + manager.swap_bytes()}; }

  // A resident sequence's bytes in page-table order, read from `mirror`.
  std::vector<std::byte> snapshot(SequenceId id, std::vector<std::byte>& mirror) const {
    const PoolViews views = views_over(manager, mirror.data(), false);
    std::vector<std::byte> out;
    for (std::int32_t layer = 0; layer < kLayers; ++layer) {
      for (const Precision p : kAllPrecisions) {
        const PoolView& view = views[pool_index(p)];
        for (const std::int32_t b : manager.blocks(id, layer, p)) {
          out.insert(out.end(), view.block(b), view.block(b) + view.format.block_bytes());
        }
      }
    }
    return out;
  }

  Rng rng{2025};
  KVCacheManager manager;
  gpu::DeviceArena arena;
  gpu::PinnedSwapBuffer pinned;
  gpu::DevicePools pools;
  gpu::DeviceSwapList list;
};

// Decode over `ids` (every layer; one split-KV chunk per sequence, so the
// result is a pure function of the page lists' contents): out then lse of
// each layer, as raw bits.
std::vector<std::uint32_t> decode_bits(DeviceCache& cache, const std::vector<SequenceId>& ids,
                                       const std::vector<Half>& q) {
  const auto batch = static_cast<std::int32_t>(ids.size());
  std::int32_t longest = 1;
  for (const SequenceId id : ids) {
    for (std::int32_t layer = 0; layer < kLayers; ++layer) {
      for (const Precision p : kAllPrecisions) {
        longest = std::max(longest, static_cast<std::int32_t>(cache.manager.blocks(id, layer, p).size()));
      }
    }
  }
  gpu::DevicePageTables tables({kLayers, batch, longest}, cache.manager.arena_layout());
  for (std::int32_t i = 0; i < batch; ++i) tables.sync(i, cache.manager.page_table(ids[static_cast<std::size_t>(i)]));
  tables.upload(nullptr);
  gpu::DecodePlanConfig config;
  config.num_layers = kLayers;
  config.num_q_heads = kQHeads;
  config.num_kv_heads = kKVHeads;
  config.head_dim = kDim;
  config.block_size = kBlock;
  config.max_batch = batch;
  config.chunks_per_sequence = 1;
  gpu::DecodePlan plan(config, tables);
  std::vector<std::int32_t> slots(ids.size());
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, nullptr);
  DeviceVector<Half> dq(q), dout(q.size());
  DeviceVector<float> dlse(static_cast<std::size_t>(batch) * kQHeads);
  std::vector<std::uint32_t> bits;
  for (std::int32_t layer = 0; layer < kLayers; ++layer) {
    dout.fill_bytes(0x7e);
    dlse.fill_bytes(0x7f);
    gpu::DecodeRunArgs run;
    run.layer = layer;
    run.q = dq.get();
    run.out = dout.get();
    run.lse = dlse.get();
    run.sm_scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    run.pools = cache.pools;
    plan.run(run);
    const std::vector<Half> out = dout.to_host();
    const std::vector<float> lse = dlse.to_host();
    for (const float x : halves_to_floats(out)) {
      EXPECT_TRUE(std::isfinite(x)) << "layer " << layer << ": non-finite decode output";
      std::uint32_t b;
      std::memcpy(&b, &x, 4);
      bits.push_back(b);
    }
    for (const float x : lse) {
      std::uint32_t b;
      std::memcpy(&b, &x, 4);
      bits.push_back(b);
    }
  }
  return bits;
}

TEST(SwapCuda, RoundTripMatchesCpuBackendAndDecode) {
  MIXKV_REQUIRE_CUDA();
  DeviceCache cache(round_trip_config());
  const TokenLayout layout = prompt_layout();
  for (SequenceId id = 1; id <= 3; ++id) cache.add(id, layout, mixed_plan(static_cast<std::int32_t>(id)));
  cache.append({1, 2, 3});
  cache.append({2, 3});  // sequence 2's FP16 tail is partly filled
  const std::vector<Half> q = random_halves(cache.rng, std::size_t{2} * kQHeads * kDim, 1.0);
  const std::vector<SequenceId> batch = {2, 1};
  const std::vector<std::uint32_t> decode_before = decode_bits(cache, batch, q);

  std::vector<std::byte> mirror = cache.arena_bytes();
  const std::vector<std::byte> seq2_before = cache.snapshot(2, mirror);
  const std::vector<std::byte> seq1_before = cache.snapshot(1, mirror);

  // Swap out: the pinned buffer must hold what the CPU backend copies.
  const std::vector<SwapCopy> out = cache.manager.swap_out(2);
  BlockCounts per_pool{};
  for (const SwapCopy& c : out) ++per_pool[pool_index(c.pool)];
  for (const Precision p : kAllPrecisions) ASSERT_GT(per_pool[pool_index(p)], 0) << to_string(p) << " pool unused";
  cache.run_swap(out, SwapDirection::DeviceToHost);
  std::vector<std::byte> expected_host(cache.manager.swap_bytes(), std::byte{0});
  cpu::swap_blocks(out, SwapDirection::DeviceToHost, views_over(cache.manager, mirror.data(), false),
                   views_over(cache.manager, expected_host.data(), true));
  ASSERT_TRUE(cache.swap_bytes() == expected_host) << "swap-out bytes differ from cpu::swap_blocks";
  EXPECT_TRUE(cache.arena_bytes() == mirror) << "swap-out changed the device arena";

  // Another sequence takes freed blocks; the freed blocks it does not take
  // are overwritten too, so that nothing of sequence 2 is left on the device.
  cache.add(4, layout, mixed_plan(2));
  std::set<std::pair<int, std::int32_t>> taken;
  for (std::int32_t layer = 0; layer < kLayers; ++layer) {
    for (const Precision p : kAllPrecisions) {
      for (const std::int32_t b : cache.manager.blocks(4, layer, p)) taken.insert({pool_index(p), b});
    }
  }
  std::size_t reused = 0;
  for (const SwapCopy& c : out) {
    if (taken.count({pool_index(c.pool), c.device_block})) {
      ++reused;
      continue;
    }
    const PoolView& view = cache.pools[pool_index(c.pool)];
    cuda_ok(cudaMemset(view.block(c.device_block), 0x5a, view.format.block_bytes()), "overwrite");
  }
  std::printf("sequence 4 reuses %zu of %zu freed blocks; the rest overwritten with 0x5a\n", reused, out.size());

  // Swap in: bit-identical bytes, the host slots untouched, decode unchanged.
  const std::vector<SwapCopy> in = cache.manager.swap_in(2);
  ASSERT_EQ(in.size(), out.size());
  cache.run_swap(in, SwapDirection::HostToDevice);
  EXPECT_TRUE(cache.swap_bytes() == expected_host) << "swap-in changed the host swap buffer";
  std::vector<std::byte> after = cache.arena_bytes();
  const PoolViews device_views = views_over(cache.manager, after.data(), false);
  const PoolViews host_views = views_over(cache.manager, expected_host.data(), true);
  for (std::size_t i = 0; i < in.size(); ++i) {
    const PoolView& d = device_views[pool_index(in[i].pool)];
    const PoolView& h = host_views[pool_index(in[i].pool)];
    EXPECT_EQ(std::memcmp(d.block(in[i].device_block), h.block(in[i].host_slot), d.format.block_bytes()), 0)
        << "copies[" << i << "]: " << to_string(in[i].pool) << " block " << in[i].device_block << " <- slot "
        << in[i].host_slot;
  }
  EXPECT_TRUE(cache.snapshot(2, after) == seq2_before) << "sequence 2 did not come back bit for bit";
  EXPECT_TRUE(cache.snapshot(1, after) == seq1_before) << "the swap touched sequence 1";
  EXPECT_NO_THROW(cache.manager.check_invariants());
  const std::vector<std::uint32_t> decode_after = decode_bits(cache, batch, q);
  ASSERT_EQ(decode_after.size(), decode_before.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < decode_after.size(); ++i) differ += decode_after[i] != decode_before[i];
  EXPECT_EQ(differ, 0u) << "decode attention over the swapped-in sequence changed";
}

// Random lists in both directions over all pools, longer than the kernel's
// grid cap (8,192 CTAs), on a stream of its own; small blocks keep the
// buffers small. The whole arena and the whole swap buffer are compared.
TEST(SwapCuda, LongRandomListsMatchCpu) {
  MIXKV_REQUIRE_CUDA();
  CacheConfig c;
  c.shape = CacheShape{1, 1, 16, 16};  // FP16 block 1 KiB, INT4 384 B, INT2 256 B
  c.slab_bytes = 64 * 1024;            // 64 FP16, 170 INT4, 256 INT2 blocks
  c.arena_bytes = c.slab_bytes * 100;
  c.swap_blocks = {4000, 3500, 3000};
  // Pools own disjoint slabs, as in the manager (a list whose FP16 and INT4
  // blocks overlap in memory would race, and the CPU would order it):
  // FP16 slabs [0, 64), INT4 [64, 86), INT2 [86, 99).
  constexpr std::array<std::int32_t, kNumPrecisions> kFirstSlab = {0, 64, 86}, kSlabs = {64, 22, 13};
  DeviceCache cache(c);
  Rng rng(77);
  std::vector<std::byte> mirror(c.arena_bytes);
  for (auto& b : mirror) b = static_cast<std::byte>(rng());
  cuda_ok(cudaMemcpy(cache.arena.base(), mirror.data(), mirror.size(), cudaMemcpyHostToDevice), "H2D");
  std::vector<std::byte> host(cache.manager.swap_bytes());
  for (auto& b : host) b = static_cast<std::byte>(rng());
  std::memcpy(cache.pinned.host(), host.data(), host.size());

  // Distinct device blocks and host slots per pool, in shuffled pairs.
  auto random_list = [&](Rng& r) {
    std::vector<SwapCopy> list;
    for (const Precision p : kAllPrecisions) {
      const std::int32_t per_slab = cache.manager.pool_stats(p).blocks_per_slab;
      std::vector<std::int32_t> blocks(static_cast<std::size_t>(kSlabs[pool_index(p)]) * per_slab);
      std::vector<std::int32_t> slots(c.swap_blocks[pool_index(p)]);
      std::iota(blocks.begin(), blocks.end(), kFirstSlab[pool_index(p)] * per_slab);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(blocks.begin(), blocks.end(), r);
      std::shuffle(slots.begin(), slots.end(), r);
      for (std::size_t i = 0; i < slots.size(); ++i) list.push_back({p, blocks[i], slots[i]});
    }
    std::shuffle(list.begin(), list.end(), r);
    return list;
  };
  const std::vector<SwapCopy> out = random_list(rng);
  ASSERT_GT(out.size(), 8192u);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cache.run_swap(out, SwapDirection::DeviceToHost, stream);
  cpu::swap_blocks(out, SwapDirection::DeviceToHost, views_over(cache.manager, mirror.data(), false),
                   views_over(cache.manager, host.data(), true));
  EXPECT_TRUE(cache.swap_bytes() == host) << "device -> host";

  // New host contents, then the other direction with another list.
  for (auto& b : host) b = static_cast<std::byte>(rng());
  std::memcpy(cache.pinned.host(), host.data(), host.size());
  const std::vector<SwapCopy> in = random_list(rng);
  cache.run_swap(in, SwapDirection::HostToDevice, stream);
  cpu::swap_blocks(in, SwapDirection::HostToDevice, views_over(cache.manager, mirror.data(), false),
                   views_over(cache.manager, host.data(), true));
  EXPECT_TRUE(cache.arena_bytes() == mirror) << "host -> device";
  EXPECT_TRUE(cache.swap_bytes() == host) << "host -> device changed the host buffer";
  cuda_ok(cudaStreamDestroy(stream), "stream destroy");
}

// A small manager (one layer, 1 x 16 x 16 blocks) for the input checks.
CacheConfig small_config() {
  CacheConfig c;
  c.shape = CacheShape{1, 1, 16, 16};
  c.slab_bytes = 4096;  // 4 FP16 blocks, 10 INT4, 16 INT2
  c.arena_bytes = c.slab_bytes * 3;
  c.swap_blocks = {2, 3, 4};
  return c;
}

template <class E>
void expect_throw_naming(const std::function<void()>& call, const std::string& name) {
  try {
    call();
    ADD_FAILURE() << "did not throw; expected a message naming " << name;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos)
        << "message does not name " << name << ": " << e.what();
  }
}

// Validation comes before any CUDA call: these run without a device too
// (the lists accepted at the edges are in the next test: a valid upload
// copies, which needs a device).
TEST(SwapCudaBadInput, ListEntriesAreNamed) {
  const KVCacheManager manager(small_config());
  gpu::DeviceSwapList list;
  const auto d2h = SwapDirection::DeviceToHost;
  const auto h2d = SwapDirection::HostToDevice;
  auto upload = [&](std::vector<SwapCopy> copies, SwapDirection dir = SwapDirection::DeviceToHost) {
    return [&list, &manager, copies = std::move(copies), dir] {
      list.upload(copies, dir, manager.arena_layout(), manager.swap_layout(), nullptr);
    };
  };
  // 3 slabs: 12 FP16, 30 INT4, 48 INT2 block ids; slots 2, 3, 4.
  expect_throw_naming<InvalidArgument>(upload({{Precision::FP16, 0, 0}, {static_cast<Precision>(3), 0, 0}}),
                                       "copies[1].pool = 3");
  expect_throw_naming<IndexOutOfRange>(upload({{Precision::FP16, 12, 0}}), "copies[0].device_block = 12");
  expect_throw_naming<IndexOutOfRange>(upload({{Precision::INT4, 5, 0}, {Precision::INT2, -1, 0}}),
                                       "copies[1].device_block = -1");
  expect_throw_naming<IndexOutOfRange>(upload({{Precision::FP16, 0, 2}}), "copies[0].host_slot = 2");
  expect_throw_naming<IndexOutOfRange>(upload({{Precision::INT4, 0, -3}}), "copies[0].host_slot = -3");
  // Two writers of one destination: host slot going out, device block coming in.
  expect_throw_naming<InvalidArgument>(upload({{Precision::INT4, 1, 1}, {Precision::INT4, 2, 1}}, d2h),
                                       "copies[1].host_slot = 1: also the destination of copies[0]");
  expect_throw_naming<InvalidArgument>(upload({{Precision::INT2, 7, 0}, {Precision::INT2, 7, 1}}, h2d),
                                       "copies[1].device_block = 7");
  expect_throw_naming<InvalidArgument>(upload({}, static_cast<SwapDirection>(2)), "direction = 2");

  gpu::SwapBlocksArgs args;  // no pools at all
  expect_throw_naming<InvalidArgument>([&] { gpu::swap_blocks(args); }, "device[FP16].base is null");
  for (const Precision p : kAllPrecisions)
    args.device[pool_index(p)] = manager.pool_view(p, reinterpret_cast<std::byte*>(256));
  expect_throw_naming<InvalidArgument>([&] { gpu::swap_blocks(args); }, "host[FP16].base is null");
  for (const Precision p : kAllPrecisions)
    args.host[pool_index(p)] = manager.swap_view(p, reinterpret_cast<std::byte*>(512));
  std::swap(args.host[1], args.host[2]);
  expect_throw_naming<InvalidArgument>([&] { gpu::swap_blocks(args); }, "host[INT4].format.precision = INT2");
  std::swap(args.host[1], args.host[2]);
  args.count = -1;
  expect_throw_naming<InvalidArgument>([&] { gpu::swap_blocks(args); }, "count = -1");
  args.count = 2;
  expect_throw_naming<InvalidArgument>([&] { gpu::swap_blocks(args); }, "copies is null");
  args.count = 0;
  EXPECT_NO_THROW(gpu::swap_blocks(args));  // nothing to do: no launch, no CUDA call

  CacheConfig no_swap = small_config();
  no_swap.swap_blocks = {0, 0, 0};
  const KVCacheManager without(no_swap);
  expect_throw_naming<InvalidArgument>([&] { gpu::PinnedSwapBuffer buffer(without.swap_layout()); },
                                       "layout.bytes = 0");
}

// A rejected upload leaves the previous list in place (count and contents)
// and copies nothing; launching afterwards runs the previous list exactly.
// An empty list is a no-op.
TEST(SwapCudaBadInput, RejectedListLaunchesNothingAndEmptyListIsANoOp) {
  MIXKV_REQUIRE_CUDA();
  DeviceCache cache(small_config());
  Rng rng(3);
  std::vector<std::byte> mirror(cache.manager.config().arena_bytes);
  for (auto& b : mirror) b = static_cast<std::byte>(rng() | 1);  // no zero byte: the swap buffer starts zeroed
  cuda_ok(cudaMemcpy(cache.arena.base(), mirror.data(), mirror.size(), cudaMemcpyHostToDevice), "H2D");
  const std::vector<std::byte> zeros(cache.manager.swap_bytes(), std::byte{0});
  ASSERT_TRUE(cache.swap_bytes() == zeros) << "PinnedSwapBuffer is not zero-filled";

  // Empty lists in both directions: nothing changes.
  cache.run_swap({}, SwapDirection::DeviceToHost);
  cache.run_swap({}, SwapDirection::HostToDevice);
  EXPECT_EQ(cache.list.count(), 0);
  EXPECT_TRUE(cache.swap_bytes() == zeros);
  EXPECT_TRUE(cache.arena_bytes() == mirror);

  // Accepted at the edges: the last block id and slot of each pool; one
  // source read twice (a destination may repeat only in the other pool or
  // the other direction).
  const auto d2h = SwapDirection::DeviceToHost;
  const auto h2d = SwapDirection::HostToDevice;
  EXPECT_NO_THROW(cache.list.upload(
      std::vector<SwapCopy>{{Precision::INT2, 47, 3}, {Precision::INT4, 29, 2}, {Precision::FP16, 11, 1}}, h2d,
      cache.manager.arena_layout(), cache.manager.swap_layout(), nullptr));
  EXPECT_NO_THROW(cache.list.upload(std::vector<SwapCopy>{{Precision::INT4, 1, 1}, {Precision::INT2, 2, 1}}, d2h,
                                    cache.manager.arena_layout(), cache.manager.swap_layout(), nullptr));
  EXPECT_NO_THROW(cache.list.upload(std::vector<SwapCopy>{{Precision::INT2, 7, 0}, {Precision::INT2, 7, 1}}, d2h,
                                    cache.manager.arena_layout(), cache.manager.swap_layout(), nullptr));

  const std::vector<SwapCopy> good = {{Precision::FP16, 3, 1}, {Precision::INT2, 40, 0}};
  cache.list.upload(good, SwapDirection::DeviceToHost, cache.manager.arena_layout(), cache.manager.swap_layout(),
                    nullptr);
  const std::vector<std::vector<SwapCopy>> bad = {
      {{Precision::FP16, 0, 0}, {static_cast<Precision>(7), 0, 0}},  // pool out of range
      {{Precision::FP16, 0, 0}, {Precision::INT4, 30, 0}},           // block out of range
      {{Precision::FP16, 0, 0}, {Precision::INT2, 0, 4}},            // host slot out of range
  };
  for (const auto& list : bad) {
    EXPECT_ANY_THROW(cache.list.upload(list, SwapDirection::HostToDevice, cache.manager.arena_layout(),
                                       cache.manager.swap_layout(), nullptr));
  }
  cuda_ok(cudaDeviceSynchronize(), "sync");
  EXPECT_TRUE(cache.swap_bytes() == zeros) << "a rejected list copied something";
  EXPECT_TRUE(cache.arena_bytes() == mirror) << "a rejected list copied something";
  ASSERT_EQ(cache.list.count(), 2);

  gpu::SwapBlocksArgs args;
  cache.list.fill(args);
  EXPECT_EQ(args.direction, SwapDirection::DeviceToHost);
  args.device = cache.pools;
  args.host = cache.pinned.device_views(cache.manager.swap_layout());
  gpu::swap_blocks(args);
  cuda_ok(cudaDeviceSynchronize(), "swap_blocks");
  std::vector<std::byte> expected = zeros;
  cpu::swap_blocks(good, SwapDirection::DeviceToHost, views_over(cache.manager, mirror.data(), false),
                   views_over(cache.manager, expected.data(), true));
  EXPECT_TRUE(cache.swap_bytes() == expected) << "the list kept after the rejected uploads was not the last good one";

  // The views: the manager's swap_view over host() and device().
  const gpu::DevicePools hv = cache.pinned.host_views(cache.manager.swap_layout());
  const gpu::DevicePools dv = cache.pinned.device_views(cache.manager.swap_layout());
  for (const Precision p : kAllPrecisions) {
    EXPECT_EQ(hv[pool_index(p)].block(1), cache.manager.swap_view(p, cache.pinned.host()).block(1));
    EXPECT_EQ(dv[pool_index(p)].block(1) - cache.pinned.device(), hv[pool_index(p)].block(1) - cache.pinned.host());
  }
  EXPECT_EQ(cache.pinned.bytes(), cache.manager.swap_bytes());
}

// A list given raw (not through DeviceSwapList, which checks on the host)
// with a device block or host slot one past its pool, far past it or
// negative, or a pool out of range: the kernel skips that copy and records
// it, the host raises IndexOutOfRange naming copies[1] and the limit, the
// other copies are exact and the context survives. Host slots of a pool
// whose swap pool is empty are all out of range.
TEST(SwapCudaBadIds, RawListEntriesAreCheckedInTheKernel) {
  MIXKV_REQUIRE_CUDA();
  CacheConfig config = small_config();
  config.swap_blocks = {2, 3, 0};
  DeviceCache cache(config);
  Rng rng(5);
  std::vector<std::byte> mirror(cache.manager.config().arena_bytes);
  for (auto& b : mirror) b = static_cast<std::byte>(rng() | 1);
  cuda_ok(cudaMemcpy(cache.arena.base(), mirror.data(), mirror.size(), cudaMemcpyHostToDevice), "H2D");
  const PoolLayout arena = cache.manager.arena_layout();
  const PoolLayout swap = cache.manager.swap_layout();
  const std::vector<SwapCopy> good = {{Precision::FP16, 3, 1}, {Precision::INT4, 5, 2}};
  std::vector<std::byte> expected(cache.manager.swap_bytes(), std::byte{0});
  cpu::swap_blocks(good, SwapDirection::DeviceToHost, views_over(cache.manager, mirror.data(), false),
                   views_over(cache.manager, expected.data(), true));

  struct Case {
    SwapCopy copy;
    std::string name;
    std::int64_t limit;
  };
  std::vector<Case> cases;
  const std::int32_t blocks = arena.pools[1].num_blocks;
  const std::int32_t slots = swap.pools[1].num_blocks;
  for (const std::int32_t bad : {blocks, blocks + 1, 1 << 30, INT32_MAX, -1, INT32_MIN}) {
    cases.push_back({{Precision::INT4, bad, 0}, "copies[1].device_block = " + std::to_string(bad), blocks});
  }
  for (const std::int32_t bad : {slots, slots + 1, 1 << 30, INT32_MAX, -1, INT32_MIN}) {
    cases.push_back({{Precision::INT4, 0, bad}, "copies[1].host_slot = " + std::to_string(bad), slots});
  }
  cases.push_back({{Precision::INT2, 0, 0}, "copies[1].host_slot = 0", 0});  // the INT2 swap pool is empty
  cases.push_back({{static_cast<Precision>(7), 0, 0}, "copies[1].pool = 7", 3});
  gpu::DeviceStatus status;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::memset(cache.pinned.host(), 0, cache.manager.swap_bytes());
    const std::vector<SwapCopy> copies = {good[0], c.copy, good[1]};
    DeviceVector<SwapCopy> list(copies);
    gpu::SwapBlocksArgs args;
    args.copies = list.get();
    args.count = 3;
    args.direction = SwapDirection::DeviceToHost;
    args.device = cache.pools;
    args.host = cache.pinned.device_views(swap);
    args.status = &status;
    gpu::swap_blocks(args);
    expect_error_naming<IndexOutOfRange>(
        [&] { status.check(nullptr); },
        {"swap_blocks: " + c.name,
         c.name.find(".pool") != std::string::npos ? std::string("FP16 (0)") : "[0, " + std::to_string(c.limit) + ")"});
    expect_context_usable("swap_blocks with a bad entry");
    EXPECT_TRUE(cache.swap_bytes() == expected);
    EXPECT_TRUE(cache.arena_bytes() == mirror);
  }
  // The next swap through the checked list is exact.
  std::memset(cache.pinned.host(), 0, cache.manager.swap_bytes());
  cache.run_swap(good, SwapDirection::DeviceToHost);
  EXPECT_TRUE(cache.swap_bytes() == expected);
  EXPECT_NO_THROW(gpu::DeviceStatus::for_current_device().check(nullptr));
}

}  // namespace
}  // namespace mixkv::test
