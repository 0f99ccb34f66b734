// coalesce rows: sorted unique ids and the per-id sums of their value rows.
#include "ops.h"
#include "segment_reduce.h"

namespace sparsecomm {

void coalesce_apply(const RowGroups& groups, const void* values, ValueType vt, int64_t d, void* out_ids,
                    IndexType it, void* out_values, int threads) {
  const int64_t u = groups.num_groups();
  for (int64_t g = 0; g < u; ++g) store_id(out_ids, it, g, groups.group_id[g]);
  if (d == 0 || u == 0) return;
  SPARSECOMM_DISPATCH_VALUE(vt, [&] { reduce_groups<V>(groups, values, d, out_values, false, false, threads); });
}

}  // namespace sparsecomm
