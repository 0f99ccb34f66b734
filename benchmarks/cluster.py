"""An emulated cluster on one machine: H hosts x R ranks, every host link capped, every sync method timed.

Hosts are network namespaces joined by a bridge, each host's link capped both
ways with tbf (``sparsecomm.bench.netns``); ranks of a host talk over
loopback. For each topology (``--topologies 2x2,4x2``) the ranks start once
and sweep link rate x overlap x density; per configuration every method runs
once per round, rounds interleaved (the method order rotates), and the
reported time is the median over rounds of the slowest rank. Methods: every
path of ``sparse_allreduce`` (``sparsecomm.collectives.methods``), by the name
a fitted model knows it by: ``partitioned`` (flat), ``allgather``, ``dense``
(the densify path: the V x d table all-reduced, with its row mask), ``torch``
(gloo's sparse all_reduce, what DDP does), ``tree`` and ``two_level`` (R
ranks per host: local aggregation first).

Every result is checked against a float64 sum of every rank's (seeded) input
before its time counts (``wrong`` in the JSON: elements off). Overlap:
``shared`` draws every rank's ids from one Zipf popularity order (hot rows
shared: ranks' rows overlap), ``disjoint`` gives every rank its own order.
After each configuration the classifier (``choose_method``: the hook's
default model, priced by ``measure_link`` per rate — a collective's latency
and the host link's bytes/s with R ranks sharing it — and with ``--fit`` a
fitted model) picks a method from the measured k and U (what the hook knows:
not the per-host union); ``auto``'s time is that method's measured time.
Before the rounds, the hook's opt-in tuner runs online (``tuned``): each
candidate the model rates within 4x of its best gets a warm-up and
``--tune-samples`` timed syncs, the ranks agree on the slowest rank's
medians (one all-reduce MAX) and keep the fastest; that kept method then
takes a slot of its own in the interleaved rounds, so ``tuned``'s
``seconds`` is its steady state timed exactly like the fixed methods, and
``explore_seconds`` the exploration's syncs (slowest rank), apart.

Overlap is the hot sets (``--overlaps``) and the Zipf exponent
(``--alphas``): a higher exponent concentrates every rank's lookups on the
same few hot rows (ranks' rows overlap more, U/k falls). Goal (1) is judged
on the most overlap-heavy workload of the sweep: shared hot sets at the
highest exponent.

Needs root and iproute2 (exits 2 otherwise, saying why); namespaces are
removed on exit, on failure and on Ctrl-C. Run it with the Python that has
sparsecomm installed:

    python3 benchmarks/cluster.py --topologies 2x2,4x2 --rates 100mbit,1gbit,10gbit --json cluster.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List

from sparsecomm.bench.netns import EmulatedCluster, can_emulate, collect, kill_all
from sparsecomm.collectives import methods as sync_methods

METHODS = tuple(p.fit_name for p in sync_methods.PATHS)
PEERS = tuple(p.fit_name for p in sync_methods.PATHS if p.baseline)


# ------------------------------------------------------------------ worker side


def _alphas(a: argparse.Namespace) -> List[float]:
    return [float(x) for x in (a.alphas or str(a.alpha)).split(",")]


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
    from sparsecomm.collectives.probe import measure_link
    from sparsecomm.cost_model import load_fitted_cost
    from sparsecomm.hooks.classifier import choose_method, method_costs, path_of
    from sparsecomm.hooks.tuner import MethodTuner, candidates_near

    torch.set_num_threads(1)
    topo = sparsecomm.init_distributed(timeout=a.timeout)
    if a.fail:
        raise SystemExit("worker failing on purpose (--fail)")
    me, n, lws = topo.rank, topo.world_size, topo.local_world_size
    hosts = n // lws
    cluster = EmulatedCluster.attach(json.loads(os.environ["SC_CLUSTER"]))
    fit = load_fitted_cost(a.fit) if a.fit else None

    def run(method, grad):
        path = sync_methods.by_name(method)
        return sparsecomm.sparse_allreduce(grad, local_world_size=lws, method=path.method.value,
                                           local_aggregation=path.hierarchical)

    def wrong(method, out, ref_ids, ref_vals):
        if not torch.equal(out.indices()[0], ref_ids):
            return a.dim * abs(out.indices().shape[1] - ref_ids.shape[0]) + a.dim
        return int(((out.values().double() - ref_vals).abs() > 1e-4 * (1 + ref_vals.abs())).sum())

    case = 0
    for rate in a.rates.split(","):
        dist.barrier()
        if me == 0:
            cluster.set_rate(rate)
        dist.barrier()
        link = measure_link(None, ranks_per_host=lws)
        for overlap, alpha, density in itertools.product(a.overlaps.split(","), _alphas(a),
                                                         [float(x) for x in a.densities.split(",")]):
            case += 1
            grads = [_inputs(r, a, overlap, density, alpha, case) for r in range(n)]
            allids = torch.cat([g.indices()[0] for g in grads])
            ref_ids, inv = torch.unique(allids, return_inverse=True)
            ref_vals = torch.zeros(len(ref_ids), a.dim, dtype=torch.float64).index_add_(
                0, inv, torch.cat([g.values().double() for g in grads]))
            ks = [g.indices().shape[1] for g in grads]
            unions_node = [torch.unique(torch.cat([grads[h * lws + j].indices()[0] for j in range(lws)])).numel()
                           for h in range(hosts)]
            grad = grads[me]
            methods = [m for m in a.methods.split(",") if m and not (m == "two_level" and lws == 1)]
            k_mean, union = sum(ks) / n, int(ref_ids.numel())
            allowed = [p.method for p in sync_methods.PATHS if not p.hierarchical and not p.moves_table]
            name_of = {m: path_of(m, n, lws).fit_name for m in allowed}
            index_bytes = 2 if a.rows <= 2**15 else 4
            tuned = None
            if a.tune:  # the hook's tuner, online, as a training job would run it: explore, agree, keep
                costs = method_costs(n, a.rows, a.dim, 4, index_bytes, k_mean, union, allowed, link=link,
                                     ranks_per_host=lws)
                tuner = MethodTuner([m for m in candidates_near(costs, 4.0, allowed) if name_of[m] in methods],
                                    warmup=1, samples=a.tune_samples, every=0)
                tried = [name_of[m] for m in tuner.trying]
                explore = torch.zeros(tuner.phase_end, dtype=torch.float64)
                for call in range(1, tuner.phase_end + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    run(name_of[tuner.method(call)], grad)
                    explore[call - 1] = time.perf_counter() - t0
                    if tuner.record(call, float(explore[call - 1])):
                        agreed = torch.tensor(tuner.local_times(), dtype=torch.float64)
                        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank keeps the same method
                        tuned = name_of[tuner.settle(agreed.tolist())]
                dist.all_reduce(explore, op=dist.ReduceOp.MAX)
                # Its steady state is timed in the interleaved rounds below, like every fixed method.
                methods.append("tuned")
            rounds = a.warmup + a.iters
            times = torch.full((rounds, len(methods)), float("nan"), dtype=torch.float64)
            bad = torch.zeros(len(methods), dtype=torch.float64)
            for rnd in range(rounds):
                for j in range(len(methods)):
                    mi = (j + rnd) % len(methods)  # interleaved: the order rotates every round
                    m = methods[mi]
                    if m != "tuned" and sync_methods.by_name(m).moves_table and rnd >= a.warmup + a.dense_iters:
                        continue
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = run(tuned if m == "tuned" else m, grad)
                    times[rnd, mi] = time.perf_counter() - t0
                    if rnd == 0:
                        bad[mi] = wrong(tuned if m == "tuned" else m, out, ref_ids, ref_vals)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank of each call
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if me != 0:
                continue
            base = dict(hosts=hosts, ranks_per_host=lws, world=n, rate=rate, overlap=overlap, alpha=alpha,
                        density=density, rows=a.rows, dim=a.dim, elem_bytes=4,
                        index_bytes=index_bytes, k_mean=k_mean, union=union,
                        union_node=sum(unions_node) / hosts)
            measured: Dict[str, float] = {}
            for mi, m in enumerate(methods):
                ts = [float(t) for t in times[a.warmup:, mi] if t == t]
                measured[m] = statistics.median(ts)
                extra = {} if m != "tuned" else dict(picked=tuned, explore_seconds=float(explore.sum()),
                                                     explore_syncs=int(explore.numel()), tried=tried,
                                                     agreed=agreed.tolist())
                print("RESULT " + json.dumps(dict(base, method=m, seconds=measured[m], rounds=ts,
                                                  wrong=int(bad[mi]), **extra)), flush=True)
            for name, f in (("auto", False), ("auto_fitted", fit)):
                if name == "auto_fitted" and fit is None:
                    continue
                d = choose_method(n, a.rows, a.dim, 4, index_bytes, k_mean, union, allowed=allowed, fitted=f,
                                  link=link, ranks_per_host=lws)
                pick = name_of[d.method]
                if pick in measured and pick != "tuned":
                    print("RESULT " + json.dumps(dict(base, method=name, picked=pick, seconds=measured[pick],
                                                      latency_s=link.latency_s, link_bytes_per_s=link.bytes_per_s,
                                                      pair_latency_s=link.pair_latency_s,
                                                      latency_bytes=link.latency_bytes)), flush=True)
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
    extra = (f" picked={r['picked']}" if "picked" in r else "") + (f" wrong={r['wrong']}" if "wrong" in r else "")
    if "explore_seconds" in r:
        extra += f" (exploring {r['explore_syncs']} syncs: {1e3 * r['explore_seconds']:.1f} ms)"
    print(f"{r['hosts']}x{r['ranks_per_host']} {r['rate']:>8} {r['overlap']:>8} alpha={r.get('alpha', 1.2):<4g} "
          f"density={r['density']:<6g} k={r['k_mean']:.0f} U={r['union']} {r['method']:>12} "
          f"{1e3 * r['seconds']:9.2f} ms{extra}", flush=True)


CLASSIFIERS = ("auto", "auto_fitted", "tuned")


def goals(records: List[dict], slow_bps: float = 1e9) -> List[str]:
    """The issue's goals, per configuration and classifier: its pick against the best and against the peers.

    Goal (1) rows (marked) are the most overlap-heavy workload of the sweep
    (shared hot sets, the highest Zipf exponent) at <= ``slow_bps``; their
    line also gives the best method's own speed-up over min(torch,
    allgather): no classifier can beat that ceiling.
    """
    from sparsecomm.bench.netns import parse_rate

    lines = []
    configs: Dict[tuple, Dict[str, dict]] = {}
    for r in records:
        key = (r["hosts"], r["ranks_per_host"], r["rate"], r["overlap"], r.get("alpha", 1.2), r["density"])
        configs.setdefault(key, {})[r["method"]] = r
    heavy = max((k[4] for k in configs), default=None)
    worst: Dict[str, List[float]] = {}
    for key, ms in configs.items():
        timed = {m: r["seconds"] for m, r in ms.items() if m in METHODS}
        if not timed:
            continue
        best_m = min(timed, key=timed.get)
        best = timed[best_m]
        peers = [timed[m] for m in PEERS if m in timed]
        goal1 = key[3] == "shared" and key[4] == heavy and parse_rate(key[2]) <= slow_bps
        for name in CLASSIFIERS:
            c = ms.get(name)
            if c is None:
                continue
            worst.setdefault(name, []).append(c["seconds"] / best)
            line = (f"{key[0]}x{key[1]} {key[2]:>8} {key[3]:>8} alpha={key[4]:<4g} density={key[5]:<6g} "
                    f"{name:>11} pick={c['picked']:<11} vs best ({best_m}) {c['seconds'] / best:5.2f}x slower")
            if peers:
                line += f", {min(peers) / c['seconds']:5.2f}x faster than min(torch, allgather)"
            if "explore_seconds" in c:
                line += f", exploring {1e3 * c['explore_seconds']:.0f} ms over {c['explore_syncs']} syncs"
            if goal1 and peers:
                line += f"  [goal 1: >= 2x; best method {min(peers) / best:.2f}x]"
            lines.append(line)
    for name, ratios in worst.items():
        lines.append(f"# {name}: worst {max(ratios):.2f}x the best method; {sum(x > 1.1 for x in ratios)} of "
                     f"{len(ratios)} configurations over 1.1x [goal 2: none]")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topologies", default="2x2,4x2", help="HOSTSxRANKS, comma-separated (at most 8 ranks here)")
    p.add_argument("--rates", default="100mbit,1gbit,10gbit", help="host link rates (tc syntax), comma-separated")
    p.add_argument("--overlaps", default="shared,disjoint", help="shared and/or disjoint hot sets")
    p.add_argument("--densities", default="0.001,0.01,0.05", help="lookups per rank / table rows")
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the ids (one)")
    p.add_argument("--alphas", help="Zipf exponents, comma-separated (overrides --alpha), e.g. 1.2,2.0")
    p.add_argument("--no-tune", dest="tune", action="store_false", help="skip the online tuner's runs")
    p.add_argument("--tune-samples", type=int, default=2, help="the tuner's timed syncs per candidate")
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
