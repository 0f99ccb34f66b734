"""End-to-end DDP training throughput: DDP's default gradient sync vs DDP + sparsecomm, in one run.

A model dominated by one large sparse embedding (default 1M x 64, Zipf(1.1)
ids, EmbeddingBag of 8 ids per sample) with a small MLP on top. Every rank
holds two identical replicas, one per mode, and trains them alternately, step
by step, on the same batches: machine noise hits both alike, and the final
losses must agree (a wrong sync would show). Reports median samples/s.

    python benchmarks/bench_ddp.py --nproc 4
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

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.synthetic import zipf_ids


class Model(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.emb = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids):
        return self.mlp(self.emb(ids)).squeeze(1)


def worker(a: argparse.Namespace) -> None:
    topo = sparsecomm.init_distributed(timeout=600)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.local_world_size))
    torch.manual_seed(0)
    base = Model(a.rows, a.dim)
    runs = {}
    for mode in ("ddp-default", "sparsecomm"):
        model = DDP(copy.deepcopy(base))
        state = sparsecomm.register(model) if mode == "sparsecomm" else None
        if a.optimizer == "adam":
            opts = [torch.optim.SparseAdam(model.module.emb.parameters(), lr=0.01),
                    torch.optim.Adam(model.module.mlp.parameters(), lr=0.01)]
        else:
            opts = [torch.optim.SGD(model.parameters(), lr=0.05)]
        runs[mode] = dict(model=model, state=state, opts=opts, times=[], losses=[])
    del base
    for step in range(a.warmup + a.steps):
        ids = zipf_ids(a.batch_size * a.bag, a.rows, a.alpha, seed=100_000 * step + topo.rank).view(-1, a.bag)
        y = torch.randn(a.batch_size, generator=torch.Generator().manual_seed(step * 131 + topo.rank))
        for mode, r in runs.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for o in r["opts"]:
                o.zero_grad(set_to_none=True)
            loss = ((r["model"](ids) - y) ** 2).mean()
            loss.backward()
            for o in r["opts"]:
                o.step()
            dt = time.perf_counter() - t0
            if step >= a.warmup:
                r["times"].append(dt)
                r["losses"].append(loss.item())
    per_rank = {m: statistics.median(r["times"]) for m, r in runs.items()}
    gathered = [None] * topo.world_size
    torch.distributed.all_gather_object(gathered, per_rank)
    if topo.rank == 0:
        rows = []
        for mode, r in runs.items():
            slowest = max(g[mode] for g in gathered)  # a step ends when the slowest rank ends
            rows.append({"mode": mode, "world_size": topo.world_size,
                         "samples_per_s": a.batch_size * topo.world_size / slowest,
                         "step_ms_median": 1e3 * slowest, "final_loss": r["losses"][-1]})
            if r["state"] is not None:
                rows[-1]["paths"] = {k: d.method.value for k, d in r["state"].decisions.items()}
        rows[1]["speedup"] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
        print(f"# DDP end-to-end: EmbeddingBag {a.rows} x {a.dim} fp32 (sparse), bag {a.bag}, Zipf({a.alpha}), "
              f"batch {a.batch_size}/rank, {a.optimizer}, {a.steps} timed steps, world {topo.world_size}, "
              f"{torch.get_num_threads()} threads/rank")
        for row in rows:
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        print("RESULT " + json.dumps(rows), flush=True)
    sparsecomm.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="spawn N local ranks with torchrun")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bag", type=int, default=8, help="ids per sample")
    p.add_argument("--batch-size", type=int, default=512, help="samples per rank per step")
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam",
                   help="adam: SparseAdam for the table + Adam for the MLP; sgd: SGD for all")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    if a.nproc and "RANK" not in os.environ:
        args = [x for x in (argv if argv is not None else sys.argv[1:])]
        i = args.index("--nproc")
        del args[i:i + 2]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
               os.path.abspath(__file__), *args]
        return subprocess.call(cmd)
    worker(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
