// Grouping of row ids: a stable sort of positions by id, and the boundaries
// of each run of equal ids. Coalesce and scatter-add both stand on it: each
// group is then reduced by one thread, in the original input order, which is
// what makes the results bitwise independent of the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace sparsecomm {

struct RowGroups {
  std::vector<int64_t> order;        // input positions, stably sorted by id
  std::vector<int64_t> group_start;  // size num_groups + 1; group g = order[start[g] : start[g+1]]
  std::vector<int64_t> group_id;     // id of each group, ascending
  int64_t num_groups() const { return static_cast<int64_t>(group_id.size()); }
};

// Groups ids[0:n]; every id must lie in [0, num_rows) (num_rows < 0: no upper bound).
RowGroups group_rows(const void* ids, IndexType it, int64_t n, int64_t num_rows, int threads);

}  // namespace sparsecomm
