"""Sharded embedding step: sparsecomm's ShardedEmbeddingBag against TorchRec's row-wise sharded EmbeddingBagCollection.

Every rank looks up ``--batch`` bags of ``--pooling`` ids drawn from
Zipf(``--alpha``) over a ``--rows x --dim`` float32 table (sum pooling), takes
``loss = sum(pooled * w)`` with a fixed random ``w`` per rank, runs backward
and updates the table. One *step* (timed) = lookup + backward + update, the
same table, batch and optimizer for every method, interleaved per round so
machine noise hits all alike:

  sparsecomm_hash   ``ShardedEmbeddingBag(scheme="hash", owner_pooling=--owner-pooling)`` +
                    ``ShardedAdagrad(rowwise=True, fused=--fused, defer=--defer)`` (defaults: "auto",
                    fused: updated in backward, as TorchRec's fused optimizer, with the gradient rows
                    riding in the next step's request); ``--prefetch 1`` sends each step's ids during
                    the previous step (``table.prefetch``)
  sparsecomm_range  the same with ``scheme="range"`` (contiguous blocks, like TorchRec's row-wise)
  sparsecomm_hot    ``sparsecomm_range`` with hot-row replication: ``HotRowConfig(budget_bytes=--hot-mb MB,
                    window=--hot-window)`` (the most looked-up rows on every rank, the rest sharded)
  torchrec          TorchRec ``EmbeddingBagCollection`` sharded row-wise by
                    ``DistributedModelParallel`` with fbgemm's fused CPU kernel and fused
                    ``EXACT_ROWWISE_ADAGRAD`` (update inside backward). Needs
                    ``pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0`` and its
                    pure-Python deps (tensordict, pyvers, cloudpickle, pyre-extensions,
                    typing-inspect, mypy-extensions, torchmetrics, lightning-utilities, tqdm)
  ddp_replicated    ``nn.EmbeddingBag(sparse=True)`` replicated on every rank under DDP
                    (gloo's sparse allreduce) + ``torch.optim.Adagrad``: what a user does
                    without sharding (element-wise Adagrad: torch has no row-wise one)

Row-wise Adagrad with gradients *summed* over ranks (what TorchRec's fused
optimizer does; ``grad_reduction="sum"`` on the sharded table). DDP averages.

``MB/rank`` is what a rank holds for the table: its rows, its optimizer state
and (hash) its ownership map, counted from the tensors; ``floor_MB`` is V/N
rows of values + one row-wise accumulator each. ``wire_MB`` is what
sparsecomm's exchanges moved per step and rank (sent + received, from the
table's ``stats``); ``pooled`` the share of its lookups the owners pooled.
TorchRec does not count its bytes: ``torchrec_MB`` is what its row-wise
design moves per step and rank (sent + received), from its messages: the
ids (int64) and bag lengths (int32) all-to-all, the partial pooled bags'
reduce-scatter and, in backward, their gradients' all-gather:
``2 * ((N-1)/N * n * 8 + (N-1) * B * 4 + 2 * (N-1) * B * d * 4)`` bytes for
``n`` ids in ``B`` bags per rank.

``--alpha`` and ``--pooling`` take comma-separated lists: every combination
runs in the same launch (one table per combination, rows labelled).

The default table shows per method ``step_ms``, ``vs_best_peer`` (the
fastest of torchrec / ddp_replicated over this method's time),
``vs_torchrec``, ``MB_per_rank`` against ``floor_MB``, and ``#wrong``;
``--wide`` prints every column. Without TorchRec installed (and no
``--methods``), its row is listed as skipped and the run exits 0. Progress
goes to stderr: one line per method built and checked, one per timing phase.

Checks (``#wrong``): every method starts from the same seeded table; its first
step's pooled output must equal a float64 lookup of that table, and the step
after the warm-up must equal a float64 simulation of that many updates on the
rows every rank touches (from every rank's seeded batch), with the method's
own rule (row-wise/sum, or element-wise/mean for DDP).

Examples::

    python -m sparsecomm.bench sharded --nproc 2,4
    python -m sparsecomm.bench sharded --nproc 2,4 --alpha 1.05,1.1,1.2 --pooling 1,8,20
    torchrun --nproc-per-node 4 -m sparsecomm.bench sharded --rows 4000000
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from sparsecomm.bench.harness import Row, Stopwatch, Verdict, progress
from sparsecomm.bench.launch import add_launch_args, run_distributed
from sparsecomm.sharded import HotRowConfig, ShardedAdagrad, ShardedEmbeddingBag
from sparsecomm.synthetic import zipf_ids

METHODS = ("sparsecomm_hash", "sparsecomm_range", "sparsecomm_hot", "torchrec", "ddp_replicated")
PEERS = ("torchrec", "ddp_replicated")
TOL = 1e-4
TORCHREC_MISSING = ("TorchRec is not installed (pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0, "
                    "see benchmarks/RESULTS.md)")
COMPACT_COLS = ("world", "alpha", "bag", "method", "step_ms", "vs_torchrec", "MB_per_rank", "wire_MB", "torchrec_MB",
                "pooled", "hot", "#wrong")
LEGEND = {
    "step_ms": "median ms per training step (lookup + backward + update), median over ranks",
    "vs_best_peer": "step time of the fastest of torchrec / ddp_replicated over this method's (> 1: faster)",
    "vs_torchrec": "TorchRec's step time over this method's (> 1: faster)",
    "MB_per_rank": "what a rank holds for the table: rows + optimizer state (+ the hash ownership map)",
    "floor_MB": "V/N rows + one row-wise accumulator each",
    "wire_MB": "bytes sparsecomm's all-to-alls moved per step and rank (sent + received)",
    "torchrec_MB": "what TorchRec's row-wise design moves per step and rank (from its messages; not counted by it)",
    "pooled": "share of sparsecomm's lookups pooled at the owners (the rest sent unique rows)",
    "hot": "share of sparsecomm_hot's looked-up unique rows read from the replica (the rest went to their owners)",
    "#wrong": "elements off a float64 simulation of the training (0: correct; a non-zero count exits 3)",
    "skipped": "a peer left out, and why (not counted as wrong: the exit status stays 0)",
}


# ---------------------------------------------------------------- workload


def initial_table(a: argparse.Namespace) -> torch.Tensor:
    return torch.randn(a.rows, a.dim, generator=torch.Generator().manual_seed(a.seed))


def batch_of(a: argparse.Namespace, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ids ``(batch, pooling)`` and loss weights ``(batch, dim)``.

    The ranks draw with different seeds from one popularity order: the hot
    ids are the same everywhere, as in real data, and scattered over the
    table (so over the owners, under either scheme).
    """
    ids = zipf_ids(a.batch * a.pooling, a.rows, a.alpha, seed=a.seed * 1000 + rank,
                   popularity_seed=a.seed).view(a.batch, a.pooling)
    w = torch.randn(a.batch, a.dim, generator=torch.Generator().manual_seed(a.seed * 1000 + 7 + rank))
    return ids, w


class Reference:
    """Float64 simulation of the training, on the rows any rank touches (never the whole table)."""

    def __init__(self, a: argparse.Namespace, world: int, me: int, table: torch.Tensor) -> None:
        self.a, self.world, self.me = a, world, me
        batches = [batch_of(a, r) for r in range(world)]
        unique, inverse = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in batches]), return_inverse=True)
        self.rows0 = table[unique].double()
        self.inverse = inverse.view(world, a.batch, a.pooling)
        self.weights = [w.double() for _, w in batches]
        self.distinct = [int(torch.unique(ids).numel()) for ids, _ in batches]
        self._cache: Dict[Tuple[int, str], torch.Tensor] = {}

    def output(self, steps: int, rule: str) -> torch.Tensor:
        """This rank's pooled output after ``steps`` updates with ``rule`` ("rowwise_sum"/"elementwise_mean")."""
        key = (steps, rule)
        if key not in self._cache:
            a = self.a
            rows, acc = self.rows0.clone(), None
            for _ in range(steps):
                # d loss / d row = sum over the lookups of that row of the bag's weight vector.
                grad = torch.zeros_like(rows)
                for r in range(self.world):
                    per_lookup = self.weights[r][:, None, :].expand(-1, a.pooling, -1).reshape(-1, a.dim)
                    grad.index_add_(0, self.inverse[r].reshape(-1), per_lookup)
                if rule == "rowwise_sum":
                    acc = torch.zeros(len(rows), dtype=torch.float64) if acc is None else acc
                    acc += grad.pow(2).mean(1)
                    rows -= a.lr * grad / (acc.sqrt() + a.eps)[:, None]
                else:
                    grad /= self.world
                    acc = torch.zeros_like(rows) if acc is None else acc
                    acc += grad.pow(2)
                    rows -= a.lr * grad / (acc.sqrt() + 1e-10)
            self._cache[key] = F.embedding_bag(self.inverse[self.me], rows, mode="sum")
        return self._cache[key]

    def wrong(self, got: torch.Tensor, steps: int, rule: str) -> int:
        ref = self.output(steps, rule)
        if got.shape != ref.shape:
            return ref.numel()
        return int(((got.double() - ref).abs() > TOL * (1 + ref.abs())).sum())


# ----------------------------------------------------------------- methods


class Method:
    """One way to train the table: ``step()`` returns the pooled output it computed."""

    rule = "rowwise_sum"

    def step(self) -> torch.Tensor:
        raise NotImplementedError

    def memory_bytes(self) -> int:
        raise NotImplementedError

    def wire_bytes(self) -> Optional[float]:
        return None

    def pooled_share(self) -> Optional[float]:
        return None

    def hot_share(self) -> Optional[float]:
        return None

    def local_rows(self) -> int:
        raise NotImplementedError


class Sparsecomm(Method):
    def __init__(self, a, table, ids, w, scheme: str, hot: bool = False) -> None:
        config = HotRowConfig(budget_bytes=int(a.hot_mb * 2**20), window=a.hot_window) if hot else None
        self.emb = ShardedEmbeddingBag(a.rows, a.dim, mode="sum", scheme=scheme, grad_reduction="sum",
                                       owner_pooling=a.owner_pooling, _weight=table, seed=0, hot_rows=config)
        fused = bool(a.fused)
        self.opt = ShardedAdagrad(self.emb, lr=a.lr, eps=a.eps, rowwise=True, fused=fused,
                                  defer=fused and bool(getattr(a, "defer", 0)))
        self.ids, self.w = ids, w
        self.steps = 0
        self.prefetch = bool(getattr(a, "prefetch", 0))
        self.next = self.emb.prefetch(ids) if self.prefetch else None

    def step(self) -> torch.Tensor:
        self.opt.zero_grad()
        if self.prefetch:  # this step's ids left during the previous step; the next step's leave now
            out = self.emb(self.next)
            self.next = self.emb.prefetch(self.ids)
        else:
            out = self.emb(self.ids)
        (out * self.w).sum().backward()
        self.opt.step()
        self.steps += 1
        return out.detach()

    def memory_bytes(self) -> int:
        return self.emb.memory_bytes()

    def wire_bytes(self) -> Optional[float]:
        s = self.emb.stats
        return (s.bytes_sent + s.bytes_recv) / max(1, self.steps)

    def pooled_share(self) -> Optional[float]:
        s = self.emb.stats
        return s.pooled_lookups / max(1, s.pooled_lookups + s.row_lookups)

    def hot_share(self) -> Optional[float]:
        hot = self.emb.hot
        return None if hot is None else hot.hits / max(1, hot.hits + hot.misses)

    def local_rows(self) -> int:
        return self.emb.layout.num_local


class TorchRec(Method):
    def __init__(self, a, table, ids, w) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.types import ShardingPlan

        n = dist.get_world_size()
        ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="t0", embedding_dim=a.dim, num_embeddings=a.rows, feature_names=["f0"],
            pooling=PoolingType.SUM)], device=torch.device("meta"))
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": a.lr, "eps": a.eps})
        # TorchRec's planner offers row-wise sharding only for CUDA; the plan itself runs on CPU.
        plan = ShardingPlan({"": construct_module_sharding_plan(
            ebc, per_param_sharding={"t0": row_wise(compute_kernel="fused")}, local_size=n, world_size=n,
            device_type="cpu", sharder=sharder)})
        self.model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
        self.weight = self.model.state_dict()["embedding_bags.t0.weight"]
        self._rows = 0
        with torch.no_grad():
            for shard in self.weight.local_shards():
                lo = shard.metadata.shard_offsets[0]
                shard.tensor.copy_(table[lo:lo + shard.tensor.shape[0]])
                self._rows += shard.tensor.shape[0]
        self.kjt = KeyedJaggedTensor(keys=["f0"], values=ids.reshape(-1),
                                     lengths=torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int32))
        self.w = w

    def step(self) -> torch.Tensor:
        out = self.model(self.kjt)
        pooled = (out.wait() if hasattr(out, "wait") else out).values()
        (pooled * self.w).sum().backward()  # the fused optimizer updates inside backward
        return pooled.detach()

    def memory_bytes(self) -> int:
        total = sum(s.tensor.numel() * s.tensor.element_size() for s in self.weight.local_shards())

        def walk(x: Any) -> int:
            if isinstance(x, dict):
                return sum(walk(v) for v in x.values())
            if hasattr(x, "local_shards"):
                return sum(s.tensor.numel() * s.tensor.element_size() for s in x.local_shards())
            return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

        return total + walk(self.model.fused_optimizer.state_dict()["state"])

    def local_rows(self) -> int:
        return self._rows


class DDPReplicated(Method):
    rule = "elementwise_mean"

    def __init__(self, a, table, ids, w) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.emb = nn.EmbeddingBag(a.rows, a.dim, mode="sum", sparse=True, _weight=table.clone())
        self.model = DDP(self.emb)
        self.opt = torch.optim.Adagrad(self.emb.parameters(), lr=a.lr)
        self.ids, self.w = ids, w

    def step(self) -> torch.Tensor:
        self.opt.zero_grad()
        out = self.model(self.ids)
        (out * self.w).sum().backward()
        self.opt.step()
        return out.detach()

    def memory_bytes(self) -> int:
        p = self.emb.weight
        state = sum(v.numel() * v.element_size() for v in self.opt.state[p].values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0) if p in self.opt.state else p.numel() * 4
        return p.numel() * p.element_size() + state

    def local_rows(self) -> int:
        return self.emb.weight.shape[0]


def make_method(name: str, a, table, ids, w) -> Method:
    if name == "sparsecomm_hash":
        return Sparsecomm(a, table, ids, w, "hash")
    if name == "sparsecomm_range":
        return Sparsecomm(a, table, ids, w, "range")
    if name == "sparsecomm_hot":
        return Sparsecomm(a, table, ids, w, "range", hot=True)
    if name == "torchrec":
        return TorchRec(a, table, ids, w)
    if name == "ddp_replicated":
        return DDPReplicated(a, table, ids, w)
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


# -------------------------------------------------------------------- body


def _agree_ok(ok: bool) -> bool:
    # A method that fails on one rank is dropped on all, so the ranks' collectives stay in step.
    flags: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def _run_method(name: str, a, table, ids, w, ref: Reference) -> Dict[str, Any]:
    """Build one method on this rank and check its first step (the warm-up and the timing interleave methods)."""
    res: Dict[str, Any] = {}
    method: Optional[Method] = None
    try:
        method = make_method(name, a, table, ids, w)
        res["wrong"] = ref.wrong(method.step(), 0, method.rule)
    except Exception as exc:  # e.g. TorchRec missing or failing: report the exact error
        res["error"] = f"{type(exc).__name__}: {exc}"[:300]
    if not _agree_ok("error" not in res):
        res.setdefault("error", "failed on another rank")
        return res
    res["memory"] = method.memory_bytes()
    res["rows"] = method.local_rows()
    res["method"] = method
    return res


def _warm_up(a, names: List[str], results: Dict[str, Dict[str, Any]], ref: Reference) -> None:
    """``a.warmup - 1`` steps of every method, interleaved as the timed rounds are (so what a method learns
    in warm-up, such as owner_pooling="auto"'s path, it learns under the timed conditions), then one more
    step each, checked against the float64 simulation."""
    live = [name for name in names if "method" in results[name]]
    for it in range(a.warmup):
        for name in live:
            r = results[name]
            if "error" in r:
                continue
            try:
                out = r["method"].step()
                if it == a.warmup - 1:
                    r["wrong"] += ref.wrong(out, a.warmup, r["method"].rule)
            except Exception as exc:
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
    for name in live:
        if not _agree_ok("error" not in results[name]):
            results[name].setdefault("error", "failed on another rank")
            results[name].pop("method", None)


def body(a: argparse.Namespace) -> List[Row]:
    if a.device != "cpu":
        raise SystemExit("sharded: CPU only (gloo), as TorchRec's CPU kernels")
    # torch.optim.Adagrad (ddp_replicated) warns on every sparse step that invariant checks are off: noise here.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    rows: List[Row] = []
    for alpha in a.alphas:
        for pooling in a.poolings:
            rows += _body_one(argparse.Namespace(**{**vars(a), "alpha": alpha, "pooling": pooling}))
    return rows


def _body_one(a: argparse.Namespace) -> List[Row]:
    """One workload (one Zipf exponent and bag size): build, check and time every method."""
    n, me = dist.get_world_size(), dist.get_rank()
    names = [m for m in a.methods.split(",") if m]
    table = initial_table(a)
    ids, w = batch_of(a, me)
    ref = Reference(a, n, me, table)
    if me == 0:
        print(f"# sharded embedding step: world={n} table={a.rows}x{a.dim} float32 batch={a.batch}x{a.pooling}/rank "
              f"zipf({a.alpha:g}) union={len(ref.rows0)} k(rank0)={ref.distinct[0]} row-wise Adagrad lr={a.lr} "
              f"warmup={a.warmup} iters={a.iters} threads/rank={torch.get_num_threads()}", flush=True)
        for name, why in getattr(a, "skipped", {}).items():
            progress(f"sharded world {n}: {name} skipped: {why}")
    results = {}
    for name in names:
        t0 = time.monotonic()
        results[name] = _run_method(name, a, table, ids, w, ref)
        if me == 0:
            r = results[name]
            done = f"FAILED: {r['error']}" if "error" in r else "built, first step checked"
            progress(f"sharded world {n}: {name}: {done} ({time.monotonic() - t0:.1f} s)")
    del table
    _warm_up(a, names, results, ref)
    if me == 0:
        for name in names:
            r = results[name]
            if "method" in r:
                progress(f"sharded world {n}: {name}: {a.warmup} warm-up steps (interleaved), checked"
                         + (f": {r['wrong']} WRONG" if r["wrong"] else ""))
    live = [name for name in names if "method" in results[name]]
    times: Dict[str, List[float]] = {name: [] for name in live}
    watch = Stopwatch("cpu")
    t0 = time.monotonic()
    if me == 0:
        progress(f"sharded world {n} zipf({a.alpha:g}) bags of {a.pooling}: timing {len(live)} methods x "
                 f"{a.iters} rounds ...")
    for it in range(a.iters):
        order = live[it % len(live):] + live[:it % len(live)] if live else []  # rotate: no favoured slot
        for name in order:
            dist.barrier()
            watch.start()
            results[name]["method"].step()
            times[name].append(watch.stop())
    mine = {}
    for name in names:
        r = results[name]
        m = r.get("method")
        mine[name] = dict(time=statistics.median(times[name]) if times.get(name) else None,
                          wrong=r.get("wrong"), error=r.get("error"), memory=r.get("memory"), rows=r.get("rows"),
                          wire=m.wire_bytes() if m is not None else None,
                          pooled=m.pooled_share() if m is not None else None,
                          hot=m.hot_share() if m is not None else None)
    everyone: List[Any] = [None] * n
    dist.all_gather_object(everyone, mine)
    if me == 0:
        progress(f"sharded world {n}: timed in {time.monotonic() - t0:.1f} s")
    return _rows(a, n, names, everyone, ref) if me == 0 else []


def torchrec_bytes(a: argparse.Namespace, n: int) -> float:
    """Bytes TorchRec's row-wise sharding moves per step and rank, sent + received (see the module docstring)."""
    ids, bags = a.batch * a.pooling, a.batch
    one_way = (n - 1) / n * ids * 8 + (n - 1) * bags * 4 + 2 * (n - 1) * bags * a.dim * 4
    return 2 * one_way


def _rows(a, n: int, names: Sequence[str], everyone: Sequence[Dict[str, Any]], ref: Reference) -> List[Row]:
    floor_mb = a.rows / n * (a.dim * 4 + 4) / 1e6
    med = {name: statistics.median(e[name]["time"] for e in everyone) if all(e[name]["time"] for e in everyone)
           else None for name in names}
    peers = [med[p] for p in PEERS if med.get(p)]
    out = []
    for name in names:
        per = [e[name] for e in everyone]
        cols: Dict[str, Any] = {"world": n, "alpha": a.alpha, "bag": a.pooling, "table": f"{a.rows}x{a.dim}",
                                "bags/rank": f"{a.batch}x{a.pooling}", "union": len(ref.rows0), "method": name}
        errors = [p["error"] for p in per if p["error"]]
        if errors:
            cols["error"] = errors[0]
            cols["#wrong"] = -1
            out.append(Row(cols))
            continue
        t = med[name]
        cols.update(step_ms=t * 1e3, max_rank_ms=max(p["time"] for p in per) * 1e3,
                    vs_best_peer=min(peers) / t if peers and name not in PEERS else "",
                    vs_torchrec=med["torchrec"] / t if med.get("torchrec") else "",
                    rows_max=max(p["rows"] for p in per),
                    MB_per_rank=statistics.mean(p["memory"] for p in per) / 1e6,
                    MB_max=max(p["memory"] for p in per) / 1e6, floor_MB=floor_mb,
                    wire_MB=statistics.mean(p["wire"] for p in per) / 1e6 if per[0]["wire"] is not None else "",
                    torchrec_MB=torchrec_bytes(a, n) / 1e6 if name == "torchrec" else "",
                    pooled=statistics.mean(p["pooled"] for p in per) if per[0]["pooled"] is not None else "",
                    hot=statistics.mean(p["hot"] for p in per) if per[0]["hot"] is not None else "",
                    **{"#wrong": int(sum(p["wrong"] for p in per))})
        out.append(Row(cols))
    for name, why in getattr(a, "skipped", {}).items():
        out.append(Row({"world": n, "alpha": a.alpha, "bag": a.pooling, "table": f"{a.rows}x{a.dim}",
                        "bags/rank": f"{a.batch}x{a.pooling}", "union": len(ref.rows0), "method": name,
                        "skipped": why}))
    return out


def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(argv or [])
    p = argparse.ArgumentParser(prog="sparsecomm.bench sharded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows V (default 1M)")
    p.add_argument("--dim", type=int, default=64, help="row width d (default 64)")
    p.add_argument("--batch", type=int, default=2048, help="bags per rank (default 2048)")
    p.add_argument("--pooling", default="20", help="ids per bag, or a comma-separated list (default 20)")
    p.add_argument("--alpha", default="1.1", help="Zipf skew of the ids, or a comma-separated list (default 1.1)")
    p.add_argument("--owner-pooling", choices=("auto", "bytes", "always", "never"), default="auto",
                   help="sparsecomm's owner_pooling (default auto: the path measured faster)")
    p.add_argument("--prefetch", type=int, choices=(0, 1), default=0,
                   help="1: sparsecomm sends the next step's ids right after each lookup (table.prefetch), so "
                        "they travel during backward and the update; default 0")
    p.add_argument("--fused", type=int, choices=(0, 1), default=1,
                   help="1 (default): sparsecomm's optimizer updates in backward, like TorchRec's; 0: in step()")
    p.add_argument("--defer", type=int, choices=(0, 1), default=1,
                   help="1 (default, with --fused 1): the optimizer's defer=True: a backward's gradient rows travel "
                        "with the next lookup's request (one all-to-all fewer per step, the same training); 0: "
                        "pushed in backward")
    p.add_argument("--hot-mb", type=float, default=16.0,
                   help="sparsecomm_hot's replica budget per rank, MB (rows + optimizer state; default 16)")
    p.add_argument("--hot-window", type=int, default=2,
                   help="sparsecomm_hot's rounds between hot-set choices (default 2: the set forms in warm-up)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--eps", type=float, default=1e-8, help="row-wise Adagrad eps (default 1e-8)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)} (default: all; "
                                                         "torchrec only when installed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=12,
                   help="untimed steps per method (default 12: owner_pooling='auto' first times each path over 4 "
                        "rounds, so the timed steps see the path it keeps)")
    p.add_argument("--iters", type=int, default=10, help="timed rounds (default 10)")
    add_launch_args(p)
    a = p.parse_args(argv)
    try:
        a.alphas = [float(x) for x in str(a.alpha).split(",") if x]
        a.poolings = [int(x) for x in str(a.pooling).split(",") if x]
    except ValueError:
        p.error("--alpha and --pooling take numbers, comma-separated")
    if not a.alphas or not a.poolings or min(a.poolings) < 1 or min(a.alphas) <= 1:
        p.error("--pooling needs ids per bag >= 1 and --alpha Zipf exponents > 1")
    if a.warmup < 1 or a.iters < 1:
        p.error("--warmup and --iters must be >= 1 (the step after warm-up is checked against a simulation of "
                "the warm-up's updates)")
    explicit = any(x == "--methods" or x.startswith("--methods=") for x in argv)
    a.skipped = {}
    if not explicit and importlib.util.find_spec("torchrec") is None:
        # A missing optional peer is not a wrong result (exit 3): list it as skipped, exit 0.
        a.methods = ",".join(m for m in METHODS if m != "torchrec")
        a.skipped["torchrec"] = TORCHREC_MISSING
    return run_distributed("sharded", argv, a, body, "sharded embedding step (median over ranks)",
                           compact_cols=COMPACT_COLS, legend=LEGEND,
                           verdict=Verdict("step_ms", PEERS, ("world", "alpha", "bag", "table")))

