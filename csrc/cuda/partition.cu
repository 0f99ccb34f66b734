// partition rows by owner on the GPU: each id's owner rank and the per-owner counts.
//
// The owner of an id comes from owner_map.h, the header the CPU kernels use
// too, so CPU and GPU ranks agree on owners bit for bit. The host side turns
// the owners into the stable permutation with torch.sort.
#include "common.cuh"
#include "owner_map.h"

namespace sparsecomm {

// Writes owners[i] for every id and adds the histogram to counts (zeroed by
// the caller). With block_bins, the block first counts in shared memory
// (num_owners 64-bit bins, sized by the launch) and then flushes one atomic
// per non-empty bin: hot owners under Zipf skew would otherwise serialise
// every thread of the grid on a few global counters. Integer counts make the
// result independent of the order the atomics land in.
template <typename IdT>
__device__ __forceinline__ void partition_owners(const IdT* __restrict__ ids, index_t n, const OwnerMap map,
                                                 int* __restrict__ owners,
                                                 unsigned long long* __restrict__ counts,
                                                 int block_bins) {
  extern __shared__ unsigned long long block_counts[];
  const index_t num_owners = map.num_owners;
  // block_bins is a kernel argument, the same for every thread: the
  // __syncthreads() under it are reached by the whole block or by none.
  if (block_bins) {
    for (index_t b = threadIdx.x; b < num_owners; b += blockDim.x) block_counts[b] = 0;
    __syncthreads();
  }
  for (index_t i = global_thread_index(); i < n; i += grid_stride()) {
    // Widened to int64 first, as the CPU kernel reads its ids.
    const long long owner = row_owner(static_cast<long long>(ids[i]), map);
    owners[i] = static_cast<int>(owner);
    atomicAdd(block_bins ? &block_counts[owner] : &counts[owner], 1ULL);
  }
  if (block_bins) {
    __syncthreads();
    for (index_t b = threadIdx.x; b < num_owners; b += blockDim.x) {
      if (block_counts[b] != 0) atomicAdd(&counts[b], block_counts[b]);
    }
  }
}

}  // namespace sparsecomm

// One entry point per id dtype: sparsecomm_partition_owners_<i32|i64>.
#define SPARSECOMM_DEFINE_PARTITION_OWNERS(ID_SUFFIX, IdT)                                       \
  extern "C" __global__ void sparsecomm_partition_owners_##ID_SUFFIX(                            \
      const IdT* __restrict__ ids, long long n, int scheme, long long num_owners,                \
      long long range_size, long long stride, int* __restrict__ owners,                          \
      unsigned long long* __restrict__ counts, int block_bins) {                                 \
    const sparsecomm::OwnerMap map = {scheme, num_owners, range_size, stride};                   \
    sparsecomm::partition_owners<IdT>(ids, n, map, owners, counts, block_bins);                  \
  }

SPARSECOMM_DEFINE_PARTITION_OWNERS(i32, int)
SPARSECOMM_DEFINE_PARTITION_OWNERS(i64, long long)
