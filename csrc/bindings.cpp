// pybind11 module `sparsecomm._C`: thin dispatch from Python to the kernels.
//
// Arguments are raw addresses (torch's data_ptr()) plus dtype codes: the module
// never links libtorch, so it builds anywhere with a C++17 compiler. Buffers
// are validated by sparsecomm/ops; ids are bounds-checked again here before
// any write. The GIL is released while kernels run so that communication
// threads keep going.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <vector>

#include "ops.h"
#include "shm_alltoall.h"

namespace py = pybind11;
using namespace sparsecomm;

namespace {

template <typename T = void>
T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

struct CoalescePlan {
  RowGroups groups;               // ids grouped by a radix sort, unless `dense`
  SlotMap slots;                  // ids grouped by a dense slot map (narrow ranges), when `dense`
  bool dense = false;
  IndexType index_type;
  std::vector<const void*> rows;  // value row addresses (plans over a receive buffer's segments)
  int64_t num_unique() const { return dense ? slots.num_unique() : groups.num_groups(); }
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "sparsecomm CPU row kernels (C++/OpenMP)";

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

  m.def("pack_rows",
        [](uintptr_t src, int64_t src_rows, size_t src_row_bytes, uintptr_t index, int index_code, int64_t index_len,
           int64_t nseg, uintptr_t segments, uintptr_t dst, int64_t dst_bytes, int wire_id_bytes, int threads) {
          const IndexType it = to_index_type(index_code);
          py::gil_scoped_release release;
          pack_rows(ptr(src), src_rows, src_row_bytes, ptr(index), it, index_len, nseg, ptr<const int64_t>(segments),
                    ptr(dst), dst_bytes, wire_id_bytes, threads);
        },
        py::arg("src"), py::arg("src_rows"), py::arg("src_row_bytes"), py::arg("index"), py::arg("index_code"),
        py::arg("index_len"), py::arg("nseg"), py::arg("segments"), py::arg("dst"), py::arg("dst_bytes"),
        py::arg("wire_id_bytes"), py::arg("threads"),
        "Copy (indexed) rows into segments of a byte buffer; index may be 0 (rows in order).");

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

  m.def("gather_rows",
        [](uintptr_t table, int64_t num_rows, size_t row_bytes, uintptr_t ids, int index_code, int64_t n,
           uintptr_t out, int threads) {
          const IndexType it = to_index_type(index_code);
          py::gil_scoped_release release;
          gather_rows(ptr(table), num_rows, row_bytes, ptr(ids), it, n, ptr(out), threads);
        },
        py::arg("table"), py::arg("num_rows"), py::arg("row_bytes"), py::arg("ids"), py::arg("index_code"),
        py::arg("n"), py::arg("out"), py::arg("threads"));

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

  m.def("advise_huge_pages", [](uintptr_t data, int64_t bytes) { advise_huge_pages(ptr(data), static_cast<size_t>(bytes)); },
        py::arg("data"), py::arg("bytes"),
        "Ask for transparent huge pages over the 2 MiB-aligned interior of [data, data + bytes) (>= 4 MiB; Linux).");

  m.def("rowwise_adagrad",
        [](uintptr_t weight, uintptr_t acc, int64_t num_rows, int value_code, int64_t d, uintptr_t slots, int64_t k,
           uintptr_t grad, double lr, double eps, int threads) {
          const ValueType vt = to_value_type(value_code);
          py::gil_scoped_release release;
          rowwise_adagrad(ptr(weight), ptr(acc), num_rows, vt, d, ptr<const int64_t>(slots), k, ptr(grad), lr, eps,
                          threads);
        },
        py::arg("weight"), py::arg("acc"), py::arg("num_rows"), py::arg("value_code"), py::arg("d"),
        py::arg("slots"), py::arg("k"), py::arg("grad"), py::arg("lr"), py::arg("eps"), py::arg("threads"));

  py::class_<PooledLists>(m, "PooledLists")
      .def_property_readonly("num_unique", [](const PooledLists& p) { return static_cast<int64_t>(p.unique.size()); })
      .def_property_readonly("num_bags", [](const PooledLists& p) { return static_cast<int64_t>(p.bag_rows.size()); })
      .def("write",
           [](const PooledLists& p, uintptr_t unique, uintptr_t bag_rows, uintptr_t lengths) {
             // Copies the lists into tensors sized from num_unique / num_bags; 0 skips one.
             if (unique && !p.unique.empty())
               std::memcpy(ptr(unique), p.unique.data(), p.unique.size() * sizeof(int64_t));
             if (bag_rows && !p.bag_rows.empty())
               std::memcpy(ptr(bag_rows), p.bag_rows.data(), p.bag_rows.size() * sizeof(int64_t));
             if (lengths && !p.lengths.empty())
               std::memcpy(ptr(lengths), p.lengths.data(), p.lengths.size() * sizeof(int32_t));
           },
           py::arg("unique"), py::arg("bag_rows"), py::arg("lengths"));

  m.def("group_by",
        [](uintptr_t index, int64_t n, int64_t size, uintptr_t order, uintptr_t offsets, int threads) {
          py::gil_scoped_release release;
          group_by(ptr<const int64_t>(index), n, size, ptr<int64_t>(order), ptr<int64_t>(offsets), threads);
        },
        py::arg("index"), py::arg("n"), py::arg("size"), py::arg("order"), py::arg("offsets"), py::arg("threads"),
        "Stable counting sort of int64 positions by index in [0, size): order (n) and group starts (size).");

  m.def("bag_groups",
        [](uintptr_t key, int64_t r, uintptr_t positions, int64_t n, uintptr_t lengths, int64_t num_bags,
           int64_t size, uintptr_t order, uintptr_t rows, uintptr_t offsets, int threads) {
          py::gil_scoped_release release;
          bag_groups(ptr<const int64_t>(key), r, ptr<const int64_t>(positions), n, ptr<const int64_t>(lengths),
                     num_bags, size, ptr<int64_t>(order), ptr<int64_t>(rows), ptr<int64_t>(offsets), threads);
        },
        py::arg("key"), py::arg("r"), py::arg("positions"), py::arg("n"), py::arg("lengths"), py::arg("num_bags"),
        py::arg("size"), py::arg("order"), py::arg("rows"), py::arg("offsets"), py::arg("threads"),
        "Owner-side backward plan of pooled lookups: occurrences grouped by key[positions] (stable), their bags.");

  m.def("unique_inverse",
        [](uintptr_t ids, int64_t n, int64_t num_rows, uintptr_t inverse, int threads) {
          auto lists = std::make_unique<PooledLists>();
          py::gil_scoped_release release;
          unique_inverse(ptr<const int64_t>(ids), n, num_rows, lists->unique, ptr<int64_t>(inverse), threads);
          return lists;
        },
        py::arg("ids"), py::arg("n"), py::arg("num_rows"), py::arg("inverse"), py::arg("threads"),
        "Distinct int64 ids ascending (kept in the returned lists' unique) and each id's index among them.");

  m.def("pooled_request",
        [](uintptr_t ids, uintptr_t bag_of, int64_t n, int64_t num_rows, int64_t num_bags, int scheme,
           int64_t num_owners, int64_t range_size, int64_t stride, uintptr_t unique_counts, uintptr_t order,
           uintptr_t occ_counts, uintptr_t positions, uintptr_t bag_counts, int threads) {
          const OwnerMap map{scheme, num_owners, range_size, stride};
          auto lists = std::make_unique<PooledLists>();
          py::gil_scoped_release release;
          pooled_request(ptr<const int64_t>(ids), ptr<const int64_t>(bag_of), n, num_rows, num_bags, map,
                         ptr<int64_t>(unique_counts), ptr<int64_t>(order), ptr<int64_t>(occ_counts),
                         ptr<int32_t>(positions), ptr<int64_t>(bag_counts), *lists, threads);
          return lists;
        },
        py::arg("ids"), py::arg("bag_of"), py::arg("n"), py::arg("num_rows"), py::arg("num_bags"), py::arg("scheme"),
        py::arg("num_owners"), py::arg("range_size"), py::arg("stride"), py::arg("unique_counts"), py::arg("order"),
        py::arg("occ_counts"), py::arg("positions"), py::arg("bag_counts"), py::arg("threads"),
        "Owner pooling's request: fixed-size outputs written, the distinct ids and partial bags returned.");

  py::class_<ShmAllToAll>(m, "ShmAllToAll")
      .def(py::init<const std::string&, bool, int, int, uint64_t>(), py::arg("path"), py::arg("create"),
           py::arg("rank"), py::arg("world"), py::arg("slot_bytes"),
           "Create (rank 0) or open a host-local all-to-all segment (see sparsecomm/collectives/shm.py).")
      .def("run",
           [](ShmAllToAll& s, uintptr_t send, const std::vector<int64_t>& send_bytes, uintptr_t recv,
              const std::vector<int64_t>& recv_bytes, double timeout_seconds) {
             py::gil_scoped_release release;
             s.run(ptr<const uint8_t>(send), send_bytes, ptr<uint8_t>(recv), recv_bytes, timeout_seconds);
           },
           py::arg("send"), py::arg("send_bytes"), py::arg("recv"), py::arg("recv_bytes"),
           py::arg("timeout_seconds"))
      .def("run_segments",
           [](ShmAllToAll& s, const std::vector<std::vector<std::pair<uint64_t, int64_t>>>& send,
              const std::vector<std::vector<std::pair<uint64_t, int64_t>>>& recv, double timeout_seconds) {
             auto convert = [](const std::vector<std::vector<std::pair<uint64_t, int64_t>>>& lists) {
               std::vector<std::vector<Segment>> out(lists.size());
               for (size_t j = 0; j < lists.size(); ++j)
                 for (const auto& [address, bytes] : lists[j]) out[j].push_back({address, bytes});
               return out;
             };
             const auto s_segs = convert(send), r_segs = convert(recv);
             py::gil_scoped_release release;
             s.run_segments(s_segs, r_segs, timeout_seconds);
           },
           py::arg("send"), py::arg("recv"), py::arg("timeout_seconds"),
           "Per peer, the (address, bytes) pieces of the message it gets / that lands here, in order.")
      .def_property_readonly("failed", &ShmAllToAll::failed)
      .def_property_readonly("bytes", &ShmAllToAll::bytes)
      .def_property_readonly("slot_bytes", &ShmAllToAll::slot_bytes);

  m.def("openmp_enabled", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
}
