// coalesce rows: sorted unique ids and the per-id sums of their value rows;
// fused with the partition by owner, or read straight out of a receive buffer.
#include <string>

#include "counting_sort.h"
#include "ops.h"
#include "segment_reduce.h"

namespace sparsecomm {

void coalesce_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d, void* out_ids,
                    IndexType it, void* out_values, int threads) {
  const int64_t u = groups.num_groups();
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, g, groups.group_id[g]);
  if (d == 0 || u == 0) return;
  SPARSECOMM_DISPATCH_VALUE(vt, [&] { reduce_groups<V>(groups, values, d, out_values, false, false, threads); });
}

void coalesce_partition_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d,
                              const OwnerMap& map, int64_t* counts, void* out_ids, IndexType it, void* out_values,
                              int threads) {
  check_owner_map(map);
  threads = clamp_threads(threads);
  const int64_t u = groups.num_groups();
  std::vector<int32_t> owner(static_cast<size_t>(u));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < u; ++g) owner[g] = static_cast<int32_t>(row_owner(groups.group_id[g], map));
  // Groups are in ascending id order: a stable sort by owner keeps ids ascending inside an owner.
  std::vector<int64_t> dest(static_cast<size_t>(u));
  stable_counting_sort(
      u, map.num_owners, threads, [&](int64_t g) { return static_cast<int64_t>(owner[g]); },
      [&](int64_t g, int64_t slot) { dest[g] = slot; }, counts);
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, dest[g], groups.group_id[g]);
  if (d == 0 || u == 0) return;
  SPARSECOMM_DISPATCH_VALUE(vt, [&] {
    using S = typename Elem<V>::storage;
    const S* vals = static_cast<const S*>(values);
    S* out = static_cast<S*>(out_values);
    reduce_groups_with<V, S>(
        groups, [&](int64_t i) { return vals + i * d; }, d, [&](int64_t g) { return out + dest[g] * d; }, false,
        threads);
  });
}

namespace {

void check_segment(int64_t s, int64_t offset, int64_t bytes, int64_t buffer_bytes, size_t align, uintptr_t base,
                   const char* what) {
  if (offset < 0 || bytes < 0 || offset > buffer_bytes || bytes > buffer_bytes - offset)
    throw std::invalid_argument("sparsecomm: segment " + std::to_string(s) + "'s " + what +
                                " lie outside the buffer");
  if ((base + static_cast<uintptr_t>(offset)) % align != 0)
    throw std::invalid_argument("sparsecomm: segment " + std::to_string(s) + "'s " + what +
                                " are not aligned to " + std::to_string(align) + " bytes");
}

}  // namespace

RowGroups group_segment_rows(const void* buffer, int64_t buffer_bytes, int64_t nseg, const int64_t* counts,
                             const int64_t* id_offsets, const int64_t* value_offsets, int id_bytes,
                             size_t row_bytes, size_t value_align, int64_t num_rows, int threads,
                             std::vector<const void*>& rows) {
  if (id_bytes != 2 && id_bytes != 4 && id_bytes != 8)
    throw std::invalid_argument("sparsecomm: wire ids must be 2, 4 or 8 bytes");
  if (value_align == 0) value_align = 1;
  const auto base = reinterpret_cast<uintptr_t>(buffer);
  int64_t n = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    if (counts[s] < 0) throw std::invalid_argument("sparsecomm: negative segment row count");
    check_segment(s, id_offsets[s], counts[s] * id_bytes, buffer_bytes, static_cast<size_t>(id_bytes), base, "ids");
    check_segment(s, value_offsets[s], counts[s] * static_cast<int64_t>(row_bytes), buffer_bytes, value_align, base,
                  "value rows");
    n += counts[s];
  }
  std::vector<int64_t> ids(static_cast<size_t>(n));
  rows.resize(static_cast<size_t>(n));
  const char* buf = static_cast<const char*>(buffer);
  int64_t at = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const char* id_src = buf + id_offsets[s];
    const char* row_src = buf + value_offsets[s];
    const int64_t c = counts[s];
#pragma omp parallel for num_threads(clamp_threads(threads)) schedule(static)
    for (int64_t r = 0; r < c; ++r) {
      int64_t v;
      if (id_bytes == 2) v = reinterpret_cast<const int16_t*>(id_src)[r];
      else if (id_bytes == 4) v = reinterpret_cast<const int32_t*>(id_src)[r];
      else v = reinterpret_cast<const int64_t*>(id_src)[r];
      ids[at + r] = v;
      rows[at + r] = row_src + r * row_bytes;
    }
    at += c;
  }
  return group_rows(ids.data(), IndexType::kInt64, n, num_rows, threads);
}

void coalesce_segments_apply(const RowGroups& groups, const std::vector<const void*>& rows, ValueType vt,
                             int64_t d, void* out_ids, IndexType it, void* out_values, bool out_acc, int threads) {
  const int64_t u = groups.num_groups();
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, g, groups.group_id[g]);
  if (d == 0 || u == 0) return;
  SPARSECOMM_DISPATCH_VALUE(vt, [&] {
    using E = Elem<V>;
    using S = typename E::storage;
    auto row_at = [&](int64_t i) { return static_cast<const S*>(rows[i]); };
    if (out_acc) {
      using A = typename E::acc;
      A* out = static_cast<A*>(out_values);
      reduce_groups_with<V, A>(groups, row_at, d, [&](int64_t g) { return out + g * d; }, false, threads);
    } else {
      S* out = static_cast<S*>(out_values);
      reduce_groups_with<V, S>(groups, row_at, d, [&](int64_t g) { return out + g * d; }, false, threads);
    }
  });
}

}  // namespace sparsecomm
