// Which rank owns a row: the one owner map of the CPU and the CUDA kernels.
//
// owner(id) = (bucket(id) / stride) % num_owners, where bucket(id) is
// splitmix64(id) under the hash scheme, id / range_size under the range
// scheme, and the map's one parameter (the owner of the whole table, held in
// range_size) under the table scheme. Every rank evaluates the same arithmetic on the same id, on the CPU
// or on the GPU, so ranks agree on every row's owner without talking; keeping
// it in one file is what makes the two devices agree bit for bit.
//
// Included by the C++ kernels (through ops.h) and by csrc/cuda/partition.cu,
// which NVRTC compiles at run time (sparsecomm/_cuda.py inlines this file into
// the source it hands over). NVRTC has no system headers, so this file
// includes none and uses builtin types only. The scheme codes are the ones
// sparsecomm/ownership.py gives the schemes' names (checked by
// tests/test_ownership.py). A new scheme: its code here, a branch in
// owner_bucket and a case in owner_map_error.
#ifndef SPARSECOMM_OWNER_MAP_H_
#define SPARSECOMM_OWNER_MAP_H_

#if defined(__CUDACC__)
#define SPARSECOMM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPARSECOMM_HOST_DEVICE inline
#endif

#define SPARSECOMM_SCHEME_HASH 0
#define SPARSECOMM_SCHEME_RANGE 1
#define SPARSECOMM_SCHEME_TABLE 2

namespace sparsecomm {

// The parameters of the map, as the kernels receive them from Python.
struct OwnerMap {
  int scheme;            // SPARSECOMM_SCHEME_*
  long long num_owners;  // >= 1
  long long range_size;  // range: rows per bucket, >= 1; table: the owner of every row, >= 0; hash: unused
  long long stride;      // >= 1: consecutive buckets that map to one owner
};

// splitmix64 finalizer: spreads consecutive and Zipf-hot ids evenly over owners.
SPARSECOMM_HOST_DEVICE unsigned long long splitmix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Why `map` cannot be evaluated (an unknown scheme, or a size that would divide by zero), or nullptr.
SPARSECOMM_HOST_DEVICE const char* owner_map_error(const OwnerMap& map) {
  if (map.scheme != SPARSECOMM_SCHEME_HASH && map.scheme != SPARSECOMM_SCHEME_RANGE &&
      map.scheme != SPARSECOMM_SCHEME_TABLE)
    return "unknown partition scheme";
  if (map.num_owners < 1) return "num_owners must be >= 1";
  if (map.stride < 1) return "stride must be >= 1";
  if (map.scheme == SPARSECOMM_SCHEME_RANGE && map.range_size < 1) return "range_size must be >= 1";
  if (map.scheme == SPARSECOMM_SCHEME_TABLE && map.range_size < 0) return "the table scheme's owner must be >= 0";
  return nullptr;
}

// The bucket of an id (read as unsigned 64 bits) under the map's scheme.
SPARSECOMM_HOST_DEVICE unsigned long long owner_bucket(unsigned long long key, const OwnerMap& map) {
  if (map.scheme == SPARSECOMM_SCHEME_HASH) return splitmix64(key);
  if (map.scheme == SPARSECOMM_SCHEME_TABLE) return static_cast<unsigned long long>(map.range_size);
  return key / static_cast<unsigned long long>(map.range_size);  // SPARSECOMM_SCHEME_RANGE
}

// The owner of a non-negative id, in [0, num_owners), for a map owner_map_error accepts.
SPARSECOMM_HOST_DEVICE long long row_owner(long long id, const OwnerMap& map) {
  const unsigned long long bucket = owner_bucket(static_cast<unsigned long long>(id), map);
  return static_cast<long long>((bucket / static_cast<unsigned long long>(map.stride)) %
                                static_cast<unsigned long long>(map.num_owners));
}

}  // namespace sparsecomm

#endif  // SPARSECOMM_OWNER_MAP_H_
