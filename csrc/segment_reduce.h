// Sum of each group's rows, in input order, by one thread per group.
#pragma once

#include <vector>

#include "row_groups.h"

namespace sparsecomm {

// For every group g of `groups`: out_row = (accumulate ? out_row : 0) + sum of
// values[order[start[g]] .. order[start[g+1]-1]], summed left to right in the
// accumulator type of V (float for fp16/bf16) and rounded once. The output row
// is row g of `out`, or row group_id[g] when `out_by_id` (scatter-add into a table).
template <ValueType V>
void reduce_groups(const RowGroups& groups, const void* values, int64_t d, void* out, bool out_by_id,
                   bool accumulate, int threads) {
  using E = Elem<V>;
  using S = typename E::storage;
  using A = typename E::acc;
  const S* vals = static_cast<const S*>(values);
  S* dst = static_cast<S*>(out);
  const int64_t num_groups = groups.num_groups();
#pragma omp parallel num_threads(clamp_threads(threads))
  {
    std::vector<A> acc(static_cast<size_t>(d));
#pragma omp for schedule(dynamic, 64)
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t b = groups.group_start[g], e = groups.group_start[g + 1];
      S* o = dst + (out_by_id ? groups.group_id[g] : g) * d;
      int64_t k = b;
      if (accumulate) {
        for (int64_t j = 0; j < d; ++j) acc[j] = E::load(o[j]);
      } else {
        // Start from the first row, not zero, so a lone -0.0 stays -0.0.
        const S* src = vals + groups.order[k++] * d;
        for (int64_t j = 0; j < d; ++j) acc[j] = E::load(src[j]);
      }
      for (; k < e; ++k) {
        // Rows arrive in id order, i.e. scattered in memory: fetch ahead.
        if (k + 4 < e) __builtin_prefetch(vals + groups.order[k + 4] * d);
        const S* src = vals + groups.order[k] * d;
        if constexpr (std::is_same<S, A>::value) {
          A* a = acc.data();
          for (int64_t j = 0; j < d; ++j) a[j] += src[j];
        } else {
          for (int64_t j = 0; j < d; ++j) acc[j] += E::load(src[j]);
        }
      }
      for (int64_t j = 0; j < d; ++j) o[j] = E::store(acc[j]);
    }
  }
}

}  // namespace sparsecomm
