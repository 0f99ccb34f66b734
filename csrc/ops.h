// What several CPU row kernels share. Each kernel lives in its own csrc/<op>.cpp with its binding
// (SPARSECOMM_BIND, binding.h); sparsecomm/ops validates, sparsecomm/_library allocates, the kernels
// re-check ids (bounds) and do the work. Only helpers used by more than one kernel file belong here.
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

}  // namespace sparsecomm
