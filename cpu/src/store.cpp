#include "mixkv/cpu/store.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "detail.h"

namespace mixkv::cpu {
namespace {

using detail::invalid;

// Values in a row of [rows][num_kv_heads][head_dim].
std::size_t row_values(const BlockFormat& f) { return static_cast<std::size_t>(f.num_kv_heads) * f.head_dim; }

// The element type (the cache's, `pool_name`.format.dtype), then the size.
void check_rows(std::string_view function, std::string_view name, Span16 values, std::size_t rows,
                std::string_view rows_name, const BlockFormat& f, std::string_view pool_name) {
  detail::check_dtype(function, name, values.dtype(), f.dtype, std::string(pool_name) + ".format.dtype");
  const std::size_t expected = rows * row_values(f);
  if (values.size() != expected) {
    invalid(function, ": ", name, " has ", values.size(), " values: expected ", rows_name, " (", rows,
            ") * num_kv_heads (", f.num_kv_heads, ") * head_dim (", f.head_dim, ") = ", expected);
  }
}

// Ids must be unique: two writers of one slot or block would race on the
// device and silently keep one of them here.
void check_unique(std::string_view function, std::string_view name, std::vector<std::int32_t> ids) {
  std::sort(ids.begin(), ids.end());
  const auto twice = std::adjacent_find(ids.begin(), ids.end());
  if (twice != ids.end()) invalid(function, ": ", name, " holds ", *twice, " twice: expected distinct values");
}

// Writes one row's K and V (every head) into an FP16 slot.
void write_fp16_row(const PoolView& pool, std::int32_t slot, const std::byte* k_row, const std::byte* v_row) {
  const BlockFormat& f = pool.format;
  std::byte* block = pool.block(slot / f.block_size);
  const std::int32_t token = slot % f.block_size;
  const std::size_t head_row = static_cast<std::size_t>(f.head_dim) * 2;
  for (std::int32_t h = 0; h < f.num_kv_heads; ++h) {
    std::byte* head = block + f.head_offset(h);
    std::memcpy(head + detail::fp16_k_row(f, token), k_row + h * head_row, head_row);
    std::memcpy(head + detail::fp16_v_row(f, token), v_row + h * head_row, head_row);
  }
}

}  // namespace

void store_prefill(Span16 k, Span16 v, const StoreMapping& mapping, const PoolViews& pools) {
  constexpr std::string_view fn = "store_prefill";
  detail::check_pools(fn, pools);
  const BlockFormat& fp16 = pools[pool_index(Precision::FP16)].format;
  const std::size_t rows = mapping.fp16_slots.size();
  check_rows(fn, "k", k, rows, "mapping.fp16_slots.size()", fp16, "pools[FP16]");
  check_rows(fn, "v", v, rows, "mapping.fp16_slots.size()", fp16, "pools[FP16]");

  // Every row goes to exactly one place: its FP16 slot, or (slot -1) the
  // one quantized window that covers it.
  std::vector<std::int32_t> covered(rows, 0);
  std::vector<std::int32_t> fp16_slots;
  const PoolView& fp16_pool = pools[pool_index(Precision::FP16)];
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int32_t slot = mapping.fp16_slots[r];
    detail::check_slot(fn, slot, fp16_pool, "pools[FP16]", "a quantized row", "mapping.fp16_slots[", r, "]");
    if (slot >= 0) fp16_slots.push_back(slot);
  }
  check_unique(fn, "mapping.fp16_slots", std::move(fp16_slots));
  for (Precision p : {Precision::INT4, Precision::INT2}) {
    const auto& windows = p == Precision::INT4 ? mapping.int4_windows : mapping.int2_windows;
    const std::string name = std::string("mapping.") + (p == Precision::INT4 ? "int4_windows" : "int2_windows");
    const std::string pool_name = detail::pool_name(p);
    std::vector<std::int32_t> block_ids;
    for (std::size_t w = 0; w < windows.size(); ++w) {
      const WindowSlot& window = windows[w];
      detail::check_block(fn, window.block_id, pools[pool_index(p)], pool_name, name, "[", w, "].block_id");
      const std::size_t last = static_cast<std::size_t>(window.first_row) + fp16.block_size;
      if (window.first_row < 0 || last > rows) {
        invalid(fn, ": ", name, "[", w, "].first_row = ", window.first_row,
                ": expected first_row >= 0 and first_row + block_size (", fp16.block_size, ") <= rows (", rows, ")");
      }
      for (std::size_t r = static_cast<std::size_t>(window.first_row); r < last; ++r) {
        if (mapping.fp16_slots[r] != -1) {
          invalid(fn, ": ", name, "[", w, "] covers row ", r, " whose mapping.fp16_slots[", r,
                  "] = ", mapping.fp16_slots[r], ": expected -1");
        }
        if (++covered[r] > 1) invalid(fn, ": ", name, "[", w, "] covers row ", r, " already covered by another window");
      }
      block_ids.push_back(window.block_id);
    }
    check_unique(fn, name + " block ids", std::move(block_ids));
  }
  for (std::size_t r = 0; r < rows; ++r) {
    if (mapping.fp16_slots[r] == -1 && covered[r] == 0) {
      invalid(fn, ": mapping.fp16_slots[", r, "] = -1 but no int4/int2 window covers row ", r,
              ": expected a slot >= 0 or a covering window");
    }
  }
  detail::check_finite(fn, "k", k);
  detail::check_finite(fn, "v", v);

  const std::size_t stride = row_values(fp16);
  const std::byte* k_bytes = k.data();
  const std::byte* v_bytes = v.data();
  for (std::size_t r = 0; r < rows; ++r) {
    if (mapping.fp16_slots[r] >= 0) {
      write_fp16_row(fp16_pool, mapping.fp16_slots[r], k_bytes + r * stride * 2, v_bytes + r * stride * 2);
    }
  }
  for (Precision p : {Precision::INT4, Precision::INT2}) {
    const PoolView& pool = pools[pool_index(p)];
    for (const WindowSlot& window : p == Precision::INT4 ? mapping.int4_windows : mapping.int2_windows) {
      std::byte* block = pool.block(window.block_id);
      const std::size_t first = static_cast<std::size_t>(window.first_row) * stride;
      for (std::int32_t h = 0; h < pool.format.num_kv_heads; ++h) {
        const std::size_t at = first + static_cast<std::size_t>(h) * pool.format.head_dim;
        detail::write_head_unchecked(pool.format, k_bytes + at * 2, v_bytes + at * 2, stride,
                                     block + pool.format.head_offset(h));
      }
    }
  }
}

void append(Span16 k, Span16 v, std::span<const std::int32_t> fp16_slots, const PoolView& fp16_pool) {
  constexpr std::string_view fn = "append";
  detail::check_pool(fn, "fp16_pool", fp16_pool, Precision::FP16);
  const BlockFormat& f = fp16_pool.format;
  check_rows(fn, "k", k, fp16_slots.size(), "fp16_slots.size()", f, "fp16_pool");
  check_rows(fn, "v", v, fp16_slots.size(), "fp16_slots.size()", f, "fp16_pool");
  const std::size_t stride = row_values(f);
  std::vector<std::int32_t> written;
  for (std::size_t i = 0; i < fp16_slots.size(); ++i) {
    detail::check_slot(fn, fp16_slots[i], fp16_pool, "fp16_pool", "a padding row", "fp16_slots[", i, "]");
    if (fp16_slots[i] < 0) continue;  // padding rows may hold anything
    written.push_back(fp16_slots[i]);
    detail::check_finite(fn, "k", k.subspan(i * stride, stride), i * stride);
    detail::check_finite(fn, "v", v.subspan(i * stride, stride), i * stride);
  }
  check_unique(fn, "fp16_slots", std::move(written));

  for (std::size_t i = 0; i < fp16_slots.size(); ++i) {
    if (fp16_slots[i] >= 0) {
      write_fp16_row(fp16_pool, fp16_slots[i], k.data() + i * stride * 2, v.data() + i * stride * 2);
    }
  }
}

void copy_blocks(std::span<const BlockCopy> copies, const PoolView& pool) {
  constexpr std::string_view fn = "copy_blocks";
  detail::check_pool(fn, "pool", pool, pool.format.precision);
  std::vector<std::int32_t> sources;
  std::vector<std::int32_t> destinations;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    const BlockCopy& copy = copies[i];
    detail::check_block(fn, copy.src, pool, "pool", "copies[", i, "].src");
    detail::check_block(fn, copy.dst, pool, "pool", "copies[", i, "].dst");
    if (copy.src == copy.dst)
      invalid(fn, ": copies[", i, "] copies block ", copy.src, " onto itself: expected src != dst");
    sources.push_back(copy.src);
    destinations.push_back(copy.dst);
  }
  // The copies must not depend on their order (the device runs them at once):
  // no block is written twice, and no written block is also read.
  check_unique(fn, "copies[].dst", destinations);
  std::sort(sources.begin(), sources.end());
  for (std::size_t i = 0; i < copies.size(); ++i) {
    if (std::binary_search(sources.begin(), sources.end(), copies[i].dst)) {
      invalid(fn, ": copies[", i, "].dst = ", copies[i].dst,
              " is also a src: expected destinations that no copy reads");
    }
  }
  for (const BlockCopy& copy : copies)
    std::memcpy(pool.block(copy.dst), pool.block(copy.src), pool.format.block_bytes());
}

}  // namespace mixkv::cpu
