"""End-to-end DDP training: plain DDP vs DDP + sparsecomm vs the floor, per phase, interleaved in one run.

A model dominated by sparse embeddings (default one 1M x 64 EmbeddingBag,
Zipf(1.1) ids, 8 ids per sample; ``--tables 2`` adds a second 200k x 32 table)
with a small MLP on top. Every rank holds three replicas and trains them
alternately, step by step, on the same batches, so machine noise hits all alike:

- ``ddp``: plain DDP (gloo's sparse allreduce for the tables);
- ``sparsecomm``: DDP + ``sparsecomm.register``;
- ``floor``: the same model in this process alone on the per-rank batch, no
  communication at all: no sync can make a step faster than this.

Per phase (forward, backward including DDP's sync, optimizer) the median over
the timed steps of the slowest rank. ``overhead`` = step - floor. The two DDP
replicas must agree: their first synchronized gradients, and with SGD their
final weights (``#wrong`` counts tensors that differ by more than the
tolerance; exit code 3 when any does).

    python benchmarks/bench_ddp.py --nproc 4 --optimizers sgd,adagrad,adam --batch-sizes 512,4096
    torchrun --nproc-per-node 4 benchmarks/bench_ddp.py
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.synthetic import zipf_ids

MODES = ("ddp", "sparsecomm", "floor")
PHASES = ("forward", "backward", "optimizer")
WRONG_EXIT = 3


class Model(nn.Module):
    def __init__(self, rows: int, dim: int, tables: int):
        super().__init__()
        self.embs = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)])
        if tables > 1:
            self.embs.append(nn.EmbeddingBag(max(1, rows // 5), dim // 2, mode="sum", sparse=True))
        width = sum(e.embedding_dim for e in self.embs)
        self.mlp = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids):
        return self.mlp(torch.cat([e(ids % e.num_embeddings) for e in self.embs], 1)).squeeze(1)


def make_optimizers(model: nn.Module, kind: str) -> List[torch.optim.Optimizer]:
    """The same rule on every replica (like with like)."""
    model = model.module if isinstance(model, DDP) else model
    tables = [p for n, p in model.named_parameters() if n.startswith("embs")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("embs")]
    if kind == "adam":
        return [torch.optim.SparseAdam(tables, lr=0.01), torch.optim.Adam(dense, lr=0.01)]
    if kind == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.05)]
    return [torch.optim.SGD(model.parameters(), lr=0.05)]


def run_config(a: argparse.Namespace, rank: int, world: int, optimizer: str, batch: int) -> Dict:
    torch.manual_seed(0)
    base = Model(a.rows, a.dim, a.tables)
    runs = {}
    for mode in MODES:
        model = copy.deepcopy(base) if mode == "floor" else DDP(copy.deepcopy(base))
        state = sparsecomm.register(model) if mode == "sparsecomm" else None
        runs[mode] = dict(model=model, state=state, opts=make_optimizers(model, optimizer),
                          times={p: [] for p in PHASES + ("step",)})
    del base
    first_grads = {}
    for step in range(a.warmup + a.steps):
        ids = zipf_ids(batch * a.bag, a.rows, a.alpha, seed=100_000 * step + rank).view(-1, a.bag)
        y = torch.randn(batch, generator=torch.Generator().manual_seed(step * 131 + rank))
        for mode, r in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            for o in r["opts"]:
                o.zero_grad(set_to_none=True)
            loss = ((r["model"](ids) - y) ** 2).mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if step == 0 and mode != "floor":
                # The synchronized gradients of the first step, from identical weights.
                first_grads[mode] = [p.grad.to_dense().clone() for p in r["model"].parameters()]
            for o in r["opts"]:
                o.step()
            t3 = time.perf_counter()
            if step >= a.warmup:
                for phase, dt in zip(PHASES + ("step",), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    r["times"][phase].append(dt)
    medians = {m: {p: statistics.median(v) for p, v in r["times"].items()} for m, r in runs.items()}
    # Both DDP replicas saw the same global batches. Their first synchronized
    # gradients (same weights) must agree to float32 summation error, and with
    # SGD so must the final weights. (Adagrad/Adam turn a gradient that sums to
    # 0 in one order and to 1e-9 in another into steps of about lr: their final
    # weights legitimately differ in a few entries.)
    pairs = list(zip(first_grads["ddp"], first_grads["sparsecomm"]))
    if optimizer == "sgd":
        pairs += [(p1.detach(), p2.detach()) for p1, p2 in
                  zip(runs["ddp"]["model"].parameters(), runs["sparsecomm"]["model"].parameters())]
    wrong, worst = 0, 0.0
    for x, y in pairs:
        diff = float((x - y).abs().max())
        worst = max(worst, diff)
        wrong += int(not diff <= a.tolerance * max(1.0, float(x.abs().max())))
    paths = {k: d.method.value for k, d in runs["sparsecomm"]["state"].decisions.items()}
    return dict(medians=medians, wrong=wrong, worst=worst, paths=paths)


def report(a: argparse.Namespace, world: int, optimizer: str, batch: int, gathered: List[Dict]) -> Dict:
    # A step ends when the slowest rank ends: per phase, the slowest rank's median.
    med = {m: {p: max(g["medians"][m][p] for g in gathered) for p in PHASES + ("step",)} for m in MODES}
    floor = med["floor"]["step"]
    row = {"world": world, "optimizer": optimizer, "batch": batch}
    for m in MODES:
        row[f"{m}_ms"] = 1e3 * med[m]["step"]
    for m in MODES:
        for p in PHASES:
            row[f"{m}_{p}_ms"] = 1e3 * med[m][p]
    for m in ("ddp", "sparsecomm"):
        row[f"{m}_overhead_ms"] = 1e3 * (med[m]["step"] - floor)
    row["sync_share_of_ddp"] = (med["ddp"]["step"] - floor) / med["ddp"]["step"]
    row["hooked_over_plain"] = med["sparsecomm"]["step"] / med["ddp"]["step"]
    row["speedup"] = med["ddp"]["step"] / med["sparsecomm"]["step"]
    row["wrong"] = max(g["wrong"] for g in gathered)
    row["max_weight_diff"] = max(g["worst"] for g in gathered)
    row["paths"] = gathered[0]["paths"]
    return row


def print_row(row: Dict) -> None:
    print(f"world {row['world']}  {row['optimizer']:<7} batch {row['batch']:<5}  "
          f"step ms: ddp {row['ddp_ms']:7.1f}  sparsecomm {row['sparsecomm_ms']:7.1f}  floor {row['floor_ms']:6.1f} | "
          f"overhead ms: ddp {row['ddp_overhead_ms']:6.1f}  sparsecomm {row['sparsecomm_overhead_ms']:6.1f} | "
          f"speedup {row['speedup']:.2f}x  #wrong={row['wrong']}  paths={row['paths']}", flush=True)
    print("    phases ms (fwd/bwd+sync/opt): " + "  ".join(
        f"{m} {row[f'{m}_forward_ms']:.1f}/{row[f'{m}_backward_ms']:.1f}/{row[f'{m}_optimizer_ms']:.1f}"
        for m in MODES), flush=True)


def worker(a: argparse.Namespace) -> int:
    topo = sparsecomm.init_distributed(timeout=600)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.local_world_size))
    rows = []
    if topo.rank == 0:
        print(f"# DDP end-to-end: EmbeddingBag {a.rows} x {a.dim} fp32 (sparse), {a.tables} table(s), bag {a.bag}, "
              f"Zipf({a.alpha}), {a.steps} timed steps (+{a.warmup} warm-up), modes interleaved per step, "
              f"world {topo.world_size}, {torch.get_num_threads()} threads/rank; medians of the slowest rank",
              flush=True)
    for optimizer in a.optimizers.split(","):
        for batch in (int(b) for b in a.batch_sizes.split(",")):
            mine = run_config(a, topo.rank, topo.world_size, optimizer, batch)
            gathered = [None] * topo.world_size
            dist.all_gather_object(gathered, mine)
            if topo.rank == 0:
                row = report(a, topo.world_size, optimizer, batch, gathered)
                print_row(row)
                rows.append(row)
    wrong = 0
    if topo.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
        wrong = sum(r["wrong"] for r in rows)
        if wrong:
            print(f"#wrong={wrong}: DDP and DDP + sparsecomm ended with different weights", file=sys.stderr)
    sparsecomm.shutdown()
    return WRONG_EXIT if wrong else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="spawn N local ranks with torchrun (default: %(default)s)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the first table (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default: %(default)s)")
    p.add_argument("--tables", type=int, choices=[1, 2], default=1, help="sparse tables (default: %(default)s)")
    p.add_argument("--bag", type=int, default=8, help="ids per sample (default: %(default)s)")
    p.add_argument("--batch-sizes", default="512", help="samples per rank per step, comma-separated "
                                                        "(default: %(default)s)")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of the ids (default: %(default)s)")
    p.add_argument("--optimizers", default="sgd", help="comma-separated sgd|adagrad|adam (adam: SparseAdam for "
                                                       "the tables + Adam for the MLP) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="max difference between the DDP replicas' first gradients (and, with SGD, final "
                        "weights), relative to the largest entry (default: %(default)s)")
    a = p.parse_args(argv)
    for o in a.optimizers.split(","):
        if o not in ("sgd", "adagrad", "adam"):
            p.error(f"--optimizers: unknown optimizer {o!r}")
    if a.nproc and "RANK" not in os.environ:
        args = list(argv if argv is not None else sys.argv[1:])
        i = args.index("--nproc")
        del args[i:i + 2]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
               os.path.abspath(__file__), *args]
        return subprocess.call(cmd)
    return worker(a)


if __name__ == "__main__":
    sys.exit(main())
