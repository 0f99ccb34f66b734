// The row kernels of the sparse path, on raw CPU buffers.
// Python reaches them through bindings.cpp; sparsecomm/ops validates,
// sparsecomm/_library allocates, these functions re-check ids (bounds) and do the work.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"
#include "owner_map.h"
#include "row_groups.h"

namespace sparsecomm {

// Throws std::invalid_argument (Python ValueError) for a map owner_map_error refuses (owner_map.h).
void check_owner_map(const OwnerMap& map);

// Ids over a narrow range, grouped without sorting: a dense map over [min, max] marks the ids present,
// and its prefix sum gives each id its output slot (ids ascending). Coalesce then streams the values in
// input order, adding each row into its slot: sequential reads of the rows instead of the random reads of
// a sorted order, with the same sums (each slot's rows in input order, from the first).
struct SlotMap {
  std::vector<int32_t> slot;       // output slot of each input row
  std::vector<int64_t> unique_id;  // id of each slot, ascending
  int64_t num_unique() const { return static_cast<int64_t>(unique_id.size()); }
};

// The widest id range (max - min + 1) per input row that the dense map takes: its cost grows with the
// range, the radix sort's with the rows.
constexpr int64_t kSlotMapSpanPerRow = 4;

// Checks every id lies in [0, num_rows) (as group_rows). If the ids' range is at most
// kSlotMapSpanPerRow * n (and n < 2^31), fills `map` and returns true; else returns false, `map` untouched.
bool build_slot_map(const void* ids, IndexType it, int64_t n, int64_t num_rows, int threads, SlotMap& map);

// coalesce_apply over a slot map: unique ids to out_ids, each slot's row sum to out_values (the same
// values, bitwise, as over the groups of the same ids, for any thread count).
void coalesce_slots_apply(const SlotMap& map, const void* values, ValueType vt, int64_t d, void* out_ids,
                          IndexType it, void* out_values, int threads);

// Writes the sorted unique ids of `groups` to out_ids and their row sums to out_values.
void coalesce_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d, void* out_ids,
                    IndexType it, void* out_values, int threads);

// coalesce_apply, then rows grouped by owner: counts[o] rows per owner, owner
// order, ascending ids inside an owner; exactly partition_rows(coalesce(...)),
// with the sums written once, straight to their partitioned position.
void coalesce_partition_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d,
                              const OwnerMap& map, int64_t* counts, void* out_ids, IndexType it, void* out_values,
                              int threads);

// Rows scattered over `nseg` segments of one byte buffer (a receive buffer:
// each peer's ids and value rows). Segment s holds counts[s] ids of `id_bytes`
// (2, 4 or 8) at byte id_offsets[s] and their value rows of `row_bytes` at
// value_offsets[s]. Checks every segment lies inside the buffer and is aligned
// for its type, gathers the ids (checked in [0, num_rows)) and groups them;
// `rows` receives the address of every value row, in segment order.
RowGroups group_segment_rows(const void* buffer, int64_t buffer_bytes, int64_t nseg, const int64_t* counts,
                             const int64_t* id_offsets, const int64_t* value_offsets, int id_bytes,
                             size_t row_bytes, size_t value_align, int64_t num_rows, int threads,
                             std::vector<const void*>& rows);

// Sums of each group of group_segment_rows, as coalesce_apply; out_acc: write
// the accumulator type (float32 for fp16/bf16) instead of the value type.
void coalesce_segments_apply(const RowGroups& groups, const std::vector<const void*>& rows, ValueType vt,
                             int64_t d, void* out_ids, IndexType it, void* out_values, bool out_acc, int threads);

// Copies rows into a byte buffer at given places (packing a send buffer).
// Segment s (segments[3s .. 3s+2] = start, count, byte offset) copies source
// rows index[start .. start+count) (rows start.. when index is null) to
// dst + offset, back to back. Rows are `src_row_bytes` of raw bytes, unless
// `wire_id_bytes` > 0: then each source row is one id of src_row_bytes (4 or
// 8) written as a signed integer of wire_id_bytes (2, 4 or 8), which it must
// fit. Every index, segment and id is checked before anything is written.
void pack_rows(const void* src, int64_t src_rows, size_t src_row_bytes, const void* index, IndexType it,
               int64_t index_len, int64_t nseg, const int64_t* segments, void* dst, int64_t dst_bytes,
               int wire_id_bytes, int threads);

void partition_rows(const void* ids, IndexType it, int64_t n, int64_t num_rows, const void* values,
                    size_t row_bytes, const OwnerMap& map, int64_t* counts, void* out_ids, void* out_values, int64_t* perm,
                    int threads);

void gather_rows(const void* table, int64_t num_rows, size_t row_bytes, const void* ids, IndexType it,
                 int64_t n, void* out, int threads);

void scatter_add_rows(void* table, int64_t num_rows, ValueType vt, int64_t d, const void* ids, IndexType it,
                      int64_t n, const void* values, int threads);

// Row-wise Adagrad on k distinct rows (slots strictly increasing, checked with their bounds before any
// write): acc[s] += mean(g^2); weight[s] += g * (-lr / (sqrt(acc[s]) + eps)). float32/float64.
void rowwise_adagrad(void* weight, void* acc, int64_t num_rows, ValueType vt, int64_t d, const int64_t* slots,
                     int64_t k, const void* grad, double lr, double eps, int threads);

// ---- owner pooling's index kernels (pooled.cpp); ids int64, checked before any write ----

// Stable counting sort of positions by index (in [0, size)): order (n) = argsort(index, stable=True),
// offsets (size) = where each group starts (cumsum(bincount) - bincount).
void group_by(const int64_t* index, int64_t n, int64_t size, int64_t* order, int64_t* offsets, int threads);

// The owner's backward plan of pooled lookups: occurrence i (bag b(i): lengths are consecutive runs of the
// n occurrences) points at requested id positions[i] (in [0, r)), whose group is key[positions[i]] (in
// [0, size)). order (n) = argsort(key[positions], stable=True), rows (n) = b(order), offsets (size) = where
// each group starts: group g's gradient is the sum of the bag gradients rows[offsets[g]:...].
void bag_groups(const int64_t* key, int64_t r, const int64_t* positions, int64_t n, const int64_t* lengths,
                int64_t num_bags, int64_t size, int64_t* order, int64_t* rows, int64_t* offsets, int threads);

// torch.unique(ids, sorted=True, return_inverse=True): the distinct ids ascending, and each id's index among
// them (inverse, n). num_rows < 0: no upper bound.
void unique_inverse(const int64_t* ids, int64_t n, int64_t num_rows, std::vector<int64_t>& unique,
                    int64_t* inverse, int threads);

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
                    int32_t* positions, int64_t* bag_counts, PooledLists& out, int threads);

}  // namespace sparsecomm
