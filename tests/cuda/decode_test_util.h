#pragma once
// The CUDA decode of one placed batch, for the decode tests: a page table,
// a plan and one run, as the engine's CUDA backend makes them.
#include <numeric>
#include <vector>

#include "cuda_test_util.h"
#include "mixkv/kernels/decode_plan.h"

namespace mixkv::test {

// Runs the CUDA decode for one layer of `placed` (stored in `arena`).
inline DecodeResult run_gpu(TestArena& arena, const PlacedBatch& placed, const std::vector<Half>& q, int q_heads,
                            float sm_scale, int chunks = 0, int layers = 1, int layer = 0, int num_sms = 0,
                            std::int32_t* num_items = nullptr, int max_heads_per_item = 0, int invariant_blocks = 0,
                            int max_batch = 0) {
  const BlockFormat f = arena.format(Precision::FP16);
  const auto batch = static_cast<std::int32_t>(placed.tables[0].indptr.size() - 1);
  DeviceArenaCopy device(arena);
  max_batch = std::max(max_batch, batch);
  gpu::DevicePageTables tables({layers, max_batch, longest_list(placed)}, layout_of(arena));
  fill_tables(tables, placed, layer);
  tables.upload(nullptr);
  gpu::DecodePlanConfig config;
  config.num_layers = layers;
  config.num_q_heads = q_heads;
  config.num_kv_heads = f.num_kv_heads;
  config.head_dim = f.head_dim;
  config.block_size = f.block_size;
  config.max_batch = max_batch;
  config.chunks_per_sequence = chunks;
  config.batch_invariant_blocks = invariant_blocks;
  config.num_sms = num_sms;
  config.max_heads_per_item = max_heads_per_item;
  gpu::DecodePlan plan(config, tables);
  std::vector<std::int32_t> slots(batch);
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, nullptr);
  DeviceVector<Half> dq(q);
  DeviceVector<Half> dout(q.size());
  DeviceVector<float> dlse(static_cast<std::size_t>(batch) * q_heads);
  dout.fill_bytes(0x7e);  // NaN: every element must be written
  dlse.fill_bytes(0x7f);
  gpu::DecodeRunArgs run;
  run.layer = layer;
  run.q = dq.get();
  run.out = dout.get();
  run.lse = dlse.get();
  run.sm_scale = sm_scale;
  run.pools = device.pools;
  plan.run(run);
  if (num_items != nullptr) *num_items = plan.num_items(layer);
  DecodeResult r;
  r.out = halves_to_floats(dout.to_host());
  r.lse = dlse.to_host();
  return r;
}

}  // namespace mixkv::test
