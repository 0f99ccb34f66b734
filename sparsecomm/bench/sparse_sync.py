"""Sparse gradient synchronization: sparsecomm against the ways PyTorch users do it today.

Every rank holds the gradient of a ``--rows x --dim`` embedding table after a
batch of ``density * rows`` lookups: an uncoalesced sparse COO tensor, one row
per lookup, ids drawn from Zipf(``--alpha``) (the same hot ids on every rank,
as in real data) or uniformly. Each method must leave every rank with the sum
over ranks; in one run, interleaved per round so machine noise hits all alike:

  dense             (a) densify into the V x d table and ``dist.all_reduce`` it
                        (``sparse_as_dense``; what NCCL users must do)
  torch_sparse      (b) ``dist.all_reduce`` of the sparse tensor (gloo's sparse
                        allreduce; what DDP does by default on gloo)
  allgather         (c) all-gather the counts, then the (padded) ids and values,
                        sum locally (what Horovod does)
  sparsecomm        (d) ``sparsecomm.sparse_allreduce``: partitioned push/pull
  sparsecomm_local  (d) the same with local aggregation over emulated nodes of
                        ``--lws`` ranks (only when 1 < lws < world size divides it)
  sparsecomm_auto   (d) what the DDP hook does: one measured partitioned call,
                        then the path the cost model picks from the global counts

and, on request (``--methods``), sparse_allreduce's other paths, the ones its
DDP hook may pick: ``sparsecomm_allgather`` (method="allgather") and
``sparsecomm_densify`` (method="densify").

Bytes per rank are sent + received, a rank's messages to itself excluded:
(a) a ring allreduce, 2 x 2(n-1)/n V d b; (b) gloo's algorithm (coalesce,
ring all-gather of 9 int64 of metadata per rank, ring all-gatherv of every
rank's int64 indices and of its values: a rank receives every other rank's
chunk and sends all chunks but its successor's); (c) ring all-gathers of 8
bytes of count and of max-nnz padded int64 ids and values, padding included;
(d) measured by ``SparseSyncStats``. ``floor`` is docs/DESIGN.md's
(n-1)/n (k + U) r per direction (``sparsecomm.cost_model``), doubled for sent
+ received, with r = d b + the id's bytes on the wire, k this rank's distinct
rows and U the union. ``inter_MB`` is what crosses between emulated nodes.
``floor_ms`` is the floor at the link speed measured first (the slowest
rank's best even all-to-all of ``--link-bytes`` through sparsecomm's own
transport, sent + received),
``time_vs_floor`` the measured time over it: what latency and compute add.

The default table shows, per method, ``time_ms``, ``vs_best_peer``,
``bytes/floor`` and ``#wrong`` (with a legend); ``--wide`` prints every
column above, ``--json``/``--csv`` save them all. A method that cannot run in
this setting (``sparsecomm_local`` without two emulated nodes) is listed as
skipped. Progress goes to stderr, one line per (distribution, density).

Every method's result is checked against a float64 sum of the touched rows
computed from every rank's seeded input (``#wrong``: elements off by more
than the dtype's rounding allows, missing or extra rows count ``dim`` each).

Examples::

    python -m sparsecomm.bench sparse_sync --nproc 4
    python -m sparsecomm.bench sparse_sync --nproc 2,3,4 --densities 0.001,0.01 --json scaling.json
    torchrun --nproc-per-node 4 -m sparsecomm.bench sparse_sync --dist zipf,uniform --plot sweep.png
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import sparsecomm
from sparsecomm.bench.harness import DTYPES, Row, Stopwatch, Verdict, parse_size, plot_rows, progress
from sparsecomm.bench.launch import add_launch_args, gather_floats, run_distributed
from sparsecomm.collectives import methods as sync_methods
from sparsecomm.collectives.exchange import all_gather_single, all_to_all, wire_index_dtype
from sparsecomm.collectives.groups import comm_device
from sparsecomm.collectives.methods import SyncPath
from sparsecomm.cost_model import partitioned_floor_bytes
from sparsecomm.hooks.classifier import choose_method
from sparsecomm.synthetic import uniform_ids, zipf_ids
from sparsecomm.types import SparseSyncStats

PEERS = ("dense", "torch_sparse", "allgather")


def _library_paths() -> Dict[str, SyncPath]:
    """The library's paths as benchmark methods: the default method flat (``sparsecomm``) and hierarchical
    (``sparsecomm_local``), then ``sparsecomm_<name>`` for every other path that runs on any backend."""
    default = sync_methods.PATHS[0]
    out = {"sparsecomm": default, "sparsecomm_local": sync_methods.path_for(default.method, True)}
    for path in sync_methods.PATHS:
        if path.method is not default.method and path.backend is None:
            out[f"sparsecomm_{path.name}"] = path
    return out


LIBRARY = _library_paths()
METHODS = (*PEERS, "sparsecomm", "sparsecomm_local", "sparsecomm_auto",
           *(m for m in LIBRARY if m not in ("sparsecomm", "sparsecomm_local")))
DEFAULT_METHODS = METHODS[:6]
# Slow at every density: timed --dense-iters rounds.
DENSE_METHODS = ("dense", *(m for m, p in LIBRARY.items() if p.moves_table))
VALUE_DTYPES = ("float32", "float64", "float16", "bfloat16")
_GLOO_META_BYTES = 9 * 8  # gloo's SparseTensorMetadata: 9 int64 per rank
# The default table: what a reader compares first. --wide prints every column.
COMPACT_COLS = ("world", "dist", "density", "method", "time_ms", "vs_best_peer", "bytes/floor", "#wrong")
LEGEND = {
    "density": "lookups per rank / table rows (batch = density x --rows ids, one gradient row each)",
    "time_ms": "median ms per sync (median over rounds, then over ranks)",
    "vs_best_peer": "time of the fastest of dense / torch_sparse / allgather over this method's (> 1: faster)",
    "bytes/floor": "bytes sent + received per rank over the owner-based floor (n-1)/n (k+U) rows, docs/DESIGN.md",
    "#wrong": "elements off the float64 sum of every rank's input (0: correct; a non-zero count exits 3)",
    "skipped": "a method that does not apply to this setting",
}


# ------------------------------------------------------------------ inputs and reference

def _floats(text: str) -> List[float]:
    return [float(x) for x in text.split(",") if x.strip()]


class Workload:
    """The seeded inputs of one (distribution, density) case: any rank can rebuild any rank's batch."""

    def __init__(self, a: argparse.Namespace, dist_name: str, density: float, case: int, perm: torch.Tensor) -> None:
        self.rows, self.dim, self.dtype = a.rows, a.dim, DTYPES[a.dtype]
        self.dist_name, self.alpha, self.density = dist_name, a.alpha, density
        self.batch = max(1, int(round(density * a.rows)))
        self.seed = a.seed * 1_000_003 + case * 1009
        self.perm = perm

    def batch_of(self, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s lookups: ``(ids, values)``, one row per lookup (duplicates included)."""
        seed = self.seed + rank
        if self.dist_name == "zipf":
            # Frequency ranks mapped through one permutation shared by all ranks: the hot ids are
            # the same everywhere (zipf_ids' own shuffle depends on the seed, i.e. on the rank).
            ids = self.perm[zipf_ids(self.batch, self.rows, self.alpha, seed=seed, shuffle=False)]
        else:
            ids = uniform_ids(self.batch, self.rows, seed=seed)
        g = torch.Generator().manual_seed(seed)
        values = torch.randn(self.batch, self.dim, generator=g).to(self.dtype)
        return ids, values


class Reference:
    """The float64 sum over ranks of the touched rows, with per-element tolerances."""

    def __init__(self, work: Workload, world: int) -> None:
        batches = [work.batch_of(r) for r in range(world)]
        self.distinct = [int(torch.unique(ids).numel()) for ids, _ in batches]  # k of every rank
        ids = torch.cat([b[0] for b in batches])
        vals = torch.cat([b[1].double() for b in batches])
        del batches
        self.ids, inv = torch.unique(ids, return_inverse=True)
        self.values = torch.zeros(len(self.ids), work.dim, dtype=torch.float64).index_add_(0, inv, vals)
        abs_sum = torch.zeros_like(self.values).index_add_(0, inv, vals.abs_())
        eps = torch.finfo(work.dtype).eps
        # Rounding of the result, plus accumulated rounding of the additions in any order;
        # an independent error (a lost or doubled contribution) is far above this.
        self.tol = 2 * eps * self.values.abs() + 64 * eps * abs_sum + 1e-30

    def wrong_rows(self, ids: torch.Tensor, values: torch.Tensor) -> int:
        """Elements of a coalesced ``(ids, values)`` result that differ from the reference."""
        ids, values = ids.detach().cpu().long(), values.detach().cpu().double()
        d = self.values.shape[1]
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            return max(ids.numel(), len(self.ids)) * d  # not coalesced: not a valid result
        if len(self.ids) == 0:
            return ids.numel() * d
        pos = torch.searchsorted(self.ids, ids).clamp_(max=len(self.ids) - 1)
        hit = self.ids[pos] == ids
        extra, missing = int((~hit).sum()), len(self.ids) - int(hit.sum())
        pos = pos[hit]
        off = (values[hit] - self.values[pos]).abs() > self.tol[pos]
        return (extra + missing) * d + int(off.sum())

    def wrong_sparse(self, t: torch.Tensor) -> int:
        t = t if t.is_coalesced() else t.coalesce()
        return self.wrong_rows(t.indices()[0], t.values())

    def wrong_dense(self, table: torch.Tensor) -> int:
        rows = table.index_select(0, self.ids.to(table.device))
        wrong = self.wrong_rows(self.ids, rows)
        # Every untouched row must stay zero.
        wrong += int((table != 0).sum()) - int((rows != 0).sum())
        return wrong


# ------------------------------------------------------------------ the methods

class Methods:
    """The contenders, sharing one process group setup; each ``run_*`` returns its result."""

    def __init__(self, a: argparse.Namespace, device: torch.device) -> None:
        self.n, self.me = dist.get_world_size(), dist.get_rank()
        self.rows, self.dim, self.dtype, self.device = a.rows, a.dim, DTYPES[a.dtype], device
        self.lws = a.lws
        self.names = [m for m in a.methods.split(",") if m]
        self.skipped: Dict[str, str] = {}
        if "sparsecomm_local" in self.names and not (1 < a.lws < self.n and self.n % a.lws == 0):
            self.names.remove("sparsecomm_local")  # needs more than one emulated node of lws ranks
            self.skipped["sparsecomm_local"] = (f"needs 2+ emulated nodes: --lws {a.lws} must be > 1, "
                                                f"< the world size {self.n} and divide it")
        self.dense_table = (torch.zeros(a.rows, a.dim, dtype=self.dtype, device=device)
                            if "dense" in self.names else None)
        # gloo's sparse allreduce is the only one torch has (NCCL has none: pytorch#22400): on a
        # NCCL job, method (b) runs on a gloo group over the same ranks, CUDA tensors and all.
        self.sparse_group = (dist.new_group(backend="gloo")
                             if "torch_sparse" in self.names and dist.get_backend() != "gloo" else None)
        self.stats = SparseSyncStats()
        self.allgather_rows = 0  # rows per rank in method (c)'s all-gather, padding included
        self.ids = self.values = None

    def set_batch(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        self.ids, self.values = ids.to(self.device), values.to(self.device)

    def _grad(self) -> torch.Tensor:
        # What backward leaves in an nn.Embedding(sparse=True): one uncoalesced row per lookup.
        return torch.sparse_coo_tensor(self.ids[None], self.values, (self.rows, self.dim), check_invariants=False)

    def run(self, name: str) -> Any:
        if name in LIBRARY:
            return self.run_library(LIBRARY[name])
        return getattr(self, "run_" + name)()

    def run_dense(self) -> torch.Tensor:
        table = self.dense_table
        table.zero_()
        table.index_add_(0, self.ids, self.values)
        dist.all_reduce(table)
        return table

    def run_torch_sparse(self) -> torch.Tensor:
        grad = self._grad()
        dist.all_reduce(grad, group=self.sparse_group)  # gloo writes the result into grad
        return grad

    def run_allgather(self) -> torch.Tensor:
        n, nnz = self.n, self.ids.shape[0]
        counts = torch.empty(n, dtype=torch.int64, device=self.device)
        all_gather_single(counts, torch.tensor([nnz], dtype=torch.int64, device=self.device))
        counts_l = counts.tolist()
        most = self.allgather_rows = max(counts_l)
        ids, values = self.ids, self.values
        if nnz < most:  # equal sizes only: pad to the largest batch
            ids = torch.cat([ids, ids.new_zeros(most - nnz)])
            values = torch.cat([values, values.new_zeros(most - nnz, self.dim)])
        all_ids = torch.empty(n * most, dtype=torch.int64, device=self.device)
        all_values = torch.empty(n * most, self.dim, dtype=self.dtype, device=self.device)
        all_gather_single(all_ids, ids)
        all_gather_single(all_values.view(-1), values.reshape(-1))
        if min(counts_l) < most:
            keep = torch.cat([torch.arange(r * most, r * most + c, device=self.device) for r, c in enumerate(counts_l)])
            all_ids, all_values = all_ids[keep], all_values[keep]
        return torch.sparse_coo_tensor(all_ids[None], all_values, (self.rows, self.dim),
                                       check_invariants=False).coalesce()

    def run_library(self, path: SyncPath) -> torch.Tensor:
        # The node layout only splits the byte counts into intra/inter-node on a flat path: one flat exchange.
        self.stats = SparseSyncStats()
        return sparsecomm.sparse_allreduce(self._grad(), local_world_size=self.lws, method=path.method.value,
                                           local_aggregation=path.hierarchical, stats=self.stats)

    def run_sparsecomm_auto(self) -> torch.Tensor:
        # What the DDP hook does: measure one partitioned sync, let the
        # classifier pick from the global counts, then use its choice.
        if getattr(self, "auto_method", None) is None:
            probe = SparseSyncStats()
            sparsecomm.sparse_allreduce(self._grad(), stats=probe)
            self.auto_method = choose_method(probe.world_size, probe.num_rows, self.dim, self.values.element_size(),
                                             probe.index_bytes, probe.rows_local_sum / probe.world_size,
                                             probe.rows_out).method.value
        self.stats = SparseSyncStats()
        return sparsecomm.sparse_allreduce(self._grad(), method=self.auto_method, stats=self.stats)

    # Bytes sent + received by this rank, and what of it crosses emulated nodes (None: not counted).
    def wire_bytes(self, name: str, distinct: Sequence[int]) -> Tuple[float, Optional[float]]:
        n, me = self.n, self.me
        esz = self.values.element_size()
        if n == 1:
            return 0.0, None
        if name == "dense":
            return 2 * 2 * (n - 1) / n * self.rows * self.dim * esz, None
        if name == "torch_sparse":
            chunk = [k * (8 + self.dim * esz) for k in distinct]  # int64 index + values per distinct row
            recv = (n - 1) * _GLOO_META_BYTES + sum(chunk) - chunk[me]
            sent = (n - 1) * _GLOO_META_BYTES + sum(chunk) - chunk[(me + 1) % n]
            return float(sent + recv), None
        if name == "allgather":
            # Every rank's chunk is padded to the largest batch: the padding travels too.
            per_rank = 8 + self.allgather_rows * (8 + self.dim * esz)
            return 2.0 * (n - 1) * per_rank, None
        s = self.stats
        # Only the owner-based paths split their counts by node, and only when lws divides the world.
        path = LIBRARY.get(name)
        split = path is not None and (path.partitions or path.hierarchical) and self.n % self.lws == 0
        return (float(s.bytes_sent + s.bytes_recv),
                float(s.bytes_sent_inter_node + s.bytes_recv_inter_node) if split else None)

    def check(self, name: str, result: Any, ref: Reference, corrupt: bool) -> int:
        if corrupt:  # --corrupt: prove that the check notices a wrong result
            if result.layout == torch.sparse_coo:
                result = result.coalesce()
                result.values()[0, 0] += 1
            else:
                result[ref.ids[0], 0] += 1
        if result.layout == torch.sparse_coo:
            return ref.wrong_sparse(result)
        return ref.wrong_dense(result)


# ------------------------------------------------------------------ the sweep

def _time_case(methods: Methods, a: argparse.Namespace, ref: Reference
               ) -> Tuple[Dict[str, List[float]], Dict[str, int], Dict[str, Tuple[float, Optional[float]]],
                          Dict[str, str]]:
    """Check each method once, then time them round-robin; all per this rank."""
    watch = Stopwatch(a.device)
    wrong: Dict[str, int] = {}
    nbytes: Dict[str, Tuple[float, Optional[float]]] = {}
    errors: Dict[str, str] = {}
    live: List[str] = []
    for name in methods.names:
        try:
            result = methods.run(name)
            wrong[name] = methods.check(name, result, ref, corrupt=name in a.corrupt.split(","))
            nbytes[name] = methods.wire_bytes(name, ref.distinct)
            del result
            for _ in range(a.warmup - 1):
                methods.run(name)
            live.append(name)
        except Exception as exc:  # e.g. a backend without this collective: report it, go on
            errors[name] = f"{type(exc).__name__}: {exc}"[:160]
    times: Dict[str, List[float]] = {name: [] for name in live}
    for it in range(max(a.iters, a.dense_iters)):
        order = live[it % len(live):] + live[:it % len(live)] if live else []  # rotate: no favoured slot
        for name in order:
            if it >= (a.dense_iters if name in DENSE_METHODS else a.iters):
                continue
            dist.barrier()
            watch.start()
            methods.run(name)
            times[name].append(watch.stop())
    return times, wrong, nbytes, errors


def link_rate(device: torch.device, nbytes: int, rounds: int = 3) -> float:
    """Bytes per second one rank moves (sent + received) in an even all-to-all of ``nbytes``.

    The all-to-all is the sparse path's own (``exchange.all_to_all``: shared
    memory between ranks of one host); its best round is the link speed the
    byte floor is converted to time with.
    """
    n = dist.get_world_size()
    if n == 1 or nbytes <= 0:
        return 0.0
    per_peer = max(1, nbytes // n)
    device = comm_device(None, device)  # where sparsecomm's own exchanges run (CPU on gloo)
    send = torch.ones(per_peer * n, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    watch, best = Stopwatch(device.type), float("inf")
    for _ in range(rounds + 1):
        dist.barrier()
        watch.start()
        all_to_all(recv, send, group=None)
        best = min(best, watch.stop())
    slowest = max(gather_floats(best))
    return 2 * (n - 1) * per_peer / slowest


def body(a: argparse.Namespace) -> List[Row]:
    n, me = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    methods = Methods(a, device)
    dtype = DTYPES[a.dtype]
    row_bytes = a.dim * dtype.itemsize + torch.empty(0, dtype=wire_index_dtype(a.rows)).element_size()
    perm = torch.from_numpy(np.random.default_rng(a.seed + 0x5EED).permutation(a.rows))
    if me == 0:
        progress(f"sparse_sync world {n}: measuring the link speed (all_to_all of {a.link_bytes})")
    rate = link_rate(device, parse_size(a.link_bytes))
    if me == 0:
        print(f"# sparse sync: world={n} backend={a.backend} device={a.device} table={a.rows}x{a.dim} {a.dtype} "
              f"methods={','.join(methods.names)} lws={a.lws} warmup={a.warmup} iters={a.iters} "
              f"dense_iters={a.dense_iters} threads/rank={torch.get_num_threads()} "
              f"link={rate / 1e9:.3f} GB/s per rank (sent+received, all_to_all of {a.link_bytes})", flush=True)
    rows: List[Row] = []
    case = 0
    cases = len(a.dist.split(",")) * len(_floats(a.densities))
    for dist_name in a.dist.split(","):
        for density in _floats(a.densities):
            case += 1
            label = (f"sparse_sync world {n}: {dist_name} density {density:g} ({case}/{cases}), "
                     f"{len(methods.names)} methods")
            t0 = time.monotonic()
            if me == 0:
                progress(f"{label}: checking, then {a.iters} timed rounds ...")
            work = Workload(a, dist_name, density, case, perm)
            ref = Reference(work, n)
            methods.set_batch(*work.batch_of(me))
            times, wrong, nbytes, errors = _time_case(methods, a, ref)
            floor = 2 * partitioned_floor_bytes(n, ref.distinct[me], len(ref.ids), row_bytes)
            mine = {name: (statistics.median(times[name]) if times.get(name) else None, wrong.get(name),
                           nbytes.get(name), errors.get(name)) for name in methods.names}
            everyone: List[Any] = [None] * n
            dist.all_gather_object(everyone, (mine, floor))
            if me == 0:
                new = _rows(a, n, work, ref, methods.names, everyone, rate, methods.skipped)
                rows += new
                progress(f"{label}: done in {time.monotonic() - t0:.1f} s ({_summary(new)})")
            del ref
    return rows


def _summary(rows: Sequence[Row]) -> str:
    """The fastest method of a case and any wrong result, for its progress line."""
    timed = [r.cols for r in rows if isinstance(r.cols.get("time_ms"), float)]
    text = (f"fastest {min(timed, key=lambda c: c['time_ms'])['method']}, "
            f"{min(c['time_ms'] for c in timed):.3g} ms") if timed else "nothing timed"
    wrong = [r.cols["method"] for r in rows if r.cols.get("#wrong") not in (0, "", None)]
    return text + (f"; WRONG or failed: {', '.join(wrong)}" if wrong else "")


def _rows(a: argparse.Namespace, n: int, work: Workload, ref: Reference, names: Sequence[str],
          everyone: Sequence[Any], rate: float, skipped: Optional[Dict[str, str]] = None) -> List[Row]:
    floor = statistics.mean(f for _, f in everyone)
    med: Dict[str, Optional[float]] = {}
    for name in names:
        ts = [m[name][0] for m, _ in everyone]
        med[name] = statistics.median(ts) if all(t is not None for t in ts) else None
    peers = [med[p] for p in PEERS if med.get(p)]
    dist_label = f"zipf({a.alpha:g})" if work.dist_name == "zipf" else work.dist_name
    out = []
    for name in names:
        per_rank = [m[name] for m, _ in everyone]
        ts = [p[0] for p in per_rank]
        errs = [p[3] for p in per_rank if p[3]]
        wrongs = [p[1] for p in per_rank]
        wire = [p[2] for p in per_rank]
        t = med[name]
        cols: Dict[str, Any] = {
            "world": n, "dist": dist_label, "density": work.density, "ids/rank": work.batch,
            "k": round(statistics.mean(ref.distinct)), "union": len(ref.ids), "method": name,
        }
        if all(w is not None for w in wire):
            mb = statistics.mean(w[0] for w in wire) / 1e6
            cols["MB/rank"] = mb
            cols["floor_MB"] = floor / 1e6
            cols["bytes/floor"] = mb / (floor / 1e6) if floor else ""
            inter = [w[1] for w in wire]
            cols["inter_MB"] = statistics.mean(inter) / 1e6 if all(i is not None for i in inter) else ""
        if t is not None:
            cols.update(time_ms=t * 1e3, min_ms=min(ts) * 1e3, max_ms=max(ts) * 1e3,
                        # The floor's bytes at the measured link speed: a time no scheme of this kind beats.
                        floor_ms=floor / rate * 1e3 if rate else "",
                        time_vs_floor=t / (floor / rate) if rate and floor else "",
                        vs_dense=med["dense"] / t if med.get("dense") else "",
                        vs_torch_sparse=med["torch_sparse"] / t if med.get("torch_sparse") else "",
                        vs_best_peer=min(peers) / t if peers and name not in PEERS else "")
        else:
            cols["error"] = errs[0] if errs else "no time"
        cols["#wrong"] = int(sum(w for w in wrongs if w is not None)) if not errs else -1
        out.append(Row(cols))
    for name, why in (skipped or {}).items():  # listed, not counted as wrong: the exit status stays 0
        out.append(Row({"world": n, "dist": dist_label, "density": work.density, "method": name, "skipped": why}))
    return out


def plot(rows: Sequence[Row], path: str) -> None:
    panel_rows = [Row({**r.cols, "setting": f"world {r.cols['world']}, {r.cols['dist']}"}) for r in rows]
    plot_rows(panel_rows, path, x="density", y="time_ms", series="method", panel="setting",
              xlabel="fraction of rows per rank (batch = density x rows)", ylabel="time per sync (ms, median)",
              title="sparse gradient sync")


def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(argv or [])
    p = argparse.ArgumentParser(prog="sparsecomm.bench sparse_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows V (default 1M)")
    p.add_argument("--dim", type=int, default=64, help="row width d (default 64)")
    p.add_argument("-d", "--dtype", default="float32", choices=VALUE_DTYPES)
    p.add_argument("--dist", default="zipf", help="id distributions, comma-separated: zipf, uniform (default zipf)")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf skew (default 1.1)")
    p.add_argument("--densities", default="0.0001,0.001,0.01,0.1",
                   help="lookups per rank as a fraction of the rows (default 0.0001,0.001,0.01,0.1)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {','.join(METHODS)} (default: the first six)")
    p.add_argument("--lws", type=int, default=2,
                   help="ranks per emulated node, for sparsecomm_local and the inter-node bytes (default 2)")
    p.add_argument("-w", "--warmup", type=int, default=2,
                   help="untimed calls per method, the first one checked (default 2)")
    p.add_argument("-n", "--iters", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--dense-iters", type=int, default=2,
                   help="timed rounds of the dense methods (default 2)")
    p.add_argument("--link-bytes", default="16M",
                   help="all_to_all size that measures the link speed for floor_ms (default 16M; 0: skip)")
    p.add_argument("--seed", type=int, default=0)
    # Tests: corrupt these methods' results before the check, to prove that #wrong catches errors.
    p.add_argument("--corrupt", default="", help=argparse.SUPPRESS)
    add_launch_args(p)
    a = p.parse_args(argv)
    bad = [m for m in a.methods.split(",") if m and m not in METHODS]
    bad += [d for d in a.dist.split(",") if d not in ("zipf", "uniform")]
    bad += [m for m in a.corrupt.split(",") if m and m not in METHODS]
    if bad:
        p.error(f"unknown method or distribution: {bad}")
    if a.warmup < 1 or a.iters < 1 or a.dense_iters < 0:
        p.error("--warmup and --iters must be >= 1, --dense-iters >= 0")
    return run_distributed("sparse_sync", argv, a, body, "sparse gradient sync (time: median over rounds; "
                           "min/max: per-rank medians)", plot, compact_cols=COMPACT_COLS, legend=LEGEND,
                           verdict=Verdict("time_ms", PEERS, ("world", "dist", "density")))
