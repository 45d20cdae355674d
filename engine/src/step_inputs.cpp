#include "step_inputs.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "mixkv/core/errors.h"

namespace mixkv::engine_detail {

namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

// Messages are built only on failure: apply() checks every decode of every step.
template <class MakeMessage>
void require(bool ok, const char* fn, MakeMessage&& what) {
  if (!ok) throw InvalidArgument(std::string(fn) + ": " + what());
}

std::string at(const char* field, std::size_t i) { return std::string(field) + "[" + std::to_string(i) + "]"; }

// A request the step names must be held by the manager, on the device.
template <class Field>
void require_live(const char* fn, const KVCacheManager& manager, RequestId id, Field&& field) {
  if (!manager.contains(id)) {
    throw UnknownId(std::string(fn) + ": " + field() + " = " + str(id) + ": expected a sequence the manager holds");
  }
  require(!manager.is_swapped(id), fn,
          [&] { return field() + " = " + str(id) + ": expected a sequence in device memory, it is swapped out"; });
}

void require_aligned(const char* fn, const char* name, const TensorView& t, std::size_t align) {
  if (t.numel() > 0 && reinterpret_cast<std::uintptr_t>(t.data) % align != 0) {
    throw InvalidArgument(std::string(fn) + ": " + name + ": data is not " + str(static_cast<std::int64_t>(align)) +
                          "-byte aligned: expected the start of an allocation or a row of one");
  }
}

bool overlap(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a.data);
  const auto y = reinterpret_cast<std::uintptr_t>(b.data);
  return x < y + b.bytes() && y < x + a.bytes();
}

void require_applied(const char* fn, const StepInputs& inputs) {
  require(inputs.applied, fn, [&] { return "no step applied yet: expected apply() (Engine::step()) first"; });
}

void require_layer(const char* fn, const BackendConfig& config, std::int32_t layer) {
  const std::int32_t layers = config.cache.shape.num_layers;
  if (layer < 0 || layer >= layers) {
    throw IndexOutOfRange(std::string(fn) + ": layer = " + str(layer) + ", expected 0 <= layer < " + str(layers));
  }
}

}  // namespace

void check_config(const char* fn, const BackendConfig& config) {
  const std::int32_t kv = config.cache.shape.num_kv_heads;
  require(config.num_q_heads > 0 && kv > 0 && config.num_q_heads % kv == 0, fn, [&] {
    return "num_q_heads = " + str(config.num_q_heads) + ": expected a positive multiple of num_kv_heads = " + str(kv);
  });
  require(config.max_num_seqs >= 1 && config.max_num_seqs <= (1 << 20), fn,
          [&] { return "max_num_seqs = " + str(config.max_num_seqs) + ": expected 1 <= max_num_seqs <= 2^20"; });
  require(config.max_prefill_rows >= 0, fn,
          [&] { return "max_prefill_rows = " + str(config.max_prefill_rows) + ": expected >= 0 (0: no bound)"; });
  require(config.max_blocks_per_sequence >= 0, fn, [&] {
    return "max_blocks_per_sequence = " + str(config.max_blocks_per_sequence) + ": expected >= 0 (0: from the arena)";
  });
  // A chunk longer than any page list is one chunk a sequence; the bound
  // keeps the planner's ceil(blocks / chunk) within int32.
  require(config.batch_invariant_blocks >= 0 && config.batch_invariant_blocks <= (1 << 20), fn, [&] {
    return "batch_invariant_blocks = " + str(config.batch_invariant_blocks) +
           ": expected 0 (off) or a chunk of 1 .. 2^20 blocks";
  });
  require(std::isfinite(config.sm_scale) && config.sm_scale >= 0.0f, fn, [&] {
    return "sm_scale = " + std::to_string(config.sm_scale) + ": expected a finite value >= 0 (0: 1/sqrt(head_dim))";
  });
}

void check_step(const char* fn, const StepOutput& step, const KVCacheManager& manager, const BackendConfig& config) {
  const std::int32_t layers = config.cache.shape.num_layers;
  const std::size_t batch = step.decodes.size();
  require(batch <= static_cast<std::size_t>(config.max_num_seqs), fn, [&] {
    return "step.decodes has " + str(static_cast<std::int64_t>(batch)) +
           " requests: expected <= max_num_seqs = " + str(config.max_num_seqs);
  });
  require(step.decode_slots.size() == batch, fn, [&] {
    return "step.decode_slots has " + str(static_cast<std::int64_t>(step.decode_slots.size())) +
           " entries: expected step.decodes.size() = " + str(static_cast<std::int64_t>(batch));
  });
  for (std::size_t i = 0; i < batch; ++i) {
    require(step.decode_slots[i] >= 0 && step.decode_slots[i] < config.max_num_seqs, fn, [&] {
      return at("step.decode_slots", i) + " = " + str(step.decode_slots[i]) +
             ": expected 0 <= slot < max_num_seqs = " + str(config.max_num_seqs);
    });
    require_live(fn, manager, step.decodes[i], [&] { return at("step.decodes", i); });
  }
  // Rows of the decode batch: one a decode, or decode_rows' CSR offsets.
  std::size_t rows_of_batch = batch;
  if (!step.decode_rows.empty()) {
    require(step.decode_rows.size() == batch + 1 && step.decode_rows[0] == 0, fn, [&] {
      return "step.decode_rows has " + str(static_cast<std::int64_t>(step.decode_rows.size())) +
             " entries: expected none or decodes.size() + 1 = " + str(static_cast<std::int64_t>(batch + 1)) +
             " offsets from 0";
    });
    for (std::size_t i = 0; i < batch; ++i) {
      require(step.decode_rows[i + 1] > step.decode_rows[i], fn, [&] {
        return at("step.decode_rows", i + 1) + " = " + str(step.decode_rows[i + 1]) + ": expected > " +
               at("step.decode_rows", i) + " = " + str(step.decode_rows[i]) + " (a decode has at least one row)";
      });
      const std::int32_t n = step.decode_rows[i + 1] - step.decode_rows[i];
      require(n <= manager.num_tokens(step.decodes[i]), fn, [&] {
        return at("step.decode_rows", i + 1) + ": " + str(n) + " rows for a sequence of " +
               str(manager.num_tokens(step.decodes[i])) + " tokens: expected rows it has appended";
      });
    }
    rows_of_batch = static_cast<std::size_t>(step.decode_rows.back());
  }
  const AppendResult& a = step.append;
  if (!a.slots.empty()) {
    require(a.slots.size() == static_cast<std::size_t>(layers), fn, [&] {
      return "step.append.slots has " + str(static_cast<std::int64_t>(a.slots.size())) +
             " layers: expected num_layers = " + str(layers);
    });
    for (std::int32_t l = 0; l < layers; ++l) {
      require(a.slots[static_cast<std::size_t>(l)].size() == rows_of_batch, fn, [&] {
        return "step.append.slots[" + str(l) + "] has " + str(static_cast<std::int64_t>(a.slots[l].size())) +
               " slots: expected the batch's rows, " + str(static_cast<std::int64_t>(rows_of_batch));
      });
    }
  } else {
    require(a.offsets.size() == batch, fn, [&] {
      return "step.append.offsets has " + str(static_cast<std::int64_t>(a.offsets.size())) +
             " entries (and append.slots none): expected the batch, " + str(static_cast<std::int64_t>(batch));
    });
  }
  if (!step.metadata.layers.empty()) {
    require(step.metadata.layers.size() == static_cast<std::size_t>(layers) &&
                step.metadata.batch_size == static_cast<std::int32_t>(batch),
            fn, [&] {
              return "step.metadata: expected num_layers = " + str(layers) + " layers for the batch of " +
                     str(static_cast<std::int64_t>(batch)) + ", or none";
            });
    for (const auto& tables : step.metadata.layers) {
      for (const PagedPoolTable& t : tables) {
        require(t.indptr.size() == batch + 1 && t.last_block_len.size() == batch, fn, [&] {
          return "step.metadata: expected indptr of batch + 1 and last_block_len of batch entries in every table";
        });
      }
    }
  }
  std::int64_t rows = 0;
  for (std::size_t c = 0; c < step.prefills.size(); ++c) {
    const PrefillChunk& chunk = step.prefills[c];
    const auto chunk_at = [&] { return at("step.prefills", c); };
    require_live(fn, manager, chunk.id, [&] { return chunk_at() + ".id"; });
    const std::int32_t tokens = manager.num_tokens(chunk.id);
    require(chunk.start >= 0 && chunk.start < chunk.end && chunk.end <= tokens, fn, [&] {
      return chunk_at() + ": rows [" + str(chunk.start) + ", " + str(chunk.end) +
             "): expected 0 <= start < end <= " + str(tokens) + " (the sequence's tokens)";
    });
    if (!chunk.mappings.empty()) {
      require(chunk.mappings.size() == static_cast<std::size_t>(layers), fn, [&] {
        return chunk_at() + ".mappings has " + str(static_cast<std::int64_t>(chunk.mappings.size())) +
               " layers: expected num_layers = " + str(layers) + ", or none";
      });
      for (const StoreMapping& m : chunk.mappings) {
        require(m.fp16_slots.size() == static_cast<std::size_t>(chunk.end - chunk.start), fn, [&] {
          return chunk_at() + ".mappings: expected end - start = " + str(chunk.end - chunk.start) +
                 " rows in every layer";
        });
      }
    }
    rows += chunk.end - chunk.start;
  }
  const std::int64_t limit = config.max_prefill_rows > 0 ? config.max_prefill_rows : INT32_MAX;
  require(rows <= limit, fn,
          [&] { return "step.prefills hold " + str(rows) + " rows: expected <= max_prefill_rows = " + str(limit); });
}

void build_inputs(const StepOutput& step, const KVCacheManager& manager, StepInputs& inputs) {
  const std::int32_t layers = manager.config().shape.num_layers;
  const std::int32_t bs = manager.config().shape.block_size;
  const std::size_t batch = step.decodes.size();
  inputs.batch = static_cast<std::int32_t>(batch);
  inputs.rows = 0;
  inputs.chunk_ids.clear();
  inputs.chunk_starts.clear();
  inputs.qo_indptr.assign(1, 0);
  for (const PrefillChunk& chunk : step.prefills) {
    inputs.rows += chunk.end - chunk.start;
    inputs.chunk_ids.push_back(chunk.id);
    inputs.chunk_starts.push_back(chunk.start);
    inputs.qo_indptr.push_back(inputs.rows);
  }

  inputs.mappings.resize(static_cast<std::size_t>(layers));
  for (std::int32_t l = 0; l < layers; ++l) {
    StoreMapping& m = inputs.mappings[static_cast<std::size_t>(l)];
    m.fp16_slots.clear();
    m.int4_windows.clear();
    m.int2_windows.clear();
    for (const PrefillChunk& chunk : step.prefills) {
      if (!chunk.mappings.empty()) {
        m.append(chunk.mappings[static_cast<std::size_t>(l)]);
        continue;
      }
      // Rows [start, end) of the prompt's mapping; chunks end on window
      // boundaries, so a window lies wholly inside or outside the chunk.
      const StoreMapping full = manager.prefill_mapping(chunk.id, l);
      StoreMapping cut;
      cut.fp16_slots.assign(full.fp16_slots.begin() + chunk.start, full.fp16_slots.begin() + chunk.end);
      const auto keep = [&](const std::vector<WindowSlot>& from, std::vector<WindowSlot>& to) {
        for (const WindowSlot& w : from) {
          if (w.first_row >= chunk.start && w.first_row < chunk.end)
            to.push_back({w.block_id, w.first_row - chunk.start});
        }
      };
      keep(full.int4_windows, cut.int4_windows);
      keep(full.int2_windows, cut.int2_windows);
      m.append(cut);
    }
  }

  inputs.decode_indptr = step.decode_rows;
  inputs.decode_rows = step.decode_rows.empty() ? inputs.batch : step.decode_rows.back();
  const auto n_rows = static_cast<std::size_t>(inputs.decode_rows);
  inputs.slots.resize(static_cast<std::size_t>(layers) * n_rows);
  if (!step.append.slots.empty()) {
    for (std::int32_t l = 0; l < layers; ++l) {
      const auto& row = step.append.slots[static_cast<std::size_t>(l)];
      std::copy(row.begin(), row.end(), inputs.slots.begin() + static_cast<std::ptrdiff_t>(l * n_rows));
    }
  } else if (!step.decode_rows.empty()) {
    // Drafts in compact form: a decode's rows are the last FP16 tokens of
    // every layer, which may span a block boundary: read from the table.
    for (std::size_t i = 0; i < batch; ++i) {
      const PageTable& t = manager.page_table(step.decodes[i]);
      const std::int32_t first = step.decode_rows[i];
      const std::int32_t n = step.decode_rows[i + 1] - first;
      for (std::int32_t l = 0; l < layers; ++l) {
        const std::int64_t tokens = t.fp16_tokens(l);
        for (std::int32_t j = 0; j < n; ++j) {
          inputs.slots[static_cast<std::size_t>(l) * n_rows + static_cast<std::size_t>(first + j)] =
              t.fp16_slot(l, tokens - n + j);
        }
      }
    }
  } else {
    // The compact form: the new token sits at the same offset of every
    // layer's FP16 tail, and the page tables already hold the tails.
    for (std::size_t i = 0; i < batch; ++i) {
      const auto tails = manager.page_table(step.decodes[i]).fp16_tails();
      for (std::int32_t l = 0; l < layers; ++l) {
        inputs.slots[static_cast<std::size_t>(l) * batch + i] =
            tails[static_cast<std::size_t>(l)] * bs + step.append.offsets[i];
      }
    }
  }
  inputs.applied = true;
}

void check_store(const char* fn, const StepInputs& inputs, const BackendConfig& config, std::int32_t layer,
                 const TensorView& k, const TensorView& v, DeviceKind device, std::int32_t device_id,
                 std::size_t align) {
  require_applied(fn, inputs);
  require_layer(fn, config, layer);
  const CacheShape& s = config.cache.shape;
  require_tensor(fn, "k", k, s.dtype, device, device_id, {inputs.rows, s.num_kv_heads, s.head_dim});
  require_tensor(fn, "v", v, s.dtype, device, device_id, {inputs.rows, s.num_kv_heads, s.head_dim});
  require_aligned(fn, "k", k, align);
  require_aligned(fn, "v", v, align);
}

namespace {

// q, k, v, out (and lse) of `n` query rows: shapes, dtypes, device,
// alignment, and outputs disjoint from the inputs.
void check_qkv_out(const char* fn, const BackendConfig& config, std::int64_t n, const TensorView& q,
                   const TensorView& k, const TensorView& v, const TensorView& out, const TensorView* lse,
                   DeviceKind device, std::int32_t device_id, std::size_t align) {
  const CacheShape& s = config.cache.shape;
  require_tensor(fn, "q", q, s.dtype, device, device_id, {n, config.num_q_heads, s.head_dim});
  require_tensor(fn, "k", k, s.dtype, device, device_id, {n, s.num_kv_heads, s.head_dim});
  require_tensor(fn, "v", v, s.dtype, device, device_id, {n, s.num_kv_heads, s.head_dim});
  require_tensor(fn, "out", out, s.dtype, device, device_id, {n, config.num_q_heads, s.head_dim});
  if (lse != nullptr) require_tensor(fn, "lse", *lse, DType::F32, device, device_id, {n, config.num_q_heads});
  require_aligned(fn, "q", q, align);
  require_aligned(fn, "k", k, align);
  require_aligned(fn, "v", v, align);
  require_aligned(fn, "out", out, align);
  if (lse != nullptr) require_aligned(fn, "lse", *lse, 4);
  // Outputs are written while inputs are still read (on the device by other
  // CTAs): shared bytes would give wrong values.
  const std::pair<const char*, const TensorView*> inputs_read[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (const auto& [name, t] : inputs_read) {
    require(!overlap(out, *t), fn, [&] { return std::string("out overlaps ") + name + ": expected disjoint memory"; });
    if (lse != nullptr)
      require(!overlap(*lse, *t), fn,
              [&] { return std::string("lse overlaps ") + name + ": expected disjoint memory"; });
  }
  if (lse != nullptr) require(!overlap(out, *lse), fn, [&] { return "out overlaps lse: expected disjoint memory"; });
}

}  // namespace

void check_prefill(const char* fn, const StepInputs& inputs, const BackendConfig& config, std::int32_t layer,
                   const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                   const TensorView* lse, DeviceKind device, std::int32_t device_id, std::size_t align) {
  require_applied(fn, inputs);
  require_layer(fn, config, layer);
  check_qkv_out(fn, config, inputs.rows, q, k, v, out, lse, device, device_id, align);
}

void check_attend(const char* fn, const StepInputs& inputs, const BackendConfig& config, std::int32_t layer,
                  const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                  const TensorView* lse, DeviceKind device, std::int32_t device_id, std::size_t align) {
  require_applied(fn, inputs);
  require_layer(fn, config, layer);
  check_qkv_out(fn, config, inputs.decode_rows, q, k, v, out, lse, device, device_id, align);
}

void drop_fp16_tails(DecodeMetadata& metadata, std::span<const std::int32_t> rows_indptr, std::int32_t block_size) {
  for (auto& tables : metadata.layers) {
    PagedPoolTable& t = tables[pool_index(Precision::FP16)];
    std::vector<std::int32_t> indices;
    indices.reserve(t.indices.size());
    std::vector<std::int32_t> indptr{0};
    for (std::size_t i = 0; i + 1 < t.indptr.size(); ++i) {
      const std::int32_t blocks = t.indptr[i + 1] - t.indptr[i];
      const std::int64_t tokens = blocks == 0 ? 0 : std::int64_t{blocks - 1} * block_size + t.last_block_len[i];
      const std::int64_t kept = tokens - (rows_indptr[i + 1] - rows_indptr[i]);
      const auto keep_blocks = static_cast<std::int32_t>((kept + block_size - 1) / block_size);
      indices.insert(indices.end(), t.indices.begin() + t.indptr[i], t.indices.begin() + t.indptr[i] + keep_blocks);
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      t.last_block_len[i] =
          keep_blocks == 0 ? 0 : static_cast<std::int32_t>(kept - std::int64_t{keep_blocks - 1} * block_size);
    }
    t.indices = std::move(indices);
    t.indptr = std::move(indptr);
  }
}

float sm_scale(const BackendConfig& config) {
  return config.sm_scale > 0.0f ? config.sm_scale : 1.0f / std::sqrt(static_cast<float>(config.cache.shape.head_dim));
}

}  // namespace mixkv::engine_detail
