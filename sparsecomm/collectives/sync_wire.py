"""The sync metadata: what every rank tells every rank about each tensor before any row moves.

Every rank sends every peer the same message: for each tensor of the call,
one record of ``RECORD_FIXED + N`` int64 (N: the group's size), so a rank's
message for T tensors is ``T * (21 + N)`` int64:

====================  ============================================================
``[0]``               magic (``MAGIC``): a peer not in a ``sparse_allreduce`` call
``[1]``               value dtype (index in ``ops.VALUE_DTYPES``), + 16 (1 + the wire dtype's index) when compressed
``[2]``, ``[3]``      dimensions, sparse dimensions
``[4]``               crc32 of (shape, dtype)
``[5:13]``            shape, padded with -1 to 8 dimensions
``[13]``              op (index in ``ReduceOp``)
``[14]``              scheme (``ownership.scheme_code``)
``[15]``              ranks per node the path's schedule uses (1 when it uses none)
``[16]``              method (index in ``SyncMethod``)
``[17]``              status (``WireStatus``) of this rank's own rows
``[18]``              k: this rank's rows after coalescing
``[19]``              n: this rank's input rows (ids before coalescing)
``[20]``              m: runs of equal consecutive input rows (``methods/runs.py``; what the
                      runs path sends; elsewhere counted on each row's first value, to price it)
``[21:21 + N]``       push counts: rows this rank sends each owner (partitioned; else 0)
====================  ============================================================

Words ``[0:17]`` (the header) must be equal on every rank. :func:`encode`
builds a record, :func:`decode` reads one back into a :class:`Record`,
:func:`check` validates every rank's record of one tensor: every rank holds
the same records, so every rank reaches the same verdict and raises together
(``ValueError``), before anything is sized from a peer's numbers.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from sparsecomm import ops
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.collectives.transport import all_to_all
from sparsecomm.ownership import describe_code, scheme_code
from sparsecomm.types import ReduceOp, SyncMethod, WireStatus

__all__ = ["MAGIC", "HEADER_WORDS", "STATUS_WORD", "K_WORD", "IDS_WORD", "RUNS_WORD", "PUSH_WORD", "RECORD_FIXED", "record_width", "Record", "encode", "decode", "describe",
           "check", "check_all", "message", "exchange_meta"]

MAGIC = 0x5C0DE
_MAX_DIMS = 8
HEADER_WORDS = 17                  # magic .. method: equal on every rank
STATUS_WORD, K_WORD, IDS_WORD, RUNS_WORD, PUSH_WORD = 17, 18, 19, 20, 21
MAX_IDS = 2**31 - 1                # most input rows a rank may announce (run lengths travel as int32)
RECORD_FIXED = PUSH_WORD           # then one push count per rank
_WIRE_STEP = 16                    # the dtype word: own dtype + 16 (1 + wire dtype) when compressed


def record_width(world_size: int) -> int:
    """int64 per tensor in a rank's metadata: ``RECORD_FIXED + N``."""
    return RECORD_FIXED + world_size


@dataclass(frozen=True)
class Record:
    """One rank's metadata about one tensor, decoded."""

    header: Tuple[int, ...]
    status: int
    k: int
    ids: int
    runs: int
    push: Tuple[int, ...]

    @property
    def magic(self) -> int:
        return self.header[0]


def _header(t: TensorRows, plan: SyncPlan) -> List[int]:
    shape = list(t.tensor.shape)
    dims = (shape + [-1] * _MAX_DIMS)[:_MAX_DIMS]
    digest = zlib.crc32(repr((shape, str(t.tensor.dtype))).encode())
    node_size = plan.local_world_size if t.path.node_layout else 1
    return [MAGIC, _dtype_word(t), len(shape), t.tensor.sparse_dim(), digest, *dims,
            list(ReduceOp).index(plan.op), scheme_code(plan.scheme), node_size, list(SyncMethod).index(t.method)]


def _dtype_word(t: TensorRows) -> int:
    word = ops.VALUE_DTYPES.index(t.tensor.dtype)
    if t.values.dtype != t.tensor.dtype:  # compressed on the wire
        word += _WIRE_STEP * (1 + ops.VALUE_DTYPES.index(t.values.dtype))
    return word


def _describe_dtype(word: int) -> str:
    dtypes = ops.VALUE_DTYPES
    own, wire = word % _WIRE_STEP, word // _WIRE_STEP - 1
    if not 0 <= own < len(dtypes) or not -1 <= wire < len(dtypes):
        return str(word)
    return str(dtypes[own]) + (f" (on the wire: {dtypes[wire]})" if wire >= 0 else "")


def encode(t: TensorRows, plan: SyncPlan, push: Sequence[int]) -> List[int]:
    """This rank's record for one tensor (``push``: its count per owner, or zeros)."""
    return _header(t, plan) + [int(t.status), t.rows_k, t.input_rows, t.runs_count, *push]


def decode(words: Sequence[int]) -> Record:
    """A record as received (nothing is checked here: see :func:`check`)."""
    return Record(tuple(words[:HEADER_WORDS]), words[STATUS_WORD], words[K_WORD], words[IDS_WORD], words[RUNS_WORD],
                  tuple(words[PUSH_WORD:]))


def describe(header: Sequence[int]) -> str:
    """A header for an error message, every field named (unknown codes as their numbers)."""
    dims = [d for d in header[5:5 + _MAX_DIMS] if d >= 0][: header[2]]
    ops_, methods = list(ReduceOp), list(SyncMethod)

    def name(table, code):
        return (table[code].value if hasattr(table[code], "value") else table[code]) \
            if 0 <= code < len(table) else code

    return (f"shape={tuple(dims)}, dtype={_describe_dtype(header[1])}, sparse_dim={header[3]}, "
            f"op={name(ops_, header[13])}, scheme={describe_code(header[14])}, local_world_size={header[15]}, "
            f"method={name(methods, header[16])}")


def message(tensors: List[TensorRows], plan: SyncPlan) -> List[int]:
    """This rank's metadata for every tensor of the call (one host sync for all push counts)."""
    n = plan.world_size
    counts = [t.part.counts for t in tensors if t.part is not None]
    lazy = [t for t in tensors if isinstance(t.runs_count, torch.Tensor)]  # the cheap runs counts, not yet read
    words = torch.cat([c.reshape(-1).to(torch.int64) for c in counts]
                      + [t.runs_count.reshape(1).to(torch.int64) for t in lazy]).tolist() if counts or lazy else []
    flat_counts = [words[i * n:(i + 1) * n] for i in range(len(counts))]
    for t, m in zip(lazy, words[len(counts) * n:]):
        t.runs_count = m
    for t in tensors:
        t.stats.runs_local = t.runs_count
    out: List[int] = []
    it = iter(flat_counts)
    for t in tensors:
        out += encode(t, plan, next(it) if t.part is not None else [0] * n)
    return out


def check(records: List[Record], t: TensorRows, plan: SyncPlan) -> Peers:
    """Validate every rank's record of one tensor; every rank runs this on the same records: the same verdict."""
    me, num_rows = plan.rank, t.num_rows
    for r, rec in enumerate(records):
        if rec.magic != MAGIC:
            raise ValueError(f"sparse_allreduce: rank {r} is not in a sparse_allreduce call "
                             f"(collective calls differ between ranks)")
    for r, rec in enumerate(records):
        if rec.status == WireStatus.ID_RANGE:
            raise ValueError(f"sparse_allreduce: rank {r} passed row ids outside [0, {num_rows}); "
                             f"nothing was exchanged")
        if rec.status == WireStatus.NONFINITE:
            raise ValueError(f"sparse_allreduce: rank {r} passed NaN or Inf values (nonfinite='raise'); "
                             f"nothing was exchanged")
    mine = records[me].header
    for r, rec in enumerate(records):
        if rec.header != mine:
            raise ValueError(f"sparse_allreduce: ranks disagree on the tensor: rank {me} has {describe(mine)} "
                             f"but rank {r} has {describe(rec.header)}")
    k = [rec.k for rec in records]
    push = [list(rec.push) for rec in records]
    for r, rec in enumerate(records):
        # k distinct rows of n input rows in m runs: 0 <= k <= min(n, V), m <= n, none of them without the others.
        bad = not 0 <= k[r] <= min(num_rows, rec.ids) or (t.path.runs and rec.ids > MAX_IDS) \
            or rec.status != WireStatus.OK
        bad = bad or not 0 <= rec.runs <= rec.ids or (rec.ids > 0) != (rec.runs > 0) or (rec.ids > 0) != (k[r] > 0)
        if t.part is not None:
            bad = bad or min(push[r]) < 0 or sum(push[r]) != k[r]
        if bad:
            raise ValueError(f"sparse_allreduce: rank {r} sent inconsistent row counts (k={k[r]}, n={rec.ids}, "
                             f"m={rec.runs}, per owner {push[r] if t.part is not None else '-'}, table of "
                             f"{num_rows} rows): a bug or a version mismatch between ranks; nothing was exchanged")
    return Peers(k, push, [rec.ids for rec in records], [rec.runs for rec in records])


def check_all(words: Sequence[Sequence[int]], tensors: List[TensorRows], plan: SyncPlan) -> List[Peers]:
    """Decode and check every tensor's records from every rank's message (``words[r]``: rank r's message)."""
    width, n = record_width(plan.world_size), plan.world_size
    return [check([decode(words[r][i * width:(i + 1) * width]) for r in range(n)], t, plan)
            for i, t in enumerate(tensors)]


def exchange_meta(tensors: List[TensorRows], plan: SyncPlan) -> List[Peers]:
    """One all-to-all: every rank's records to every rank; the checked :class:`Peers` of each tensor.

    Every rank receives the same message from a peer (its full count vector,
    not just the count meant for it), so every rank checks the same numbers.
    An all-to-all, not an all-gather: on gloo a tiny all-gather costs several
    times the latency of an all-to-all of the same bytes.
    """
    n, width = plan.world_size, record_width(plan.world_size)
    send = torch.tensor(message(tensors, plan) * n, dtype=torch.int64, device=plan.comm_device).view(n, -1)
    recv = torch.empty_like(send)
    all_to_all(recv, send, group=plan.group)
    for t in tensors:
        t.stats.bytes_sent += 8 * width * (n - 1)
        t.stats.bytes_recv += 8 * width * (n - 1)
    return check_all(recv.tolist(), tensors, plan)
