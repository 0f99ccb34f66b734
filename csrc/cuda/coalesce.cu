// coalesce rows on the GPU: the per-id sums of value rows.
//
// The host side (sparsecomm/_cuda.py) sorts the ids stably and finds the runs
// of equal ids with torch; this kernel sums each run. One thread owns one
// (group, column) pair and walks the group's rows in input order, so the
// result is deterministic and bitwise equal to the CPU kernel. Neighbouring
// threads take neighbouring columns of the same rows: loads coalesce for any d.
#include "common.cuh"

namespace sparsecomm {

// out[g, :] = sum of values[order[k], :] for k in seg_start[g] .. seg_start[g + 1].
template <typename T>
__device__ __forceinline__ void coalesce_rows(const T* __restrict__ values,
                                              const index_t* __restrict__ order,
                                              const index_t* __restrict__ seg_start,
                                              index_t num_groups, index_t d, T* __restrict__ out) {
  const index_t total = num_groups * d;
  for (index_t t = global_thread_index(); t < total; t += grid_stride()) {
    const index_t g = t / d;
    const index_t col = t - g * d;
    out[t] = Accum<T>::store(reduce_group_column<T>(values, order, seg_start, g, col, d, 0));
  }
}

}  // namespace sparsecomm

// One entry point per value dtype: sparsecomm_coalesce_rows_<f32|f64|f16|bf16>.
#define SPARSECOMM_DEFINE_COALESCE_ROWS(SUFFIX, T)                                              \
  extern "C" __global__ void sparsecomm_coalesce_rows_##SUFFIX(                                 \
      const T* __restrict__ values, const long long* __restrict__ order,                        \
      const long long* __restrict__ seg_start, long long num_groups, long long d,               \
      T* __restrict__ out) {                                                                    \
    sparsecomm::coalesce_rows<T>(values, order, seg_start, num_groups, d, out);                 \
  }

SPARSECOMM_DEFINE_COALESCE_ROWS(f32, float)
SPARSECOMM_DEFINE_COALESCE_ROWS(f64, double)
SPARSECOMM_DEFINE_COALESCE_ROWS(f16, sparsecomm::half_bits)
SPARSECOMM_DEFINE_COALESCE_ROWS(bf16, sparsecomm::bf16_bits)
