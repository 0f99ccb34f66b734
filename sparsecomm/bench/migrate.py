"""What moving a table costs, in steps: ``sparsecomm.replan`` of one large table, whole or from a stale replica.

The model: one sum EmbeddingBag of ``--rows`` x ``--dim`` (default 1M x 64,
256 MB in float32) and an MLP, ``--batch`` bags of ``--bag`` Zipf(``--alpha``)
ids per rank. Two copies train side by side on the same batches, steps
interleaved, through the same placements, as a placement trial would move
them (``sparsecomm.trial``), ``--between`` steps at each:

    replicated -> row-sharded (hash) -> table-wise (on rank 0) -> replicated

- ``whole``: ``replan`` without stale replicas: each move after the first
  sends the whole table and its optimizer state (an all-to-all between
  schemes, an all-gather back to the replica);
- ``stale``: ``replan(..., stale=StaleReplicas())``, as the trial calls it:
  the replica is kept when the table leaves it, and each later move sends
  only the rows (with their state) that changed since.

Columns: ``move_s`` (the slowest rank's wall time of the ``replan`` call),
``steps`` (``move_s`` over the median step at the placement moved to, so
"costs less than 10 steps" reads off it), ``MB_sent`` (rows and state this
rank sent, the busiest rank's). Every move of both copies is followed by a
check that both hold the same bits (``#wrong`` counts tables that differ:
exit 3).

    python -m sparsecomm.bench migrate --nproc 2 --optimizers sgd,adam
    python -m sparsecomm.bench migrate --hosts 2 --rate 1gbit,10gbit --optimizers sgd,adagrad,adam
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

import sparsecomm
from sparsecomm.bench.e2e import OPTIMIZERS, add_optimizers_arg, check_optimizers
from sparsecomm.bench.harness import Row, progress
from sparsecomm.bench.launch import add_launch_args, emulated_link, run_distributed
from sparsecomm.stale import StaleReplicas
from sparsecomm.synthetic import zipf_ids

STATE_ROWS = {"sgd": 0, "adagrad": 1, "adam": 2}   # rows of optimizer state that move with each table row
MODES = ("whole", "stale")
# Where the table is after each move (the first entry: where it starts).
CHAIN = (("replicate",), ("shard", "hash"), ("shard", "table", 0), ("replicate",))
COMPACT_COLS = ("world", "hosts", "rate", "optimizer", "move", "mode", "move_s", "steps", "step_ms", "MB_sent",
                "#wrong")
LEGEND = {
    "move": "from -> to",
    "mode": "whole: every move sends the whole table and its state; stale: only rows changed since it left its "
            "replica (sparsecomm.stale)",
    "move_s": "wall time of the replan call, slowest rank",
    "steps": "move_s over the median step at the placement moved to",
    "step_ms": "median ms per step at the placement moved to (slowest rank)",
    "MB_sent": "rows and optimizer state the busiest rank contributed to the move (each sent to every peer "
               "that needs it)",
    "#wrong": "tables whose bits differ between the two copies after the move (non-zero exits 3)",
}


class Model(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids)).squeeze(1)


def _label(where: Sequence[Any]) -> str:
    return where[0] if where[0] == "replicate" else (f"table:{where[2]}" if where[1] == "table" else where[1])


def _plan(model: nn.Module, where: Sequence[Any]):
    plan = copy.deepcopy(getattr(model, "module", model).sparsecomm_plan)
    if where[0] == "replicate":
        return plan.override("table", "replicate")
    return plan.override("table", "shard", where[1], **({"owner": where[2]} if len(where) > 2 else {}))


def _step(model: nn.Module, opt: Any, batch: Dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    nn.functional.binary_cross_entropy_with_logits(model(batch["ids"]), batch["y"]).backward()
    opt.step()
    return time.perf_counter() - start


def run_config(a: argparse.Namespace, optimizer: str) -> List[Dict[str, Any]]:
    rank, n = dist.get_rank(), dist.get_world_size()
    cls, kw = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    base = Model(a.rows, a.dim)
    start = sparsecomm.plan(base)
    start.override("table", "replicate")
    runs: Dict[str, Dict[str, Any]] = {}
    hook: Dict[str, Any] = {}
    for mode in MODES:
        model, opt = sparsecomm.parallelize(copy.deepcopy(base), cls, plan=copy.deepcopy(start), trial=False,
                                            hook_options=dict(hook), **kw)
        runs[mode] = dict(model=model, opt=opt, stale=StaleReplicas() if mode == "stale" else None)
        state = getattr(model, "module", model).sparsecomm_state
        if state is not None:   # the second copy prices its syncs on the link the first measured: the same
            hook["link"] = state.link   # paths, so the copies can be compared bit for bit
    del base
    step = 0

    def batch() -> Dict[str, torch.Tensor]:
        ids = zipf_ids(a.batch * a.bag, a.rows, a.alpha, seed=step * 1009 + rank).view(a.batch, a.bag)
        return {"ids": ids, "y": (torch.rand(a.batch, generator=torch.Generator().manual_seed(step)) < 0.3).float()}

    out = []
    for i, where in enumerate(CHAIN):
        figures: Dict[str, Dict[str, float]] = {}
        for mode, r in runs.items():
            if i == 0:
                continue
            dist.barrier()
            sent_before = r["stale"].rows_sent if r["stale"] is not None else 0
            r["opt"].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            r["model"], r["opt"] = sparsecomm.replan(r["model"], r["opt"], _plan(r["model"], where),
                                                     stale=r["stale"])
            seconds = time.perf_counter() - t0
            if r["stale"] is not None:
                rows = r["stale"].rows_sent - sent_before
            else:   # a replica sends nothing; a shard sends all its rows
                rows = 0 if CHAIN[i - 1][0] == "replicate" else _rows_of(CHAIN[i - 1], a.rows, n, rank)
            sent = rows * a.dim * 4 * (1 + STATE_ROWS[optimizer])
            figures[mode] = dict(move_s=seconds, sent=sent, times=[])
        for _ in range(a.between):
            b = batch()
            step += 1
            for mode, r in runs.items():
                t = _step(r["model"], r["opt"], b)
                if mode in figures:
                    figures[mode]["times"].append(t)
        if i == 0:
            continue
        wrong = _differ(runs)
        for mode, f in figures.items():
            out.append(dict(move=f"{_label(CHAIN[i - 1])} -> {_label(where)}", mode=mode, move_s=f["move_s"],
                            step_s=statistics.median(f["times"][1:] or f["times"]), sent=f["sent"], wrong=wrong))
        progress(f"migrate: world {n} {optimizer}: {_label(CHAIN[i - 1])} -> {_label(where)} done")
    return out


def _rows_of(where: Sequence[Any], rows: int, n: int, rank: int) -> int:
    """This rank's rows under ``where``."""
    if where[0] == "replicate":
        return rows
    if where[1] == "table":
        return rows if rank == where[2] else 0
    return -(-rows // n)


def _differ(runs: Dict[str, Dict[str, Any]]) -> int:
    """1 when the two copies' tables (or MLPs) differ in any bit, else 0 (the same on every rank)."""
    weights = []
    for r in runs.values():
        inner = getattr(r["model"], "module", r["model"])
        t = inner.table
        table = t.full_weight() if hasattr(t, "full_weight") else t.weight.detach()
        weights.append([table] + [p.detach() for p in inner.mlp.parameters()])
    same = all(torch.equal(x, y) for x, y in zip(*weights))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, same)
    return int(not all(flags))


def body(a: argparse.Namespace) -> List[Row]:
    rank, n = dist.get_rank(), dist.get_world_size()
    link = emulated_link()
    where = {"hosts": f"{link[0]}x{link[1]}" if link else "", "rate": link[2] if link else ""}
    out: List[Row] = []
    for optimizer in a.optimizers.split(","):
        mine = run_config(a, optimizer)
        everyone: List[Any] = [None] * n
        dist.all_gather_object(everyone, mine)
        if rank:
            continue
        for i, m in enumerate(mine):
            move_s = max(e[i]["move_s"] for e in everyone)
            step_s = max(e[i]["step_s"] for e in everyone)
            out.append(Row({"world": n, **where, "optimizer": optimizer, "move": m["move"], "mode": m["mode"],
                            "move_s": move_s, "steps": move_s / step_s, "step_ms": 1e3 * step_s,
                            "MB_sent": max(e[i]["sent"] for e in everyone) / 1e6, "#wrong": m["wrong"]}))
    return out


def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(argv or [])
    p = argparse.ArgumentParser(prog="sparsecomm.bench migrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the table (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default: %(default)s)")
    p.add_argument("--batch", type=int, default=512, help="bags per rank per step (default: %(default)s)")
    p.add_argument("--bag", type=int, default=8, help="ids per bag (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of the ids (default: %(default)s)")
    p.add_argument("--between", type=int, default=10, help="steps at each placement (default: %(default)s)")
    add_optimizers_arg(p, "sgd,adam")
    add_launch_args(p)
    a = p.parse_args(argv)
    check_optimizers(p, a)
    if a.between < 2 or a.rows < 1 or a.dim < 1:
        p.error("--between must be at least 2, --rows and --dim at least 1")
    return run_distributed("migrate", argv, a, body, "moving one table (slowest rank)",
                           compact_cols=COMPACT_COLS, legend=LEGEND)
