#include "row_groups.h"

#include "counting_sort.h"

#include <algorithm>
#include <climits>
#include <limits>

namespace sparsecomm {

IdRange id_range(const void* ids, IndexType it, int64_t n, int threads) {
  int64_t lo = std::numeric_limits<int64_t>::max();
  int64_t hi = std::numeric_limits<int64_t>::min();
  if (n == 0) return {0, -1};
#pragma omp parallel for num_threads(clamp_threads(threads)) reduction(min : lo) reduction(max : hi) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = load_id(ids, it, i);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  return {lo, hi};
}

IdRange check_ids(const void* ids, IndexType it, int64_t n, int64_t num_rows, int threads,
                  const char* what) {
  if (n < 0) throw std::invalid_argument(std::string("sparsecomm: ") + what + " has a negative length");
  const IdRange r = id_range(ids, it, n, threads);
  if (n > 0 && (r.min < 0 || (num_rows >= 0 && r.max >= num_rows))) {
    const int64_t bad = r.min < 0 ? r.min : r.max;
    throw std::invalid_argument(std::string("sparsecomm: ") + what + " contains id " +
                                std::to_string(bad) + " outside [0, " +
                                (num_rows >= 0 ? std::to_string(num_rows) : std::string("inf")) + ")");
  }
  return r;
}

namespace {

// One stable counting-sort pass over digit (key >> shift) & mask, moving
// (key, pos) pairs from src to dst.
template <typename K, typename P>
void radix_pass(const K* key_src, const P* pos_src, K* key_dst, P* pos_dst, int64_t n, int shift, K mask,
                int threads) {
  stable_counting_sort(
      n, static_cast<int64_t>(mask) + 1, threads, [&](int64_t i) { return static_cast<int64_t>((key_src[i] >> shift) & mask); },
      [&](int64_t i, int64_t dst) {
        key_dst[dst] = key_src[i];
        pos_dst[dst] = pos_src[i];
      });
}

// Scratch buffers reused across calls by the calling thread: fresh pages
// cost as much as the sort itself here (first-touch faults), so inputs up to
// kScratchCacheRows keep theirs; larger ones allocate and free per call.
constexpr int64_t kScratchCacheRows = int64_t{1} << 20;  // at most 32 MiB kept per thread

template <typename K, typename P>
struct RadixScratch {
  std::vector<K> keys, key_tmp;
  std::vector<P> pos, pos_tmp;
  void resize(int64_t n) {
    for (auto* v : {&keys, &key_tmp}) if (static_cast<int64_t>(v->size()) < n) v->resize(static_cast<size_t>(n));
    for (auto* v : {&pos, &pos_tmp}) if (static_cast<int64_t>(v->size()) < n) v->resize(static_cast<size_t>(n));
  }
};

// Stable LSD radix sort of positions by key = id - min, in <= 16-bit digits,
// then the group boundaries. K/P are 32-bit whenever the span and n allow:
// half the memory traffic.
template <typename K, typename P>
void radix_group(const void* ids, IndexType it, int64_t n, int64_t min_id, int bits, int threads, RowGroups& g) {
  thread_local RadixScratch<K, P> cached;
  RadixScratch<K, P> local;
  RadixScratch<K, P>& sc = n <= kScratchCacheRows ? cached : local;
  sc.resize(n);
  const int passes = (bits + 15) / 16;
  const int digit = (bits + passes - 1) / passes;
  const K mask = static_cast<K>((uint64_t{1} << digit) - 1);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    sc.keys[i] = static_cast<K>(load_id(ids, it, i) - min_id);
    sc.pos[i] = static_cast<P>(i);
  }
  K* ks = sc.keys.data(); P* ps = sc.pos.data();
  K* kd = sc.key_tmp.data(); P* pd = sc.pos_tmp.data();
  for (int p = 0; p < passes; ++p) {
    radix_pass(ks, ps, kd, pd, n, p * digit, mask, threads);
    std::swap(ks, kd);
    std::swap(ps, pd);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) g.order[i] = static_cast<int64_t>(ps[i]);
  g.group_id.push_back(static_cast<int64_t>(ks[0]) + min_id);
  for (int64_t i = 1; i < n; ++i) {
    if (ks[i] != ks[i - 1]) {
      g.group_start.push_back(i);
      g.group_id.push_back(static_cast<int64_t>(ks[i]) + min_id);
    }
  }
  g.group_start.push_back(n);
}

}  // namespace

RowGroups group_rows(const void* ids, IndexType it, int64_t n, int64_t num_rows, int threads) {
  threads = clamp_threads(threads);
  const IdRange r = check_ids(ids, it, n, num_rows, threads, "ids");
  RowGroups g;
  g.order.resize(static_cast<size_t>(n));
  g.group_start.push_back(0);
  if (n == 0) return g;

  const uint64_t span = static_cast<uint64_t>(r.max - r.min);
  int bits = 0;
  while (bits < 64 && (span >> bits) != 0) ++bits;

  if (n < 2048 || bits == 0) {
    // Small inputs: a comparison sort beats the histogram set-up.
    for (int64_t i = 0; i < n; ++i) g.order[i] = i;
    std::stable_sort(g.order.begin(), g.order.end(), [&](int64_t a, int64_t b) {
      return load_id(ids, it, a) < load_id(ids, it, b);
    });
    int64_t prev = load_id(ids, it, g.order[0]);
    g.group_id.push_back(prev);
    for (int64_t i = 1; i < n; ++i) {
      const int64_t cur = load_id(ids, it, g.order[i]);
      if (cur != prev) {
        g.group_start.push_back(i);
        g.group_id.push_back(cur);
        prev = cur;
      }
    }
    g.group_start.push_back(n);
  } else if (bits <= 32 && n <= INT32_MAX) {
    radix_group<uint32_t, uint32_t>(ids, it, n, r.min, bits, threads, g);
  } else {
    radix_group<uint64_t, int64_t>(ids, it, n, r.min, bits, threads, g);
  }
  return g;
}

}  // namespace sparsecomm
