"""Two emulated hosts on one machine: what local aggregation saves on a slow link between nodes.

Creates two network namespaces joined by a bridge, each host's link capped
both ways with a token-bucket filter (``tc ... tbf``; see
``sparsecomm.bench.netns``, shared with ``benchmarks/cluster.py``), starts ``--ranks-per-host``
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
import statistics
import subprocess
import sys
import time
from typing import List

from sparsecomm.bench.netns import EmulatedCluster, can_emulate, collect, kill_all

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
    why = can_emulate()
    if why:
        # Not a success: nothing was measured. Run it as root with the Python
        # that has sparsecomm installed (`sudo python3` may pick another one).
        print(f"two_hosts: not run: {why} (as root: python3 benchmarks/two_hosts.py ...)", file=sys.stderr)
        return 2
    world = 2 * args.ranks_per_host
    with EmulatedCluster(2, args.rate, args.latency_ms) as hosts:
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
            outs, failed = collect(procs, deadline)
        finally:
            kill_all(procs)
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
