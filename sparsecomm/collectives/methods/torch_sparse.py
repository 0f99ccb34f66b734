"""The torch path: the backend's own sparse ``all_reduce`` (gloo), then coalesced.

gloo's sparse all_reduce is three ring all-gathers (sizes, ids as int64,
values), N-1 hops each: what plain DDP does with a sparse gradient. Kept as
a method so a caller (or the classifier, on gloo) can take it where it wins,
and as the peer the other methods are measured against.

Exactness: every rank receives the same rows in the same (rank) order and
coalesces them with the library's kernel: identical sums everywhere.

Trust: gloo sizes its own buffers; the received ids are bounds-checked as
they are coalesced.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.futures import wait_kept
from sparsecomm.collectives.methods.base import SyncPath, Workload
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.types import ReduceOp, SyncMethod

__all__ = ["PATH", "torch_allreduce", "host_bytes"]


def torch_allreduce(t: TensorRows, p: Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """gloo's sparse all_reduce of the coalesced rows, coalesced again (the same rows in rank order everywhere)."""
    n = plan.world_size
    local = torch.sparse_coo_tensor(t.ids.long()[None], t.values, (t.num_rows, *t.value_shape()),
                                    is_coalesced=True, check_invariants=False).to(plan.comm_device)
    wait_kept(dist.all_reduce(local, group=plan.group, async_op=True), plan.group)
    row = t.stats.row_bytes + 8
    t.stats.bytes_sent += (n - 1) * t.ids.shape[0] * row
    t.stats.bytes_recv += (t.stats.rows_local_sum - t.ids.shape[0]) * row
    ids, values = local._indices()[0], local._values()
    ids, values = ops.coalesce_rows(ids.to(t.ids.device), values.to(t.values.device).to(t.sum_dtype), t.num_rows)
    if plan.op is ReduceOp.AVG:
        values.div_(n)
    return ids, values.to(t.values.dtype)


def _steps(n: int) -> float:
    return 3 * (n - 1) if n > 1 else 0.0


def host_bytes(w: Workload, hosts: int, lws: int, union_node: float) -> float:
    """(N-1) k (d b + 8): every rank's rows with int64 ids reach every rank, around the ring."""
    n = hosts * lws
    if n <= 1 or hosts <= 1:
        return 0.0
    return (n - 1) * w.rows_mean * (w.row_elems * w.elem_bytes + 8)


PATH = SyncPath(
    name="torch",
    method=SyncMethod.TORCH,
    round_trips=lambda w: _steps(w.world_size),
    latency=lambda w, lat: _steps(w.world_size) * lat.pair,
    link_bytes=lambda w: (w.world_size - 1) * w.rows_mean * (w.row_elems * w.elem_bytes + 8),
    fit_steps=_steps,
    host_bytes=host_bytes,
    merged_rows=lambda w: w.world_size * w.rows_mean,
    backend="gloo",
    baseline=True,
    run=torch_allreduce,
)
