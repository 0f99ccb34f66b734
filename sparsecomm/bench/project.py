"""Fit a time model to emulated-cluster runs, check it on held-out runs, and project sync time to 64-128 ranks.

Reads the JSON of ``benchmarks/cluster.py``. Per method (every path of the
registry, by its fitted name) it fits, by non-negative least
squares over the training runs,

    seconds = latency x steps(N) + per_byte x host-link bytes / link rate + per_row x rows merged

with each method's own formulas (``sparsecomm.collectives.methods``:
``fit_steps``, ``host_bytes``, ``merged_rows``; k, U and U_node as measured
in each run), then reports its error on the held-out runs (``--holdout-rates``, by
default every rate strictly between the lowest and the highest). It then
projects per-step sync time to 8x8 and 16x8 ranks at 25 and 100 Gbit/s for
two workloads whose k and U at each N are *measured* from
``sparsecomm.synthetic.zipf_ids`` with the examples' default shapes:

    lm1b-like  examples/train_lm.py: 100k-word vocabulary, 64 sentences x 21 ids per rank, Zipf(1.1), d=64
    dlrm-like  examples/train_dlrm.py: its largest table, 200k rows, 256 samples x 4 ids per rank, Zipf(1.1), d=32

Two projections are printed: the fitted model as is (its latency and per-row
terms are this machine's: ranks sharing 2 CPU cores, gloo over TCP, so they
are pessimistic for a GPU cluster) and the bytes-only model (host-link bytes
at line rate, the formulas Zen's analysis uses), with Zen's published figure.

    python -m sparsecomm.bench project --json cluster.json --save fit.json --plot projection.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

from sparsecomm.collectives import methods as sync_methods
from sparsecomm.collectives.methods import Workload
from sparsecomm.cost_model import FittedCost

# Every path, by the name a fit knows it by (benchmarks/cluster.py's methods).
METHODS_ON_CLUSTER = tuple(p.fit_name for p in sync_methods.PATHS)

# Zen (Wang et al., OSDI'25), abstract: up to 5.09x speedup in communication time and up to 2.48x in
# training throughput over the state of the art (allgather- and allreduce-based sparse sync), 16 machines
# x 8 V100 on 25 Gbit/s. Its per-model table could not be retrieved here; only the headline is compared.
ZEN_PUBLISHED = {"communication speedup (max)": 5.09, "throughput speedup (max)": 2.48,
                 "setting": "16x8 V100, 25 Gbit/s"}

WORKLOADS = {
    "lm1b-like": dict(rows=100_000, lookups=64 * 21, alpha=1.1, dim=64),
    "dlrm-like": dict(rows=200_000, lookups=256 * 4, alpha=1.1, dim=32),
}


def _parse_rate(rate: str) -> float:
    from sparsecomm.bench.netns import parse_rate

    return parse_rate(rate)


def features(rec: dict, method: str, rate_bps: Optional[float] = None, dim: Optional[int] = None
             ) -> Tuple[float, float, float]:
    """(latency steps, seconds at line rate on a host link, rows merged x d/32) of one run or projection."""
    n, lws, hosts = rec["world"], rec["ranks_per_host"], rec["hosts"]
    d = dim or rec["dim"]
    rate = rate_bps or _parse_rate(rec["rate"])
    path = sync_methods.by_name(method)
    w = Workload(n, rec["rows"], d, rec.get("elem_bytes", 4), rec.get("index_bytes", 4), rec["k_mean"], rec["union"],
                 lws, rec["union_node"])
    link = path.host_bytes(w, hosts, lws, rec["union_node"])
    # Per-row work scales with the row width; the fit's unit is a 32-value row.
    rows = path.merged_rows(w) * d / 32
    return path.fit_steps(n), link / (rate / 8), rows


def nnls(x: List[Sequence[float]], y: List[float]) -> Tuple[float, ...]:
    """Least squares with non-negative coefficients, by trying every subset of the (three) columns."""
    import numpy as np

    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    best, best_err = (0.0,) * a.shape[1], float("inf")
    for size in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), size):
            # Relative error: weigh each run by 1 / its time, so fast runs count as much as slow ones.
            w = 1 / np.maximum(b, 1e-6)
            sol, *_ = np.linalg.lstsq(a[:, cols] * w[:, None], b * w, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(a.shape[1])
            coef[list(cols)] = sol
            err = float(((((a @ coef) - b) * w) ** 2).sum())
            if err < best_err:
                best, best_err = tuple(float(c) for c in coef), err
    return best


def _topology(rec: dict) -> str:
    return f"{rec['hosts']}x{rec['ranks_per_host']}"


def fit(records: List[dict], holdout: Sequence[str], per_topology: bool = False
        ) -> Tuple[FittedCost, Dict[str, Dict[str, float]]]:
    """Fit every method on the runs not in ``holdout`` rates; return the model and held-out errors.

    The pooled fit uses every topology's runs; with ``per_topology`` each
    topology (H x R) also gets its own terms, and held-out runs are predicted
    with their own topology's terms.
    """
    coef: Dict[str, Tuple[float, float, float]] = {}
    by_topo: Dict[str, Dict[str, Tuple[float, float, float]]] = {}
    usable = {m: [r for r in records if r["method"] == m and not r.get("wrong")] for m in METHODS_ON_CLUSTER}
    for m, runs in usable.items():
        train = [r for r in runs if r["rate"] not in holdout]
        if len(train) < 2:
            continue
        coef[m] = nnls([features(r, m) for r in train], [r["seconds"] for r in train])
        if per_topology:
            for topo in sorted({_topology(r) for r in train}):
                mine = [r for r in train if _topology(r) == topo]
                if len(mine) >= 3:
                    by_topo.setdefault(topo, {})[m] = nnls([features(r, m) for r in mine],
                                                           [r["seconds"] for r in mine])
    lws = max((r["ranks_per_host"] for r in records), default=1)
    model = FittedCost(coef, 25e9 / 8, lws, by_topo)
    errors = {}
    for m in coef:
        test = [r for r in usable[m] if r["rate"] in holdout]
        rel = []
        for r in test:
            terms = model.terms(m, r["hosts"], r["ranks_per_host"])
            pred = sum(c * x for c, x in zip(terms, features(r, m)))
            rel.append(abs(pred - r["seconds"]) / r["seconds"])
        errors[m] = {"train_runs": len(usable[m]) - len(test), "heldout_runs": len(test),
                     "heldout_mean_abs_err": sum(rel) / len(rel) if rel else float("nan"),
                     "heldout_max_abs_err": max(rel) if rel else float("nan")}
    return model, errors


def workload_growth(name: str, worlds: Sequence[int], ranks_per_host: int = 8) -> Dict[int, dict]:
    """k (mean distinct rows per rank), U and U_node measured from the seeded generator at each N."""
    import torch

    from sparsecomm.synthetic import zipf_ids

    w = WORKLOADS[name]
    out = {}
    for n in worlds:
        ids = [torch.unique(zipf_ids(w["lookups"], w["rows"], w["alpha"], seed=1009 * n + r)) for r in range(n)]
        lws = ranks_per_host if n % ranks_per_host == 0 else 1
        nodes = [torch.unique(torch.cat(ids[h * lws:(h + 1) * lws])).numel() for h in range(n // lws)]
        out[n] = dict(k_mean=sum(i.numel() for i in ids) / n, union=int(torch.unique(torch.cat(ids)).numel()),
                      union_node=sum(nodes) / len(nodes))
    return out


def project(model: FittedCost, topologies: Sequence[Tuple[int, int]], rates: Sequence[str],
            growth: Dict[str, Dict[int, dict]]) -> List[dict]:
    rows = []
    for (hosts, lws), rate, (wname, g) in itertools.product(topologies, rates, growth.items()):
        n = hosts * lws
        w = WORKLOADS[wname]
        rec = dict(world=n, hosts=hosts, ranks_per_host=lws, rows=w["rows"], dim=w["dim"], elem_bytes=4,
                   index_bytes=4, **g[n])
        bps = _parse_rate(rate)
        for m in METHODS_ON_CLUSTER:
            f = features(rec, m, bps, w["dim"])
            fitted = sum(c * x for c, x in zip(model.coef[m], f)) if m in model.coef else float("nan")
            rows.append(dict(topology=f"{hosts}x{lws}", rate=rate, workload=wname, method=m, k=g[n]["k_mean"],
                             U=g[n]["union"], fitted_s=fitted, bytes_only_s=f[1]))
    return rows


def _path(name: str):
    return sync_methods.by_name(name)


def _speedups(rows: List[dict], key: str) -> Dict[tuple, Tuple[str, float]]:
    out = {}
    for cfg, grp in itertools.groupby(rows, key=lambda r: (r["topology"], r["rate"], r["workload"])):
        t = {r["method"]: r[key] for r in grp if not math.isnan(r[key])}
        ours = {m: t[m] for m in t if not _path(m).baseline and not _path(m).moves_table}
        peers = [t[m] for m in t if _path(m).baseline]
        if ours and peers:
            best = min(ours, key=ours.get)
            out[cfg] = (best, min(peers) / max(ours[best], 1e-12))
    return out


def run(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsecomm.bench project", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="benchmarks/cluster.py's output")
    p.add_argument("--holdout-rates", help="rates whose runs are held out (default: all but the lowest and highest)")
    p.add_argument("--topologies", default="8x8,16x8")
    p.add_argument("--rates", default="25gbit,100gbit")
    p.add_argument("--save", help="write the fitted model here (for SPARSECOMM_COST_FIT / cluster.py --fit)")
    p.add_argument("--per-topology", action="store_true",
                   help="also fit each topology (HxR) of the runs on its own; its held-out runs are checked against "
                        "those terms (the projection to other sizes uses the pooled fit)")
    p.add_argument("--plot", help="write a bar chart of the projection here (needs matplotlib)")
    a = p.parse_args(argv)
    if a.plot:
        try:
            import matplotlib  # noqa: F401  (checked before any work)
        except ImportError:
            print("project: --plot needs matplotlib, which is not installed (pip install matplotlib)")
            return 2
    with open(a.json) as f:
        records = json.load(f)["records"]
    rates = sorted({r["rate"] for r in records if r["method"] in METHODS_ON_CLUSTER}, key=_parse_rate)
    holdout = a.holdout_rates.split(",") if a.holdout_rates else rates[1:-1]
    model, errors = fit(records, holdout, a.per_topology)
    print(f"# fit: seconds = latency x steps + per_byte x host-link bytes / rate + per_row x rows(d/32); "
          f"trained on rates {[r for r in rates if r not in holdout]}, held out {holdout}"
          + (f"; terms per topology {sorted(model.topologies)} (the pooled terms below project)"
             if model.topologies else ""))
    print(f"{'method':>12} {'latency_ms':>10} {'per_byte':>9} {'per_row_us':>10} {'train':>6} {'held':>5} "
          f"{'held_err_mean':>13} {'held_err_max':>12}")
    for m, c in model.coef.items():
        e = errors[m]
        print(f"{m:>12} {1e3 * c[0]:10.3f} {c[1]:9.3f} {1e6 * c[2]:10.3f} {e['train_runs']:6d} "
              f"{e['heldout_runs']:5d} {e['heldout_mean_abs_err']:13.1%} {e['heldout_max_abs_err']:12.1%}")
    for topo, terms in sorted(model.topologies.items()):
        print(f"  {topo}: " + ", ".join(f"{m} {1e3 * c[0]:.2f} ms/{c[1]:.2f}/{1e6 * c[2]:.2f} us"
                                        for m, c in terms.items()))
    if a.save:
        with open(a.save, "w") as f:
            json.dump(model.to_json(), f, indent=1)
        print(f"# model written to {a.save}")
    topos = [tuple(int(x) for x in t.lower().split("x")) for t in a.topologies.split(",")]
    worlds = sorted({h * l for h, l in topos})
    growth = {w: workload_growth(w, worlds, topos[0][1]) for w in WORKLOADS}
    print("\n# workload growth, measured from sparsecomm.synthetic.zipf_ids (examples' default shapes)")
    for w, g in growth.items():
        print(f"  {w}: " + ", ".join(f"N={n}: k={v['k_mean']:.0f} U={v['union']} U/k={v['union'] / v['k_mean']:.1f}"
                                     for n, v in g.items()))
    rows = project(model, topos, a.rates.split(","), growth)
    print("\n# projected per-step sync time, ms (fitted | bytes only at line rate)")
    print(f"{'ranks':>6} {'rate':>7} {'workload':>10} " + " ".join(f"{m:>19}" for m in METHODS_ON_CLUSTER))
    for cfg, grp in itertools.groupby(rows, key=lambda r: (r["topology"], r["rate"], r["workload"])):
        t = {r["method"]: r for r in grp}
        print(f"{cfg[0]:>6} {cfg[1]:>7} {cfg[2]:>10} " + " ".join(
            f"{1e3 * t[m]['fitted_s']:9.2f}|{1e3 * t[m]['bytes_only_s']:9.3f}" for m in METHODS_ON_CLUSTER))
    ours = " / ".join(p.fit_name for p in sync_methods.PATHS if not p.baseline and not p.moves_table)
    peers = ", ".join(p.fit_name for p in sync_methods.PATHS if p.baseline)
    print(f"\n# best of ours ({ours}) vs best of allgather-based ({peers})")
    sf, sb = _speedups(rows, "fitted_s"), _speedups(rows, "bytes_only_s")
    for cfg in sf:
        print(f"  {cfg[0]:>6} {cfg[1]:>7} {cfg[2]:>10}: fitted {sf[cfg][0]} {sf[cfg][1]:.2f}x, "
              f"bytes only {sb[cfg][0]} {sb[cfg][1]:.2f}x")
    print(f"# Zen (OSDI'25), published: {ZEN_PUBLISHED}")
    if a.plot:
        _plot(rows, a.plot)
        print(f"# plot written to {a.plot}")
    return 0


def _plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = sorted({(r["topology"], r["rate"], r["workload"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cfgs)), 4))
    width = 0.8 / len(METHODS_ON_CLUSTER)
    for i, m in enumerate(METHODS_ON_CLUSTER):
        ys = [next(r["fitted_s"] * 1e3 for r in rows if (r["topology"], r["rate"], r["workload"]) == c
                   and r["method"] == m) for c in cfgs]
        ax.bar([j + i * width for j in range(len(cfgs))], ys, width, label=m)
    ax.set_xticks([j + 0.4 for j in range(len(cfgs))])
    ax.set_xticklabels(["\n".join(c) for c in cfgs], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("projected ms per step (fitted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
