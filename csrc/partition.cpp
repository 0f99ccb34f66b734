// partition rows by owner: a stable counting sort of rows by owner rank.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "counting_sort.h"
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

}  // namespace sparsecomm
