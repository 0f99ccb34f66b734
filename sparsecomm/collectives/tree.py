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

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.exchange import all_to_all, count_bytes
from sparsecomm.collectives.sync_plan import ERR_OK, ERR_RANGE, Peers, Rows, SyncPlan
from sparsecomm.cost_model import tree_schedule
from sparsecomm.types import ReduceOp

__all__ = ["tree_allreduce", "tree_schedule"]

ERR_COUNT = 3  # a partner announced a row count outside its bounds (ERR_RANGE, 1: ids outside the table)


def tree_allreduce(t: Rows, peers: Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
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
    err = ERR_OK

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
        if err == ERR_OK:
            ids, values, err = link.merge((ids, values), (other_ids, other_values))
    covered = 0  # bits merged so far
    for bit in bits:
        partner = me ^ bit
        mine_bound = bound([r for q in range(p) if (q ^ me) & ~covered == 0 for r in folded(q)])
        theirs_bound = bound([r for q in range(p) if (q ^ partner) & ~covered == 0 for r in folded(q)])
        other_ids, other_values, err = link.swap(partner, ids, values, err, mine_bound, theirs_bound)
        if err == ERR_OK:
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

    def __init__(self, t: Rows, plan: SyncPlan):
        self.t, self.plan = t, plan
        self.dev = plan.comm_device
        self.wi = torch.empty(0, dtype=t.wire_ids).element_size()
        self.wv = t.stats.row_bytes
        self.sent = [0] * plan.world_size
        self.recv = [0] * plan.world_size

    def _global(self, r: int) -> int:
        g = self.plan.group
        return r if g is None or g is dist.GroupMember.WORLD else dist.get_global_rank(g, r)

    def _count(self, ids: torch.Tensor, err: int) -> int:
        return ids.shape[0] if err == ERR_OK else -1 - err

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
            err = err or (-1 - theirs if -1 - theirs in (ERR_RANGE, ERR_COUNT) else ERR_COUNT)
        elif theirs > theirs_bound:
            err = err or ERR_COUNT
        # Both sides evaluate the same rule on the same two numbers: rows move both ways or not at all.
        move = 0 <= mine <= mine_bound and 0 <= theirs <= theirs_bound
        if not move:
            return ids[:0], values[:0], err or ERR_COUNT
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
            return (*empty, err or (-1 - count if -1 - count in (ERR_RANGE, ERR_COUNT) else ERR_COUNT))
        if count > limit:  # no rows follow (the sender's rule); the verdict round fails every rank
            return (*empty, err or ERR_COUNT)
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
            return ids[:0], t.values[:0], ERR_RANGE
        return ids, values.to(t.values.dtype), ERR_OK

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
        bad = [(r, c) for r, c in enumerate(codes) if c != ERR_OK]
        if bad:
            r, c = bad[0]
            what = "row ids outside [0, %d)" % self.t.num_rows if c == ERR_RANGE else "an impossible row count"
            raise ValueError(f"sparse_allreduce (tree): rank {r} received {what} from its partner "
                             f"(inconsistent data between ranks); nothing was returned")
        return ids, values
