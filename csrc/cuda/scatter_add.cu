// scatter-add rows on the GPU: table[ids[i], :] += values[i, :], duplicates allowed.
//
// The host side groups the rows by id (stable sort + runs of equal ids, with
// torch). Each table row then belongs to exactly one group, so each (group,
// column) element is updated by one thread without atomics: the sum starts
// from the table's current value, adds the group's rows in input order
// (float32 for fp16/bf16) and rounds once. That makes the result
// deterministic and bitwise equal to the CPU kernel, unlike atomicAdd, whose
// order depends on scheduling. Groups of more than long_rows rows (hot ids)
// are left to a second launch, a block a group, staging its rows for the
// adding threads (common.cuh).
#include "common.cuh"

namespace sparsecomm {

// Where scatter-add puts the sum of (group g, column col): table[group_id[g], col],
// starting from its current value.
template <typename T, typename IdT>
struct TableRows {
  T* table;
  index_t num_rows;
  const IdT* group_id;
  index_t d;
  static const bool kAccumulate = true;
  __device__ __forceinline__ T* dst(index_t g, index_t col, index_t) const {
    const index_t row = static_cast<index_t>(group_id[g]);
    // sparsecomm/_library checks ids first; this only keeps a bad id from corrupting memory.
    if (row < 0 || row >= num_rows) return 0;
    return table + row * d + col;
  }
};

}  // namespace sparsecomm

// Two entry points per (value dtype, id dtype), launched one after the other:
// sparsecomm_scatter_add_rows_<f32|f64|f16|bf16>_<i32|i64> (the short groups)
// and sparsecomm_scatter_add_rows_long_<...>_<...> (the long ones, which the
// first lists in long_groups[0 .. *num_long), at most capacity).
#define SPARSECOMM_DEFINE_SCATTER_ADD_ROWS(SUFFIX, T, ID_SUFFIX, IdT)                              \
  extern "C" __global__ void sparsecomm_scatter_add_rows_##SUFFIX##_##ID_SUFFIX(                   \
      T* __restrict__ table, long long num_rows, const IdT* __restrict__ group_id,                 \
      const T* __restrict__ values, const long long* __restrict__ order,                           \
      const long long* __restrict__ seg_start, long long num_groups, long long d,                  \
      long long long_rows, long long* __restrict__ long_groups, long long* __restrict__ num_long,     \
      long long capacity) {                                                                        \
    const sparsecomm::TableRows<T, IdT> target = {table, num_rows, group_id, d};                   \
    sparsecomm::reduce_short_groups<T>(values, order, seg_start, num_groups, d, long_rows, long_groups, \
                                       num_long, capacity, target);                                \
  }                                                                                                \
  extern "C" __global__ void sparsecomm_scatter_add_rows_long_##SUFFIX##_##ID_SUFFIX(              \
      T* __restrict__ table, long long num_rows, const IdT* __restrict__ group_id,                 \
      const T* __restrict__ values, const long long* __restrict__ order,                           \
      const long long* __restrict__ seg_start, const long long* __restrict__ long_groups,          \
      const long long* __restrict__ num_long, long long capacity, long long d) {                   \
    const sparsecomm::TableRows<T, IdT> target = {table, num_rows, group_id, d};                   \
    sparsecomm::reduce_long_groups<T>(values, order, seg_start, long_groups, num_long, capacity, d, target); \
  }

#define SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(SUFFIX, T)   \
  SPARSECOMM_DEFINE_SCATTER_ADD_ROWS(SUFFIX, T, i32, int)       \
  SPARSECOMM_DEFINE_SCATTER_ADD_ROWS(SUFFIX, T, i64, long long)

SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(f32, float)
SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(f64, double)
SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(f16, sparsecomm::half_bits)
SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(bf16, sparsecomm::bf16_bits)
