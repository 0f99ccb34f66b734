// Sum of each group's rows, in input order, by one thread per group.
#pragma once

#include <type_traits>
#include <vector>

#include "row_groups.h"

namespace sparsecomm {

// For every group g of `groups`: out_row(g) = (accumulate ? out_row(g) : 0) +
// the rows row_at(order[start[g]]) .. row_at(order[start[g+1]-1]), summed left
// to right in the accumulator type of V (float for fp16/bf16) and rounded once.
// row_at(i) is the address of input row i (storage type of V); out_row(g) the
// address of group g's output row, of type O: the storage type of V, or its
// accumulator type when the caller keeps full precision (an owner summing
// fp16 rows in float32 before dividing by the world size).
template <ValueType V, typename O, typename RowAt, typename OutRow>
void reduce_groups_with(const RowGroups& groups, RowAt row_at, int64_t d, OutRow out_row, bool accumulate,
                        int threads) {
  using E = Elem<V>;
  using S = typename E::storage;
  using A = typename E::acc;
  static_assert(std::is_same<O, S>::value || std::is_same<O, A>::value, "output is storage or accumulator");
  const int64_t num_groups = groups.num_groups();
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(S));
  constexpr int64_t kPrefetchRows = 8;
  constexpr int64_t kPrefetchGroups = 4;
  auto load = [](O x) -> A { if constexpr (std::is_same<O, S>::value) return E::load(x); else return x; };
  auto store = [](A x) -> O { if constexpr (std::is_same<O, S>::value) return E::store(x); else return x; };
#pragma omp parallel num_threads(clamp_threads(threads))
  {
    std::vector<A> acc(static_cast<size_t>(d));
#pragma omp for schedule(dynamic, 64)
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t b = groups.group_start[g], e = groups.group_start[g + 1];
      if (g + kPrefetchGroups < num_groups) {  // most groups of skewed ids are one row: fetch the next ones early
        const char* ahead = reinterpret_cast<const char*>(row_at(groups.order[groups.group_start[g + kPrefetchGroups]]));
        for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(ahead + byte);
      }
      O* o = out_row(g);
      int64_t k = b;
      A* a = acc.data();
      if (accumulate) {
        for (int64_t j = 0; j < d; ++j) a[j] = load(o[j]);
      } else if (e - b == 1) {
        // A lone row: converted straight through, the common case for skewed ids.
        const S* src = row_at(groups.order[k]);
        for (int64_t j = 0; j < d; ++j) o[j] = store(E::load(src[j]));
        continue;
      } else {
        // Start from the first row, not zero, so a lone -0.0 stays -0.0.
        const S* src = row_at(groups.order[k++]);
        for (int64_t j = 0; j < d; ++j) a[j] = E::load(src[j]);
      }
      for (; k < e; ++k) {
        // Rows arrive in id order, i.e. scattered in memory: fetch every cache line of a row a few rows ahead.
        if (k + kPrefetchRows < e) {
          const char* ahead = reinterpret_cast<const char*>(row_at(groups.order[k + kPrefetchRows]));
          for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(ahead + byte);
        }
        const S* src = row_at(groups.order[k]);
        if constexpr (std::is_same<S, A>::value) {
          for (int64_t j = 0; j < d; ++j) a[j] += src[j];
        } else {
          for (int64_t j = 0; j < d; ++j) a[j] += E::load(src[j]);
        }
      }
      for (int64_t j = 0; j < d; ++j) o[j] = store(a[j]);
    }
  }
}

// The common case: input rows back to back in `values`; output row g of `out`,
// or row group_id[g] when `out_by_id` (scatter-add into a table).
template <ValueType V>
void reduce_groups(const RowGroups& groups, const void* values, int64_t d, void* out, bool out_by_id,
                   bool accumulate, int threads) {
  using S = typename Elem<V>::storage;
  const S* vals = static_cast<const S*>(values);
  S* dst = static_cast<S*>(out);
  reduce_groups_with<V, S>(
      groups, [&](int64_t i) { return vals + i * d; }, d,
      [&](int64_t g) { return dst + (out_by_id ? groups.group_id[g] : g) * d; }, accumulate, threads);
}

}  // namespace sparsecomm
