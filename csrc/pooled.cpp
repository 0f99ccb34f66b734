// Index kernels of owner pooling (a sharded bag lookup that sends each owner its distinct ids and partial
// bags): group_by, bag_groups, unique_inverse and pooled_request. They replace per-owner torch.unique calls,
// unique_consecutive, argsort and repeat_interleave with one pass or two.
//
// Outputs equal the torch reference exactly (sparsecomm/ops documents it): a stable counting sort is argsort(stable)
// by construction, and the distinct ids come out ascending with each id's index among them. Every input is
// checked before anything is written, and no result depends on the thread count (scatters are stable
// counting sorts over chunks in order; marks are idempotent ORs).
#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "binding.h"
#include "counting_sort.h"
#include "ops.h"
#include "row_groups.h"

namespace sparsecomm {

namespace {

// Distinct ids by a bitmap over [min, max] when it has at most this many 64-bit words per id: marking, one
// scan of the words and a popcount per id cost less than a radix sort's passes. Over 1M rows that is any
// n >= ~4k (16k words); over 1e8 rows (1.6M words) the sort runs below ~400k ids. A sparser bitmap misses
// the cache on every word; the bitmap's edge is the hot, clustered ids of a skewed draw.
constexpr int64_t kBitmapWordsPerId = 4;
// Bitmaps (and their prefix counts) up to this many words stay allocated in the calling thread: fresh pages
// cost a fault per 4 KiB, more than the scan itself.
constexpr int64_t kBitmapCacheWords = int64_t{1} << 18;  // 2 MiB of bits + 2 MiB of counts

struct BitmapScratch {
  std::vector<uint64_t> bits;
  std::vector<int64_t> before;  // set bits in the words before each word
};

// Population counts: the portable x86-64 target has no popcnt instruction, and the library call GCC emits
// instead makes the bitmap's prefix and rank loops several times slower. The loops are compiled twice, with and
// without the instruction, and the CPU picks (every x86-64 CPU since 2008 has it).
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SPARSECOMM_POPCNT_TARGET __attribute__((target("popcnt")))
inline bool hardware_popcount() { return __builtin_cpu_supports("popcnt"); }
#else
#define SPARSECOMM_POPCNT_TARGET
inline bool hardware_popcount() { return false; }
#endif

// before[w] = set bits in words [0, w); returns the total.
__attribute__((always_inline)) inline int64_t count_before_body(const uint64_t* bits, int64_t m, int64_t* before) {
  int64_t total = 0;
  for (int64_t w = 0; w < m; ++w) {
    before[w] = total;
    total += __builtin_popcountll(bits[w]);
  }
  return total;
}

// inverse[i] = rank of ids[i] among the set bits (ids[a:e]).
template <typename I>
__attribute__((always_inline)) inline void rank_body(const int64_t* ids, int64_t a, int64_t e, int64_t lo,
                                                     const uint64_t* bits, const int64_t* before, I* inverse) {
  for (int64_t i = a; i < e; ++i) {
    const int64_t x = ids[i] - lo;
    const uint64_t below = bits[x >> 6] & ((uint64_t{1} << (x & 63)) - 1);
    inverse[i] = static_cast<I>(before[x >> 6] + __builtin_popcountll(below));
  }
}

SPARSECOMM_POPCNT_TARGET int64_t count_before_hw(const uint64_t* bits, int64_t m, int64_t* before) {
  return count_before_body(bits, m, before);
}

template <typename I>
SPARSECOMM_POPCNT_TARGET void rank_hw(const int64_t* ids, int64_t a, int64_t e, int64_t lo, const uint64_t* bits,
                                      const int64_t* before, I* inverse) {
  rank_body(ids, a, e, lo, bits, before, inverse);
}

// The distinct ids of ids[0:n] (checked in range already, r their min and max), ascending, and each id's
// index among them. `inverse` may be int64 or int32 (I).
template <typename I>
void distinct_with_inverse(const int64_t* ids, int64_t n, IdRange r, std::vector<int64_t>& unique, I* inverse,
                           int threads) {
  unique.clear();
  if (n == 0) return;
  const uint64_t span = static_cast<uint64_t>(r.max - r.min) + 1;  // r.min >= 0: no overflow
  const uint64_t words = (span + 63) / 64;
  if (words > static_cast<uint64_t>(kBitmapWordsPerId) * static_cast<uint64_t>(n)) {
    // Wide range: a stable radix sort of the positions by id (group_rows), then each group's index.
    const RowGroups g = group_rows(ids, IndexType::kInt64, n, -1, threads);
    unique = g.group_id;
    const int64_t groups = g.num_groups();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < groups; ++k)
      for (int64_t j = g.group_start[k]; j < g.group_start[k + 1]; ++j) inverse[g.order[j]] = static_cast<I>(k);
    return;
  }
  const int64_t m = static_cast<int64_t>(words);
  thread_local BitmapScratch cached;
  BitmapScratch local;
  BitmapScratch& sc = m <= kBitmapCacheWords ? cached : local;
  if (static_cast<int64_t>(sc.bits.size()) < m) {
    sc.bits.resize(static_cast<size_t>(m));
    sc.before.resize(static_cast<size_t>(m));
  }
  uint64_t* bits = sc.bits.data();
  int64_t* before = sc.before.data();
  const int64_t lo = r.min;
  const bool hw = hardware_popcount();
  std::memset(bits, 0, static_cast<size_t>(m) * sizeof(uint64_t));
  if (threads > 1) {
    // Several ids may set bits of one word: atomic ORs (the result is the same in any order).
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t x = ids[i] - lo;
      __atomic_fetch_or(&bits[x >> 6], uint64_t{1} << (x & 63), __ATOMIC_RELAXED);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t x = ids[i] - lo;
      bits[x >> 6] |= uint64_t{1} << (x & 63);
    }
  }
  const int64_t total = hw ? count_before_hw(bits, m, before) : count_before_body(bits, m, before);
  unique.resize(static_cast<size_t>(total));
  int64_t* u = unique.data();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t w = 0; w < m; ++w) {
    uint64_t b = bits[w];
    int64_t k = before[w];
    while (b) {
      u[k++] = lo + w * 64 + __builtin_ctzll(b);
      b &= b - 1;
    }
  }
#pragma omp parallel num_threads(threads)
  {
    const auto [t, nt] = this_thread_team();
    const int64_t a = n * t / nt, e = n * (t + 1) / nt;
    if (hw) rank_hw(ids, a, e, lo, bits, before, inverse);
    else rank_body(ids, a, e, lo, bits, before, inverse);
  }
}

void check_length(int64_t n, const char* what) {
  if (n < 0) throw std::invalid_argument(std::string("sparsecomm: ") + what + " has a negative length");
}

// Checks bag_of[0:n] is non-decreasing in [0, num_bags) (num_bags < 0: no bound), naming the first bad entry.
void check_bags(const int64_t* bag_of, int64_t n, int64_t num_bags) {
  const int64_t bound = num_bags >= 0 ? num_bags : INT64_MAX;
  // Non-decreasing, first >= 0 and last < bound: then all lie in range.
  bool bad = n > 0 && (bag_of[0] < 0 || bag_of[n - 1] >= bound);
  int64_t drops = 0;
  for (int64_t i = 1; i < n; ++i) drops += bag_of[i] < bag_of[i - 1];
  bad |= drops != 0;
  if (!bad) return;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = bag_of[i];
    if (i > 0 && b < bag_of[i - 1])
      throw std::invalid_argument("sparsecomm: bag_of must be non-decreasing: bag_of[" + std::to_string(i) +
                                  "] = " + std::to_string(b) + " < bag_of[" + std::to_string(i - 1) +
                                  "] = " + std::to_string(bag_of[i - 1]));
    if (b < 0 || b >= bound)
      throw std::invalid_argument("sparsecomm: bag_of contains bag " + std::to_string(b) + " outside [0, " +
                                  (num_bags >= 0 ? std::to_string(num_bags) : std::string("inf")) + ")");
  }
}

// pooled_request's scratch, kept by the calling thread between calls (a training step makes the same call
// every step: fresh pages would cost a fault per 4 KiB).
constexpr int64_t kPooledCacheRows = int64_t{1} << 20;  // up to ~24 MiB kept per calling thread
struct PooledScratch {
  std::vector<int64_t> distinct, start, bag_rows;
  std::vector<int32_t> inv, owner, local, run_start;
};

// Group sizes -> where each group starts (an exclusive prefix sum, in place).
void counts_to_starts(int64_t* counts, int64_t size) {
  int64_t sum = 0;
  for (int64_t g = 0; g < size; ++g) {
    const int64_t c = counts[g];
    counts[g] = sum;
    sum += c;
  }
}

}  // namespace

// Stable counting sort of positions by index (in [0, size)): order (n) = argsort(index, stable=True),
// offsets (size) = where each group starts (cumsum(bincount) - bincount).
void group_by(const int64_t* index, int64_t n, int64_t size, int64_t* order, int64_t* offsets, int threads) {
  check_length(n, "index");
  if (size < 0) throw std::invalid_argument("sparsecomm: group_by: size must be >= 0, got " + std::to_string(size));
  threads = clamp_threads(threads);
  check_ids(index, IndexType::kInt64, n, size, threads, "index");
  if (size == 0) return;  // then n == 0 (checked): nothing to write
  // One histogram per thread of `size` buckets: more threads only pay when the groups are few.
  if (size > n) threads = 1;
  stable_counting_sort(
      n, size, threads, [&](int64_t i) { return index[i]; }, [&](int64_t i, int64_t dst) { order[dst] = i; },
      offsets);
  counts_to_starts(offsets, size);
}

// The owner's backward plan of pooled lookups: occurrence i (bag b(i): lengths are consecutive runs of the
// n occurrences) points at requested id positions[i] (in [0, r)), whose group is key[positions[i]] (in
// [0, size)). order (n) = argsort(key[positions], stable=True), rows (n) = b(order), offsets (size) = where
// each group starts: group g's gradient is the sum of the bag gradients rows[offsets[g]:...].
void bag_groups(const int64_t* key, int64_t r, const int64_t* positions, int64_t n, const int64_t* lengths,
                int64_t num_bags, int64_t size, int64_t* order, int64_t* rows, int64_t* offsets, int threads) {
  check_length(r, "key");
  check_length(n, "positions");
  check_length(num_bags, "lengths");
  if (size < 0) throw std::invalid_argument("sparsecomm: bag_groups: size must be >= 0, got " + std::to_string(size));
  threads = clamp_threads(threads);
  check_ids(key, IndexType::kInt64, r, size, threads, "key");
  check_ids(positions, IndexType::kInt64, n, r, threads, "positions");
  int64_t total = 0;
  for (int64_t b = 0; b < num_bags; ++b) {
    if (lengths[b] < 0 || lengths[b] > n - total)
      throw std::invalid_argument("sparsecomm: bag_groups: lengths must be >= 0 and add up to the " +
                                  std::to_string(n) + " positions; bag " + std::to_string(b) + " has " +
                                  std::to_string(lengths[b]) + " after " + std::to_string(total));
    total += lengths[b];
  }
  if (total != n)
    throw std::invalid_argument("sparsecomm: bag_groups: lengths add up to " + std::to_string(total) + ", not the " +
                                std::to_string(n) + " positions");
  if (size == 0) return;  // then r == 0, so n == 0 (checked): nothing to write
  std::vector<int64_t> bag_of(static_cast<size_t>(n));
  for (int64_t b = 0, i = 0; b < num_bags; ++b)
    for (int64_t k = 0; k < lengths[b]; ++k) bag_of[static_cast<size_t>(i++)] = b;
  if (size > n) threads = 1;  // one histogram of `size` buckets per thread
  stable_counting_sort(
      n, size, threads, [&](int64_t i) { return key[positions[i]]; },
      [&](int64_t i, int64_t dst) {
        order[dst] = i;
        rows[dst] = bag_of[static_cast<size_t>(i)];
      },
      offsets);
  counts_to_starts(offsets, size);
}

// torch.unique(ids, sorted=True, return_inverse=True): the distinct ids ascending, and each id's index among
// them (inverse, n). num_rows < 0: no upper bound.
void unique_inverse(const int64_t* ids, int64_t n, int64_t num_rows, std::vector<int64_t>& unique,
                    int64_t* inverse, int threads) {
  check_length(n, "ids");
  threads = clamp_threads(threads);
  const IdRange r = check_ids(ids, IndexType::kInt64, n, num_rows, threads, "ids");
  distinct_with_inverse(ids, n, r, unique, inverse, threads);
}

// The data-sized outputs of pooled_request.
struct PooledLists {
  std::vector<int64_t> unique;    // per owner its distinct ids ascending, owners in order
  std::vector<int64_t> bag_rows;  // the bag of each partial bag, grouped by owner
  std::vector<int32_t> lengths;   // occurrences per partial bag
};

// The requester side of owner pooling. Occurrences sorted stably by owner (order, occ_counts: partition_rows'
// perm and counts); per owner its distinct ids (out.unique, unique_counts) and each occurrence's index among
// them (positions, in `order` order); the runs of one bag inside an owner's occurrences (out.bag_rows,
// out.lengths, bag_counts per owner). bag_of must be non-decreasing in [0, num_bags) (num_bags < 0: no bound).
void pooled_request(const int64_t* ids, const int64_t* bag_of, int64_t n, int64_t num_rows, int64_t num_bags,
                    const OwnerMap& map, int64_t* unique_counts, int64_t* order, int64_t* occ_counts,
                    int32_t* positions, int64_t* bag_counts, PooledLists& out, int threads) {
  check_owner_map(map);
  check_length(n, "ids");
  if (n > INT32_MAX)
    throw std::invalid_argument("sparsecomm: pooled_request: more than 2^31 - 1 ids (positions are int32)");
  threads = clamp_threads(threads);
  const IdRange r = check_ids(ids, IndexType::kInt64, n, num_rows, threads, "ids");
  check_bags(bag_of, n, num_bags);
  const int64_t owners = map.num_owners;
  // An owner's distinct ids are the distinct ids of all owners that it owns: one distinct pass over
  // everything, then the distinct ids (ascending) grouped by owner keep their order inside an owner.
  thread_local PooledScratch cached;
  PooledScratch uncached;
  PooledScratch& sc = n <= kPooledCacheRows ? cached : uncached;
  std::vector<int64_t>& distinct = sc.distinct;
  sc.inv.resize(static_cast<size_t>(n));
  int32_t* inv = sc.inv.data();
  distinct_with_inverse(ids, n, r, distinct, inv, threads);
  const int64_t u = static_cast<int64_t>(distinct.size());
  sc.owner.resize(static_cast<size_t>(u));
  sc.local.resize(static_cast<size_t>(u));
  int32_t* owner = sc.owner.data();
  int32_t* local = sc.local.data();  // index of each distinct id among its owner's
  // Owners of the ascending distinct ids. Under the range scheme an id's owner is its bucket's
  // (id / range_size): row_owner is called once per bucket met instead of once per id.
  if (map.scheme == SPARSECOMM_SCHEME_RANGE) {
    int64_t bucket_end = -1, o = 0;
    for (int64_t g = 0; g < u; ++g) {
      const int64_t id = distinct[g];
      if (id >= bucket_end) {
        o = row_owner(id, map);
        const int64_t bucket = id / map.range_size;
        bucket_end = bucket >= INT64_MAX / map.range_size - 1 ? INT64_MAX : (bucket + 1) * map.range_size;
      }
      owner[g] = static_cast<int32_t>(o);
    }
  } else {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < u; ++g) owner[g] = static_cast<int32_t>(row_owner(distinct[g], map));
  }
  out.unique.resize(static_cast<size_t>(u));
  int64_t* out_unique = out.unique.data();
  stable_counting_sort(
      u, owners, 1, [&](int64_t g) { return static_cast<int64_t>(owner[g]); },
      [&](int64_t g, int64_t dst) {
        out_unique[dst] = distinct[g];
        local[g] = static_cast<int32_t>(dst);
      },
      unique_counts);
  sc.start.assign(static_cast<size_t>(owners) + 1, 0);
  int64_t* start = sc.start.data();
  for (int64_t o = 0; o < owners; ++o) start[o + 1] = start[o] + unique_counts[o];
  for (int64_t g = 0; g < u; ++g) local[g] -= static_cast<int32_t>(start[owner[g]]);
  // Occurrences by owner, stably (partition_rows' perm): each one's position among its owner's distinct ids.
  if (threads == 1) {
    // One thread: the counting sort without its per-thread tables, on restrict pointers.
    // One thread, four quarters of the input sorted as four threads would be (each quarter's occurrences
    // after the previous quarters' in every owner), in one interleaved loop: with few owners, a single
    // cursor's increments would each wait on the last.
    const int64_t q = n / 4;
    sc.start.assign(static_cast<size_t>(owners) * 4, 0);
    int64_t* __restrict h = sc.start.data();  // h[k * owners + o]: occurrences of owner o in quarter k
    int64_t* h1 = h + owners;
    int64_t* h2 = h + 2 * owners;
    int64_t* h3 = h + 3 * owners;
    for (int64_t k = 0; k < q; ++k) {
      ++h[owner[inv[k]]];
      ++h1[owner[inv[q + k]]];
      ++h2[owner[inv[2 * q + k]]];
      ++h3[owner[inv[3 * q + k]]];
    }
    for (int64_t i = 4 * q; i < n; ++i) ++h3[owner[inv[i]]];  // the last quarter's tail
    int64_t sum = 0;
    for (int64_t o = 0; o < owners; ++o) {
      occ_counts[o] = h[o] + h1[o] + h2[o] + h3[o];
      for (int64_t k = 0; k < 4; ++k) {
        const int64_t c = h[k * owners + o];
        h[k * owners + o] = sum;
        sum += c;
      }
    }
    int64_t* __restrict ord = order;
    int32_t* __restrict pos = positions;
    const auto place = [&](int64_t* cursor, int64_t i) {
      const int32_t g = inv[i];
      const int64_t dst = cursor[owner[g]]++;
      ord[dst] = i;
      pos[dst] = local[g];
    };
    for (int64_t k = 0; k < q; ++k) {
      place(h, k);
      place(h1, q + k);
      place(h2, 2 * q + k);
      place(h3, 3 * q + k);
    }
    for (int64_t i = 4 * q; i < n; ++i) place(h3, i);
  } else {
    stable_counting_sort(
        n, owners, threads, [&](int64_t i) { return static_cast<int64_t>(owner[inv[i]]); },
        [&](int64_t i, int64_t dst) {
          order[dst] = i;
          positions[dst] = local[inv[i]];
        },
        occ_counts);
  }
  // Partial bags: runs of one bag inside an owner's occurrences (bag order is kept: the sort is stable).
  // At most one per occurrence: scratch of n + 1, then copied to their exact size. Branch-free: every
  // occurrence writes its bag and index to the next free slot, which only a new run keeps.
  sc.bag_rows.resize(static_cast<size_t>(n) + 1);
  sc.run_start.resize(static_cast<size_t>(n) + 1);
  int64_t* __restrict rows = sc.bag_rows.data();
  int32_t* __restrict starts = sc.run_start.data();
  int64_t runs = 0, j = 0;
  for (int64_t o = 0; o < owners; ++o) {
    const int64_t end = j + occ_counts[o], first = runs;
    int64_t prev = -1;  // bags are >= 0: an owner's first occurrence starts a run
    for (; j < end; ++j) {
      const int64_t b = bag_of[order[j]];
      rows[runs] = b;
      starts[runs] = static_cast<int32_t>(j);
      runs += b != prev;
      prev = b;
    }
    bag_counts[o] = runs - first;
  }
  starts[runs] = static_cast<int32_t>(n);  // runs never cross owners: each ends where the next starts
  out.bag_rows.assign(rows, rows + runs);
  out.lengths.resize(static_cast<size_t>(runs));
  for (int64_t k = 0; k < runs; ++k) out.lengths[k] = starts[k + 1] - starts[k];
}

// ---- binding ----

SPARSECOMM_BIND(pooled) {
  py::class_<PooledLists>(m, "PooledLists")
      .def_property_readonly("num_unique", [](const PooledLists& p) { return static_cast<int64_t>(p.unique.size()); })
      .def_property_readonly("num_bags", [](const PooledLists& p) { return static_cast<int64_t>(p.bag_rows.size()); })
      .def("write",
           [](const PooledLists& p, uintptr_t unique, uintptr_t bag_rows, uintptr_t lengths) {
             // Copies the lists into tensors sized from num_unique / num_bags; 0 skips one.
             if (unique && !p.unique.empty())
               std::memcpy(ptr(unique), p.unique.data(), p.unique.size() * sizeof(int64_t));
             if (bag_rows && !p.bag_rows.empty())
               std::memcpy(ptr(bag_rows), p.bag_rows.data(), p.bag_rows.size() * sizeof(int64_t));
             if (lengths && !p.lengths.empty())
               std::memcpy(ptr(lengths), p.lengths.data(), p.lengths.size() * sizeof(int32_t));
           },
           py::arg("unique"), py::arg("bag_rows"), py::arg("lengths"));

  m.def("group_by",
        [](uintptr_t index, int64_t n, int64_t size, uintptr_t order, uintptr_t offsets, int threads) {
          py::gil_scoped_release release;
          group_by(ptr<const int64_t>(index), n, size, ptr<int64_t>(order), ptr<int64_t>(offsets), threads);
        },
        py::arg("index"), py::arg("n"), py::arg("size"), py::arg("order"), py::arg("offsets"), py::arg("threads"),
        "Stable counting sort of int64 positions by index in [0, size): order (n) and group starts (size).");

  m.def("bag_groups",
        [](uintptr_t key, int64_t r, uintptr_t positions, int64_t n, uintptr_t lengths, int64_t num_bags,
           int64_t size, uintptr_t order, uintptr_t rows, uintptr_t offsets, int threads) {
          py::gil_scoped_release release;
          bag_groups(ptr<const int64_t>(key), r, ptr<const int64_t>(positions), n, ptr<const int64_t>(lengths),
                     num_bags, size, ptr<int64_t>(order), ptr<int64_t>(rows), ptr<int64_t>(offsets), threads);
        },
        py::arg("key"), py::arg("r"), py::arg("positions"), py::arg("n"), py::arg("lengths"), py::arg("num_bags"),
        py::arg("size"), py::arg("order"), py::arg("rows"), py::arg("offsets"), py::arg("threads"),
        "Owner-side backward plan of pooled lookups: occurrences grouped by key[positions] (stable), their bags.");

  m.def("unique_inverse",
        [](uintptr_t ids, int64_t n, int64_t num_rows, uintptr_t inverse, int threads) {
          auto lists = std::make_unique<PooledLists>();
          py::gil_scoped_release release;
          unique_inverse(ptr<const int64_t>(ids), n, num_rows, lists->unique, ptr<int64_t>(inverse), threads);
          return lists;
        },
        py::arg("ids"), py::arg("n"), py::arg("num_rows"), py::arg("inverse"), py::arg("threads"),
        "Distinct int64 ids ascending (kept in the returned lists' unique) and each id's index among them.");

  m.def("pooled_request",
        [](uintptr_t ids, uintptr_t bag_of, int64_t n, int64_t num_rows, int64_t num_bags, int scheme,
           int64_t num_owners, int64_t range_size, int64_t stride, uintptr_t unique_counts, uintptr_t order,
           uintptr_t occ_counts, uintptr_t positions, uintptr_t bag_counts, int threads) {
          const OwnerMap map{scheme, num_owners, range_size, stride};
          auto lists = std::make_unique<PooledLists>();
          py::gil_scoped_release release;
          pooled_request(ptr<const int64_t>(ids), ptr<const int64_t>(bag_of), n, num_rows, num_bags, map,
                         ptr<int64_t>(unique_counts), ptr<int64_t>(order), ptr<int64_t>(occ_counts),
                         ptr<int32_t>(positions), ptr<int64_t>(bag_counts), *lists, threads);
          return lists;
        },
        py::arg("ids"), py::arg("bag_of"), py::arg("n"), py::arg("num_rows"), py::arg("num_bags"), py::arg("scheme"),
        py::arg("num_owners"), py::arg("range_size"), py::arg("stride"), py::arg("unique_counts"), py::arg("order"),
        py::arg("occ_counts"), py::arg("positions"), py::arg("bag_counts"), py::arg("threads"),
        "Owner pooling's request: fixed-size outputs written, the distinct ids and partial bags returned.");
}

}  // namespace sparsecomm
