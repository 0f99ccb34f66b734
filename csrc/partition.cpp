// partition rows by owner: a stable counting sort of rows by owner rank.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "counting_sort.h"
#include "binding.h"
#include "ops.h"

namespace sparsecomm {

void check_owner_map(const OwnerMap& map) {
  if (const char* why = owner_map_error(map)) throw std::invalid_argument(std::string("sparsecomm: ") + why);
}

void partition_rows(const void* ids, IndexType it, int64_t n, int64_t num_rows, const void* values,
                    size_t row_bytes, const OwnerMap& map, int64_t* counts, void* out_ids, void* out_values, int64_t* perm,
                    int threads) {
  check_owner_map(map);
  threads = clamp_threads(threads);
  check_ids(ids, it, n, num_rows, threads, "ids");
  const int64_t owners = map.num_owners;
  std::vector<int32_t> owner(static_cast<size_t>(n));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) owner[i] = static_cast<int32_t>(row_owner(load_id(ids, it, i), map));
  const size_t id_bytes = it == IndexType::kInt32 ? 4 : 8;
  const char* vsrc = static_cast<const char*>(values);
  char* vdst = static_cast<char*>(out_values);
  const char* isrc = static_cast<const char*>(ids);
  char* idst = static_cast<char*>(out_ids);
  stable_counting_sort(
      n, owners, threads, [&](int64_t i) { return static_cast<int64_t>(owner[i]); },
      [&](int64_t i, int64_t dst) {
        std::memcpy(idst + dst * id_bytes, isrc + i * id_bytes, id_bytes);
        if (vdst && row_bytes) std::memcpy(vdst + dst * row_bytes, vsrc + i * row_bytes, row_bytes);
        if (perm) perm[dst] = i;
      },
      counts);
}

// Bit j of words[w] is set when id 64 * w + j (< num_rows) belongs to `rank` under `map`: the owned-id bitmap
// of a sharded table's layout, in one pass over the ids, none of them materialized.
void owned_bitmap(int64_t num_rows, const OwnerMap& map, int64_t rank, int64_t* words, int threads) {
  check_owner_map(map);
  const int64_t nwords = (num_rows + 63) / 64;
#pragma omp parallel for num_threads(clamp_threads(threads)) schedule(static)
  for (int64_t w = 0; w < nwords; ++w) {
    const int64_t lo = w * 64;
    const int64_t hi = lo + 64 < num_rows ? lo + 64 : num_rows;
    uint64_t bits = 0;
    for (int64_t id = lo; id < hi; ++id)
      bits |= static_cast<uint64_t>(row_owner(id, map) == rank) << (id - lo);
    std::memcpy(words + w, &bits, sizeof bits);
  }
}

// The ids whose bits are set in words[0, nwords), ascending, into out (at most capacity of them); returns how
// many bits are set (more than capacity: the ids past it are not written).
int64_t bitmap_ids(const int64_t* words, int64_t nwords, int64_t* out, int64_t capacity) {
  int64_t at = 0;
  for (int64_t w = 0; w < nwords; ++w) {
    uint64_t bits;
    std::memcpy(&bits, words + w, sizeof bits);
    while (bits) {
      if (at < capacity) out[at] = w * 64 + __builtin_ctzll(bits);
      ++at;
      bits &= bits - 1;
    }
  }
  return at;
}

// Each id's rank among the set bits of words (its slot in a layout's owned-id bitmap): before[w] plus the set
// bits below it in its word. Returns the index of the first id outside [0, 64 * nwords), or -1 (then out is full).
template <typename B>
int64_t bitmap_positions(const int64_t* words, int64_t nwords, const B* before, const int64_t* ids, int64_t n,
                         int64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || (id >> 6) >= nwords) return i;
    uint64_t bits;
    std::memcpy(&bits, words + (id >> 6), sizeof bits);
    const uint64_t below = (uint64_t{1} << (id & 63)) - 1;
    out[i] = static_cast<int64_t>(before[id >> 6]) + __builtin_popcountll(bits & below);
  }
  return -1;
}

// Whether each id lies in [0, num_rows) and its bit is set (bool bytes into out).
void bitmap_owns(const int64_t* words, int64_t num_rows, const int64_t* ids, int64_t n, bool* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    uint64_t bits = 0;
    if (id >= 0 && id < num_rows) std::memcpy(&bits, words + (id >> 6), sizeof bits);
    out[i] = (id >= 0 && id < num_rows) && ((bits >> (id & 63)) & 1);
  }
}

// ---- binding ----

SPARSECOMM_BIND(partition) {
  m.def("partition_rows",
        [](uintptr_t ids, int index_code, int64_t n, int64_t num_rows, uintptr_t values, size_t row_bytes, int scheme,
           int64_t num_owners, int64_t range_size, int64_t stride, uintptr_t counts, uintptr_t out_ids,
           uintptr_t out_values, uintptr_t perm, int threads) {
          const IndexType it = to_index_type(index_code);
          const OwnerMap map{scheme, num_owners, range_size, stride};
          py::gil_scoped_release release;
          partition_rows(ptr(ids), it, n, num_rows, ptr(values), row_bytes, map, ptr<int64_t>(counts), ptr(out_ids),
                         ptr(out_values), ptr<int64_t>(perm), threads);
        },
        py::arg("ids"), py::arg("index_code"), py::arg("n"), py::arg("num_rows"), py::arg("values"),
        py::arg("row_bytes"), py::arg("scheme"), py::arg("num_owners"), py::arg("range_size"), py::arg("stride"), py::arg("counts"),
        py::arg("out_ids"), py::arg("out_values"), py::arg("perm"), py::arg("threads"),
        "Stable counting sort of rows by owner; values/perm may be 0 (skipped).");

  m.def("row_owner",
        [](int64_t id, int scheme, int64_t num_owners, int64_t range_size, int64_t stride) {
          const OwnerMap map{scheme, num_owners, range_size, stride};
          check_owner_map(map);
          if (id < 0) throw std::invalid_argument("sparsecomm: ids must be non-negative");
          return row_owner(id, map);
        },
        "Owner of one id (for tests and diagnostics).");

  m.def("owned_bitmap",
        [](int64_t num_rows, int scheme, int64_t num_owners, int64_t range_size, int64_t stride, int64_t rank,
           uintptr_t words, int threads) {
          const OwnerMap map{scheme, num_owners, range_size, stride};
          py::gil_scoped_release release;
          owned_bitmap(num_rows, map, rank, ptr<int64_t>(words), threads);
        },
        py::arg("num_rows"), py::arg("scheme"), py::arg("num_owners"), py::arg("range_size"), py::arg("stride"),
        py::arg("rank"), py::arg("words"), py::arg("threads"),
        "Bitmap of the ids in [0, num_rows) that rank owns: ceil(num_rows / 64) int64 words.");

  m.def("bitmap_positions",
        [](uintptr_t words, int64_t nwords, uintptr_t before, int before_bytes, uintptr_t ids, int64_t n,
           uintptr_t out) {
          py::gil_scoped_release release;
          if (before_bytes == 4)
            return bitmap_positions(ptr<int64_t>(words), nwords, ptr<int32_t>(before), ptr<int64_t>(ids), n,
                                    ptr<int64_t>(out));
          if (before_bytes == 8)
            return bitmap_positions(ptr<int64_t>(words), nwords, ptr<int64_t>(before), ptr<int64_t>(ids), n,
                                    ptr<int64_t>(out));
          throw std::invalid_argument("sparsecomm: bitmap prefix counts must be int32 or int64");
        },
        py::arg("words"), py::arg("nwords"), py::arg("before"), py::arg("before_bytes"), py::arg("ids"),
        py::arg("n"), py::arg("out"),
        "Each id's rank among the set bits (prefix counts per word in before); the first id out of range or -1.");

  m.def("bitmap_owns",
        [](uintptr_t words, int64_t num_rows, uintptr_t ids, int64_t n, uintptr_t out) {
          py::gil_scoped_release release;
          bitmap_owns(ptr<int64_t>(words), num_rows, ptr<int64_t>(ids), n, ptr<bool>(out));
        },
        py::arg("words"), py::arg("num_rows"), py::arg("ids"), py::arg("n"), py::arg("out"),
        "Whether each id is in [0, num_rows) with its bit set.");

  m.def("bitmap_ids",
        [](uintptr_t words, int64_t nwords, uintptr_t out, int64_t capacity) {
          py::gil_scoped_release release;
          return bitmap_ids(ptr<int64_t>(words), nwords, ptr<int64_t>(out), capacity);
        },
        py::arg("words"), py::arg("nwords"), py::arg("out"), py::arg("capacity"),
        "The set bits' ids, ascending, into out (at most capacity); returns the number of set bits.");
}

}  // namespace sparsecomm
