// scatter-add rows: table[ids[i]] += values[i], duplicates allowed.
//
// Every table row is updated by exactly one thread, which applies that row's
// updates in input order: no atomics, no races, and a result that is bitwise
// the same for any thread count.
//  - float32/float64: thread t owns the rows with id % T == t and walks the
//    ids once, applying its own (no sort: values are read in input order).
//  - float16/bfloat16: rows are grouped by id first so each row's updates are
//    summed in float32 and rounded once, not once per update.
#include "binding.h"
#include "ops.h"
#include "segment_reduce.h"

namespace sparsecomm {

namespace {

template <typename T>
void scatter_add_owned(T* table, int64_t d, const void* ids, IndexType it, int64_t n, const T* values,
                       int threads) {
#pragma omp parallel num_threads(threads)
  {
    const auto [t, nt] = this_thread_team();
    constexpr int64_t kAhead = 16;
    const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
    for (int64_t i = 0; i < n; ++i) {
      // Table rows are hit at random: fetch the ones this thread will update a few ids ahead.
      if (i + kAhead < n) {
        const int64_t next = load_id(ids, it, i + kAhead);
        if (next % nt == t) {
          const char* row = reinterpret_cast<const char*>(table + next * d);
          for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte, 1);
        }
      }
      const int64_t id = load_id(ids, it, i);
      if (id % nt != t) continue;
      T* dst = table + id * d;
      const T* src = values + i * d;
      for (int64_t j = 0; j < d; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace

void scatter_add_rows(void* table, int64_t num_rows, ValueType vt, int64_t d, const void* ids, IndexType it,
                      int64_t n, const void* values, int threads) {
  // A negative bound would mean "unbounded" to check_ids: never for a table we write to.
  if (num_rows < 0) throw std::invalid_argument("sparsecomm: scatter_add_rows needs num_rows >= 0");
  threads = clamp_threads(threads);
  if (vt == ValueType::kFloat32 || vt == ValueType::kFloat64) {
    check_ids(ids, it, n, num_rows, threads, "ids");  // before any write
    if (d == 0 || n == 0) return;
    if (vt == ValueType::kFloat32)
      scatter_add_owned(static_cast<float*>(table), d, ids, it, n, static_cast<const float*>(values), threads);
    else
      scatter_add_owned(static_cast<double*>(table), d, ids, it, n, static_cast<const double*>(values), threads);
    return;
  }
  const RowGroups groups = group_rows(ids, it, n, num_rows, threads);
  if (d == 0 || n == 0) return;
  SPARSECOMM_DISPATCH_VALUE(vt, [&] { reduce_groups<V>(groups, values, d, table, true, true, threads); });
}

// ---- binding ----

SPARSECOMM_BIND(scatter_add) {
  m.def("scatter_add_rows",
        [](uintptr_t table, int64_t num_rows, int value_code, int64_t d, uintptr_t ids, int index_code,
           int64_t n, uintptr_t values, int threads) {
          const ValueType vt = to_value_type(value_code);
          const IndexType it = to_index_type(index_code);
          py::gil_scoped_release release;
          scatter_add_rows(ptr(table), num_rows, vt, d, ptr(ids), it, n, ptr(values), threads);
        },
        py::arg("table"), py::arg("num_rows"), py::arg("value_code"), py::arg("d"), py::arg("ids"),
        py::arg("index_code"), py::arg("n"), py::arg("values"), py::arg("threads"));
}

}  // namespace sparsecomm
