// The four row kernels of the sparse path, on raw CPU buffers.
// Python reaches them through bindings.cpp; sparsecomm/ops.py validates and
// allocates, these functions re-check ids (bounds) and do the work.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"
#include "row_groups.h"

namespace sparsecomm {

enum class OwnerScheme : int { kHash = 0, kRange = 1 };

// owner(id) = (bucket(id) / stride) % num_owners, bucket = splitmix64(id) or id / range_size.
struct OwnerMap {
  OwnerScheme scheme;
  int64_t num_owners;
  int64_t range_size;
  int64_t stride;
};

// Throws std::invalid_argument (Python ValueError) for a scheme/owner count/size that would divide by zero.
void check_owner_map(const OwnerMap& map);

int64_t row_owner(int64_t id, const OwnerMap& map);

// Writes the sorted unique ids of `groups` to out_ids and their row sums to out_values.
void coalesce_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d, void* out_ids,
                    IndexType it, void* out_values, int threads);

void partition_rows(const void* ids, IndexType it, int64_t n, int64_t num_rows, const void* values,
                    size_t row_bytes, const OwnerMap& map, int64_t* counts, void* out_ids, void* out_values, int64_t* perm,
                    int threads);

void gather_rows(const void* table, int64_t num_rows, size_t row_bytes, const void* ids, IndexType it,
                 int64_t n, void* out, int threads);

void scatter_add_rows(void* table, int64_t num_rows, ValueType vt, int64_t d, const void* ids, IndexType it,
                      int64_t n, const void* values, int threads);

}  // namespace sparsecomm
