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

MODES = ("ddp-default", "sparsecomm")


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
    p.add_argument("--mode", choices=MODES, default="sparsecomm",
                   help="ddp-default: DDP's own gradient sync; sparsecomm: DDP + sparsecomm.register")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: per example)")
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


def wrap(model: torch.nn.Module, args: argparse.Namespace):
    """DDP, plus the sparsecomm hook in sparsecomm mode. Returns (ddp model, hook state or None)."""
    ddp = DDP(model)
    state = sparsecomm.register(ddp) if args.mode == "sparsecomm" else None
    return ddp, state


def log(topo: sparsecomm.Topology, msg: str) -> None:
    if topo.rank == 0:
        print(msg, flush=True)


def optimizer_step(opts, loss: torch.Tensor) -> float:
    """Backward and step every optimizer; return the loss as a float."""
    loss.backward()
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)
    return loss.item()


def train(args, topo, step_fn: Callable[[int], float], eval_fn: Optional[Callable[[], Dict[str, float]]],
          samples_per_step: int, state=None, name: str = "job", unit: str = "samples") -> Dict[str, object]:
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
    summary: Dict[str, object] = {
        "example": name, "mode": args.mode, "world_size": topo.world_size, "steps": args.steps,
        "batch_per_rank": args.batch_size,
        f"{unit}_per_s_median": samples_per_step / statistics.median(warm),
        "first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        **{f"start_{k}": v for k, v in first_eval.items()}, **{f"final_{k}": v for k, v in final_eval.items()},
    }
    if state is not None:
        for path, s in state.stats.items():
            summary[f"comm_{path}_MB_sent_per_step"] = s.bytes_sent / 1e6 / max(1, args.steps)
            summary[f"comm_{path}_ms_per_call"] = 1e3 * s.seconds / max(1, s.calls)
        summary["paths"] = {k: d.method.value for k, d in state.decisions.items()}
    if topo.rank == 0:
        print(f"[{name}] summary: " + _fmt(summary), flush=True)
        if state is not None:  # the path each table took, and why (the classifier's decision log)
            print(state.summary(), flush=True)
        if args.json:
            print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


def _fmt(d: Dict[str, object]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def finish() -> None:
    sparsecomm.shutdown()
    sys.stdout.flush()
