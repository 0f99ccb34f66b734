"""The two-level partitioned path (Parallax's local aggregation): sum inside each node before crossing nodes.

Taken instead of the flat partitioned path when several ranks share a node
(``local_world_size`` L, 1 < L < N, ranks of a node contiguous) and local
aggregation is on. Algorithm: push to owners inside the node, then push
across nodes among the ranks with the same local rank; share the sums back
across nodes, then inside the node. Each row crosses between nodes once per
node: (M-1)/M (U_n + U) rows on a host's link (M nodes, U_n the union of a
node's rows), against L (N-L)/N (k + U) for the flat exchange.

Exactness: each level sums in rank order; fp16/bf16 are summed in float32
and rounded once per level (twice in all), so the result can differ from the
flat path's in the last bit, and is bitwise the same on every rank.

Trust: every level's counts are exchanged and checked (``check_counts``)
before they size a buffer; received ids are bounds-checked as they are summed.
"""

from __future__ import annotations

from typing import Tuple

import torch

from sparsecomm import ops
from sparsecomm.collectives.exchange import allgather_rows, push_to_owners
from sparsecomm.collectives.groups import node_groups
from sparsecomm.collectives.methods.base import Latencies, SyncPath, Workload, exchange_latency
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.types import ReduceOp, SyncMethod

__all__ = ["PATH", "two_level_allreduce", "host_bytes"]


def two_level_allreduce(t: TensorRows, p: Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Push inside the node, then across nodes; share back across nodes, then inside the node."""
    n, lws, dtype = plan.world_size, plan.local_world_size, t.values.dtype
    local_pg, cross_pg = node_groups(plan.group, lws)
    nodes_local = [0] * lws                    # every peer in my node group is on my node
    nodes_cross = list(range(n // lws))        # every peer in my cross group is on another node
    common = dict(scheme=plan.scheme, num_rows=t.num_rows, range_size=plan.range_size(t.num_rows),
                  wire_ids=t.wire_ids, device=plan.comm_device, stats=t.stats, sum_dtype=t.sum_dtype)
    ids, values = push_to_owners(t.ids, t.values, local_pg, num_owners=lws, stride=1, peer_node=nodes_local,
                                 **common)
    ids, values = push_to_owners(ids, values.to(dtype), cross_pg, num_owners=n // lws, stride=lws,
                                 peer_node=nodes_cross, **common)
    if plan.op is ReduceOp.AVG:
        values.div_(n)
    values = values.to(dtype)
    ids, values = allgather_rows(ids, values, cross_pg, wire_ids=t.wire_ids, device=plan.comm_device,
                                 stats=t.stats, peer_node=nodes_cross, max_rows=t.num_rows)
    ids, values = allgather_rows(ids, values, local_pg, wire_ids=t.wire_ids, device=plan.comm_device,
                                 stats=t.stats, peer_node=nodes_local, max_rows=t.num_rows)
    return ops.coalesce_rows(ids, values, t.num_rows)


def host_bytes(w: Workload, hosts: int, lws: int, union_node: float) -> float:
    """(M-1)/M (U_n + U) r: each row leaves a host once, to the host that owns it, and comes back once."""
    n = hosts * lws
    if n <= 1 or hosts <= 1:
        return 0.0
    return (hosts - 1) / hosts * (union_node + w.union_rows) * w.row_bytes


def _latency(w: Workload, lat: Latencies) -> float:
    # The metadata among all N, then 4 exchanges among a node's L and 4 among the M nodes.
    n, lws = w.world_size, w.lws
    return (lat.all_to_all + 4 * exchange_latency(lws, n, lat.all_to_all, lat.pair)
            + 4 * exchange_latency(n // lws, n, lat.all_to_all, lat.pair))


PATH = SyncPath(
    name="two_level",
    method=SyncMethod.PARTITIONED,
    hierarchical=True,
    round_trips=lambda w: 9,
    latency=_latency,
    link_bytes=lambda w: host_bytes(w, w.hosts, w.lws, w.host_union),
    fit_steps=lambda n: 9 if n > 1 else 0.0,
    host_bytes=host_bytes,
    merged_rows=lambda w: 2 * (w.rows_mean + w.union_rows),
    node_layout=True,
    run=two_level_allreduce,
    compresses=True,
)
