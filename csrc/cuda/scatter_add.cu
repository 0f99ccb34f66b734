// scatter-add rows on the GPU: table[ids[i], :] += values[i, :], duplicates allowed.
//
// The host side groups the rows by id (stable sort + runs of equal ids, with
// torch). Each table row then belongs to exactly one group, so one thread per
// (group, column) updates it without atomics: the sum starts from the table's
// current value, adds the group's rows in input order (float32 for fp16/bf16)
// and rounds once. That makes the result deterministic and bitwise equal to
// the CPU kernel, unlike atomicAdd, whose order depends on scheduling.
#include "common.cuh"

namespace sparsecomm {

template <typename T, typename IdT>
__device__ __forceinline__ void scatter_add_rows(T* __restrict__ table, index_t num_rows,
                                                 const IdT* __restrict__ group_id,
                                                 const T* __restrict__ values,
                                                 const index_t* __restrict__ order,
                                                 const index_t* __restrict__ seg_start,
                                                 index_t num_groups, index_t d) {
  const index_t total = num_groups * d;
  for (index_t t = global_thread_index(); t < total; t += grid_stride()) {
    const index_t g = t / d;
    const index_t col = t - g * d;
    const index_t row = static_cast<index_t>(group_id[g]);
    // sparsecomm/_library checks ids first; this only keeps a bad id from corrupting memory.
    if (row < 0 || row >= num_rows) continue;
    T* dst = table + row * d + col;
    *dst = Accum<T>::store(reduce_group_column<T>(values, order, seg_start, g, col, d, dst));
  }
}

}  // namespace sparsecomm

// One entry point per (value dtype, id dtype):
// sparsecomm_scatter_add_rows_<f32|f64|f16|bf16>_<i32|i64>.
#define SPARSECOMM_DEFINE_SCATTER_ADD_ROWS(SUFFIX, T, ID_SUFFIX, IdT)                         \
  extern "C" __global__ void sparsecomm_scatter_add_rows_##SUFFIX##_##ID_SUFFIX(              \
      T* __restrict__ table, long long num_rows, const IdT* __restrict__ group_id,            \
      const T* __restrict__ values, const long long* __restrict__ order,                      \
      const long long* __restrict__ seg_start, long long num_groups, long long d) {           \
    sparsecomm::scatter_add_rows<T, IdT>(table, num_rows, group_id, values, order, seg_start, \
                                         num_groups, d);                                      \
  }

#define SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(SUFFIX, T)   \
  SPARSECOMM_DEFINE_SCATTER_ADD_ROWS(SUFFIX, T, i32, int)       \
  SPARSECOMM_DEFINE_SCATTER_ADD_ROWS(SUFFIX, T, i64, long long)

SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(f32, float)
SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(f64, double)
SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(f16, sparsecomm::half_bits)
SPARSECOMM_DEFINE_SCATTER_ADD_ROWS_FOR_IDS(bf16, sparsecomm::bf16_bits)
