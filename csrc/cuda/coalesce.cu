// coalesce rows on the GPU: the per-id sums of value rows.
//
// The host side (sparsecomm/_cuda.py) sorts the ids stably and finds the runs
// of equal ids with torch; this kernel sums each run. Each (group, column)
// pair is summed by one thread, over the group's rows in input order, so the
// result is deterministic and bitwise equal to the CPU kernel. Neighbouring
// threads take neighbouring columns of the same rows: loads coalesce for any
// d. Groups of more than long_rows rows (hot ids) are left to a second
// launch, a block a group, staging its rows for the adding threads
// (common.cuh).
#include "common.cuh"

namespace sparsecomm {

// Where coalesce puts the sum of (group g, column col): out[g, col], starting
// from the group's first row.
template <typename T>
struct GroupSums {
  T* out;
  static const bool kAccumulate = false;
  __device__ __forceinline__ T* dst(index_t, index_t, index_t t) const { return out + t; }
};


}  // namespace sparsecomm

// out[g, :] = sum of values[order[k], :] for k in seg_start[g] .. seg_start[g + 1]:
// two entry points per value dtype, launched one after the other,
// sparsecomm_coalesce_rows_<f32|f64|f16|bf16> (the short groups) and
// sparsecomm_coalesce_rows_long_<f32|f64|f16|bf16> (the long ones, which
// the first lists in long_groups[0 .. *num_long), at most capacity).
#define SPARSECOMM_DEFINE_COALESCE_ROWS(SUFFIX, T)                                              \
  extern "C" __global__ void sparsecomm_coalesce_rows_##SUFFIX(                                 \
      const T* __restrict__ values, const long long* __restrict__ order,                        \
      const long long* __restrict__ seg_start, long long num_groups, long long d,               \
      long long long_rows, long long* __restrict__ long_groups, long long* __restrict__ num_long,  \
      long long capacity, T* __restrict__ out) {                                                \
    const sparsecomm::GroupSums<T> target = {out};                                              \
    sparsecomm::reduce_short_groups<T>(values, order, seg_start, num_groups, d, long_rows, long_groups, \
                                       num_long, capacity, target);                             \
  }                                                                                             \
  extern "C" __global__ void sparsecomm_coalesce_rows_long_##SUFFIX(                            \
      const T* __restrict__ values, const long long* __restrict__ order,                        \
      const long long* __restrict__ seg_start, const long long* __restrict__ long_groups,       \
      const long long* __restrict__ num_long, long long capacity, long long d,                  \
      T* __restrict__ out) {                                                                    \
    const sparsecomm::GroupSums<T> target = {out};                                              \
    sparsecomm::reduce_long_groups<T>(values, order, seg_start, long_groups, num_long, capacity, d, target); \
  }

SPARSECOMM_DEFINE_COALESCE_ROWS(f32, float)
SPARSECOMM_DEFINE_COALESCE_ROWS(f64, double)
SPARSECOMM_DEFINE_COALESCE_ROWS(f16, sparsecomm::half_bits)
SPARSECOMM_DEFINE_COALESCE_ROWS(bf16, sparsecomm::bf16_bits)
