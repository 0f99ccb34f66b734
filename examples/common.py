"""What both example jobs share: arguments, the launch, the training loop's display and summary."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.sharded.combined import build_optimizer

MODES = ("parallelize", "sparsecomm", "ddp-default")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in --help.

    An option without a help text still shows its default; one whose help
    already says its default ("default: per example") is not told twice.
    """

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    p.add_argument("--mode", choices=MODES, default="parallelize",
                   help="parallelize: sparsecomm.parallelize (planned: large tables sharded, the rest under DDP + "
                        "the hook); sparsecomm: DDP + sparsecomm.register; ddp-default: DDP's own gradient sync")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: per example)")
    p.add_argument("--small-table-bytes", type=int, default=4 << 20,
                   help="parallelize: tables smaller than this stay replicated")
    p.add_argument("--latency-bytes", type=float, default=None,
                   help="parallelize: the price of one collective in bytes, which sharded tables' lookup round "
                        "must repay (default: measured; 0: shard every table predicted to move fewer bytes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights")
    p.add_argument("--log-every", type=int, default=20, help="progress line every N steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line too")


def setup(args: argparse.Namespace) -> sparsecomm.Topology:
    topo = sparsecomm.init_distributed(timeout=300)
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        import os

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, topo.local_world_size)))
    return topo


def prepare(model: torch.nn.Module, args: argparse.Namespace, optimizer_class, lr: float, sample_batch):
    """The model and its optimizer for ``args.mode``; returns ``(model, optimizer, hook state or None)``.

    Every mode trains with the same rule (``sparsecomm.sharded.combined.build_optimizer``:
    Adam on dense parameters, lazy Adam on embedding rows), so the modes train alike.
    """
    if args.mode == "parallelize":
        plan = sparsecomm.plan(model, sample_batch, optimizer=optimizer_class,
                               small_table_bytes=args.small_table_bytes, latency_bytes=args.latency_bytes)
        model, opt = sparsecomm.parallelize(model, optimizer_class, plan=plan, lr=lr)
        inner = unwrap(model)
        if topology_rank() == 0:
            print(inner.sparsecomm_plan, flush=True)  # where each table lives, and why
        return model, opt, inner.sparsecomm_state
    ddp = DDP(model)
    state = sparsecomm.register(ddp) if args.mode == "sparsecomm" else None
    sparse = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
              and m.sparse]
    ids = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in ids]
    return ddp, build_optimizer(optimizer_class, {"lr": lr}, dense, sparse, []), state


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (the model itself when there is none)."""
    return model.module if isinstance(model, DDP) else model


def topology_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def log(topo: sparsecomm.Topology, msg: str) -> None:
    if topo.rank == 0:
        print(msg, flush=True)


def optimizer_step(opt, loss: torch.Tensor) -> float:
    """Backward and step the optimizer; return the loss as a float."""
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def train(args, topo, step_fn: Callable[[int], float], eval_fn: Optional[Callable[[], Dict[str, float]]],
          samples_per_step: int, state=None, name: str = "job", unit: str = "samples",
          model: Optional[torch.nn.Module] = None) -> Dict[str, object]:
    """Run ``step_fn(step) -> loss`` for ``args.steps`` steps with a progress line and a summary.

    Returns the summary (also printed on rank 0).
    """
    times: List[float] = []
    losses: List[float] = []
    first_eval = eval_fn() if eval_fn else {}
    log(topo, f"[{name}] mode={args.mode} world={topo.world_size} batch/rank={args.batch_size} steps={args.steps}"
              + (f" | start: {_fmt(first_eval)}" if first_eval else ""))
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = step_fn(step)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if topo.rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            recent = losses[-args.log_every:]
            rate = samples_per_step / statistics.median(times[-args.log_every:])
            bar = "#" * int(20 * (step + 1) / args.steps)
            print(f"[{name}] {bar:<20} step {step + 1:>5}/{args.steps}  loss {sum(recent) / len(recent):.4f}  "
                  f"{rate:,.0f} {unit}/s", flush=True)
    final_eval = eval_fn() if eval_fn else {}
    warm = times[min(5, len(times) - 1):] if len(times) > 1 else times
    last = losses[-args.log_every:]  # the last progress line's window: the two agree
    summary: Dict[str, object] = {
        "example": name, "mode": args.mode, "world_size": topo.world_size, "steps": args.steps,
        "batch_per_rank": args.batch_size,
        f"{unit}_per_s_median": samples_per_step / statistics.median(warm),
        "first_loss": losses[0], "final_loss": sum(last) / len(last), "final_loss_steps": len(last),
        **{f"start_{k}": v for k, v in first_eval.items()}, **{f"final_{k}": v for k, v in final_eval.items()},
    }
    plan = getattr(unwrap(model), "sparsecomm_plan", None) if model is not None else None
    if plan is not None:
        summary["sharded_tables"] = plan.sharded()
    if state is not None:
        for path, s in state.stats.items():
            summary[f"comm_{path}_MB_sent_per_step"] = s.bytes_sent / 1e6 / max(1, args.steps)
            summary[f"comm_{path}_ms_per_call"] = 1e3 * s.seconds / max(1, s.calls)
        summary["paths"] = {k: d.method.value for k, d in state.decisions.items()}
    if topo.rank == 0:
        print(summary_table(summary, state, unit), flush=True)
        if state is not None:  # the path each table took, and why (the classifier's decision log)
            print(state.summary(), flush=True)
        if args.json:
            print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


def summary_table(summary: Dict[str, object], state, unit: str) -> str:
    """The summary as a few rows that fit 80 columns: what was trained, how well, how fast, what moved."""
    s, name = summary, summary["example"]
    rows = [("trained", f"{s['steps']} steps, world {s['world_size']}, {s['batch_per_rank']} {unit}/rank, "
                        f"mode {s['mode']}"),
            ("loss", f"{s['first_loss']:.4f} (step 1) -> {s['final_loss']:.4f} (mean of the last "
                     f"{s['final_loss_steps']} steps)")]
    for k in (k[len("final_"):] for k in s if k.startswith("final_") and k not in ("final_loss", "final_loss_steps")):
        rows.append((k, f"{s['start_' + k]:.4g} at the start -> {s['final_' + k]:.4g} at the end"))
    rows.append(("speed", f"{s[f'{unit}_per_s_median']:,.0f} {unit}/s (median step, all ranks)"))
    if "sharded_tables" in s:
        rows.append(("sharded", ", ".join(s["sharded_tables"]) or "none (every table replicated)"))
    if state is not None:
        for path, st in sorted(state.stats.items()):
            rows.append((f"sync {path}", f"{st.bytes_sent / 1e6 / max(1, s['steps']):.3f} MB sent per step, "
                                         f"{1e3 * st.seconds / max(1, st.calls):.2f} ms per call"))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"[{name}] summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _fmt(d: Dict[str, object]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def finish() -> None:
    sparsecomm.shutdown()
    sys.stdout.flush()
