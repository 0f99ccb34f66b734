"""Kernel benchmark: sparsecomm's row kernels against what a user writes with torch ops.

Inputs: ``--n`` ids drawn from Zipf(``--alpha``) over ``--rows`` rows, values
``(n, d)``. Effective GB/s counts the bytes each op must read and write once
(ids, input rows, output rows).
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

import torch

from sparsecomm import ops
from sparsecomm.bench.harness import Contender, Row, print_table, time_interleaved, write_outputs
from sparsecomm.synthetic import zipf_ids

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _wrong(got: torch.Tensor, ref: torch.Tensor, tol: float) -> int:
    if got.shape != ref.shape:
        return max(got.numel(), ref.numel())
    return int(((got.double() - ref.double()).abs() > tol * (1 + ref.double().abs())).sum())


def run(argv: Optional[Sequence[str]] = None) -> List[Row]:
    p = argparse.ArgumentParser(prog="sparsecomm.bench kernels", description=__doc__)
    p.add_argument("--n", type=int, default=1_000_000, help="number of ids (default 1M)")
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1M)")
    p.add_argument("--d", type=int, default=64, help="row width (default 64)")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf skew of the ids (default 1.1)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--json")
    p.add_argument("--csv")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    ids = zipf_ids(a.n, a.rows, a.alpha, seed=0).to(dev)
    values = torch.randn(a.n, a.d, device=dev).to(dtype)
    table = torch.randn(a.rows, a.d, device=dev).to(dtype)
    esz = values.element_size()
    uniq = int(torch.unique(ids).numel())
    print(f"# kernels: n={a.n} rows={a.rows} d={a.d} {a.dtype} zipf({a.alpha}) unique={uniq} "
          f"device={a.device} threads={torch.get_num_threads()}", flush=True)

    def torch_coalesce():
        t = torch.sparse_coo_tensor(ids[None], values, (a.rows, a.d), check_invariants=False).coalesce()
        return t.indices()[0], t.values()

    def unique_index_add():
        u, inv = torch.unique(ids, return_inverse=True)
        return u, torch.zeros(len(u), a.d, device=dev, dtype=dtype).index_add_(0, inv, values)

    ref_ids, ref_vals = unique_index_add()

    def check_coalesce(res):
        return int(not torch.equal(res[0].long(), ref_ids.long())) + _wrong(res[1], ref_vals, tol)

    ref_gather = table.index_select(0, ids)
    scatter_tables = {"sparsecomm": table.clone(), "torch index_add_": table.clone()}
    ref_scatter = table.double().index_add(0, ids, values.double())

    def scatter_ours():
        return ops.scatter_add_rows(scatter_tables["sparsecomm"], ids, values)

    def scatter_torch():
        return scatter_tables["torch index_add_"].index_add_(0, ids, values)

    part_ref = torch.bincount(ops.row_owners(ids, 4), minlength=4)
    groups = [
        ("coalesce", a.n * (8 + a.d * esz) + uniq * (8 + a.d * esz), [
            Contender("sparsecomm", lambda: ops.coalesce_rows(ids, values), check_coalesce),
            Contender("torch coalesce()", torch_coalesce, check_coalesce),
            Contender("torch unique+index_add_", unique_index_add, check_coalesce),
        ]),
        ("gather", a.n * (8 + 2 * a.d * esz), [
            Contender("sparsecomm", lambda: ops.gather_rows(table, ids), lambda r: _wrong(r, ref_gather, 0)),
            Contender("torch index_select", lambda: table.index_select(0, ids), lambda r: _wrong(r, ref_gather, 0)),
        ]),
        ("scatter_add", a.n * (8 + a.d * esz) + 2 * uniq * a.d * esz, [
            # Checked after the first (warm-up) call only, against one application.
            Contender("sparsecomm", scatter_ours, lambda r: _wrong(r, ref_scatter, tol * 10)),
            Contender("torch index_add_", scatter_torch, lambda r: _wrong(r, ref_scatter, tol * 10)),
        ]),
        ("partition(4 owners)", a.n * 2 * (8 + a.d * esz), [
            Contender("sparsecomm", lambda: ops.partition_rows(ids, values, 4),
                      lambda r: int(not torch.equal(r.counts, part_ref))),
            Contender("torch sort+index_select",
                      lambda: (lambda perm: (ids[perm], values.index_select(0, perm)))(
                          torch.sort(ops.row_owners(ids, 4), stable=True).indices)),
        ]),
    ]
    rows: List[Row] = []
    for op, nbytes, contenders in groups:
        res = time_interleaved(contenders, warmup=1, iters=a.iters, device=a.device)
        base = res["sparsecomm"].get("median")
        for c in contenders:
            r = res[c.name]
            med = r.get("median")
            rows.append(Row({
                "op": op, "impl": c.name,
                "median_ms": med * 1e3 if med else "error",
                "min_ms": r["min"] * 1e3 if med else "",
                "GB/s": nbytes / med / 1e9 if med else "",
                "time_vs_sparsecomm": (med / base) if med and base else "",
                "#wrong": int(r["wrong"]),
            }))
    print_table(rows, "kernel benchmark (median of interleaved runs)")
    write_outputs(rows, a.json, a.csv)
    return rows
