// gather rows: out[i] = table[ids[i]].
#include <cstring>

#include "ops.h"

namespace sparsecomm {

void gather_rows(const void* table, int64_t num_rows, size_t row_bytes, const void* ids, IndexType it,
                 int64_t n, void* out, int threads) {
  if (num_rows < 0) throw std::invalid_argument("sparsecomm: gather_rows needs num_rows >= 0");
  // Check every id before writing anything, so a bad id leaves `out` untouched.
  check_ids(ids, it, n, num_rows, threads, "ids");
  // Zero-width rows or no ids: nothing to copy, and the buffers may be null
  // (memcpy of 0 bytes from a null pointer is still undefined behaviour).
  if (row_bytes == 0 || n == 0) return;
  const char* src = static_cast<const char*>(table);
  char* dst = static_cast<char*>(out);
#pragma omp parallel for num_threads(clamp_threads(threads)) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * row_bytes, src + load_id(ids, it, i) * row_bytes, row_bytes);
}

}  // namespace sparsecomm
