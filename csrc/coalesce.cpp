// coalesce rows: sorted unique ids and the per-id sums of their value rows;
// fused with the partition by owner, or read straight out of a receive buffer.
//
// Two ways to group the ids: a dense slot map when their range is narrow
// (build_slot_map, then the values are streamed in input order), else a radix
// sort (group_rows, then each group's rows are gathered). Both sum each id's
// rows in input order starting from the first, so they agree bitwise, and
// neither depends on the number of threads.
#include <climits>
#include <memory>
#include <string>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "binding.h"
#include "counting_sort.h"
#include "ops.h"
#include "segment_reduce.h"

namespace sparsecomm {

namespace {

// The widest id range whose slot map build_slot_map keeps between calls (8 MiB per calling thread).
constexpr int64_t kSlotMapCacheSpan = int64_t{1} << 21;

}  // namespace

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
bool build_slot_map(const void* ids, IndexType it, int64_t n, int64_t num_rows, int threads, SlotMap& map) {
  threads = clamp_threads(threads);
  const IdRange r = check_ids(ids, it, n, num_rows, threads, "ids");
  if (n == 0) {
    map = SlotMap{};
    return true;
  }
  if (n > INT32_MAX) return false;
  // r.min >= 0 (checked): the span cannot overflow.
  const uint64_t span = static_cast<uint64_t>(r.max - r.min) + 1;
  if (span > static_cast<uint64_t>(kSlotMapSpanPerRow) * static_cast<uint64_t>(n)) return false;
  const int64_t m = static_cast<int64_t>(span);
  // The map over the range is scratch: fresh pages for it cost ~1,000 page faults a call (4 MiB for ids
  // over 1M rows), so ranges up to kSlotMapCacheSpan keep theirs in the calling thread.
  thread_local std::vector<int32_t> cached;
  std::vector<int32_t> local;
  std::vector<int32_t>& scratch = m <= kSlotMapCacheSpan ? cached : local;
  if (static_cast<int64_t>(scratch.size()) < m) scratch.resize(static_cast<size_t>(m));
  int32_t* pos = scratch.data();
  std::vector<int64_t> before(static_cast<size_t>(threads) + 1, 0);  // slots before each thread's chunk
  map.slot.resize(static_cast<size_t>(n));
#pragma omp parallel num_threads(threads)
  {
    const auto [t, nt] = this_thread_team();
    const int64_t lo = m * t / nt, hi = m * (t + 1) / nt;
    for (int64_t x = lo; x < hi; ++x) pos[x] = 0;
#pragma omp barrier
    // Several rows may mark the same id: relaxed atomic stores of the same value, no data race.
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) __atomic_store_n(&pos[load_id(ids, it, i) - r.min], 1, __ATOMIC_RELAXED);
    int64_t present = 0;
    for (int64_t x = lo; x < hi; ++x) present += pos[x];
    before[t + 1] = present;
#pragma omp barrier
#pragma omp single
    {
      for (int u = 0; u < nt; ++u) before[u + 1] += before[u];
      map.unique_id.resize(static_cast<size_t>(before[nt]));
    }
    // Ids present get consecutive slots in id order.
    int64_t next = before[t];
    for (int64_t x = lo; x < hi; ++x) {
      if (pos[x]) {
        map.unique_id[next] = x + r.min;
        pos[x] = static_cast<int32_t>(next++);
      }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) map.slot[i] = pos[load_id(ids, it, i) - r.min];
  }
  return true;
}

namespace {

// Thread t of T adds the rows whose slot % T == t, walking the input once in
// order: each slot's rows are summed by one thread, in input order, starting
// from the first (as reduce_groups_with). fp32/fp64 sum in the output itself;
// fp16/bf16 in a float32 scratch rounded once at the end.
template <ValueType V>
void sum_into_slots(const SlotMap& map, const void* values, int64_t d, void* out_values, int threads) {
  using E = Elem<V>;
  using S = typename E::storage;
  using A = typename E::acc;
  constexpr bool kInPlace = std::is_same<S, A>::value;
  const int64_t n = static_cast<int64_t>(map.slot.size());
  const int64_t u = map.num_unique();
  const S* vals = static_cast<const S*>(values);
  S* out = static_cast<S*>(out_values);
  std::unique_ptr<A[]> scratch(kInPlace ? nullptr : new A[static_cast<size_t>(u * d)]);
  A* acc = kInPlace ? reinterpret_cast<A*>(out) : scratch.get();
  advise_huge_pages(acc, static_cast<size_t>(u * d) * sizeof(A));
  if (!kInPlace) advise_huge_pages(out, static_cast<size_t>(u * d) * sizeof(S));
  std::vector<uint8_t> seen(static_cast<size_t>(u), 0);  // a slot's first row starts its sum
  const int32_t* slot = map.slot.data();
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(A));
  const int64_t src_bytes = d * static_cast<int64_t>(sizeof(S));
  constexpr int64_t kAhead = 16, kAheadRows = 8;
#pragma omp parallel num_threads(clamp_threads(threads))
  {
    const auto [t, nt] = this_thread_team();
    // Which thread owns a slot does not change any sum (each slot has one owner, adding in input order);
    // a mask instead of a division when the team size allows.
    const uint32_t mask = (nt & (nt - 1)) == 0 ? static_cast<uint32_t>(nt - 1) : 0;
    auto mine = [&](uint32_t s) { return mask || nt == 1 ? (s & mask) == static_cast<uint32_t>(t)
                                                         : s % static_cast<uint32_t>(nt) == static_cast<uint32_t>(t); };
    for (int64_t i = 0; i < n; ++i) {
      // Sums are hit at random (the rows in order): fetch the ones this thread will add to a few rows
      // ahead, and the rows it will read (it skips the other threads' rows).
      if (i + kAhead < n && mine(static_cast<uint32_t>(slot[i + kAhead]))) {
        const char* dst = reinterpret_cast<const char*>(acc + static_cast<int64_t>(slot[i + kAhead]) * d);
        for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(dst + byte, 1);
      }
      if (i + kAheadRows < n && mine(static_cast<uint32_t>(slot[i + kAheadRows]))) {
        const char* src = reinterpret_cast<const char*>(vals + (i + kAheadRows) * d);
        for (int64_t byte = 0; byte < src_bytes; byte += 64) __builtin_prefetch(src + byte);
      }
      const int64_t s = slot[i];
      if (!mine(static_cast<uint32_t>(s))) continue;
      const S* src = vals + i * d;
      A* a = acc + s * d;
      if (seen[s]) {
        if constexpr (kInPlace) {
          for (int64_t j = 0; j < d; ++j) a[j] += src[j];
        } else {
          for (int64_t j = 0; j < d; ++j) a[j] += E::load(src[j]);
        }
      } else {
        seen[s] = 1;
        for (int64_t j = 0; j < d; ++j) a[j] = E::load(src[j]);
      }
    }
    if constexpr (!kInPlace) {
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t k = 0; k < u * d; ++k) out[k] = E::store(acc[k]);
    }
  }
}

}  // namespace

// coalesce_apply over a slot map: unique ids to out_ids, each slot's row sum to out_values (the same
// values, bitwise, as over the groups of the same ids, for any thread count).
void coalesce_slots_apply(const SlotMap& map, const void* values, ValueType vt, int64_t d, void* out_ids,
                          IndexType it, void* out_values, int threads) {
  const int64_t u = map.num_unique();
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, g, map.unique_id[g]);
  if (d == 0 || u == 0) return;
  SPARSECOMM_DISPATCH_VALUE(vt, [&] { sum_into_slots<V>(map, values, d, out_values, threads); });
}

// Writes the sorted unique ids of `groups` to out_ids and their row sums to out_values.
void coalesce_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d, void* out_ids,
                    IndexType it, void* out_values, int threads) {
  const int64_t u = groups.num_groups();
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, g, groups.group_id[g]);
  if (d == 0 || u == 0) return;
  advise_huge_pages(out_values, static_cast<size_t>(u * d) * value_size(vt));
  SPARSECOMM_DISPATCH_VALUE(vt, [&] { reduce_groups<V>(groups, values, d, out_values, false, false, threads); });
}

// coalesce_apply, then rows grouped by owner: counts[o] rows per owner, owner
// order, ascending ids inside an owner; exactly partition_rows(coalesce(...)),
// with the sums written once, straight to their partitioned position.
void coalesce_partition_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d,
                              const OwnerMap& map, int64_t* counts, void* out_ids, IndexType it, void* out_values,
                              int threads) {
  check_owner_map(map);
  threads = clamp_threads(threads);
  const int64_t u = groups.num_groups();
  std::vector<int32_t> owner(static_cast<size_t>(u));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < u; ++g) owner[g] = static_cast<int32_t>(row_owner(groups.group_id[g], map));
  // Groups are in ascending id order: a stable sort by owner keeps ids ascending inside an owner.
  std::vector<int64_t> dest(static_cast<size_t>(u));
  stable_counting_sort(
      u, map.num_owners, threads, [&](int64_t g) { return static_cast<int64_t>(owner[g]); },
      [&](int64_t g, int64_t slot) { dest[g] = slot; }, counts);
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, dest[g], groups.group_id[g]);
  if (d == 0 || u == 0) return;
  advise_huge_pages(out_values, static_cast<size_t>(u * d) * value_size(vt));
  SPARSECOMM_DISPATCH_VALUE(vt, [&] {
    using S = typename Elem<V>::storage;
    const S* vals = static_cast<const S*>(values);
    S* out = static_cast<S*>(out_values);
    reduce_groups_with<V, S>(
        groups, [&](int64_t i) { return vals + i * d; }, d, [&](int64_t g) { return out + dest[g] * d; }, false,
        threads);
  });
}

namespace {

void check_segment(int64_t s, int64_t offset, int64_t bytes, int64_t buffer_bytes, size_t align, uintptr_t base,
                   const char* what) {
  if (offset < 0 || bytes < 0 || offset > buffer_bytes || bytes > buffer_bytes - offset)
    throw std::invalid_argument("sparsecomm: segment " + std::to_string(s) + "'s " + what +
                                " lie outside the buffer");
  if ((base + static_cast<uintptr_t>(offset)) % align != 0)
    throw std::invalid_argument("sparsecomm: segment " + std::to_string(s) + "'s " + what +
                                " are not aligned to " + std::to_string(align) + " bytes");
}

}  // namespace

// Rows scattered over `nseg` segments of one byte buffer (a receive buffer:
// each peer's ids and value rows). Segment s holds counts[s] ids of `id_bytes`
// (2, 4 or 8) at byte id_offsets[s] and their value rows of `row_bytes` at
// value_offsets[s]. Checks every segment lies inside the buffer and is aligned
// for its type, gathers the ids (checked in [0, num_rows)) and groups them;
// `rows` receives the address of every value row, in segment order.
RowGroups group_segment_rows(const void* buffer, int64_t buffer_bytes, int64_t nseg, const int64_t* counts,
                             const int64_t* id_offsets, const int64_t* value_offsets, int id_bytes,
                             size_t row_bytes, size_t value_align, int64_t num_rows, int threads,
                             std::vector<const void*>& rows) {
  if (id_bytes != 2 && id_bytes != 4 && id_bytes != 8)
    throw std::invalid_argument("sparsecomm: wire ids must be 2, 4 or 8 bytes");
  if (value_align == 0) value_align = 1;
  const auto base = reinterpret_cast<uintptr_t>(buffer);
  int64_t n = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    if (counts[s] < 0) throw std::invalid_argument("sparsecomm: negative segment row count");
    check_segment(s, id_offsets[s], counts[s] * id_bytes, buffer_bytes, static_cast<size_t>(id_bytes), base, "ids");
    check_segment(s, value_offsets[s], counts[s] * static_cast<int64_t>(row_bytes), buffer_bytes, value_align, base,
                  "value rows");
    n += counts[s];
  }
  std::vector<int64_t> ids(static_cast<size_t>(n));
  rows.resize(static_cast<size_t>(n));
  const char* buf = static_cast<const char*>(buffer);
  int64_t at = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const char* id_src = buf + id_offsets[s];
    const char* row_src = buf + value_offsets[s];
    const int64_t c = counts[s];
#pragma omp parallel for num_threads(clamp_threads(threads)) schedule(static)
    for (int64_t r = 0; r < c; ++r) {
      int64_t v;
      if (id_bytes == 2) v = reinterpret_cast<const int16_t*>(id_src)[r];
      else if (id_bytes == 4) v = reinterpret_cast<const int32_t*>(id_src)[r];
      else v = reinterpret_cast<const int64_t*>(id_src)[r];
      ids[at + r] = v;
      rows[at + r] = row_src + r * row_bytes;
    }
    at += c;
  }
  return group_rows(ids.data(), IndexType::kInt64, n, num_rows, threads);
}

// Sums of each group of group_segment_rows, as coalesce_apply; out_acc: write
// the accumulator type (float32 for fp16/bf16) instead of the value type.
void coalesce_segments_apply(const RowGroups& groups, const std::vector<const void*>& rows, ValueType vt,
                             int64_t d, void* out_ids, IndexType it, void* out_values, bool out_acc, int threads) {
  const int64_t u = groups.num_groups();
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, g, groups.group_id[g]);
  if (d == 0 || u == 0) return;
  SPARSECOMM_DISPATCH_VALUE(vt, [&] {
    using E = Elem<V>;
    using S = typename E::storage;
    using A = typename E::acc;
    auto row_at = [&](int64_t i) { return static_cast<const S*>(rows[i]); };
    advise_huge_pages(out_values, static_cast<size_t>(u * d) * (out_acc ? sizeof(A) : sizeof(S)));
    if (out_acc) {
      A* out = static_cast<A*>(out_values);
      reduce_groups_with<V, A>(groups, row_at, d, [&](int64_t g) { return out + g * d; }, false, threads);
    } else {
      S* out = static_cast<S*>(out_values);
      reduce_groups_with<V, S>(groups, row_at, d, [&](int64_t g) { return out + g * d; }, false, threads);
    }
  });
}

// ---- binding ----

namespace {

// What Python holds between a coalesce's two calls: the grouping (plan), then the sums (apply), so that the
// outputs are allocated by torch once the unique count is known.
struct CoalescePlan {
  RowGroups groups;               // ids grouped by a radix sort, unless `dense`
  SlotMap slots;                  // ids grouped by a dense slot map (narrow ranges), when `dense`
  bool dense = false;
  IndexType index_type;
  std::vector<const void*> rows;  // value row addresses (plans over a receive buffer's segments)
  int64_t num_unique() const { return dense ? slots.num_unique() : groups.num_groups(); }
};

}  // namespace

SPARSECOMM_BIND(coalesce) {
  py::class_<CoalescePlan>(m, "CoalescePlan")
      .def_property_readonly("num_unique", &CoalescePlan::num_unique)
      .def_property_readonly("dense", [](const CoalescePlan& p) { return p.dense; });

  m.def("coalesce_plan",
        [](uintptr_t ids, int index_code, int64_t n, int64_t num_rows, int threads, bool allow_dense) {
          auto plan = std::make_unique<CoalescePlan>();
          plan->index_type = to_index_type(index_code);
          py::gil_scoped_release release;
          plan->dense = allow_dense && build_slot_map(ptr(ids), plan->index_type, n, num_rows, threads, plan->slots);
          if (!plan->dense) plan->groups = group_rows(ptr(ids), plan->index_type, n, num_rows, threads);
          return plan;
        },
        py::arg("ids"), py::arg("index_code"), py::arg("n"), py::arg("num_rows"), py::arg("threads"),
        py::arg("allow_dense") = false,
        "Group equal ids: a dense slot map over a narrow id range (if allowed), else a stable radix sort.");

  m.def("coalesce_apply",
        [](const CoalescePlan& plan, uintptr_t values, int value_code, int64_t d, uintptr_t out_ids,
           uintptr_t out_values, int threads) {
          const ValueType vt = to_value_type(value_code);
          py::gil_scoped_release release;
          if (plan.dense)
            coalesce_slots_apply(plan.slots, ptr(values), vt, d, ptr(out_ids), plan.index_type, ptr(out_values),
                                 threads);
          else
            coalesce_apply(plan.groups, ptr(values), vt, d, ptr(out_ids), plan.index_type, ptr(out_values),
                           threads);
        },
        py::arg("plan"), py::arg("values"), py::arg("value_code"), py::arg("d"), py::arg("out_ids"),
        py::arg("out_values"), py::arg("threads"),
        "Write the plan's unique ids and each group's row sum.");

  m.def("coalesce_partition_apply",
        [](const CoalescePlan& plan, uintptr_t values, int value_code, int64_t d, int scheme, int64_t num_owners,
           int64_t range_size, int64_t stride, uintptr_t counts, uintptr_t out_ids, uintptr_t out_values,
           int threads) {
          const ValueType vt = to_value_type(value_code);
          const OwnerMap map{scheme, num_owners, range_size, stride};
          if (plan.dense) throw std::invalid_argument("sparsecomm: coalesce_partition_apply needs a sorted plan");
          py::gil_scoped_release release;
          coalesce_partition_apply(plan.groups, ptr(values), vt, d, map, ptr<int64_t>(counts), ptr(out_ids),
                                   plan.index_type, ptr(out_values), threads);
        },
        py::arg("plan"), py::arg("values"), py::arg("value_code"), py::arg("d"), py::arg("scheme"),
        py::arg("num_owners"), py::arg("range_size"), py::arg("stride"), py::arg("counts"), py::arg("out_ids"),
        py::arg("out_values"), py::arg("threads"),
        "Write the plan's unique ids and sums grouped by owner (owner order, ascending ids inside).");

  m.def("coalesce_segments_plan",
        [](uintptr_t buffer, int64_t buffer_bytes, int64_t nseg, uintptr_t counts, uintptr_t id_offsets,
           uintptr_t value_offsets, int id_bytes, size_t row_bytes, size_t value_align, int64_t num_rows,
           int out_index_code, int threads) {
          auto plan = std::make_unique<CoalescePlan>();
          plan->index_type = to_index_type(out_index_code);
          py::gil_scoped_release release;
          plan->groups = group_segment_rows(ptr(buffer), buffer_bytes, nseg, ptr<const int64_t>(counts),
                                            ptr<const int64_t>(id_offsets), ptr<const int64_t>(value_offsets),
                                            id_bytes, row_bytes, value_align, num_rows, threads, plan->rows);
          return plan;
        },
        py::arg("buffer"), py::arg("buffer_bytes"), py::arg("nseg"), py::arg("counts"), py::arg("id_offsets"),
        py::arg("value_offsets"), py::arg("id_bytes"), py::arg("row_bytes"), py::arg("value_align"),
        py::arg("num_rows"), py::arg("out_index_code"), py::arg("threads"),
        "Group the ids of rows spread over segments of one byte buffer.");

  m.def("coalesce_segments_apply",
        [](const CoalescePlan& plan, int value_code, int64_t d, uintptr_t out_ids, uintptr_t out_values, bool out_acc,
           int threads) {
          const ValueType vt = to_value_type(value_code);
          if (static_cast<int64_t>(plan.rows.size()) != static_cast<int64_t>(plan.groups.order.size()))
            throw std::invalid_argument("sparsecomm: not a plan over buffer segments");
          py::gil_scoped_release release;
          coalesce_segments_apply(plan.groups, plan.rows, vt, d, ptr(out_ids), plan.index_type, ptr(out_values),
                                  out_acc, threads);
        },
        py::arg("plan"), py::arg("value_code"), py::arg("d"), py::arg("out_ids"), py::arg("out_values"),
        py::arg("out_acc"), py::arg("threads"),
        "Write the unique ids and row sums of a segment plan (out_acc: in the accumulator type).");
}

}  // namespace sparsecomm
