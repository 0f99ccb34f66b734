// gather rows on the GPU: out[i, :] = table[ids[i], :].
//
// A gather only moves bytes, so the kernels are typed by copy unit rather
// than by dtype: the host picks the widest unit (up to 16 bytes) that divides
// the row size and both base addresses, and one thread copies one unit. Wide
// units cut the number of memory instructions by up to 8x for fp16 rows.
#include "common.cuh"

namespace sparsecomm {

// 16-byte copy unit; uint4 comes with NVRTC's and nvcc's built-in vector types.
typedef uint4 bytes16;

template <typename UnitT, typename IdT>
__device__ __forceinline__ void gather_rows(const UnitT* __restrict__ table, index_t num_rows,
                                            const IdT* __restrict__ ids, index_t n,
                                            index_t row_units, UnitT* __restrict__ out) {
  const index_t total = n * row_units;
  for (index_t t = global_thread_index(); t < total; t += grid_stride()) {
    const index_t i = t / row_units;
    const index_t u = t - i * row_units;
    const index_t row = static_cast<index_t>(ids[i]);
    // sparsecomm/_library checks ids first; a bad one yields a zero row instead of a fault.
    if (row >= 0 && row < num_rows) {
      out[t] = table[row * row_units + u];
    } else {
      out[t] = UnitT();
    }
  }
}

}  // namespace sparsecomm

// One entry point per (copy unit, id dtype):
// sparsecomm_gather_rows_<u8|u16|u32|u64|u128>_<i32|i64>.
#define SPARSECOMM_DEFINE_GATHER_ROWS(UNIT_SUFFIX, UnitT, ID_SUFFIX, IdT)                        \
  extern "C" __global__ void sparsecomm_gather_rows_##UNIT_SUFFIX##_##ID_SUFFIX(                 \
      const UnitT* __restrict__ table, long long num_rows, const IdT* __restrict__ ids,          \
      long long n, long long row_units, UnitT* __restrict__ out) {                               \
    sparsecomm::gather_rows<UnitT, IdT>(table, num_rows, ids, n, row_units, out);                \
  }

#define SPARSECOMM_DEFINE_GATHER_ROWS_FOR_IDS(UNIT_SUFFIX, UnitT)  \
  SPARSECOMM_DEFINE_GATHER_ROWS(UNIT_SUFFIX, UnitT, i32, int)      \
  SPARSECOMM_DEFINE_GATHER_ROWS(UNIT_SUFFIX, UnitT, i64, long long)

SPARSECOMM_DEFINE_GATHER_ROWS_FOR_IDS(u8, unsigned char)
SPARSECOMM_DEFINE_GATHER_ROWS_FOR_IDS(u16, unsigned short)
SPARSECOMM_DEFINE_GATHER_ROWS_FOR_IDS(u32, unsigned int)
SPARSECOMM_DEFINE_GATHER_ROWS_FOR_IDS(u64, unsigned long long)
SPARSECOMM_DEFINE_GATHER_ROWS_FOR_IDS(u128, sparsecomm::bytes16)
