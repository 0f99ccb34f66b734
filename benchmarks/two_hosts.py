"""Two emulated hosts on one machine: what local aggregation saves on a slow link between nodes.

Creates two network namespaces joined by a veth pair whose both ends are
capped with a token-bucket filter (``tc ... tbf``), starts ``--ranks-per-host``
ranks in each (torchrun-style variables, gloo bound to the veth), and times
``sparsecomm.sparse_allreduce`` on Zipf batches with and without local
(intra-host) aggregation, reporting bytes that crossed between hosts and the
median time. Only addresses inside the namespaces it created are used; they
are removed on exit, on failure and on Ctrl-C. Needs root and iproute2;
otherwise it says so and exits 0.

    sudo python benchmarks/two_hosts.py --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import List

SUBNET = "10.231.{}.{}"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class TwoHosts:
    """Context manager owning the namespaces, the veth pair and the tbf qdiscs."""

    def __init__(self, rate: str, latency_ms: float):
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"sc_host{tag}a", f"sc_host{tag}b"]
        self.dev = [f"sc{tag}va", f"sc{tag}vb"]
        net = 1 + os.getpid() % 250
        self.addr = [SUBNET.format(net, 1), SUBNET.format(net, 2)]
        self.rate, self.latency_ms = rate, latency_ms

    def __enter__(self) -> "TwoHosts":
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                # Cap each direction of the link between the hosts.
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                    "burst", "256kb", "latency", f"{self.latency_ms}ms")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for dev in self.dev:
            subprocess.run(["ip", "link", "del", dev], capture_output=True)

    def exists(self) -> bool:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(ns in out for ns in self.ns)


def _worker(args: argparse.Namespace) -> None:
    import torch

    import sparsecomm
    from sparsecomm.synthetic import zipf_ids

    torch.set_num_threads(1)
    topo = sparsecomm.init_distributed(timeout=120)
    if args.fail:
        raise SystemExit("worker failing on purpose (--fail)")
    k = max(1, int(args.density * args.rows))
    results = {}
    for mode, agg in (("flat", False), ("local-aggregation", True)):
        times: List[float] = []
        inter = 0
        for it in range(args.warmup + args.iters):
            ids = zipf_ids(k, args.rows, args.alpha, seed=1000 * it + topo.rank)
            grad = torch.sparse_coo_tensor(ids[None], torch.ones(k, args.dim), (args.rows, args.dim),
                                           check_invariants=False)
            stats = sparsecomm.SparseSyncStats()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            sparsecomm.sparse_allreduce(grad, local_world_size=topo.local_world_size, local_aggregation=agg,
                                        stats=stats)
            if it >= args.warmup:
                times.append(time.perf_counter() - t0)
                inter += stats.bytes_sent_inter_node
        results[mode] = (statistics.median(times), inter / args.iters)
    gathered = [None] * topo.world_size
    torch.distributed.all_gather_object(gathered, results)
    if topo.rank == 0:
        rows = []
        for mode in ("flat", "local-aggregation"):
            t = max(g[mode][0] for g in gathered)
            b = sum(g[mode][1] for g in gathered)
            rows.append({"mode": mode, "inter_host_MB_per_call": b / 1e6, "median_ms_slowest_rank": 1e3 * t})
        rows[1]["bytes_vs_flat"] = rows[1]["inter_host_MB_per_call"] / max(1e-12, rows[0]["inter_host_MB_per_call"])
        rows[1]["time_vs_flat"] = rows[1]["median_ms_slowest_rank"] / rows[0]["median_ms_slowest_rank"]
        print("RESULT " + json.dumps(rows), flush=True)
    sparsecomm.shutdown()


def _launch(args: argparse.Namespace) -> int:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        # Not a success: nothing was measured. Run it as root with the Python
        # that has sparsecomm installed (`sudo python3` may pick another one).
        print("two_hosts: not run: needs root and iproute2's ip/tc (as root: python3 benchmarks/two_hosts.py ...)",
              file=sys.stderr)
        return 2
    world = 2 * args.ranks_per_host
    with TwoHosts(args.rate, args.latency_ms) as hosts:
        procs = []
        try:
            for rank in range(world):
                host = rank // args.ranks_per_host
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(rank % args.ranks_per_host), LOCAL_WORLD_SIZE=str(args.ranks_per_host),
                           MASTER_ADDR=hosts.addr[0], MASTER_PORT="29533", GLOO_SOCKET_IFNAME=hosts.dev[host],
                           OMP_NUM_THREADS="1")
                cmd = ["ip", "netns", "exec", hosts.ns[host], sys.executable, os.path.abspath(__file__), "--worker",
                       *sys.argv[1:]]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
            deadline = time.monotonic() + args.timeout
            outs = []
            for p in procs:
                try:
                    outs.append(p.communicate(timeout=max(1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    outs.append(("", "timed out"))
            failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
        if failed:
            print(f"two_hosts: ranks {failed} failed:\n" + outs[failed[0]][1][-2000:], file=sys.stderr)
            return 1
    line = next(l for l in outs[0][0].splitlines() if l.startswith("RESULT "))
    rows = json.loads(line[len("RESULT "):])
    print(f"# two emulated hosts x {args.ranks_per_host} ranks, link {args.rate} (tbf), table {args.rows} x "
          f"{args.dim} fp32, {args.density:.2%} rows/rank Zipf({args.alpha}), {args.iters} iterations")
    for r in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="link rate between the hosts (tc syntax)")
    p.add_argument("--latency-ms", type=float, default=50, help="tbf queue latency bound")
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--density", type=float, default=0.01, help="rows per rank as a fraction of the table")
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write the result rows here")
    p.add_argument("--fail", action="store_true", help=argparse.SUPPRESS)  # tests: workers fail after setup
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
