"""The DDP hook's tunable settings (:class:`HookConfig`), validated in one place.

A frozen dataclass, like TorchRec's configs: built once, checked once, handed
to :class:`~sparsecomm.hooks.state.SparseCommState`, picklable (no process
group or tensor in it). Only the checks that need the hook's group (the
backend) stay in the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Union

from sparsecomm.collectives.dense import COMPRESSION_DTYPES
from sparsecomm.types import PartitionScheme, SyncMethod

__all__ = ["HookConfig"]

OVERRIDES = ("auto", *(m.value for m in SyncMethod))
NONFINITE = ("propagate", "raise")


@dataclass(frozen=True, slots=True)
class HookConfig:
    r"""Tunable settings of :func:`sparsecomm.sparsecomm_hook`.

    Args:
        compression: None, "fp16" or "bf16": dense buckets travel in half
            precision. "none" is read as None.
        sparse_compression: None (default: exact), "bf16" or "fp16": the
            value rows of sparse gradients travel in half precision on the
            paths that sum at an owner or merge ("partitioned", "allgather",
            "runs", "tree", two-level), summed in float32 and returned in the
            gradient's dtype; each rank's result is the same bitwise, within
            about 2 units of the wire dtype's roundoff of the exact sum
            (``sparse_allreduce(compression=...)``). Ids and metadata stay
            exact; "densify" and "torch" ignore it. Dense buckets stay exact,
            fused into the exchange or not.
            Half the value bytes: for a slow link between hosts. "none" is
            read as None.
        overrides: ``{parameter name: "partitioned" | "allgather" | "densify" | "torch" | "tree" | "runs" |
            "auto"}``.
        sparse_dense_embeddings: for embeddings trained with dense gradients
            (``sparse=False``), send only their non-zero rows through the
            sparse path (exact: zero rows stay zero). Off by default.
        scheme: row ownership of the partitioned path, "hash" or "range".
        local_world_size, local_aggregation: node layout for two-level
            aggregation (see :func:`sparsecomm.sparse_allreduce`); None: what
            the launcher says for the default group, else 1.
        nonfinite: "propagate" (default: NaN/Inf pass through the sums, as
            with plain DDP, so AMP's ``GradScaler`` sees them and skips the
            step) or "raise" (``ValueError`` on every rank; costs a host
            synchronization per bucket).
        latency_bytes: the classifier's price of one collective, in bytes;
            None (default) measures the link when the state is built (a few
            tiny and a few 4 MiB all-to-alls on the hook's group): a
            collective's latency and the bytes/s of a host's link, shared by
            the ``local_world_size`` ranks of a host; the classifier then
            prices each path by its latency and the bytes it puts on that link.
        reclassify_every: re-decide auto paths every this many syncs of a
            table (0: decide once).
        history: how many past steps of per-path counters to keep.
        overlap_sparse: run the step's fused synchronization on the hook
            group's worker thread; False (default) runs it on the autograd
            thread: it starts once the backward's graph has run, so nothing
            is left to overlap and the thread hop only adds latency. Either
            way only one thread ever uses the hook's group.
        eager_sparse: ``'auto'`` (default), True or False. True: synchronize
            each sparse bucket as soon as DDP hands it over, on the hook
            group's worker thread, while backward goes on: one collective per
            sparse bucket instead of one per step, worth it where bytes, not
            round trips, make the step (few ranks on a slow link), since each
            table's transfer then overlaps the rest of backward; plain DDP
            does the same with gloo's sparse allreduce. False: one fused sync
            per step, after the graph. ``'auto'``: measured in the job (see
            :mod:`sparsecomm.hooks.eager_trial`): from step 2, a few steps each
            way, and every rank keeps the mode whose steps were faster on the
            slowest rank (one small all-reduce; eager by 5% at least),
            re-measured every ``tune_every`` steps; on gloo groups only
            (on NCCL, fused). Results are the same bits either way.
        fuse_dense: let small dense buckets ride in the step's sparse
            exchange (every rank sends its bucket to every rank, which sums
            them in rank order) instead of an allreduce of their own, where
            the cost model says a collective's latency is worth more than
            the extra bytes (default True; never with ``compression``; with
            ``sparse_compression`` the fused buckets travel exact).
        tune: measure instead of trusting the model (off by default): after a
            table's first sync, try each path the model rates within 4x of
            its best (and the best) for ``tune_samples`` + 1 syncs, the first
            of each not counted; every rank takes the path fastest on the
            slowest rank (one small all-reduce per exploration phase, on the
            hook's group, under its timeout), and re-measures it and the
            paths that came within 2x every ``tune_every`` syncs.
        tune_samples: timed syncs per candidate path (their median counts).
        tune_every: syncs between exploration phases (0: explore once); for
            ``eager_sparse='auto'``, steps between its measurements.

    Raises:
        ValueError: a setting out of its range, naming the setting and why.

    Example::

        >>> config = HookConfig(compression="bf16", overrides={"emb.weight": "allgather"})
        >>> state = SparseCommState(model=ddp, config=config)
    """

    # what travels and how
    compression: Optional[str] = None
    sparse_compression: Optional[str] = None
    overrides: Dict[str, str] = field(default_factory=dict)
    sparse_dense_embeddings: bool = False
    scheme: str = "hash"
    local_world_size: Optional[int] = None
    local_aggregation: bool = True
    nonfinite: str = "propagate"
    # how paths are chosen
    latency_bytes: Optional[float] = None
    reclassify_every: int = 0
    history: int = 100
    overlap_sparse: bool = False
    eager_sparse: Union[bool, str] = "auto"
    fuse_dense: bool = True
    # measured choice (see sparsecomm.hooks.tuner)
    tune: bool = False
    tune_samples: int = 2
    tune_every: int = 500

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSION_DTYPES:
            raise ValueError(f"compression must be 'fp16', 'bf16' or None, got {self.compression!r}")
        # Frozen: normalize through object.__setattr__, once, here.
        object.__setattr__(self, "compression", None if self.compression == "none" else self.compression)
        if self.sparse_compression not in COMPRESSION_DTYPES:
            raise ValueError(f"sparse_compression must be 'fp16', 'bf16' or None, got {self.sparse_compression!r}")
        if self.sparse_compression == "none":
            object.__setattr__(self, "sparse_compression", None)
        overrides = dict(self.overrides or {})  # a copy: the caller's dict stays theirs
        for name, path in overrides.items():
            if path not in OVERRIDES:
                raise ValueError(f"override for {name!r} must be one of {sorted(OVERRIDES)}, got {path!r}")
        object.__setattr__(self, "overrides", overrides)
        if self.scheme not in [s.value for s in PartitionScheme]:  # a PartitionScheme member is equal to its value
            raise ValueError(f"scheme must be one of {[s.value for s in PartitionScheme]}, got {self.scheme!r}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {self.nonfinite!r}")
        if not (isinstance(self.eager_sparse, bool) or self.eager_sparse == "auto"):
            raise ValueError(f"eager_sparse must be True, False or 'auto', got {self.eager_sparse!r}")
        if self.reclassify_every < 0:
            raise ValueError(f"reclassify_every must be >= 0 (0: decide once), got {self.reclassify_every}")
        if self.history < 0:
            raise ValueError(f"history must be >= 0 (steps of counters to keep), got {self.history}")
        if self.tune_samples < 1:
            raise ValueError(f"tune_samples must be >= 1 (a median needs a sample), got {self.tune_samples}")
        if self.tune_every < 0:
            raise ValueError(f"tune_every must be >= 0 (0: explore once), got {self.tune_every}")
