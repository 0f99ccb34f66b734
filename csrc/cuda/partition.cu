// partition rows by owner on the GPU: each id's owner rank and the per-owner counts.
//
// owner(id) = (bucket(id) / stride) % num_owners, with bucket = splitmix64(id)
// (scheme 0, hash) or id / range_size (scheme 1, range): the same map as
// csrc/partition.cpp, bit for bit, so CPU and GPU ranks agree on owners. The
// host side turns the owners into the stable permutation with torch.sort.
#include "common.cuh"

namespace sparsecomm {

// splitmix64 finalizer: spreads consecutive and Zipf-hot ids evenly over owners.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Writes owners[i] for every id and adds the histogram to counts (zeroed by
// the caller). With block_bins, the block first counts in shared memory
// (num_owners 64-bit bins, sized by the launch) and then flushes one atomic
// per non-empty bin: hot owners under Zipf skew would otherwise serialise
// every thread of the grid on a few global counters. Integer counts make the
// result independent of the order the atomics land in.
template <typename IdT>
__device__ __forceinline__ void partition_owners(const IdT* __restrict__ ids, index_t n, int scheme,
                                                 index_t num_owners, index_t range_size,
                                                 index_t stride, int* __restrict__ owners,
                                                 unsigned long long* __restrict__ counts,
                                                 int block_bins) {
  extern __shared__ unsigned long long block_counts[];
  const unsigned long long owners_u = static_cast<unsigned long long>(num_owners);
  const unsigned long long range_u = static_cast<unsigned long long>(range_size);
  const unsigned long long stride_u = static_cast<unsigned long long>(stride);
  // block_bins is a kernel argument, the same for every thread: the
  // __syncthreads() under it are reached by the whole block or by none.
  if (block_bins) {
    for (index_t b = threadIdx.x; b < num_owners; b += blockDim.x) block_counts[b] = 0;
    __syncthreads();
  }
  for (index_t i = global_thread_index(); i < n; i += grid_stride()) {
    // Widen to int64, then reinterpret as uint64, as the CPU kernel does.
    const unsigned long long key =
        static_cast<unsigned long long>(static_cast<long long>(ids[i]));
    const unsigned long long bucket = scheme == 0 ? splitmix64(key) : key / range_u;
    const unsigned long long owner = (bucket / stride_u) % owners_u;
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
    sparsecomm::partition_owners<IdT>(ids, n, scheme, num_owners, range_size, stride, owners,    \
                                      counts, block_bins);                                       \
  }

SPARSECOMM_DEFINE_PARTITION_OWNERS(i32, int)
SPARSECOMM_DEFINE_PARTITION_OWNERS(i64, long long)
