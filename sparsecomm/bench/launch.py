"""Start a distributed benchmark: under torchrun, mpirun or srun, or self-spawned on one machine.

Every distributed benchmark goes through :func:`run_distributed`:

- launched by torchrun / mpirun / srun (``sparsecomm.init_distributed``
  understands their environment), this process is one rank: it initializes,
  runs the benchmark body, and rank 0 prints the table and writes
  ``--json``/``--csv``/``--plot``;
- started by hand with ``--nproc N`` (or ``--nproc 2,3,4`` for a scaling
  sweep), this process is only a parent: it starts N children of
  ``python -m sparsecomm.bench BENCH ...`` with torchrun's variables
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``), waits for them, merges the rows their
  rank 0 hands back, and writes the outputs itself;
- started by hand with ``--hosts H`` (as root), the parent first builds H
  emulated hosts on this machine (``sparsecomm.bench.netns``: a network
  namespace each, its link capped both ways at ``--rate`` with tbf) and
  starts ``--ranks-per-host`` children in each, gloo bound to the host's
  link: ranks of different hosts talk only through the capped links (no
  shared memory joins them). Lists (``--hosts 2,4 --rate 1gbit,10gbit``) run
  every combination; each row says its hosts and rate.

Before anything starts, the outputs are checked (``--plot`` needs
matplotlib; output folders must exist): a problem exits with status 2 and
the reason in the first second. While it runs, progress lines go to stderr;
rank 0 prints the table on stdout, compact unless ``--wide``.

Exit status: 0 when every result was right (a contender skipped for a missing
optional dependency is reported as skipped, not as wrong),
:data:`EXIT_WRONG` when some ``#wrong`` was non-zero, 2 when a dependency or
an output folder is missing, anything else when a rank failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.bench.harness import (EXIT_USAGE, Row, Verdict, check_outputs, print_table, progress,
                                      write_outputs)
from sparsecomm.collectives.bootstrap import init_distributed, shutdown
from sparsecomm.collectives.launchers import detect_launcher, free_port, launcher_variable

__all__ = ["EXIT_WRONG", "add_launch_args", "launched", "spawn", "spawn_hosts", "emulated_link", "run_distributed",
           "gather_floats",
           "resolve_device_backend"]

EXIT_WRONG = 3
# Where a self-spawned job's rank 0 writes its rows (JSON) for the parent to merge.
_RESULT_ENV = "SPARSECOMM_BENCH_RESULT"
# The emulated host link a rank runs behind (set by spawn_hosts): "HOSTS,RANKS_PER_HOST,RATE".
_LINK_ENV = "SPARSECOMM_BENCH_LINK"
# A rank that died leaves the others blocked in a collective: stop them this long after.
_GRACE_S = 10.0


def _world_sizes(text: str) -> List[int]:
    sizes = [int(s) for s in str(text).split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--nproc wants positive integers like 4 or 2,3,4, got {text!r}")
    return sizes


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """Add the options every distributed benchmark shares: launch, device, outputs."""
    g = p.add_argument_group("launch")
    g.add_argument("--nproc", type=_world_sizes, default=None, metavar="N[,N...]",
                   help="spawn N local ranks (a list runs one job per world size, e.g. 2,3,4); "
                        "ignored when started by torchrun/mpirun/srun")
    g.add_argument("--hosts", type=_world_sizes, default=None, metavar="H[,H...]",
                   help="emulate H hosts on this machine (needs root: network namespaces, tbf-capped links), "
                        "--ranks-per-host ranks on each; a list runs one job per host count")
    g.add_argument("--ranks-per-host", type=int, default=1, metavar="R",
                   help="ranks on each emulated host (default 1)")
    g.add_argument("--rate", default="1gbit", metavar="RATE[,RATE...]",
                   help="each emulated host link's rate, both ways, in tc's syntax (100mbit, 1gbit, 10gbit); "
                        "a list runs one job per rate (default 1gbit)")
    g.add_argument("--backend", default=None, choices=["gloo", "nccl", "mpi"],
                   help="default: nccl with --device cuda, else gloo")
    g.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where the tensors live (default: cuda when available, else cpu)")
    g.add_argument("--timeout", type=float, default=300.0,
                   help="collective timeout in seconds: a hung or dead rank fails the run after this")
    o = p.add_argument_group("output")
    o.add_argument("--json", help="write the rows as JSON (rank 0 / the spawning parent)")
    o.add_argument("--csv", help="write the rows as CSV")
    o.add_argument("--plot", help="write a PNG plot (needs matplotlib: pip install 'sparsecomm[bench]')")
    o.add_argument("--wide", action="store_true",
                   help="print every column (default: a compact table with a legend; --json/--csv hold every column)")


def resolve_device_backend(args: argparse.Namespace) -> None:
    """Fill ``args.device`` and ``args.backend`` defaults (in place)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")


def launched() -> bool:
    """True when a launcher (torchrun, mpirun, srun, or our own spawn) made this process a rank."""
    return detect_launcher()[0] != "none"


def _child_env(rank: int, world_size: int, port: int, result_path: Optional[str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not launcher_variable(k) and k != _RESULT_ENV}
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # N ranks share the cores: without this each would start one OpenMP thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    # A rank killed by a signal (SIGSEGV in a kernel) prints every thread's Python stack on its stderr first.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    # The children import this very package, even from a checkout that is not installed.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if rank == 0 and result_path:
        env[_RESULT_ENV] = result_path
    return env


def spawn(bench: str, argv: Sequence[str], world_size: int, result_path: Optional[str] = None) -> int:
    """Run ``python -m sparsecomm.bench BENCH ARGV`` as ``world_size`` local ranks; return the exit status.

    The children inherit stdout/stderr (rank 0 prints the table). When a rank
    fails, the others get :data:`_GRACE_S` seconds to notice and are then
    terminated, so a crash never leaves the job hanging until the timeout.

    Returns:
        0, :data:`EXIT_WRONG` if the ranks reported wrong results, or the
        first failing rank's status.
    """
    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "sparsecomm.bench", bench, *argv]
    return _watch([subprocess.Popen(cmd, env=_child_env(r, world_size, port, result_path))
                   for r in range(world_size)])


def spawn_hosts(bench: str, argv: Sequence[str], hosts: int, ranks_per_host: int, rate: str,
                result_path: Optional[str] = None) -> int:
    """:func:`spawn` across ``hosts`` emulated hosts of ``ranks_per_host`` ranks, every host link capped at ``rate``.

    Ranks of a host share its namespace (loopback between them, uncapped);
    gloo binds to the host's veth, rank 0's address is the rendezvous. The
    namespaces are removed when the ranks are done, on failure and on Ctrl-C.
    """
    from sparsecomm.bench.netns import EmulatedCluster

    world = hosts * ranks_per_host
    with EmulatedCluster(hosts, rate) as cluster:
        procs = []
        for rank in range(world):
            host = rank // ranks_per_host
            env = _child_env(rank, world, 29500, result_path)
            env.update(LOCAL_RANK=str(rank % ranks_per_host), LOCAL_WORLD_SIZE=str(ranks_per_host),
                       MASTER_ADDR=cluster.addr[0], GLOO_SOCKET_IFNAME=cluster.dev[host],
                       **{_LINK_ENV: f"{hosts},{ranks_per_host},{rate}"})
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
            cmd = ["ip", "netns", "exec", cluster.ns[host], sys.executable, "-m", "sparsecomm.bench", bench, *argv]
            procs.append(subprocess.Popen(cmd, env=env))
        return _watch(procs)


def emulated_link() -> Optional[Tuple[int, int, str]]:
    """``(hosts, ranks per host, rate)`` of the emulated hosts this rank runs on, or None (not emulated)."""
    value = os.environ.get(_LINK_ENV)
    if not value:
        return None
    hosts, rph, rate = value.split(",")
    return int(hosts), int(rph), rate


def _watch(procs: List[subprocess.Popen]) -> int:
    """Wait for the ranks; a failing rank's peers get :data:`_GRACE_S` seconds, then are stopped."""
    first_failure: Optional[int] = None
    failed_at: Optional[float] = None
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                rc = p.poll()
                if rc not in (None, 0, EXIT_WRONG) and failed_at is None:
                    first_failure, failed_at = rc, time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.05)
    except BaseException:  # Ctrl-C or the test's timeout: never leave ranks behind
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    codes = [p.returncode for p in procs]
    if first_failure is not None:
        return first_failure
    bad = [c for c in codes if c not in (0, EXIT_WRONG)]
    if bad:
        return bad[0]
    return EXIT_WRONG if EXIT_WRONG in codes else 0


def _rate_ok(parse, rate: str) -> bool:
    try:
        parse(rate)
        return True
    except ValueError:
        return False


def _run_jobs(bench: str, jobs: Sequence, args: argparse.Namespace, table: Callable[[List[Row], str], None],
              title: str, plot: Optional[Callable[[List[Row], str], None]]) -> int:
    """Run each ``(label, start)`` job (``start(result_path) -> exit status``), merge the rows their rank 0 hands back."""
    rows: List[Row] = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="sparsecomm-bench-") as tmp:
        for i, (label, start) in enumerate(jobs):
            result_path = os.path.join(tmp, f"rows-{i}.json")
            progress(f"{bench}: starting {label}; a line per configuration follows")
            t0 = time.monotonic()
            rc = start(result_path)
            progress(f"{bench}: {label} finished in {time.monotonic() - t0:.1f} s (exit status {rc})")
            if os.path.exists(result_path):
                with open(result_path) as f:
                    rows += [Row(cols) for cols in json.load(f)]
            if rc not in (0, EXIT_WRONG):
                print(f"# {bench}: {label} failed with exit status {rc}", file=sys.stderr, flush=True)
            status = status or rc
    if len(jobs) > 1 and rows:
        table(rows, f"{title}: " + "; ".join(label for label, _ in jobs))
    _write(rows, args, plot)
    return status


def gather_floats(value: float) -> List[float]:
    """Every rank's ``value``, in rank order, on every rank (one small all-gather)."""
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, float(value))
    return [float(v) for v in out]


def _write(rows: List[Row], args: argparse.Namespace, plot: Optional[Callable[[List[Row], str], None]]) -> None:
    write_outputs(rows, getattr(args, "json", None), getattr(args, "csv", None))
    if getattr(args, "plot", None) and plot is not None and rows:
        plot(rows, args.plot)
        print(f"# plot written to {args.plot}", flush=True)


def _exit_status(rows: Sequence[Row]) -> int:
    return EXIT_WRONG if any(r.cols.get("#wrong", 0) not in (0, "") for r in rows) else 0


def run_distributed(bench: str, argv: Sequence[str], args: argparse.Namespace,
                    body: Callable[[argparse.Namespace], List[Row]], title: str,
                    plot: Optional[Callable[[List[Row], str], None]] = None,
                    compact_cols: Optional[Sequence[str]] = None, legend: Optional[Dict[str, str]] = None,
                    verdict: Optional[Verdict] = None) -> int:
    """Run a benchmark body on every rank, or spawn the ranks first (``--nproc``).

    Args:
        bench: the name under ``python -m sparsecomm.bench`` (children run it).
        argv: this process's arguments; the children get the same ones.
        args: the parsed arguments (with :func:`add_launch_args`' options).
        body: ``body(args) -> rows``, called on every rank after
            ``init_distributed``; the rows must be complete on rank 0.
        title: the table's title.
        plot: ``plot(rows, path)`` for ``--plot``.
        compact_cols, legend: the default table's columns and their meaning
            (see :func:`~sparsecomm.bench.harness.print_table`); ``--wide``
            prints every column.
        verdict: how to judge the rows in one line printed under the table.

    Returns:
        The exit status (see the module docstring).
    """
    problems = check_outputs(getattr(args, "plot", None) if plot is not None else None,
                             getattr(args, "json", None), getattr(args, "csv", None))
    if getattr(args, "plot", None) and plot is None:
        problems.append("--plot: this benchmark draws no plot (use --json or --csv)")
    if problems:  # before any rank starts: not after a run of minutes
        for msg in problems:
            print(f"{bench}: {msg}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    resolve_device_backend(args)  # fail here, before starting any rank, on --device cuda without CUDA

    def table(rows: List[Row], heading: str) -> None:
        print_table(rows, heading, compact_cols=compact_cols, wide=getattr(args, "wide", False), legend=legend)
        if verdict is not None and rows:
            print(verdict.line(rows), flush=True)

    if args.hosts and args.nproc:
        print(f"{bench}: --hosts and --nproc exclude each other (--ranks-per-host sets the ranks of a host)",
              file=sys.stderr, flush=True)
        return EXIT_USAGE
    if args.hosts and not launched():
        from sparsecomm.bench.netns import can_emulate, parse_rate

        why = can_emulate()
        bad_rate = [r for r in args.rate.split(",") if not _rate_ok(parse_rate, r)]
        if why or bad_rate or args.ranks_per_host < 1:
            reason = why or (f"--rate {bad_rate[0]!r}: use tc's syntax (100mbit, 1gbit, 10gbit)" if bad_rate
                             else "--ranks-per-host must be >= 1")
            print(f"{bench}: cannot emulate hosts: {reason}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        jobs = [(f"{h} hosts x {args.ranks_per_host} ranks at {rate}",
                 lambda path, h=h, rate=rate: spawn_hosts(bench, argv, h, args.ranks_per_host, rate, path))
                for h in args.hosts for rate in args.rate.split(",")]
        return _run_jobs(bench, jobs, args, table, title, plot)
    if args.nproc and not launched():
        jobs = [(f"world size {n}", lambda path, n=n: spawn(bench, argv, n, path)) for n in args.nproc]
        return _run_jobs(bench, jobs, args, table, title, plot)

    if args.nproc and launched() and int(os.environ.get("WORLD_SIZE", args.nproc[0])) not in args.nproc:
        print("# --nproc ignored: the launcher decides the world size", file=sys.stderr, flush=True)
    init_distributed(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rows = body(args)
        status = 0
        if dist.get_rank() == 0:
            table(rows, title)
            result_path = os.environ.get(_RESULT_ENV)
            if result_path:  # the spawning parent writes the outputs (it may merge world sizes)
                with open(result_path, "w") as f:
                    json.dump([r.cols for r in rows], f, default=str)
            else:
                _write(rows, args, plot)
            status = _exit_status(rows)
        # Every rank leaves with rank 0's verdict, so launchers report it whichever rank they watch.
        verdict = torch.tensor([status], dtype=torch.int64)
        if args.backend == "nccl":
            verdict = verdict.cuda()
        dist.broadcast(verdict, 0)
        status = int(verdict.item())
    finally:
        shutdown()
    return status
