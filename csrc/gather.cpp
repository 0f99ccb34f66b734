// gather rows: out[i] = table[ids[i]].
#include <cstring>

#include "ops.h"

namespace sparsecomm {

void gather_rows(const void* table, int64_t num_rows, size_t row_bytes, const void* ids, IndexType it,
                 int64_t n, void* out, int threads) {
  // Check every id before writing anything, so a bad id leaves `out` untouched.
  check_ids(ids, it, n, num_rows, threads, "ids");
  const char* src = static_cast<const char*>(table);
  char* dst = static_cast<char*>(out);
#pragma omp parallel for num_threads(clamp_threads(threads)) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * row_bytes, src + load_id(ids, it, i) * row_bytes, row_bytes);
}

}  // namespace sparsecomm
