"""An emulated cluster on one machine: H hosts x R ranks, every host link capped, every sync method timed.

Hosts are network namespaces joined by a bridge, each host's link capped both
ways with tbf (``sparsecomm.bench.netns``); ranks of a host talk over
loopback. For each topology (``--topologies 2x2,4x2``) the ranks start once
and sweep link rate x overlap x density; per configuration every method runs
once per round, rounds interleaved (the method order rotates), and the
reported time is the median over rounds of the slowest rank. Methods:

    dense        dist.all_reduce of the dense V x d table (sparse_as_dense)
    torch        dist.all_reduce of the sparse tensor (gloo's sparse all_reduce, what DDP does), coalesced
    allgather    sparse_allreduce(method="allgather")
    partitioned  sparse_allreduce(method="partitioned", local_aggregation=False): flat hashed push/pull
    two_level    sparse_allreduce(method="partitioned"), R ranks per host: local aggregation first
    tree         sparse_allreduce(method="tree"): recursive doubling, stages between hosts first

Every result is checked against a float64 sum of every rank's (seeded) input
before its time counts (``wrong`` in the JSON: elements off). Overlap:
``shared`` draws every rank's ids from one Zipf popularity order (hot rows
shared: ranks' rows overlap), ``disjoint`` gives every rank its own order.
After each configuration the classifier (``choose_method``, with the latency
probe's price, and with ``--fit`` a fitted model) picks a method from the
measured k and U; its time is that method's measured time.

Needs root and iproute2 (exits 2 otherwise, saying why); namespaces are
removed on exit, on failure and on Ctrl-C. Run it with the Python that has
sparsecomm installed:

    python3 benchmarks/cluster.py --topologies 2x2,4x2 --rates 100mbit,1gbit,10gbit --json cluster.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List

from sparsecomm.bench.netns import EmulatedCluster, can_emulate, collect, kill_all

METHODS = ("dense", "torch", "allgather", "partitioned", "two_level", "tree")


# ------------------------------------------------------------------ worker side


def _inputs(rank: int, a, overlap: str, density: float, alpha: float, case: int):
    import torch

    from sparsecomm.synthetic import zipf_ids

    n = max(1, int(density * a.rows))
    pop = 0 if overlap == "shared" else 1 + rank
    ids = zipf_ids(n, a.rows, alpha, seed=7919 * case + rank, popularity_seed=pop)
    vals = torch.randn(n, a.dim, generator=torch.Generator().manual_seed(104729 * case + rank))
    return torch.sparse_coo_tensor(ids[None], vals, (a.rows, a.dim)).coalesce()


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import sparsecomm
    from sparsecomm.collectives.probe import measure_latency_bytes
    from sparsecomm.cost_model import load_fitted_cost
    from sparsecomm.hooks.classifier import choose_method
    from sparsecomm.types import SyncMethod

    torch.set_num_threads(1)
    topo = sparsecomm.init_distributed(timeout=a.timeout)
    if a.fail:
        raise SystemExit("worker failing on purpose (--fail)")
    me, n, lws = topo.rank, topo.world_size, topo.local_world_size
    hosts = n // lws
    cluster = EmulatedCluster.attach(json.loads(os.environ["SC_CLUSTER"]))
    fit = load_fitted_cost(a.fit) if a.fit else None

    def run(method, grad):
        if method == "dense":
            dense = grad.to_dense()
            dist.all_reduce(dense)
            return dense
        if method == "torch":
            out = grad.clone()
            dist.all_reduce(out)
            return out.coalesce()
        kw = dict(local_world_size=lws, method="tree" if method == "tree" else
                  ("allgather" if method == "allgather" else "partitioned"),
                  local_aggregation=method == "two_level")
        return sparsecomm.sparse_allreduce(grad, **kw)

    def wrong(method, out, ref_ids, ref_vals):
        if method == "dense":
            got = out[ref_ids].double()
            touched = int((out.abs().sum(1) > 0).sum())  # rows no rank touched must stay zero
            return int(((got - ref_vals).abs() > 1e-4 * (1 + ref_vals.abs())).sum()) + a.dim * abs(
                touched - ref_ids.numel())
        if not torch.equal(out.indices()[0], ref_ids):
            return a.dim * abs(out.indices().shape[1] - ref_ids.shape[0]) + a.dim
        return int(((out.values().double() - ref_vals).abs() > 1e-4 * (1 + ref_vals.abs())).sum())

    case = 0
    for rate in a.rates.split(","):
        dist.barrier()
        if me == 0:
            cluster.set_rate(rate)
        dist.barrier()
        latency_bytes = measure_latency_bytes(None)
        for overlap in a.overlaps.split(","):
            for density in [float(x) for x in a.densities.split(",")]:
                case += 1
                grads = [_inputs(r, a, overlap, density, a.alpha, case) for r in range(n)]
                allids = torch.cat([g.indices()[0] for g in grads])
                ref_ids, inv = torch.unique(allids, return_inverse=True)
                ref_vals = torch.zeros(len(ref_ids), a.dim, dtype=torch.float64).index_add_(
                    0, inv, torch.cat([g.values().double() for g in grads]))
                ks = [g.indices().shape[1] for g in grads]
                unions_node = [torch.unique(torch.cat([grads[h * lws + j].indices()[0] for j in range(lws)])).numel()
                               for h in range(hosts)]
                grad = grads[me]
                methods = [m for m in a.methods.split(",") if m and not (m == "two_level" and lws == 1)]
                rounds = a.warmup + a.iters
                times = torch.full((rounds, len(methods)), float("nan"), dtype=torch.float64)
                bad = torch.zeros(len(methods), dtype=torch.float64)
                for rnd in range(rounds):
                    for j in range(len(methods)):
                        mi = (j + rnd) % len(methods)  # interleaved: the order rotates every round
                        m = methods[mi]
                        if m == "dense" and rnd >= a.warmup + a.dense_iters:
                            continue
                        dist.barrier()
                        t0 = time.perf_counter()
                        out = run(m, grad)
                        times[rnd, mi] = time.perf_counter() - t0
                        if rnd == 0:
                            bad[mi] = wrong(m, out, ref_ids, ref_vals)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank of each call
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                if me != 0:
                    continue
                k_mean, union = sum(ks) / n, int(ref_ids.numel())
                base = dict(hosts=hosts, ranks_per_host=lws, world=n, rate=rate, overlap=overlap, alpha=a.alpha,
                            density=density, rows=a.rows, dim=a.dim, elem_bytes=4,
                            index_bytes=2 if a.rows <= 2**15 else 4, k_mean=k_mean, union=union,
                            union_node=sum(unions_node) / hosts)
                measured: Dict[str, float] = {}
                for mi, m in enumerate(methods):
                    ts = [float(t) for t in times[a.warmup:, mi] if t == t]
                    measured[m] = statistics.median(ts)
                    print("RESULT " + json.dumps(dict(base, method=m, seconds=measured[m], rounds=ts,
                                                      wrong=int(bad[mi]))), flush=True)
                allowed = [SyncMethod.PARTITIONED, SyncMethod.ALLGATHER, SyncMethod.TORCH, SyncMethod.TREE]
                for name, f in (("auto", False), ("auto_fitted", fit)):
                    if name == "auto_fitted" and fit is None:
                        continue
                    d = choose_method(n, a.rows, a.dim, 4, base["index_bytes"], k_mean, union,
                                      latency_bytes=latency_bytes, allowed=allowed, fitted=f)
                    pick = {"partitioned": "two_level" if lws > 1 else "partitioned"}.get(d.method.value,
                                                                                         d.method.value)
                    if pick in measured:
                        print("RESULT " + json.dumps(dict(base, method=name, picked=pick, seconds=measured[pick],
                                                          latency_bytes=latency_bytes)), flush=True)
    sparsecomm.shutdown()


# ------------------------------------------------------------------ launcher side


def _run_topology(a, hosts: int, rph: int, records: List[dict]) -> int:
    world = hosts * rph
    rates = a.rates.split(",")
    with EmulatedCluster(hosts, rates[0], a.latency_ms) as cluster:
        procs = []
        env_common = dict(os.environ, SC_CLUSTER=json.dumps(cluster.describe()), OMP_NUM_THREADS="1")
        try:
            for rank in range(world):
                host = rank // rph
                env = dict(env_common, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % rph),
                           LOCAL_WORLD_SIZE=str(rph), MASTER_ADDR=cluster.addr[0], MASTER_PORT=str(a.port),
                           GLOO_SOCKET_IFNAME=cluster.dev[host])
                cmd = ["ip", "netns", "exec", cluster.ns[host], sys.executable, os.path.abspath(__file__),
                       "--worker", *sys.argv[1:]]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if rank == 0 else
                                              subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            deadline = time.monotonic() + a.timeout
            # Rank 0 streams one line per (configuration, method).
            for line in procs[0].stdout:
                if line.startswith("RESULT "):
                    rec = json.loads(line[len("RESULT "):])
                    records.append(rec)
                    _print_row(rec)
                if time.monotonic() > deadline:
                    break
            outs, failed = collect(procs, deadline)
        finally:
            kill_all(procs)
        if failed:
            print(f"cluster: {hosts}x{rph}: ranks {failed} failed:\n" + (outs[failed[0]][1] or "")[-2000:],
                  file=sys.stderr)
            return 1
    return 0


def _print_row(r: dict) -> None:
    extra = f" picked={r['picked']}" if "picked" in r else f" wrong={r['wrong']}"
    print(f"{r['hosts']}x{r['ranks_per_host']} {r['rate']:>8} {r['overlap']:>8} density={r['density']:<6g} "
          f"k={r['k_mean']:.0f} U={r['union']} {r['method']:>12} {1e3 * r['seconds']:9.2f} ms{extra}", flush=True)


def goals(records: List[dict], slow_bps: float = 1e9) -> List[str]:
    """The issue's goals, per configuration: the classifier's pick against the peers and against the best."""
    from sparsecomm.bench.netns import parse_rate

    lines = []
    configs: Dict[tuple, Dict[str, dict]] = {}
    for r in records:
        key = (r["hosts"], r["ranks_per_host"], r["rate"], r["overlap"], r["density"])
        configs.setdefault(key, {})[r["method"]] = r
    for key, ms in configs.items():
        auto = ms.get("auto_fitted") or ms.get("auto")
        timed = {m: r["seconds"] for m, r in ms.items() if m in METHODS}
        if auto is None or not timed:
            continue
        best = min(timed.values())
        peers = [timed[m] for m in ("torch", "allgather") if m in timed]
        line = (f"{key[0]}x{key[1]} {key[2]:>8} {key[3]:>8} density={key[4]:<6g} pick={auto['picked']:<11} "
                f"vs best {auto['seconds'] / best:5.2f}x slower")
        if peers:
            line += f", {min(peers) / auto['seconds']:5.2f}x faster than min(torch, allgather)"
        if key[3] == "shared" and parse_rate(key[2]) <= slow_bps:
            line += "  [goal: >= 2x]"
        lines.append(line)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topologies", default="2x2,4x2", help="HOSTSxRANKS, comma-separated (at most 8 ranks here)")
    p.add_argument("--rates", default="100mbit,1gbit,10gbit", help="host link rates (tc syntax), comma-separated")
    p.add_argument("--overlaps", default="shared,disjoint", help="shared and/or disjoint hot sets")
    p.add_argument("--densities", default="0.001,0.01,0.05", help="lookups per rank / table rows")
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the ids")
    p.add_argument("--rows", type=int, default=100_000, help="table rows V")
    p.add_argument("--dim", type=int, default=32, help="values per row (fp32)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--iters", type=int, default=3, help="timed rounds per configuration")
    p.add_argument("--dense-iters", type=int, default=1, help="timed rounds of the dense allreduce (slow)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--latency-ms", type=float, default=50, help="tbf queue latency bound")
    p.add_argument("--fit", help="a fitted cost model (sparsecomm.bench project --save) for the classifier")
    p.add_argument("--port", type=int, default=29541)
    p.add_argument("--timeout", type=float, default=900, help="seconds per topology")
    p.add_argument("--json", help="write every record here")
    p.add_argument("--fail", action="store_true", help=argparse.SUPPRESS)  # tests: workers fail after setup
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    why = can_emulate()
    if why:
        print(f"cluster: not run: {why}. Run as root with the Python that has sparsecomm installed: "
              f"python3 benchmarks/cluster.py ...", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM both unwind through the context managers that remove the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    records: List[dict] = []
    status = 0
    t0 = time.monotonic()
    for topo in a.topologies.split(","):
        hosts, rph = (int(x) for x in topo.lower().split("x"))
        if hosts < 2 or rph < 1:
            print(f"cluster: bad topology {topo!r} (need HOSTSxRANKS, HOSTS >= 2)", file=sys.stderr)
            return 2
        status = _run_topology(a, hosts, rph, records) or status
        if a.json:  # after every topology: a failure later keeps what was measured
            with open(a.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("worker", "fail")},
                           "records": records}, f, indent=1)
    print(f"# {len(records)} records in {time.monotonic() - t0:.0f} s")
    for line in goals(records):
        print(line)
    if any(r.get("wrong") for r in records):
        print("cluster: some results were WRONG (see 'wrong')", file=sys.stderr)
        return 3
    return status


if __name__ == "__main__":
    sys.exit(main())
