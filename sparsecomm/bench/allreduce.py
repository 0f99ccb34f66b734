"""Dense collectives benchmark in the style of nccl-tests: all_reduce, all_gather, all_to_all.

``sc_alltoall`` is sparsecomm's own all-to-all (``exchange.all_to_all``: shared
memory between ranks of one host, else the backend's); ``alltoall`` is torch's.

Sizes go from ``--minbytes`` to ``--maxbytes`` multiplying by ``--stepfactor``
(nccl-tests' ``-b/-e/-f``). ``size`` is the bytes of one rank's buffer for
all_reduce and all_to_all, and of the gathered output for all_gather (each
rank contributes ``size / n``), as in nccl-tests. For each size and op:
warm-up, then ``iters`` back-to-back calls timed together (CUDA events on
GPU), the time averaged over ranks; then one more call on fresh inputs whose
result is checked element by element (``#wrong``).

    algbw = size / time
    busbw = algbw * 2(n-1)/n   (all_reduce)
    busbw = algbw * (n-1)/n    (all_gather, all_to_all)

Large sizes get fewer iterations: a size runs ``min(iters, budget / t)``
timed calls, ``t`` the slowest rank's warm-up call.

The default table shows op, size, time, algbw, busbw and ``#wrong``;
``--wide`` adds count, dtype, iterations and the fastest/slowest rank.
Progress goes to stderr, one line per (op, size).

Examples::

    python -m sparsecomm.bench allreduce --nproc 4
    torchrun --nproc-per-node 4 -m sparsecomm.bench allreduce -b 1M -e 256M -f 2
    mpirun -np 4 python -m sparsecomm.bench allreduce --ops allreduce --json out.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from sparsecomm.bench.harness import DTYPES, Row, Stopwatch, format_size, parse_size, plot_rows, progress
from sparsecomm.bench.launch import add_launch_args, gather_floats, run_distributed
from sparsecomm.collectives.exchange import all_gather_single, all_to_all

OPS = ("allreduce", "allgather", "alltoall", "sc_alltoall")
COMPACT_COLS = ("world", "op", "size_h", "time_us", "algbw_GBs", "busbw_GBs", "#wrong")
LEGEND = {
    "size_h": "bytes of one rank's buffer (all_gather: of the gathered output), as nccl-tests",
    "time_us": "microseconds per call, averaged over ranks",
    "algbw_GBs": "size / time",
    "busbw_GBs": "algbw x 2(n-1)/n (all_reduce) or x (n-1)/n (all_gather, all_to_all): comparable across n",
    "#wrong": "elements off the exact expected result (0: correct; a non-zero count exits 3)",
}


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw: what each rank's link must carry relative to ``size`` (nccl-tests' factors)."""
    if n <= 1:
        return 0.0 if op == "allreduce" else 1.0
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def _scale(rank: int, salt: int = 0) -> int:
    return (rank + salt) % 3 + 1


class _Case:
    """One op at one size: buffers, the call, and the check of its result.

    Rank r's data are ``scale(r) * base`` with ``base[i] = i % 5 + 1``: small
    integers, so every dtype holds every sum exactly (bf16 up to 256, i.e. 17
    ranks) in any order of addition, and the expected result is a multiple of
    ``base`` computed without materializing any other rank's data.
    """

    def __init__(self, op: str, size: int, dtype: torch.dtype, device: torch.device, corrupt: bool) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        esz = torch.empty(0, dtype=dtype).element_size()
        self.op, self.dtype, self.device, self.corrupt = op, dtype, device, corrupt
        if op == "allreduce":
            self.count = max(1, size // esz)
            self.inp = torch.empty(self.count, dtype=dtype, device=device)
            self.out = self.inp  # in place, like torch's all_reduce
        else:
            per_rank = max(1, size // (esz * n))  # what one rank sends in all (allgather) or to each peer
            self.count = per_rank * n
            self.inp = torch.empty(per_rank if op == "allgather" else self.count, dtype=dtype, device=device)
            self.out = torch.empty(self.count, dtype=dtype, device=device)
        self.bytes = self.count * esz
        self.n, self.me = n, me
        self.per = self.count if op == "allreduce" else self.count // n
        self.base = (torch.arange(self.per, device=device) % 5 + 1).to(dtype)
        self.fill()

    def fill(self) -> None:
        if self.op in ("alltoall", "sc_alltoall"):  # chunk j goes to rank j: make it depend on both ends
            for j in range(self.n):
                torch.mul(self.base, _scale(self.me, 7 * j), out=self.inp[j * self.per:(j + 1) * self.per])
        else:
            torch.mul(self.base, _scale(self.me), out=self.inp)
        if self.out is not self.inp:
            self.out.zero_()

    def run(self) -> None:
        if self.op == "allreduce":
            dist.all_reduce(self.inp)
        elif self.op == "allgather":
            all_gather_single(self.out, self.inp)
        elif self.op == "sc_alltoall":
            all_to_all(self.out, self.inp, group=None)
        else:
            dist.all_to_all_single(self.out, self.inp)

    def wrong(self) -> int:
        """Run once on fresh inputs and count the elements that differ from the expected result."""
        self.fill()
        self.run()
        if self.corrupt:  # --corrupt: prove that the check notices
            self.out.view(-1)[0] += 1
        if self.op == "allreduce":
            return int((self.out != self.base * sum(_scale(r) for r in range(self.n))).sum())
        chunks = self.out.view(self.n, self.per)
        wrong = 0
        for r in range(self.n):  # chunk r came from rank r
            scale = _scale(r) if self.op == "allgather" else _scale(r, 7 * self.me)
            wrong += int((chunks[r] != self.base * scale).sum())
        return wrong


def _sizes(minbytes: int, maxbytes: int, factor: float, step: int) -> List[int]:
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(int(s))
        s = s * factor if factor > 1 else s + step
        if factor <= 1 and step <= 0:
            break
    return sizes


def body(a: argparse.Namespace) -> List[Row]:
    n, me = dist.get_world_size(), dist.get_rank()
    device = torch.device(a.device, torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    dtype = DTYPES[a.dtype]
    ops = [o for o in a.ops.split(",") if o]
    sizes = _sizes(parse_size(a.minbytes), parse_size(a.maxbytes), a.stepfactor, parse_size(a.stepbytes))
    if me == 0:
        print(f"# dense collectives: world={n} backend={a.backend} device={a.device} dtype={a.dtype} "
              f"warmup={a.warmup} iters<={a.iters} budget={a.budget}s/size "
              f"threads/rank={torch.get_num_threads()}", flush=True)
    rows: List[Row] = []
    watch = Stopwatch(a.device)
    for op in ops:
        seen = set()
        for size in sizes:
            case = _Case(op, size, dtype, device, corrupt=op in a.corrupt.split(","))
            if case.bytes in seen:  # rounding to whole elements per rank made it a repeat
                continue
            seen.add(case.bytes)
            dist.barrier()
            watch.start()
            for _ in range(max(1, a.warmup)):
                case.run()
            t_warm = watch.stop() / max(1, a.warmup)
            # Every rank must agree on the count of calls: use the slowest rank's warm-up time.
            t_warm = max(gather_floats(t_warm))
            iters = max(1, min(a.iters, int(a.budget / max(t_warm, 1e-9))))
            dist.barrier()
            watch.start()
            for _ in range(iters):
                case.run()
            per_call = watch.stop() / iters
            times = gather_floats(per_call)
            wrong = int(sum(gather_floats(case.wrong())))
            t = statistics.mean(times)  # nccl-tests' default: the average over ranks
            algbw = case.bytes / t / 1e9
            if me == 0:
                progress(f"allreduce world {n}: {op} {format_size(case.bytes)}: {iters} calls, "
                         f"{t * 1e6:.4g} us/call, busbw {algbw * bus_factor(op, n):.3g} GB/s"
                         + (f", {wrong} WRONG" if wrong else ""))
            rows.append(Row({
                "world": n, "op": op, "size": case.bytes, "size_h": format_size(case.bytes), "count": case.count,
                "dtype": a.dtype, "iters": iters, "time_us": t * 1e6,
                "min_us": min(times) * 1e6, "max_us": max(times) * 1e6,
                "algbw_GBs": algbw, "busbw_GBs": algbw * bus_factor(op, n), "#wrong": wrong,
            }))
            del case
    if me == 0 and rows:
        for op in ops:
            bw = [r.cols["busbw_GBs"] for r in rows if r.cols["op"] == op]
            if bw:
                print(f"# {op}: avg bus bandwidth {statistics.mean(bw):.3f} GB/s over {len(bw)} sizes", flush=True)
    return rows


def plot(rows: Sequence[Row], path: str) -> None:
    plot_rows(rows, path, x="size", y="busbw_GBs", series="op", panel="world", logy=False,
              xlabel="size (bytes)", ylabel="bus bandwidth (GB/s)", title="dense collectives")


def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(argv or [])
    p = argparse.ArgumentParser(prog="sparsecomm.bench allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", default="4", help="smallest size (default 4; K/M/G suffixes)")
    p.add_argument("-e", "--maxbytes", default="256M", help="largest size (default 256M)")
    p.add_argument("-f", "--stepfactor", type=float, default=4, help="multiply the size by this (default 4)")
    p.add_argument("-i", "--stepbytes", default="0", help="add this instead, when --stepfactor is 1")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {','.join(OPS)} (default all)")
    p.add_argument("-d", "--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("-w", "--warmup", type=int, default=3, help="untimed calls per size (default 3)")
    p.add_argument("-n", "--iters", type=int, default=20, help="most timed calls per size (default 20)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of timed calls per size at most, so large sizes get fewer (default 1)")
    # Tests: corrupt these ops' results before the check, to prove that #wrong catches errors.
    p.add_argument("--corrupt", default="", help=argparse.SUPPRESS)
    add_launch_args(p)
    a = p.parse_args(argv)
    bad = [o for o in a.ops.split(",") + a.corrupt.split(",") if o and o not in OPS]
    if bad:
        p.error(f"unknown --ops {bad}; choose from {OPS}")
    return run_distributed("allreduce", argv, a, body, "dense collectives (time averaged over ranks)", plot,
                           compact_cols=COMPACT_COLS, legend=LEGEND)
