"""The densify path: scatter the rows into the dense table and all-reduce it, with a row mask.

Algorithm: every rank scatters its coalesced rows into a zero V x d table
and a uint8 row mask, both all-reduced (the mask with MAX); the union's rows
are the mask's non-zero rows. The table travels in the tensor's dtype, as a
dense all-reduce would: cheaper than the sparse paths only when most rows are
touched. The mask keeps rows whose sum is exactly zero: optimizers like
SparseAdam treat "row present with zero gradient" differently from "row absent".

Exactness: the backend's all-reduce sums in its own order (the same on every
rank for gloo and NCCL); ``op="avg"`` divides before the sum, as DDP does
(fp16 overflows otherwise).

Trust: nothing a peer sends sizes anything (the table's shape is checked
equal in the metadata).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.methods.base import SyncPath, Workload
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.cost_model import dense_allreduce_bytes
from sparsecomm.types import ReduceOp, SyncMethod

__all__ = ["PATH", "densify_allreduce", "host_bytes"]


def densify_allreduce(t: TensorRows, p: Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """The union's rows and their sums (or means), through an all-reduce of the dense table and a row mask."""
    n, cdev, stats = plan.world_size, plan.comm_device, t.stats
    ids, values = t.ids, t.values
    if plan.op is ReduceOp.AVG:
        values = values.to(t.sum_dtype).div_(n).to(values.dtype)
    dense = torch.zeros((t.num_rows, *values.shape[1:]), dtype=values.dtype, device=cdev)
    mask = torch.zeros(t.num_rows, dtype=torch.uint8, device=cdev)
    dense[ids.to(cdev).long()] = values.to(cdev)
    mask[ids.to(cdev).long()] = 1
    # Not kept (collectives.futures): table-sized buffers would pile up; the exit's settling covers them.
    works = [dist.all_reduce(dense, group=plan.group, async_op=True),
             dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=plan.group, async_op=True)]
    for w in works:
        w.wait()
    ring = 2 * (n - 1) / n if n > 1 else 0.0
    for x in (dense, mask):
        stats.bytes_sent += int(ring * x.numel() * x.element_size())
        stats.bytes_recv += int(ring * x.numel() * x.element_size())
    union = mask.nonzero().view(-1)
    return union.to(ids.device), dense.index_select(0, union).to(values.device)


def host_bytes(w: Workload, hosts: int, lws: int, union_node: float) -> float:
    """2 (N-1)/N V d b: a ring all-reduce of the table, one ring edge leaving each host."""
    n = hosts * lws
    if n <= 1 or hosts <= 1:
        return 0.0
    return 2 * (n - 1) / n * w.num_rows * w.row_elems * w.elem_bytes


PATH = SyncPath(
    name="densify",
    method=SyncMethod.DENSIFY,
    round_trips=lambda w: 3,          # the metadata, the table's all-reduce, the mask's
    latency=lambda w, lat: lat.all_to_all + (3 - 1) * lat.other,
    # The table plus its one-byte row mask, whatever the layout.
    link_bytes=lambda w: dense_allreduce_bytes(w.world_size, w.num_rows, w.row_elems * w.elem_bytes + 1, 1),
    fit_steps=lambda n: 2 * (n - 1) if n > 1 else 0.0,   # a ring all-reduce
    host_bytes=host_bytes,
    merged_rows=lambda w: w.num_rows,
    moves_table=True,
    fitted_name="dense",
    run=densify_allreduce,
)
