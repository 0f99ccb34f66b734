// Stable parallel counting sort: the scatter step shared by the radix sort
// (row_groups.cpp) and the partition by owner (partition.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace sparsecomm {

// Moves every i in [0, n) to its slot in bucket key(i) (0 <= key < buckets),
// keeping input order inside a bucket: move(i, slot). Threads take contiguous
// chunks and scatter in chunk order, so the result is the same for any number
// of threads. The chunking uses the team OpenMP actually starts, which may be
// smaller than `threads` (OMP_DYNAMIC, OMP_THREAD_LIMIT, nesting).
// If `totals` is given, it receives the size of every bucket.
template <typename KeyFn, typename MoveFn>
void stable_counting_sort(int64_t n, int64_t buckets, int threads, KeyFn key, MoveFn move,
                          int64_t* totals = nullptr) {
  threads = clamp_threads(threads);
  std::vector<int64_t> hist(static_cast<size_t>(threads) * buckets, 0);
#pragma omp parallel num_threads(threads)
  {
    const auto [t, nt] = this_thread_team();
    const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
    int64_t* h = hist.data() + static_cast<size_t>(t) * buckets;
    for (int64_t i = lo; i < hi; ++i) ++h[key(i)];
#pragma omp barrier
#pragma omp single
    {
      int64_t sum = 0;
      for (int64_t b = 0; b < buckets; ++b) {
        const int64_t start = sum;
        for (int u = 0; u < nt; ++u) {
          int64_t& c = hist[static_cast<size_t>(u) * buckets + b];
          const int64_t cnt = c;
          c = sum;
          sum += cnt;
        }
        if (totals) totals[b] = sum - start;
      }
    }
    for (int64_t i = lo; i < hi; ++i) move(i, h[key(i)]++);
  }
}

}  // namespace sparsecomm
