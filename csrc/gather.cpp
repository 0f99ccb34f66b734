// gather rows: out[i] = table[ids[i]].
#include <cstring>

#include "binding.h"
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

// ---- binding ----

SPARSECOMM_BIND(gather) {
  m.def("gather_rows",
        [](uintptr_t table, int64_t num_rows, size_t row_bytes, uintptr_t ids, int index_code, int64_t n,
           uintptr_t out, int threads) {
          const IndexType it = to_index_type(index_code);
          py::gil_scoped_release release;
          gather_rows(ptr(table), num_rows, row_bytes, ptr(ids), it, n, ptr(out), threads);
        },
        py::arg("table"), py::arg("num_rows"), py::arg("row_bytes"), py::arg("ids"), py::arg("index_code"),
        py::arg("n"), py::arg("out"), py::arg("threads"));
}

}  // namespace sparsecomm
