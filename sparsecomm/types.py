"""Plain types shared by every layer: configs, topology, statistics. No communication here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Optional

__all__ = ["PartitionScheme", "ReduceOp", "SyncMethod", "WireStatus", "Topology", "SparseSyncStats"]


class PartitionScheme(str, enum.Enum):
    """How rows are assigned to owner ranks."""

    HASH = "hash"    # splitmix64(id) mod N: balanced under Zipf skew (default)
    RANGE = "range"  # contiguous blocks of ceil(V / N) rows
    TABLE = "table"  # every row on one owner (table-wise placement)


class SyncMethod(str, enum.Enum):
    """How a sparse gradient is synchronized."""

    PARTITIONED = "partitioned"  # push rows to owners, sum there, share back (default)
    ALLGATHER = "allgather"      # every rank gathers every rank's rows and sums locally (Horovod)
    DENSIFY = "densify"          # scatter into the dense table and allreduce it (+ a row mask)
    TORCH = "torch"              # the backend's own sparse all_reduce (gloo), then coalesced
    TREE = "tree"                # recursive doubling, merging rows at each of log2 N stages (SparCML)
    RUNS = "runs"                # an allgather sending each run of equal consecutive rows once (pooled bags)


class WireStatus(enum.IntEnum):
    """A rank's verdict on its own input, or on what a peer sent it: the one code set every exchange carries.

    A rank that finds a problem does not raise alone (its peers would wait
    in the next collective); it sends the code in the exchange's metadata, or
    as a negative count (``-1 - code``), and every rank raises together.
    """

    OK = 0
    ID_RANGE = 1    # row ids outside the table
    NONFINITE = 2   # NaN or Inf values where nonfinite="raise"
    BAD_COUNT = 3   # a peer announced a row count outside the bounds the metadata allows
    BAD_INPUT = 4   # a lookup's input is not valid (type, dtype, device, offsets)


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    AVG = "avg"


@dataclass(frozen=True)
class Topology:
    """Where this process sits: global rank/size and its node.

    Ranks of a node are assumed contiguous: node ``rank // local_world_size``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


@dataclass
class SparseSyncStats:
    """What one sparse synchronization did on this rank.

    Bytes count payload put on / taken off the wire by this rank, including
    the small metadata exchanges; a rank's messages to itself are not counted.
    ``*_inter_node`` counts only messages between different nodes.
    """

    world_size: int = 1
    method: str = "partitioned"
    num_rows: int = 0         # rows of the (sparse part of the) table, V
    rows_in: int = 0          # rows (nnz) of the input tensor
    rows_local: int = 0       # after local coalescing (k)
    rows_local_sum: int = 0   # k summed over all ranks (same on every rank)
    rows_local_max: int = 0   # largest k of any rank
    rows_out: int = 0         # union of all ranks' rows (U)
    rows_in_sum: int = 0      # rows_in summed over all ranks (n; same on every rank)
    runs_local: int = 0       # runs of equal consecutive input rows (m; see collectives/methods/runs.py)
    runs_local_sum: int = 0   # m summed over all ranks (same on every rank)
    row_bytes: int = 0        # bytes of one value row
    index_bytes: int = 0      # bytes of one id on the wire
    bytes_sent: int = 0
    bytes_recv: int = 0
    bytes_sent_inter_node: int = 0
    bytes_recv_inter_node: int = 0
    bytes_copied: int = 0     # bytes the kernels copied between the rows and the wire (send and receive side)
    row_lookups: int = 0      # sharded bag/table lookups served as unique rows (pooled by the requester)
    pooled_lookups: int = 0   # sharded bag lookups pooled by the owners (partial bags travel, not rows)
    hierarchical: bool = False
    seconds: Dict[str, float] = field(default_factory=dict)

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def merge(self, other: "SparseSyncStats") -> None:
        """Accumulate another call's counters into this one (e.g. per step)."""
        for name in ("rows_in", "rows_local", "rows_local_sum", "rows_out", "rows_in_sum", "runs_local",
                     "runs_local_sum", "bytes_sent", "bytes_recv",
                     "bytes_sent_inter_node", "bytes_recv_inter_node", "bytes_copied", "row_lookups",
                     "pooled_lookups"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.seconds.items():
            self.add_time(k, v)


def optional_int(value: Optional[str]) -> Optional[int]:
    """Parse an environment variable as int, None when unset or empty."""
    if value is None or value.strip() == "":
        return None
    return int(value)
