"""End-to-end training of a DLRM-like model: plain DDP, DDP + sparsecomm.register, sparsecomm.parallelize.

The model: ``--tables`` EmbeddingBags (default four: 1M, 300k, 50k and 10k
rows x ``--dim``, sum-pooled bags of Zipf(``--alpha``) ids), 16 dense
features through a bottom MLP, everything concatenated into a top MLP, BCE
loss. Every rank holds one replica per method and trains them alternately,
step by step, on the same batches (noise hits all alike; each step starts
from the next method in turn, so none always follows plain DDP's transfer;
``--block B`` takes B consecutive steps of a method at a time instead, the
first untimed, the others back to back as a job runs them, so what a method
carries from one step into the next counts too):

- ``ddp``: plain DDP, ``sparse=True`` tables (gloo's sparse allreduce);
- ``register``: the same under ``sparsecomm.register`` (the hook) as a user
  calls it: ``eager_sparse='auto'`` times a few steps with one fused sparse
  sync per step and a few with one sync per sparse bucket, and keeps the
  faster; like ``parallelize``'s trial below, that trial runs alone right
  after the checked step (``kept``, ``trial_s``, ``trial_cost``);
- ``register_fused`` / ``register_eager``: the hook held to one mode,
  ``eager_sparse=False`` (the step's sparse tables in one sync after the
  graph) or ``True`` (each sparse bucket synced as it arrives, on the hook
  group's worker thread, while backward goes on, as plain DDP overlaps its
  sparse allreduces);
- ``register_bf16``: the hook with ``sparse_compression="bf16"`` (sparse
  rows in bf16 on the wire: not exact, so never the verdict's pick; SGD and
  Adagrad only, since Adam's first step takes a sign that a rounded sum of
  nearly cancelling gradients may flip);
- ``parallelize_bf16``: ``parallelize`` as below, with ``sparse_compression="bf16"``
  (every embedding row and gradient row in bf16 between ranks: the sharded
  tables' rounds and the replicated tables' sync; not exact, SGD and
  Adagrad only, like ``register_bf16``);
- ``parallelize``: ``sparsecomm.parallelize(model, Optimizer, lr=...)`` as a
  user calls it, no plan given: it plans from the model alone (large bag
  tables table-wise, spread over the ranks, where that moves fewer bytes),
  then its placement trial (``sparsecomm.trial``) times every table
  replicated, that plan, the tables row-sharded, every bag table table-wise
  and the plan for the first step's ids on training steps and keeps the
  fastest, then its replicas'
  hook measures its sync modes (``eager_sparse='auto'``). Here both trials
  run to their decisions right after the checked step, alone, on batches of
  their own; ``trial_s`` is the time of their steps (moves included, batches
  made off the clock), ``trial_cost`` what they cost
  beyond the same steps at the kept placement's speed, as a share of a
  1,000-step run;
- ``parallelize_plan``: ``parallelize`` with the plan made from a sample batch
  (``sparsecomm.plan(model, batch)``: large tables sharded with owner-side
  optimizers when that is predicted faster, the rest replicated under the hook);
- ``sharded``: ``parallelize`` with every table of 4 MiB or more row-sharded
  by hash (``plan.override``), whatever the plan predicts;
- ``table_wise``: ``parallelize`` with every table table-wise, the i-th
  largest on rank i mod N (the placement TorchRec's CPU planner picks here);
- ``parallelize_pipelined``, ``table_wise_pipelined`` (only when ``--methods``
  names them): the same, trained through ``sparsecomm.pipeline`` (each next
  batch's ids sent to their owners during the current step; nothing to
  prefetch where every table is replicated);
- ``floor``: one process on the per-rank batch, no communication at all.
  For a method with sharded tables, the floor's step minus (N-1)/N of its
  optimizer time (the owners' share of the update).

Two floors stand beside the times: ``floor_ms`` (compute, above) and
``link_floor_ms``: compute plus the bytes the method must move per step and
direction at the link rate (emulated hosts only, ``--hosts``; ``MB_moved``
those bytes, per rank): the dense part's ring all-reduce, 2 (N-1)/N of its
bytes; per replicated table, plain DDP's gloo all-gather of every rank's
rows with int64 ids, (N-1) k (d b + 8), or for the library the cheapest of
its sync paths' busiest-link bytes (``collectives.methods``); per row-sharded
table the pull and the gradient push, (N-1)/N 2 k r plus the ids; per
table-wise table, on the busiest rank, (N-1) B r of pooled rows sent as its
owner, else B r of gradient plus its ids (B bags a rank). k is a rank's
distinct ids of a table in a batch, U their union over ranks.

``cpu_ms``: the CPU time the rank's process spent on a step (all its
threads: gloo's workers, the hook's), the median of the slowest rank. Where
ranks outnumber cores (emulated hosts on this machine) the ranks' CPU
together, not the link, can set the step time.

Across hosts (``--hosts H --rate R``, as root): H network namespaces on this
machine, each host's link capped both ways at R with tbf, ``--ranks-per-host``
ranks per host, gloo between hosts (``sparsecomm.bench.launch``).

Every method uses the same optimizer rule (``--optimizers``: SGD, Adagrad
element-wise, or Adam = lazy Adam on tables + Adam on the MLP). Before any
timing, one step of each method from the same weights is checked against
a float64 single-process step on the whole (all ranks') batch: ``#wrong``
counts tensors off by more than the tolerance (exit 3 when any is).
- ``torchrec_dmp``: TorchRec's ``DistributedModelParallel`` with its own
  planner (on CPU: table-wise), where TorchRec is installed
  (``bench/e2e_torchrec.py``); listed as skipped, with the reason, otherwise.

    python -m sparsecomm.bench e2e --nproc 2,4 --optimizers sgd,adagrad
    python -m sparsecomm.bench e2e --hosts 2,4 --rate 1gbit,10gbit --optimizers sgd,adagrad,adam
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.bench import e2e_torchrec
from sparsecomm.bench.harness import Row, Verdict, interleaved_schedule, progress
from sparsecomm.bench.launch import add_launch_args, emulated_link, run_distributed
from sparsecomm.bench.netns import parse_rate
from sparsecomm.collectives import methods as sync_methods
from sparsecomm.collectives.methods import InputRuns, Workload
from sparsecomm.collectives.transport import wire_index_dtype
from sparsecomm.cost_model import sharded_floor_bytes
from sparsecomm.sharded.combined import build_optimizer
from sparsecomm.synthetic import zipf_ids

METHODS = ("ddp", "register", "register_fused", "register_eager", "parallelize", "parallelize_plan", "sharded",
           "table_wise")
# Methods trained through sparsecomm.pipeline: the next batch's ids move while the current one trains. Run only
# when --methods names them: every method holds a model, and 14 of them at 4 ranks outgrew 24 GiB.
PIPELINED = {"parallelize_pipelined": "parallelize", "table_wise_pipelined": "table_wise"}
LOSSY = ("register_bf16", "parallelize_bf16")   # compared, checked against the same tolerance, left out of the verdict
PHASES = ("forward", "backward", "optimizer", "step", "cpu")
# Adagrad starts its accumulators at 0.1 (as DLRM setups do): a first step of lr * g / |g| would make the
# float64 check meaningless for gradients near zero, where float32 and float64 disagree on the sign.
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.05)),
              "adagrad": (torch.optim.Adagrad, dict(lr=0.05, initial_accumulator_value=0.1)),
              "adam": (torch.optim.Adam, dict(lr=0.01))}
DENSE_FEATURES = 16
COMPACT_COLS = ("world", "hosts", "rate", "optimizer", "method", "step_ms", "vs_ddp", "MB_per_rank", "floor_ms",
                "link_floor_ms", "#wrong")
LEGEND = {
    "step_ms": "median ms per training step of the slowest rank (forward + backward + optimizer)",
    "samples_per_s": "global batch (all ranks) / step_ms",
    "vs_ddp": "plain DDP's step time over this method's (> 1: faster)",
    "MB_per_rank": "tables + dense parameters + optimizer state this rank holds",
    "floor_ms": "one process on the per-rank batch without communication (rows with sharded tables: minus the "
                "owners' (N-1)/N share of the optimizer)",
    "link_floor_ms": "floor_ms + the bytes this method must move per step and direction at the emulated link rate",
    "hosts": "emulated hosts x ranks per host (blank: one host)",
    "rate": "each emulated host link's cap, both ways",
    "#wrong": "tensors off a float64 single-process step on the whole batch (non-zero exits 3)",
    "kept": "what the trial kept: parallelize's placement (replicated, planned, row-sharded, table-wise or sampled), "
            "the hook's sparse sync mode (eager or fused)",
    "trial_s": "time of the placement trial's steps, its moves included (the batches made off the clock)",
    "trial_steps": "steps the placement trial took",
    "trial_cost": "the trial's time beyond as many steps at the kept placement's speed, per 1,000 steps at that speed",
}


class DLRM(nn.Module):
    """Bags of ids per table + dense features -> bottom MLP -> concatenation -> top MLP -> one logit."""

    def __init__(self, rows: Sequence[int], dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList([nn.EmbeddingBag(r, dim, mode="sum", sparse=True) for r in rows])
        self.bottom = nn.Sequential(nn.Linear(DENSE_FEATURES, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(dim * (len(rows) + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, batch: Dict[str, Any]) -> torch.Tensor:
        pooled = [t(ids) for t, ids in zip(self.tables, batch["ids"])]   # every lookup first: one round
        return self.top(torch.cat([self.bottom(batch["dense"])] + pooled, 1)).squeeze(1)


def make_batch(a: argparse.Namespace, rows: Sequence[int], step: int, rank: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(step * 7919 + rank)
    ids = [zipf_ids(a.batch * a.bag, r, a.alpha, seed=(step * 131 + rank) * 17 + i).view(a.batch, a.bag)
           for i, r in enumerate(rows)]
    return {"ids": ids, "dense": torch.randn(a.batch, DENSE_FEATURES, generator=g),
            "y": (torch.rand(a.batch, generator=g) < 0.3).float()}


def loss_of(model: nn.Module, b: Dict[str, Any]) -> torch.Tensor:
    out = model(*e2e_torchrec.batch_input(b, len(b["ids"]))) if isinstance(model, _DMP_TYPES) else model(b)
    return nn.functional.binary_cross_entropy_with_logits(out, b["y"].to(b["dense"].dtype))


def _dmp_types() -> tuple:
    if e2e_torchrec.missing():
        return ()
    from torchrec.distributed.model_parallel import DistributedModelParallel

    return (DistributedModelParallel,)


_DMP_TYPES = _dmp_types()


def _methods(optimizer: str, wanted: Optional[str] = None) -> Sequence[str]:
    """The contenders of this run (``--methods``, plain DDP always): TorchRec's only where it runs the optimizer."""
    lossy = LOSSY if optimizer in ("sgd", "adagrad") else ()
    every = METHODS + tuple(PIPELINED) + lossy + (() if e2e_torchrec.missing(optimizer) else ("torchrec_dmp",))
    keep = set(wanted.split(",")) | {"ddp"} if wanted else set(every) - set(PIPELINED)
    return tuple(m for m in every if m in keep)


def reference_optimizer(model: DLRM, name: str) -> torch.optim.Optimizer:
    cls, kw = OPTIMIZERS[name]
    sparse = [t.weight for t in model.tables]
    ids = {id(p) for p in sparse}
    return build_optimizer(cls, kw, [p for p in model.parameters() if id(p) not in ids], sparse, [])


def memory_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    inner = getattr(model, "module", model)
    total = sum(p.numel() * p.element_size() for p in inner.parameters())
    for _, t in sparsecomm.sharded.sharded_modules(inner):
        total += t.memory_bytes()   # rows, ownership map and the owner-side state
    for p, s in opt.state.items():
        if getattr(p, "_sparsecomm_table", None) is not None:
            continue  # counted with its table
        total += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return total


def full_weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)
    out = {k: v for k, v in inner.state_dict().items() if not k.endswith(("local_weight", "_extra_state"))}
    for name, t in sparsecomm.sharded.sharded_modules(inner):
        out[f"{name}.weight"] = t.full_weight()
    return out


def run_config(a: argparse.Namespace, rows: Sequence[int], optimizer: str) -> Dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = DLRM(rows, a.dim)
    # The float64 reference: one process, one step on every rank's batch together.
    batches = [make_batch(a, rows, 0, r) for r in range(n)]
    whole = {"ids": [torch.cat([b["ids"][i] for b in batches]) for i in range(len(rows))],
             "dense": torch.cat([b["dense"] for b in batches]), "y": torch.cat([b["y"] for b in batches])}
    ref = copy.deepcopy(base).double()
    ref_opt = reference_optimizer(ref, optimizer)
    loss_of(ref, {**whole, "dense": whole["dense"].double(), "y": whole["y"].double()}).backward()
    ref_opt.step()
    expected = ref.state_dict()
    del ref, ref_opt

    names = list(_methods(optimizer, a.methods) + ("floor",))
    order = interleaved_schedule(names, a.warmup, a.steps, a.block)
    # Every method takes the same steps: their batches, made once, before any timing.
    data = [make_batch(a, rows, s, rank) for s in range(1 + max(step for _, step, _, _ in order))]
    runs: Dict[str, Dict[str, Any]] = {}
    plans: Dict[str, str] = {}
    for method in names:
        model, opt, plans[method] = _build(PIPELINED.get(method, method), copy.deepcopy(base), a, rows, optimizer)
        runs[method] = dict(model=model, opt=opt, times={p: [] for p in PHASES},
                            bytes=_bytes_moved(method, model, batches, rows, a))
        if method in PIPELINED:   # the same batches, one ahead
            runs[method]["pipe"] = iter(sparsecomm.pipeline(data, model))
    del base

    wrong: Dict[str, int] = {}
    for i, (method, step, timed, first) in enumerate(order):
        r = runs[method]
        if first:   # a block's first step: every rank starts it together, the link drained of the last method's
            dist.barrier()
        times = _train_step(r, next(r["pipe"]) if "pipe" in r else data[step])
        if step == 0 and method == "torchrec_dmp":
            wrong[method] = e2e_torchrec.local_weights_wrong(r["model"], expected, a.tolerance)
        elif step == 0 and method != "floor":
            got = full_weights(r["model"])
            wrong[method] = sum(int(not torch.allclose(got[k].double(), v, rtol=a.tolerance, atol=a.tolerance))
                                for k, v in expected.items())
        if step == 0 and getattr(r["opt"], "trial", None) is not None:   # checked: now run it to its decision
            r["trial"] = _finish_trial(r, a, rows, rank)
            r["bytes"] = _bytes_moved(method, r["model"], batches, rows, a)
        elif step == 0 and _hook_state(r["model"]).eager_undecided:
            r["trial"] = _finish_hook_trial(r, a, rows, rank)
        if timed:
            for phase, dt in zip(PHASES, times):
                r["times"][phase].append(dt)
        if rank == 0 and i == a.warmup * len(names) - 1:   # the warm-up's last step
            progress(f"e2e: world {n} {optimizer}: checked ({wrong}), timing {a.steps} steps")
    for r in runs.values():   # what the placement trial did after its decision, the timed steps among them
        if "log_len" in r.get("trial", {}):
            r["trial"]["later"] = r["opt"].trial.log[r["trial"]["log_len"]:]
    return dict(medians={m: {p: statistics.median(v) for p, v in r["times"].items()} for m, r in runs.items()},
                trials={m: r["trial"] for m, r in runs.items() if "trial" in r},
                memory={m: (e2e_torchrec.memory_bytes(r["model"], r["opt"]) if m == "torchrec_dmp" else
                            memory_bytes(r["model"], r["opt"])) for m, r in runs.items()}, wrong=wrong,
                plan=plans.get("parallelize", ""), plans=plans, bytes={m: r["bytes"] for m, r in runs.items()},
                sharded={m: m == "torchrec_dmp" or bool(sparsecomm.sharded.sharded_modules(
                    getattr(r["model"], "module", r["model"]))) for m, r in runs.items()})


def _train_step(r: Dict[str, Any], b: Any) -> Tuple[float, float, float, float, float]:
    """One training step of a method: the seconds of its forward, backward, optimizer step and all three, and
    the CPU seconds the process (all its threads: gloo's, the hook's) spent on the step."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    r["opt"].zero_grad(set_to_none=True)
    loss = loss_of(r["model"], b)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    r["opt"].step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t3 - t0, time.process_time() - c0


def _finish_trial(r: Dict[str, Any], a: argparse.Namespace, rows: Sequence[int], rank: int) -> Dict[str, Any]:
    """Train this method alone until its placement trial has decided: its steps, wall time and report."""
    opt, model, steps, seconds = r["opt"], r["model"], 0, 0.0
    while (not opt.trial.done or _hook_state(model).eager_undecided) and steps < 500:
        b = make_batch(a, rows, 100_000 + steps, rank)   # off the clock (~20 ms a batch: more than a step)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(model, b).backward()
        opt.step()   # the trial's moves run in its post-step hook: on the clock
        seconds += time.perf_counter() - start
        steps += 1
    hook = _hook_state(model).eager_trial
    report = opt.trial.report() + (f"\n# its hook's sparse syncs: {hook.reason}" if hook is not None else "") \
        + _paths(_hook_state(model))
    return dict(steps=steps, seconds=seconds, report=report, log_len=len(opt.trial.log),
                kept=opt.trial.candidates[opt.trial.kept].name if opt.trial.done else "undecided")


def _finish_hook_trial(r: Dict[str, Any], a: argparse.Namespace, rows: Sequence[int], rank: int
                       ) -> Dict[str, Any]:
    """Train the hook's model alone until its eager/fused trial has decided: its steps, wall time and report."""
    model, opt, steps = r["model"], r["opt"], 0
    state = _hook_state(model)
    batches = [make_batch(a, rows, 100_000 + i, rank) for i in range(40)]   # made before the clock starts
    start = time.perf_counter()
    while state.eager_undecided and steps < len(batches):
        opt.zero_grad(set_to_none=True)
        loss_of(model, batches[steps]).backward()
        opt.step()
        steps += 1
    trial = state.eager_trial
    kept = "undecided" if trial is None or trial.eager is None else "eager" if trial.eager else "fused"
    return dict(steps=steps, seconds=time.perf_counter() - start, kept=kept,
                report=f"# the hook's sparse syncs: {kept}, " + (trial.reason if trial else "no trial") + _paths(state))


def _paths(state: Any) -> str:
    """The hook's path per table so far (its classifier's decisions), as a report line; '' without any."""
    decisions = getattr(state, "decisions", None)
    if not decisions:
        return ""
    return "\n#   paths: " + ", ".join(f"{name} {d.method.value}" for name, d in sorted(decisions.items()))


class _NoHook:
    eager_undecided = False
    eager_trial = None


def _hook_state(model: nn.Module) -> Any:
    """The DDP hook's state of a method's model (``register``'s or ``parallelize``'s replicas'), or a stand-in."""
    state = getattr(model, "_sparsecomm_state", None) or getattr(getattr(model, "module", model), "sparsecomm_state",
                                                                  None)
    return state if state is not None else _NoHook()


def _build(method: str, model: nn.Module, a: argparse.Namespace, rows: Sequence[int], optimizer: str):
    """One method's model and optimizer (and its plan, printed), from a copy of the same initial weights."""
    cls, kw = OPTIMIZERS[optimizer]
    if method == "torchrec_dmp":
        return e2e_torchrec.build(model, rows, a.dim, optimizer, OPTIMIZERS)
    if method in ("ddp", "register", "register_fused", "register_eager", "register_bf16"):
        model = DDP(model)
        if method != "ddp":
            sparsecomm.register(model, sparse_compression="bf16" if method == "register_bf16" else None,
                                eager_sparse={"register_eager": True, "register_fused": False}.get(method, "auto"))
        return model, reference_optimizer(model.module, optimizer), ""
    if method in ("parallelize", "parallelize_bf16"):  # as a user calls it: no plan, no sample batch
        compression = "bf16" if method == "parallelize_bf16" else None
        model, opt = sparsecomm.parallelize(model, cls, sparse_compression=compression, **kw)
        return model, opt, str(getattr(getattr(model, "module", model), "sparsecomm_plan", ""))
    if method in ("parallelize_plan", "sharded", "table_wise"):
        plan = sparsecomm.plan(model, make_batch(a, rows, 0, dist.get_rank()), optimizer=cls)
        by_size = sorted(plan.tables.items(), key=lambda kv: -kv[1].memory_replicated)
        for i, (name, t) in enumerate(by_size):
            if method == "table_wise":
                plan.override(name, "shard", "table", owner=i % dist.get_world_size())
            elif method == "sharded" and t.memory_replicated >= 4 << 20:
                plan.override(name, "shard", "hash")
        model, opt = sparsecomm.parallelize(model, cls, plan=plan, **kw)
        return model, opt, str(plan)
    return model, reference_optimizer(model, optimizer), ""


def _bytes_moved(method: str, model: nn.Module, batches: Sequence[Dict[str, Any]], rows: Sequence[int],
                 a: argparse.Namespace) -> float:
    """Bytes per rank and direction this method must move in one step (module docstring), from the first batch."""
    n = len(batches)
    if method == "floor" or n == 1:
        return 0.0
    if method == "torchrec_dmp":
        dense = sum(p.numel() * 4 for name, p in model.named_parameters() if not name.startswith("ebc."))
        return e2e_torchrec.bytes_moved(a.batch, a.bag, a.dim, len(rows), n, dense)
    inner = getattr(model, "module", model)
    dense = sum(p.numel() * p.element_size() for name, p in inner.named_parameters() if not name.startswith("tables"))
    total = 2 * (n - 1) / n * dense
    sharded = {name: t for name, t in sparsecomm.sharded.sharded_modules(inner)}
    sent = [0.0] * n   # table-wise tables: what each rank sends in a step (the busiest one counts)
    for i, v in enumerate(rows):
        ids = [torch.unique(b["ids"][i]) for b in batches]
        k, union = sum(x.numel() for x in ids) / n, torch.unique(torch.cat(ids)).numel()
        row, idb = a.dim * (2 if method in LOSSY else 4), torch.empty(0, dtype=wire_index_dtype(v)).element_size()
        table = sharded.get(f"tables.{i}")
        if table is not None and table.scheme == "table":
            for r in range(n):
                sent[r] += (n - 1) * a.batch * row if r == table.owner else a.batch * (row + a.bag * idb)
        elif table is not None:
            total += sharded_floor_bytes(n, k, row) + (n - 1) / n * k * idb
        elif method == "ddp":
            total += (n - 1) * k * (row + 8)
        else:  # bf16 rows (register_bf16) on the paths that compress
            half = method in LOSSY
            # Sum-pooled bags: a.bag ids a bag, one gradient row each (the runs path's input).
            w = Workload(n, v, a.dim, 2 if half else 4, idb, k, union, runs=InputRuns(a.batch * a.bag, a.batch))
            total += min(p.link_bytes(w) for p in sync_methods.PATHS if not p.hierarchical and p.backend in
                         (None, "gloo") and (p.compresses or not half))
    return total + max(sent)


def body(a: argparse.Namespace) -> List[Row]:
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = [int(r) for r in a.tables.split(",")]
    out: List[Row] = []
    for optimizer in a.optimizers.split(","):
        mine = run_config(a, rows, optimizer)
        everyone: List[Any] = [None] * n
        dist.all_gather_object(everyone, mine)
        if rank != 0:
            continue
        if optimizer == a.optimizers.split(",")[0]:
            print(mine["plan"], flush=True)
            if "table_wise" in mine["plans"]:
                print("# table_wise's plan:\n" + mine["plans"]["table_wise"], flush=True)
            for t in mine["trials"].values():
                print(t["report"], flush=True)
                if t.get("later"):
                    print("# after its decision (timed steps among them): " + "\n#   ".join(t["later"]), flush=True)
            if "torchrec_dmp" in mine["plans"]:
                print("# TorchRec's own plan:\n" + mine["plans"]["torchrec_dmp"], flush=True)
        methods = _methods(optimizer, a.methods)
        med = {m: {p: max(e["medians"][m][p] for e in everyone) for p in PHASES} for m in methods + ("floor",)}
        floor = med["floor"]["step"]
        floor_sharded = floor - (n - 1) / n * med["floor"]["optimizer"]
        link = emulated_link()
        where = {"hosts": f"{link[0]}x{link[1]}" if link else "", "rate": link[2] if link else ""}
        for m in methods:
            step = med[m]["step"]
            compute = floor_sharded if mine["sharded"][m] else floor
            moved = max(e["bytes"][m] for e in everyone)
            out.append(Row({
                "world": n, **where, "optimizer": optimizer, "method": m, "step_ms": 1e3 * step,
                "samples_per_s": a.batch * n / step, "vs_ddp": med["ddp"]["step"] / step,
                "MB_per_rank": max(e["memory"][m] for e in everyone) / 2**20,
                "floor_ms": 1e3 * compute, "MB_moved": moved / 1e6,
                "link_floor_ms": 1e3 * (compute + moved / (parse_rate(link[2]) / 8)) if link else "",
                "forward_ms": 1e3 * med[m]["forward"], "backward_ms": 1e3 * med[m]["backward"],
                "optimizer_ms": 1e3 * med[m]["optimizer"], "cpu_ms": 1e3 * med[m]["cpu"],
                "#wrong": max(e["wrong"][m] for e in everyone), **_trial_columns(mine["trials"].get(m), step)}))
        if e2e_torchrec.missing(optimizer) and "torchrec_dmp" in (a.methods or "torchrec_dmp"):
            out.append(Row({"world": n, **where, "optimizer": optimizer, "method": "torchrec_dmp",
                            "skipped": e2e_torchrec.missing(optimizer)}))
        progress(f"e2e: world {n} {optimizer} done")
    return out


def _trial_columns(trial: Optional[Dict[str, Any]], step: float) -> Dict[str, Any]:
    """A trial's columns: its wall time, the placement kept, and its cost beyond the same steps at the kept speed."""
    if trial is None:
        return {}
    extra = trial["seconds"] - trial["steps"] * step
    return {"trial_s": trial["seconds"], "trial_steps": trial["steps"], "kept": trial["kept"],
            "trial_cost": f"{100 * extra / (1000 * step):.1f}%"}


def add_optimizers_arg(p: argparse.ArgumentParser, default: str) -> None:
    """``--optimizers``: the rules to train with, one run each (names of :data:`OPTIMIZERS`)."""
    p.add_argument("--optimizers", default=default, help="comma-separated sgd|adagrad|adam (default: %(default)s)")


def check_optimizers(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for o in a.optimizers.split(","):
        if o not in OPTIMIZERS:
            p.error(f"--optimizers: unknown optimizer {o!r}")


def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(argv or [])
    p = argparse.ArgumentParser(prog="sparsecomm.bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default="1000000,300000,50000,10000", help="rows per table (default: %(default)s)")
    p.add_argument("--dim", type=int, default=32, help="embedding width (default: %(default)s)")
    p.add_argument("--batch", type=int, default=512, help="samples per rank per step (default: %(default)s)")
    p.add_argument("--bag", type=int, default=8, help="ids per sample and table (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of the ids (default: %(default)s)")
    add_optimizers_arg(p, "sgd,adagrad")
    p.add_argument("--methods", default=None,
                   help="comma-separated contenders to run (plain DDP always runs; default: all of them)")
    p.add_argument("--steps", type=int, default=50,
                   help="timed steps per method (default: %(default)s; on a noisy 2-core box 20 left step-to-step "
                        "noise the size of a 10%% difference)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--block", type=int, default=1,
                   help="consecutive steps of one method before the next method's (default: %(default)s: steps "
                        "interleaved one by one, a barrier before each); more: the first of a block untimed, the "
                        "rest back to back, as a job trains")
    p.add_argument("--tolerance", type=float, default=1e-4, help="of the float64 check (default: %(default)s)")
    add_launch_args(p)
    a = p.parse_args(argv)
    check_optimizers(p, a)
    unknown = set((a.methods or "").split(",")) - set(METHODS + tuple(PIPELINED) + LOSSY + ("torchrec_dmp", ""))
    if unknown:
        p.error(f"--methods: unknown method(s) {sorted(unknown)}")
    if a.warmup < 1:
        p.error("--warmup must be at least 1 (the checked step)")
    if a.block < 1 or a.steps < 1:
        p.error("--block and --steps must be at least 1")
    return run_distributed("e2e", argv, a, body, "end-to-end DLRM-like training (slowest rank's medians)",
                           verdict=Verdict("step_ms", ("ddp", "torchrec_dmp"), ("world", "hosts", "rate", "optimizer"),
                                           apart=LOSSY),
                           compact_cols=COMPACT_COLS, legend=LEGEND)
