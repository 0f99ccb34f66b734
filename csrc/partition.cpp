// partition rows by owner: a stable counting sort of rows by owner rank.
#include <cstring>
#include <vector>

#include "ops.h"

namespace sparsecomm {

int64_t row_owner(int64_t id, const OwnerMap& map) {
  uint64_t bucket;
  if (map.scheme == OwnerScheme::kHash) {
    // splitmix64 finalizer: spreads consecutive and Zipf-hot ids evenly over owners.
    uint64_t z = static_cast<uint64_t>(id) + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    bucket = z ^ (z >> 31);
  } else {
    bucket = static_cast<uint64_t>(id) / static_cast<uint64_t>(map.range_size);
  }
  return static_cast<int64_t>((bucket / static_cast<uint64_t>(map.stride)) % static_cast<uint64_t>(map.num_owners));
}

void partition_rows(const void* ids, IndexType it, int64_t n, const void* values, size_t row_bytes,
                    const OwnerMap& map, int64_t* counts, void* out_ids, void* out_values, int64_t* perm,
                    int threads) {
  if (map.num_owners < 1) throw std::invalid_argument("sparsecomm: num_owners must be >= 1");
  if (map.stride < 1) throw std::invalid_argument("sparsecomm: stride must be >= 1");
  if (map.scheme == OwnerScheme::kRange && map.range_size < 1)
    throw std::invalid_argument("sparsecomm: range_size must be >= 1");
  threads = clamp_threads(threads);
  check_ids(ids, it, n, -1, threads, "ids");
  const int64_t owners = map.num_owners;
  std::vector<int32_t> owner(static_cast<size_t>(n));
  std::vector<int64_t> hist(static_cast<size_t>(threads) * owners, 0);
  const size_t id_bytes = it == IndexType::kInt32 ? 4 : 8;
  const char* vsrc = static_cast<const char*>(values);
  char* vdst = static_cast<char*>(out_values);
  const char* isrc = static_cast<const char*>(ids);
  char* idst = static_cast<char*>(out_ids);
#pragma omp parallel num_threads(threads)
  {
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
#endif
    // Contiguous chunk per thread, scattered in chunk order: stable for any thread count.
    const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
    int64_t* h = hist.data() + static_cast<size_t>(t) * owners;
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t o = static_cast<int32_t>(row_owner(load_id(ids, it, i), map));
      owner[i] = o;
      ++h[o];
    }
#pragma omp barrier
#pragma omp single
    {
      int64_t sum = 0;
      for (int64_t o = 0; o < owners; ++o) {
        int64_t total = 0;
        for (int u = 0; u < threads; ++u) {
          int64_t& c = hist[static_cast<size_t>(u) * owners + o];
          const int64_t cnt = c;
          c = sum;
          sum += cnt;
          total += cnt;
        }
        counts[o] = total;
      }
    }
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t dst = h[owner[i]]++;
      std::memcpy(idst + dst * id_bytes, isrc + i * id_bytes, id_bytes);
      if (vdst) std::memcpy(vdst + dst * row_bytes, vsrc + i * row_bytes, row_bytes);
      if (perm) perm[dst] = i;
    }
  }
}

}  // namespace sparsecomm
