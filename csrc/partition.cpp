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
}

}  // namespace sparsecomm
