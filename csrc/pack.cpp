// pack rows: copy rows, optionally through an index, straight into their
// places in a byte buffer (a send buffer), converting ids to their wire width;
// unpack rows: copy rows out of their places in a byte buffer (a receive
// buffer) into one tensor, back to back.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "binding.h"
#include "ops.h"

namespace sparsecomm {

namespace {

template <typename W>
void pack_ids_as(const void* src, size_t src_bytes, const void* index, IndexType it, int64_t start, int64_t count,
                 char* dst, int threads) {
  W* out = reinterpret_cast<W*>(dst);
  const IndexType st = src_bytes == 4 ? IndexType::kInt32 : IndexType::kInt64;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = index ? load_id(index, it, start + r) : start + r;
    const W v = static_cast<W>(load_id(src, st, row));
    std::memcpy(out + r, &v, sizeof(W));  // the buffer may be unaligned for W
  }
}

// Checks segment triples (start, count, byte offset): rows [start, start + count) lie inside `rows` rows,
// and `count` rows of `row_bytes` from the offset inside `bytes` bytes; the errors name which side is off.
void check_segments(int64_t nseg, const int64_t* segments, int64_t rows, int64_t bytes, int64_t row_bytes,
                    const char* rows_error, const char* bytes_error) {
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t start = segments[3 * s], count = segments[3 * s + 1], offset = segments[3 * s + 2];
    if (start < 0 || count < 0 || start > rows || count > rows - start)
      throw std::invalid_argument("sparsecomm: segment " + std::to_string(s) + rows_error);
    if (offset < 0 || offset > bytes || (row_bytes && count > (bytes - offset) / row_bytes))
      throw std::invalid_argument("sparsecomm: segment " + std::to_string(s) + bytes_error);
  }
}

}  // namespace

// Copies rows into a byte buffer at given places (packing a send buffer).
// Segment s (segments[3s .. 3s+2] = start, count, byte offset) copies source
// rows index[start .. start+count) (rows start.. when index is null) to
// dst + offset, back to back. Rows are `src_row_bytes` of raw bytes, unless
// `wire_id_bytes` > 0: then each source row is one id of src_row_bytes (4 or
// 8) written as a signed integer of wire_id_bytes (2, 4 or 8), which it must
// fit. Every index, segment and id is checked before anything is written.
void pack_rows(const void* src, int64_t src_rows, size_t src_row_bytes, const void* index, IndexType it,
               int64_t index_len, int64_t nseg, const int64_t* segments, void* dst, int64_t dst_bytes,
               int wire_id_bytes, int threads) {
  threads = clamp_threads(threads);
  if (src_rows < 0 || dst_bytes < 0 || nseg < 0) throw std::invalid_argument("sparsecomm: negative size");
  if (wire_id_bytes != 0) {
    if (src_row_bytes != 4 && src_row_bytes != 8) throw std::invalid_argument("sparsecomm: ids must be int32 or int64");
    if (wire_id_bytes != 2 && wire_id_bytes != 4 && wire_id_bytes != 8)
      throw std::invalid_argument("sparsecomm: wire ids must be 2, 4 or 8 bytes");
  }
  const int64_t rows_available = index ? index_len : src_rows;
  if (index) check_ids(index, it, index_len, src_rows, threads, "index");
  const int64_t dst_row = wire_id_bytes ? wire_id_bytes : static_cast<int64_t>(src_row_bytes);
  check_segments(nseg, segments, rows_available, dst_bytes, dst_row, " reads rows outside the source",
                 " writes outside the buffer");
  if (wire_id_bytes) {
    const IdRange r = id_range(src, src_row_bytes == 4 ? IndexType::kInt32 : IndexType::kInt64, src_rows, threads);
    const int64_t hi = wire_id_bytes == 8 ? INT64_MAX : (int64_t{1} << (8 * wire_id_bytes - 1)) - 1;
    if (src_rows > 0 && (r.min < -hi - 1 || r.max > hi))
      throw std::invalid_argument("sparsecomm: id " + std::to_string(r.max > hi ? r.max : r.min) +
                                  " does not fit in " + std::to_string(wire_id_bytes) + " wire bytes");
  }
  if (dst_row == 0) return;
  char* out = static_cast<char*>(dst);
  const char* in = static_cast<const char*>(src);
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t start = segments[3 * s], count = segments[3 * s + 1];
    char* base = out + segments[3 * s + 2];
    if (count == 0) continue;
    if (wire_id_bytes == 2) pack_ids_as<int16_t>(src, src_row_bytes, index, it, start, count, base, threads);
    else if (wire_id_bytes == 4) pack_ids_as<int32_t>(src, src_row_bytes, index, it, start, count, base, threads);
    else if (wire_id_bytes == 8) pack_ids_as<int64_t>(src, src_row_bytes, index, it, start, count, base, threads);
    else {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t r = 0; r < count; ++r) {
        const int64_t row = index ? load_id(index, it, start + r) : start + r;
        std::memcpy(base + r * src_row_bytes, in + row * src_row_bytes, src_row_bytes);
      }
    }
  }
}

// Copies rows out of a byte buffer (reading a receive buffer). Segment s
// (segments[3s .. 3s+2] = start, count, byte offset) copies `count` rows of
// `row_bytes` from src + offset to rows start .. start+count of dst. Every
// segment is checked before anything is written.
void unpack_rows(const void* src, int64_t src_bytes, int64_t nseg, const int64_t* segments, void* dst,
                 int64_t dst_rows, size_t row_bytes, int threads) {
  threads = clamp_threads(threads);
  if (src_bytes < 0 || dst_rows < 0 || nseg < 0) throw std::invalid_argument("sparsecomm: negative size");
  const int64_t rb = static_cast<int64_t>(row_bytes);
  check_segments(nseg, segments, dst_rows, src_bytes, rb, " writes rows outside the output",
                 " reads outside the buffer");
  if (rb == 0) return;
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(dst);
  // Chunks of about 64 KiB: one memcpy each, spread over the threads.
  const int64_t chunk_rows = std::max<int64_t>(1, (int64_t{1} << 16) / rb);
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t start = segments[3 * s], count = segments[3 * s + 1];
    const char* from = in + segments[3 * s + 2];
    char* to = out + start * rb;
    const int64_t chunks = (count + chunk_rows - 1) / chunk_rows;
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = c * chunk_rows, rows = std::min(chunk_rows, count - first);
      std::memcpy(to + first * rb, from + first * rb, static_cast<size_t>(rows * rb));
    }
  }
}

// ---- binding ----

SPARSECOMM_BIND(pack) {
  m.def("pack_rows",
        [](uintptr_t src, int64_t src_rows, size_t src_row_bytes, uintptr_t index, int index_code, int64_t index_len,
           const std::vector<int64_t>& segments, uintptr_t dst, int64_t dst_bytes, int wire_id_bytes, int threads) {
          const IndexType it = to_index_type(index_code);
          if (segments.size() % 3) throw std::invalid_argument("sparsecomm: segments must be triples");
          py::gil_scoped_release release;
          pack_rows(ptr(src), src_rows, src_row_bytes, ptr(index), it, index_len,
                    static_cast<int64_t>(segments.size() / 3), segments.data(), ptr(dst), dst_bytes, wire_id_bytes,
                    threads);
        },
        py::arg("src"), py::arg("src_rows"), py::arg("src_row_bytes"), py::arg("index"), py::arg("index_code"),
        py::arg("index_len"), py::arg("segments"), py::arg("dst"), py::arg("dst_bytes"), py::arg("wire_id_bytes"),
        py::arg("threads"),
        "Copy (indexed) rows into segments (flat start, count, byte offset triples) of a byte buffer; index may be "
        "0 (rows in order).");
  m.def("unpack_rows",
        [](uintptr_t src, int64_t src_bytes, const std::vector<int64_t>& segments, uintptr_t dst, int64_t dst_rows,
           size_t row_bytes, int threads) {
          if (segments.size() % 3) throw std::invalid_argument("sparsecomm: segments must be triples");
          py::gil_scoped_release release;
          unpack_rows(ptr(src), src_bytes, static_cast<int64_t>(segments.size() / 3), segments.data(), ptr(dst),
                      dst_rows, row_bytes, threads);
        },
        py::arg("src"), py::arg("src_bytes"), py::arg("segments"), py::arg("dst"), py::arg("dst_rows"),
        py::arg("row_bytes"), py::arg("threads"),
        "Copy segments (flat start, count, byte offset triples) of a byte buffer into consecutive rows of a "
        "tensor.");
}

}  // namespace sparsecomm
