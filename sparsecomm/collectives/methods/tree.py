"""The tree path: recursive doubling with a merge at each stage (SparCML-style), for rows that barely overlap.

At each of log2(P) stages a rank swaps its merged rows so far with one
partner (the rank differing in one bit) and both merge the two sets, so the
set a rank sends grows with the union of the ranks it covers, never with
their row count: (N-1) k rows per rank when ranks' rows are disjoint (like
an allgather) and log2(N) k when they are identical, between the two
otherwise (Zen, OSDI'25: with partitioned push/pull, the two
communication-optimal families for sparse allreduce).

Any world size: with P the largest power of two <= N, ranks P..N-1 first
fold their rows into ranks 0..N-P-1, which run the doubling and send the
result back (as recursive halving/doubling allreduce does). With several
ranks per node (every rank agrees on the node size through the metadata
header), the stages between nodes run first, while merged sets are still
small, and the stages inside a node last.

Exactness: both partners of a stage compute ``coalesce(lower rank's set,
higher rank's set)`` from the same bytes, so after the last stage every rank
holds bitwise the same sorted, coalesced rows. fp16/bf16 are summed in
float32 at each merge and rounded once per stage (they travel in their own
dtype); ``op="avg"`` divides each rank's rows by N before the first stage,
as DDP does (fp16 overflows otherwise).

Trust: each stage first swaps one int64 (the row count, or a negative error
code), and rows move only when both counts lie within the bounds every
rank derives from the validated metadata (a block's rows <= min(V, sum of
its ranks' k)): both partners evaluate the same rule, so a bad count never
sizes a buffer nor leaves one side waiting. Received ids pass through
``ops.coalesce_rows``' bounds check. Errors travel on in later counts, and a
last all-to-all of one int64 per peer makes every rank raise together.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.methods.base import Latencies, SyncPath, Workload
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.collectives.transport import all_to_all, count_bytes
from sparsecomm.cost_model import union_rows
from sparsecomm.types import ReduceOp, SyncMethod, WireStatus

__all__ = ["PATH", "tree_allreduce", "tree_schedule", "tree_bytes", "host_bytes"]


def tree_allreduce(t: TensorRows, peers: Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum one tensor's coalesced rows over the group by recursive doubling; see the module docstring.

    Returns:
        ``(ids, values)``: sorted unique ids and their sums in the tensor's
        dtype, bitwise the same on every rank.

    Raises:
        ValueError: on every rank, when any rank received counts or ids
            inconsistent with the metadata.
    """
    n, me = plan.world_size, plan.rank
    node_size = plan.local_world_size
    p, bits = tree_schedule(n, node_size)
    link = _Link(t, plan)
    ids, values = t.ids, t.values
    if plan.op is ReduceOp.AVG:
        values = values.to(t.sum_dtype).div_(n).to(values.dtype)
    err = WireStatus.OK

    def bound(ranks: List[int]) -> int:
        return min(t.num_rows, sum(peers.k[r] for r in ranks))

    def folded(q: int) -> List[int]:
        return [q, q + p] if q + p < n else [q]

    if me >= p:  # fold in, then wait for the result
        err = link.send_rows(me - p, ids, values, err, bound([me]))
        ids, values, err = link.recv_rows(me - p, bound(list(range(n))), err)
        return link.finish(ids, values, err)
    if me + p < n:
        other_ids, other_values, err = link.recv_rows(me + p, bound([me + p]), err)
        if err == WireStatus.OK:
            ids, values, err = link.merge((ids, values), (other_ids, other_values))
    covered = 0  # bits merged so far
    for bit in bits:
        partner = me ^ bit
        mine_bound = bound([r for q in range(p) if (q ^ me) & ~covered == 0 for r in folded(q)])
        theirs_bound = bound([r for q in range(p) if (q ^ partner) & ~covered == 0 for r in folded(q)])
        other_ids, other_values, err = link.swap(partner, ids, values, err, mine_bound, theirs_bound)
        if err == WireStatus.OK:
            lower, upper = ((ids, values), (other_ids, other_values))
            if partner < me:
                lower, upper = upper, lower
            ids, values, err = link.merge(lower, upper)
        covered |= bit
    if me + p < n:
        err = link.send_rows(me + p, ids, values, err, bound(list(range(n))))
    return link.finish(ids, values, err)


class _Link:
    """Point-to-point messages of one tensor's tree, with byte counting and the final verdict."""

    def __init__(self, t: TensorRows, plan: SyncPlan):
        self.t, self.plan = t, plan
        self.dev = plan.comm_device
        self.wi = t.wire_ids.itemsize
        self.wv = math.prod(t.value_shape()) * t.values.element_size()   # a row on the wire (maybe compressed)
        self.sent = [0] * plan.world_size
        self.recv = [0] * plan.world_size

    def _global(self, r: int) -> int:
        g = self.plan.group
        return r if g is None or g is dist.GroupMember.WORLD else dist.get_global_rank(g, r)

    def _count(self, ids: torch.Tensor, err: int) -> int:
        return ids.shape[0] if err == WireStatus.OK else -1 - err

    # ---- messages

    def _swap_ints(self, peer: int, value: Optional[int], receive: bool) -> Optional[int]:
        reqs, got = [], None
        if value is not None:
            reqs.append(dist.isend(torch.tensor([value], dtype=torch.int64, device=self.dev), self._global(peer),
                                   group=self.plan.group))
            self.sent[peer] += 8
        if receive:
            got = torch.empty(1, dtype=torch.int64, device=self.dev)
            reqs.append(dist.irecv(got, self._global(peer), group=self.plan.group))
            self.recv[peer] += 8
        for r in reqs:
            r.wait()
        return None if got is None else int(got.item())

    def _size(self, k: int) -> Tuple[int, int]:
        # Values first, ids at the next multiple of 8 bytes: each region can be viewed in its dtype.
        off = (k * self.wv + 7) // 8 * 8
        return off, off + k * self.wi

    def _pack(self, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        k = ids.shape[0]
        off, size = self._size(k)
        buf = torch.empty(size, dtype=torch.uint8, device=self.dev)
        if k:
            buf[:k * self.wv].view(values.dtype).view(k, -1).copy_(values.reshape(k, -1))
            buf[off:].view(self.t.wire_ids).copy_(ids)
        return buf

    def _unpack(self, buf: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        t = self.t
        off, _ = self._size(k)
        ids = buf[off:].view(t.wire_ids).to(device=t.ids.device, dtype=t.ids.dtype)
        values = buf[:k * self.wv].view(t.values.dtype).view(k, *t.value_shape()).to(t.values.device)
        return ids, values

    def _rows(self, peer: int, send: Optional[torch.Tensor], recv_count: int) -> Optional[torch.Tensor]:
        reqs, buf = [], None
        if send is not None and send.numel():
            reqs.append(dist.isend(send, self._global(peer), group=self.plan.group))
            self.sent[peer] += send.numel()
        if recv_count > 0:
            buf = torch.empty(self._size(recv_count)[1], dtype=torch.uint8, device=self.dev)
            reqs.append(dist.irecv(buf, self._global(peer), group=self.plan.group))
            self.recv[peer] += buf.numel()
        for r in reqs:
            r.wait()
        return buf

    # ---- steps

    def swap(self, peer: int, ids, values, err: int, mine_bound: int, theirs_bound: int):
        """Both partners send their count, then (if both counts are in bounds) their rows."""
        mine = self._count(ids, err)
        theirs = self._swap_ints(peer, mine, receive=True)
        if theirs < 0:
            err = err or (-1 - theirs if -1 - theirs in (WireStatus.ID_RANGE, WireStatus.BAD_COUNT) else WireStatus.BAD_COUNT)
        elif theirs > theirs_bound:
            err = err or WireStatus.BAD_COUNT
        # Both sides evaluate the same rule on the same two numbers: rows move both ways or not at all.
        move = 0 <= mine <= mine_bound and 0 <= theirs <= theirs_bound
        if not move:
            return ids[:0], values[:0], err or WireStatus.BAD_COUNT
        buf = self._rows(peer, self._pack(ids, values), theirs)
        other = self._unpack(buf, theirs) if buf is not None else (ids[:0], values[:0])
        return other[0], other[1], err

    def send_rows(self, peer: int, ids, values, err: int, limit: int) -> int:
        """One-way rows (fold in, result out): the count, then the rows if it lies in [0, limit].

        The receiver applies the same rule to the same count, so a refused
        count moves no rows either way.
        """
        count = self._count(ids, err)
        self._swap_ints(peer, count, receive=False)
        if 0 < count <= limit:
            self._rows(peer, self._pack(ids, values), 0)
        return err

    def recv_rows(self, peer: int, limit: int, err: int):
        t = self.t
        empty = (t.ids[:0], t.values[:0])
        count = self._swap_ints(peer, None, receive=True)
        if count < 0:
            return (*empty, err or (-1 - count if -1 - count in (WireStatus.ID_RANGE, WireStatus.BAD_COUNT) else WireStatus.BAD_COUNT))
        if count > limit:  # no rows follow (the sender's rule); the verdict round fails every rank
            return (*empty, err or WireStatus.BAD_COUNT)
        buf = self._rows(peer, None, count)
        got = self._unpack(buf, count) if buf is not None else empty
        return got[0], got[1], err

    def merge(self, lower, upper):
        t = self.t
        ids = torch.cat([lower[0], upper[0]])
        values = torch.cat([lower[1], upper[1]]).to(t.sum_dtype)
        try:
            # Received ids are bounds-checked here, before they index anything.
            ids, values = ops.coalesce_rows(ids, values, t.num_rows)
        except ValueError:
            return ids[:0], t.values[:0], WireStatus.ID_RANGE
        return ids, values.to(t.values.dtype), WireStatus.OK

    def finish(self, ids, values, err: int):
        """Every rank's error code to every rank (one all-to-all): raise together, or return the rows."""
        plan, n = self.plan, self.plan.world_size
        send = torch.full((n,), err, dtype=torch.int64, device=self.dev)
        got = torch.empty_like(send)
        all_to_all(got, send, group=plan.group)
        for r in range(n):
            if r != plan.rank:
                self.sent[r] += 8
                self.recv[r] += 8
        count_bytes(self.t.stats, self.sent, self.recv, plan.rank, plan.peer_node)
        codes = got.tolist()
        bad = [(r, c) for r, c in enumerate(codes) if c != WireStatus.OK]
        if bad:
            r, c = bad[0]
            what = "row ids outside [0, %d)" % self.t.num_rows if c == WireStatus.ID_RANGE else "an impossible row count"
            raise ValueError(f"sparse_allreduce (tree): rank {r} received {what} from its partner "
                             f"(inconsistent data between ranks); nothing was returned")
        return ids, values


# ----------------------------------------------------------------- pricing


def tree_schedule(world_size: int, node_size: int = 1) -> Tuple[int, List[int]]:
    """The tree's doubling size P (largest power of two <= N) and each stage's partner bit (``rank ^ bit``).

    Bits that cross nodes come first when ``node_size`` is a power of two
    dividing P (ranks of a node contiguous), so the large late stages stay
    inside a node. Ranks P..N-1 fold into ranks 0..N-P-1 before the stages.
    """
    p = 1 << (world_size.bit_length() - 1) if world_size > 0 else 1
    bits = [1 << i for i in range(p.bit_length() - 1)]
    if 1 < node_size < p and p % node_size == 0 and node_size & (node_size - 1) == 0:
        bits = [b for b in bits if b >= node_size] + [b for b in bits if b < node_size]
    return p, bits


def tree_bytes(world_size: int, k: float, union: float, row_bytes: float) -> float:
    """Bytes the busiest rank sends on the tree path: sum over log2 P stages of its merged set so far.

        sum_{s < log2 P} u(2^s N/P) r  (+ (k + U) r when N is not a power of two: fold in, result out)

    u(m) is :func:`~sparsecomm.cost_model.union_rows`. Disjoint rows: (N-1) k r, like an allgather;
    identical rows: log2(N) k r, against 2 (N-1)/N k r for partitioned.
    """
    n = world_size
    if n <= 1:
        return 0.0
    p, bits = tree_schedule(n)
    total = sum(union_rows((1 << s) * n / p, n, k, union) for s in range(len(bits)))
    if n != p:
        total += k + union
    return total * row_bytes


def host_bytes(w: Workload, hosts: int, lws: int, union_node: float) -> float:
    """L sum over the stages between hosts of u(ranks covered) r (node bits first); folded ranks on other hosts."""
    n = hosts * lws
    if n <= 1 or hosts <= 1:
        return 0.0
    k, union = w.rows_mean, w.union_rows
    p, bits = tree_schedule(n, lws)
    covered, total = 1, 0.0
    for bit in bits:
        if bit >= lws:  # partner on another host
            total += lws * union_rows(covered * n / p, n, k, union)
        covered *= 2
    if n != p:  # folded ranks: assume they sit on other hosts
        total += (n - p) / hosts * (k + union)
    return total * w.row_bytes


def _steps(n: int) -> float:
    """Messages on the critical path: the metadata, a count and a row message per stage, the verdict (+4 folding)."""
    if n <= 1:
        return 0.0
    p, bits = tree_schedule(n)
    return 2 + 2 * len(bits) + (4 if n != p else 0)


def _link_bytes(w: Workload) -> float:
    if w.lws == 1:
        return tree_bytes(w.world_size, w.rows_mean, w.union_rows, w.row_bytes)
    return host_bytes(w, w.hosts, w.lws, w.host_union)


def _merged_rows(w: Workload) -> float:
    n, k, union = w.world_size, w.rows_mean, w.union_rows
    p, bits = tree_schedule(n)
    return sum(2 * union_rows((1 << s) * n / p, n, k, union) for s in range(len(bits))) + k


def _latency(w: Workload, lat: Latencies) -> float:
    # The metadata and the verdict are all-to-alls; every stage's count and rows are pairwise messages.
    return 2 * lat.all_to_all + (_steps(w.world_size) - 2) * lat.pair


PATH = SyncPath(
    name="tree",
    method=SyncMethod.TREE,
    round_trips=lambda w: _steps(w.world_size),
    latency=_latency,
    link_bytes=_link_bytes,
    fit_steps=_steps,
    host_bytes=host_bytes,
    merged_rows=_merged_rows,
    node_layout=True,
    run=tree_allreduce,
    compresses=True,
)
