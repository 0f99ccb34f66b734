"""What the planner's predictions are priced with: bytes on the link, and the optimizer's work measured in the job.

``sparsecomm.plan`` with a sample batch predicts, per table, the bytes a
step costs replicated and sharded (:func:`predict`). Most of it is bytes on
the link (the hook's sync; ids, rows and gradients of a lookup round). One
term is not: the optimizer's work on the rows a step touches, all ``U``
distinct rows of the step on every replica, ``U / N`` on each owner. It is
priced in link bytes, so it adds to the rest:

- measured (:func:`measure_prices`, when the plan has peers and a sample
  batch on every rank): the seconds per row of torch's rule on a replica's
  sparse gradient (SparseAdam's for Adam), timed on a scratch table of each
  width and dtype the model has, times the link's bytes per second
  (``measure_link``: a large all-to-all), the slowest rank's numbers (one
  all-gather), so every rank plans alike. An owner runs the same arithmetic
  on its shard (the twin rules of :mod:`sparsecomm.sharded.optimizer`), so
  its rows are priced alike;
- otherwise the constants below: each touched row costs ``touch x r`` bytes
  of memory traffic (read and write of the weight and each state tensor) at
  :data:`OPTIMIZER_BYTE_PRICE` link bytes per byte (this machine's scattered
  row memory rate, ~10 GB/s, over its loopback all-to-all rate, 0.5-0.8 GB/s).

The lookup round's own collectives are priced by the planner with the
measured latency of one collective (``Plan.latency_bytes``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm import cost_model
from sparsecomm.collectives.objects import all_gather_objects
from sparsecomm.collectives.probe import measure_link
from sparsecomm.collectives.transport import wire_index_dtype
from sparsecomm.sharded.combined import OptimizerSpec, _TWINS   # the rules parallelize can train with

__all__ = ["JobPrices", "measure_prices", "predict", "OPTIMIZER_BYTE_PRICE", "ROUND_COLLECTIVES"]

# Optimizer work per row, in bytes it touches per byte of row (read/write weight and state), and the
# price of one such byte in link bytes when nothing was measured.
_OPT_TOUCH = {"SGD": 2, "Adagrad": 4, "Adam": 6, "SparseAdam": 6}
OPTIMIZER_BYTE_PRICE = 1 / 16
# All-to-alls a step of sharded tables costs, whatever their number: the ids (with the last step's gradient
# rows: parallelize's optimizers defer the push) and the rows.
ROUND_COLLECTIVES = 2
_SCRATCH_ROWS = 16384   # rows of the scratch table the optimizer is timed on
_REPEATS = 5

Shape = Tuple[int, str]   # (embedding_dim, dtype name)


@dataclasses.dataclass(frozen=True)
class JobPrices:
    """The job's link and optimizer, measured (the same on every rank).

    Attributes:
        latency_bytes: one tiny collective, in bytes of a large one.
        bytes_per_s: the link's rate under a large all-to-all.
        row_s: per (dim, dtype name): seconds per row of the optimizer's rule on a sparse gradient.
    """

    latency_bytes: float
    bytes_per_s: float
    row_s: Dict[Shape, float]

    def row_bytes(self, shape: Shape) -> float:
        """One row's optimizer work in link bytes."""
        return self.row_s[shape] * self.bytes_per_s


def _optimizer_class(name: str) -> type:
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls not in _TWINS:
        raise ValueError(f"no owner-side twin of optimizer {name!r} to time")
    return cls


def _median_s(run, repeats: int = _REPEATS) -> float:
    run()   # warm-up: state made, kernels loaded
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_rows(optimizer: str, dim: int, dtype: torch.dtype, rows: int = _SCRATCH_ROWS) -> float:
    """Seconds per row of ``optimizer``'s rule (torch's, on a sparse gradient) on ``rows`` distinct rows of ``dim``."""
    cls = _optimizer_class(optimizer)
    spec = OptimizerSpec(cls, (("lr", 0.01),))
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(rows, generator=g)
    grad_rows = torch.randn(rows, dim, generator=g).to(dtype)
    weight = torch.nn.Parameter(torch.zeros(rows, dim, dtype=dtype))
    rule = spec.part_class(spec.replica_part(sparse=True))([weight], lr=0.01)

    def step() -> None:
        weight.grad = torch.sparse_coo_tensor(ids.view(1, -1), grad_rows, (rows, dim), check_invariants=False)
        rule.step()

    return _median_s(step) / rows


def measure_prices(group: Optional[dist.ProcessGroup], optimizer: str, shapes: Iterable[Tuple[int, torch.dtype]]
                   ) -> JobPrices:
    """The link and the optimizer on every (dim, dtype) in ``shapes``, timed here; the slowest rank's numbers.

    Collective: every rank of ``group`` calls it with the same shapes.
    """
    link = measure_link(group)
    mine = {(d, str(dt).replace("torch.", "")): time_rows(optimizer, d, dt) for d, dt in sorted(
        set(shapes), key=str)}
    everyone: List[Dict[Shape, float]] = all_gather_objects(mine, group)
    return JobPrices(link.latency_bytes, link.bytes_per_s, {k: max(e[k] for e in everyone) for k in mine})


def predict(t: Any, row: int, n: int, distinct: Sequence[int], union: int, optimizer: str,
            prices: Optional[JobPrices]) -> None:
    """Fill table plan ``t``'s predicted bytes per step replicated and sharded (the module docstring's prices)."""
    idb = torch.empty(0, dtype=wire_index_dtype(t.num_embeddings)).element_size()
    k = max(distinct)
    t.distinct, t.union = tuple(distinct), union
    if prices is not None:
        t.optimizer_row_bytes, t.measured_optimizer = prices.row_bytes((t.embedding_dim, t.dtype)), True
    else:
        t.optimizer_row_bytes = _OPT_TOUCH.get(optimizer, 6) * row * OPTIMIZER_BYTE_PRICE
    sync = min(cost_model.allgather_bytes(n, k, row + idb), cost_model.partitioned_floor_bytes(n, k, union, row + idb))
    t.bytes_replicated = sync + union * t.optimizer_row_bytes
    t.bytes_sharded = cost_model.sharded_floor_bytes(n, k, row) + (n - 1) / n * k * idb + union / n * t.optimizer_row_bytes
