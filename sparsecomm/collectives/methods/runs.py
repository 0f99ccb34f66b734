"""The runs path: an allgather that sends each run of equal consecutive rows once (pooled bags' gradients).

A sum-pooled ``EmbeddingBag``'s sparse gradient holds one row per looked-up
id, and every id of a bag gets the same row (the bag's output gradient):
``B`` bags of ``s`` ids give ``B s`` rows but only ``B`` different ones, in
runs. The allgather path coalesces them first (k distinct rows, each a sum);
this path sends the input as it is, compressed without loss: per rank its
``n`` ids, then ``m`` runs (a length and one value row each). On the
benchmark's tables (bags of 8 Zipf ids) that is 2.3-2.7x fewer bytes than
the k coalesced rows.

Algorithm: every rank finds the runs of bitwise-equal consecutive rows of its
input (``sync_plan.prepare``); one all-to-all (fused with the call's other
allgather and partitioned tensors, after the metadata's) sends every rank
every rank's ids, run lengths and run rows; every rank expands the runs back
into rows and sums all ranks' rows by id. Bytes per rank: (N-1) (n i + m
(d b + 4)) instead of the allgather's (N-1) k (d b + i); rows summed per rank:
N n instead of N k: it wins where the link, not the merge, is the cost.

Exactness: expanding the runs gives back the input rows bit for bit (runs are
found on the rows' bytes: -0.0 and 0.0, or two NaNs, are not merged); every
rank sums the same rows in the same (rank, then input) order, so results are
bitwise the same everywhere; fp16/bf16 accumulate in float32. The sums equal
the allgather path's up to floating-point summation order (there each rank's
rows are summed locally first).

Trust: the counts (n, m) come from the validated metadata; a peer's run
lengths must each be at least 1 and add up to its n, and its ids lie in the
table, else every rank (all received the same bytes) raises ``ValueError``.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import List, Sequence, Tuple

import torch

from sparsecomm import ops
from sparsecomm.collectives.exchange import Gathered
from sparsecomm.collectives.fused import FusedPush
from sparsecomm.collectives.methods.base import SyncPath, Workload
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.collectives.transport import kernel_ids
from sparsecomm.types import SyncMethod

__all__ = ["PATH", "host_bytes", "LENGTH_BYTES"]

LENGTH_BYTES = 4   # a run's length travels as int32


def host_bytes(w: Workload, hosts: int, lws: int, union_node: float) -> float:
    """L (N-L) (n i + m (d b + 4)): a host's L ranks each send their ids and runs to the N-L ranks of other hosts."""
    if w.runs is None:
        return math.inf   # not measured: not priced
    n = hosts * lws
    if n <= 1 or hosts <= 1:
        return 0.0
    per_rank = w.runs.ids_mean * w.index_bytes + w.runs.runs_mean * (w.row_elems * w.elem_bytes + LENGTH_BYTES)
    return lws * (n - lws) * per_rank


def _push(t: TensorRows, p: Peers, plan: SyncPlan) -> List[FusedPush]:
    n, me = plan.world_size, plan.rank
    return [FusedPush([Gathered(t.ids, None, t.wire_ids)], [p.ids[me]] * n, list(p.ids), repeat=True),
            FusedPush([t.run_lengths, t.values], [p.runs[me]] * n, list(p.runs), repeat=True)]


def _check_lengths(lengths: torch.Tensor, p: Peers) -> None:
    """Every run at least one row, each rank's runs covering exactly its ids (same verdict on every rank)."""
    if lengths.numel() == 0:
        return
    ends = torch.cumsum(lengths.to(torch.int64), 0)
    # Per rank with runs: the index of its last run, and the ids covered up to and including it.
    sent = [(r_end - 1, i_end) for r_end, i_end, m in zip(accumulate(p.runs), accumulate(p.ids), p.runs) if m]
    last = torch.tensor([r for r, _ in sent], dtype=torch.int64, device=lengths.device)
    want = torch.tensor([i for _, i in sent], dtype=torch.int64, device=lengths.device)
    if int(lengths.min()) < 1 or not torch.equal(ends.index_select(0, last), want):
        raise ValueError("sparse_allreduce: a peer sent run lengths that do not cover its ids "
                         "(inconsistent data between ranks)")


def _merge(t: TensorRows, received: Sequence[Sequence[torch.Tensor]], p: Peers, plan: SyncPlan
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Expand every rank's runs into rows and sum them by id (rank order, then input order)."""
    (ids,), (lengths, rows) = received
    _check_lengths(lengths, p)
    rows = rows.to(t.sum_dtype).repeat_interleave(lengths.to(torch.int64), dim=0, output_size=ids.shape[0])
    try:
        ids, sums = ops.coalesce_rows(kernel_ids(ids), rows, t.num_rows)
    except ValueError:  # every rank received the same ids: every rank raises
        raise ValueError(f"sparse_allreduce: a peer sent row ids outside [0, {t.num_rows}) "
                         f"(inconsistent data between ranks)") from None
    return ids.to(t.ids.dtype), sums


PATH = SyncPath(
    name="runs",
    method=SyncMethod.RUNS,
    round_trips=lambda w: 2,          # metadata, then every rank's ids and runs to every rank
    latency=lambda w, lat: 2 * lat.all_to_all,
    link_bytes=lambda w: host_bytes(w, w.hosts, w.lws, w.host_union),
    fit_steps=lambda n: 2 if n > 1 else 0.0,
    host_bytes=host_bytes,
    # Every rank's n rows summed, and the pass that finds the runs (about one more coalesce of the input).
    merged_rows=lambda w: (w.world_size + 1) * (w.runs.ids_mean if w.runs is not None else w.rows_mean),
    fused=True,
    runs=True,
    push=_push,
    merge=_merge,
    compresses=True,
)
