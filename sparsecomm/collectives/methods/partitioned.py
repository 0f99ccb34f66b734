"""The partitioned path: push each row to its owner, owners sum, owners share the sums (the parameter server).

Algorithm: every rank partitions its coalesced rows by owner
(:mod:`sparsecomm.ownership`), pushes each owner the rows it owns, each
owner sums what it received in rank order, then shares its summed rows with
every rank. Fused: every partitioned (and allgather) tensor of a call shares
one push all-to-all, and the partitioned ones one pull-count exchange and one
pull all-to-all (``collectives/fused.py``). About (N-1)/N (k + U) rows per
rank, instead of the (N-1) k of an allgather.

Exactness: each row is summed once, by its owner, adding ranks in rank
order; every rank receives the owner's bytes, so results are bitwise the same
everywhere. fp16/bf16 accumulate in float32 and round once.

Trust: push counts come from the validated metadata; ids an owner receives
are bounds-checked as it sums them (an owner that finds a bad id tells every
rank in its pull count); pull counts are checked against what was pushed.
"""

from __future__ import annotations

from typing import List

from sparsecomm.collectives.exchange import Gathered
from sparsecomm.collectives.fused import FusedPush
from sparsecomm.collectives.methods.base import SyncPath, Workload
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.types import SyncMethod

__all__ = ["PATH", "host_bytes"]


def host_bytes(w: Workload, hosts: int, lws: int, union_node: float) -> float:
    """L (N-L)/N (k + U) r: the flat exchange's bytes from a host's L ranks to other hosts."""
    n = hosts * lws
    if n <= 1 or hosts <= 1:
        return 0.0
    return lws * (n - lws) / n * (w.rows_mean + w.union_rows) * w.row_bytes


def _push(t: TensorRows, p: Peers, plan: SyncPlan) -> List[FusedPush]:
    n, me = plan.world_size, plan.rank
    recv: List[int] = [p.push[i][me] for i in range(n)]
    return [FusedPush([Gathered(t.part.ids, None, t.wire_ids), Gathered(t.values, t.part.perm)], p.push[me], recv,
                      repeat=False)]


PATH = SyncPath(
    name="partitioned",
    method=SyncMethod.PARTITIONED,
    round_trips=lambda w: 4,          # metadata (+ push counts), push, pull counts, pull
    latency=lambda w, lat: 4 * lat.all_to_all,
    link_bytes=lambda w: host_bytes(w, w.hosts, w.lws, w.host_union),
    fit_steps=lambda n: 4 if n > 1 else 0.0,
    host_bytes=host_bytes,
    merged_rows=lambda w: w.rows_mean + w.union_rows,
    fused=True,
    pulls=True,
    partitions=True,
    push=_push,
    compresses=True,
)
