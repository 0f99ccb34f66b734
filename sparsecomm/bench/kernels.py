"""Kernel benchmark: sparsecomm's row kernels against what a user writes with torch ops.

Inputs, seeded (the same on every run): ``--n`` ids drawn from Zipf(``--alpha``)
over ``--rows`` rows, values ``(n, d)`` and a ``(rows, d)`` table from a
seeded normal generator. Effective GB/s counts the bytes each op must read and
write once (ids, input rows, output rows); it is printed next to the measured
copy bandwidth of the machine (``Tensor.copy_`` of the values, read + write).

Every result is checked before its time is reported (``#wrong``): ids exactly,
sums against a float64 reference within the worst-case error of recursive
summation in the values' dtype, ``gamma(m) * sum|x|`` with
``gamma(m) = m u / (1 - m u)`` for a row of ``m`` terms (``u`` the unit
roundoff), which holds for any summation order. Owner pooling's index kernels
(group_by, bag_groups, unique_inverse, pooled_request: 2 owners by range, bags of 20 ids)
must equal the torch ops they replace exactly, every output and its dtype.
The run exits with status 3 if any result is wrong (0 otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, List, Optional, Sequence

import torch

from sparsecomm import _library, ops
from sparsecomm.bench.harness import Contender, Row, print_table, time_interleaved, write_outputs
from sparsecomm.synthetic import zipf_ids

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
EXIT_WRONG = 3
OWNERS = 4
POOL_OWNERS, POOL_BAG = 2, 20  # owner pooling's workload: 2 owners (range), bags of 20 ids


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next value of ``dtype``."""
    return torch.finfo(dtype).eps / 2


def summation_bound(terms: torch.Tensor, abs_sum: torch.Tensor, dtype: torch.dtype,
                    acc_dtype: Optional[torch.dtype] = None, exact: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Worst-case error of a sum of ``terms`` values of ``dtype`` whose magnitudes add up to ``abs_sum``.

    Summed in ``acc_dtype`` (default: ``dtype``, rounding every step), in any
    order: ``gamma(m) * abs_sum`` with ``gamma(m) = m u / (1 - m u)`` (Higham,
    Accuracy and Stability of Numerical Algorithms, eq. 4.4), infinite once
    ``m u >= 1``. Accumulated in a wider ``acc_dtype`` and rounded once to
    ``dtype``: that bound plus one rounding of the result, ``u_dtype *
    (|exact| + bound)``. ``terms`` broadcasts against ``abs_sum``.
    """
    acc = acc_dtype or dtype
    mu = terms.double() * unit_roundoff(acc)
    gamma = torch.where(mu < 1, mu / (1 - mu).clamp_min(1e-300), torch.full_like(mu, float("inf")))
    bound = gamma * abs_sum + terms.double() * torch.finfo(acc).tiny  # gradual underflow: at most tiny per step
    if acc != dtype:
        magnitude = abs_sum if exact is None else exact.abs()
        bound = bound + unit_roundoff(dtype) * (magnitude + bound) + torch.finfo(dtype).tiny
    return bound


def count_wrong(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> int:
    """Elements of ``got`` farther than ``bound`` from the float64 ``ref`` (shape mismatch: all)."""
    if got.shape != ref.shape:
        return max(got.numel(), ref.numel())
    return int(((got.double() - ref).abs() > bound).sum())


def count_unequal(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> int:
    """Elements of the outputs ``got`` that differ from ``want`` (an output of another dtype or shape: all)."""
    if len(got) != len(want):
        return sum(max(t.numel(), 1) for t in (*got, *want))
    wrong = 0
    for g, w in zip(got, want):
        if g.dtype != w.dtype or g.shape != w.shape:
            wrong += max(g.numel(), w.numel(), 1)
        else:
            wrong += int((g != w).sum())
    return wrong


def _progress(msg: str, t0: float) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def copy_bandwidth(nbytes: int, device: torch.device, iters: int = 5) -> float:
    """Measured GB/s of ``Tensor.copy_`` between two warm buffers, read + write bytes."""
    src = torch.ones(max(1, nbytes // 4), device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def _segments(counts: Sequence[int], row_bytes: int) -> List[tuple]:
    # One segment per owner, back to back: a send buffer's layout.
    segs, start = [], 0
    for c in counts:
        segs.append((start, c, start * row_bytes))
        start += c
    return segs


def run(argv: Optional[Sequence[str]] = None) -> int:
    """Run the kernel benchmark; return the exit status (3 if any result was wrong)."""
    p = argparse.ArgumentParser(prog="sparsecomm.bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="number of ids (default 1M)")
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1M)")
    p.add_argument("--d", type=int, default=64, help="row width (default 64)")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf skew of the ids (default 1.1)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0, help="seed of ids and values (default 0)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each contender (default 2)")
    p.add_argument("--iters", type=int, default=7, help="timed interleaved rounds (default 7)")
    p.add_argument("--json")
    p.add_argument("--csv")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    dev = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    gen = torch.Generator().manual_seed(a.seed)
    ids = zipf_ids(a.n, a.rows, a.alpha, seed=a.seed).to(dev)
    values = torch.randn(a.n, a.d, generator=gen, dtype=torch.float64).to(dtype).to(dev)
    table = torch.randn(a.rows, a.d, generator=gen, dtype=torch.float64).to(dtype).to(dev)
    esz = values.element_size()
    row = a.d * esz

    # float64 references and their error bounds.
    uniq, inv, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    u = uniq.numel()
    ref_sums = torch.zeros(u, a.d, dtype=torch.float64, device=dev).index_add_(0, inv, values.double())
    abs_sums = torch.zeros(u, a.d, dtype=torch.float64, device=dev).index_add_(0, inv, values.double().abs())
    # sparsecomm sums fp16/bf16 in float32 and rounds once; torch may round every step.
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    ours_bound = summation_bound(counts[:, None], abs_sums, dtype, acc, ref_sums)
    torch_bound = summation_bound(counts[:, None], abs_sums, dtype)
    copy_gbs = copy_bandwidth(a.n * row, dev)
    print(f"# kernels: n={a.n} rows={a.rows} d={a.d} {a.dtype} zipf({a.alpha}) seed={a.seed} unique={u} "
          f"device={a.device} threads={torch.get_num_threads()} copy bandwidth {copy_gbs:.1f} GB/s (read+write)",
          flush=True)

    def check_coalesce(res, bound) -> int:
        got_ids, got = res
        if not torch.equal(got_ids.long(), uniq.long()):
            return max(got_ids.numel(), u)
        return count_wrong(got, ref_sums, bound)

    def torch_coalesce():
        t = torch.sparse_coo_tensor(ids[None], values, (a.rows, a.d), check_invariants=False).coalesce()
        return t.indices()[0], t.values()

    def unique_index_add():
        uu, ii = torch.unique(ids, return_inverse=True)
        return uu, torch.zeros(len(uu), a.d, device=dev, dtype=dtype).index_add_(0, ii, values)

    # gather-and-pack: the rows of each owner's ids, into a reused send buffer.
    part = ops.partition_rows(ids, None, OWNERS)
    part_counts = part.counts.tolist()
    segs = _segments(part_counts, row)
    send = torch.empty(a.n * row, dtype=torch.uint8, device=dev)
    send_torch = torch.empty_like(send)
    ref_packed = table.index_select(0, ids.index_select(0, part.perm))

    def pack_ours():
        ops.pack_rows(send, table, part.ids, segs)
        return send

    def pack_torch():
        send_torch.view(dtype).view(a.n, a.d).copy_(table.index_select(0, part.ids))
        return send_torch

    def check_packed(buf) -> int:
        return count_wrong(buf.view(dtype).view(a.n, a.d), ref_packed.double(), torch.zeros(()))

    ref_gather = table.index_select(0, ids).double()

    # scatter-add: each contender updates its own table; the check knows how many times it was applied.
    table_terms = torch.zeros(a.rows, dtype=torch.float64, device=dev).index_add_(
        0, ids, torch.ones(a.n, dtype=torch.float64, device=dev))
    delta = torch.zeros(a.rows, a.d, dtype=torch.float64, device=dev).index_add_(0, ids, values.double())
    abs_delta = torch.zeros(a.rows, a.d, dtype=torch.float64, device=dev).index_add_(0, ids, values.double().abs())

    def scatter_contender(name: str, fn: Callable[[torch.Tensor], torch.Tensor], acc_dtype: torch.dtype
                          ) -> Contender:
        state = {"table": table.clone(), "calls": 0}

        def run_once():
            state["calls"] += 1
            return fn(state["table"])

        def check(res) -> int:
            k = state["calls"]
            ref = table.double() + k * delta
            # k applications: each row's old value plus k times its updates (ours: rounded once per call).
            bound = k * summation_bound(table_terms[:, None] + 1, table.double().abs() + k * abs_delta, dtype,
                                        acc_dtype)
            return count_wrong(res, ref, bound)

        return Contender(name, run_once, check)

    def check_partition(res) -> int:
        return (int(not torch.equal(res.counts, part.counts)) + int(not torch.equal(res.ids, part.ids))
                + count_wrong(res.values, values.index_select(0, part.perm).double(), torch.zeros(())))

    coalesced = ops.coalesce_rows(ids, values, a.rows)
    ref_cp = ops.partition_rows(coalesced[0], coalesced[1], OWNERS)

    def check_cp(res) -> int:
        return (int(not torch.equal(res.counts, ref_cp.counts)) + int(not torch.equal(res.ids, ref_cp.ids))
                + count_wrong(res.values, ref_cp.values.double(), torch.zeros(())))

    def two_step_cp():
        i, v = ops.coalesce_rows(ids, values, a.rows)
        return ops.partition_rows(i, v, OWNERS)

    # Owner pooling's index kernels, each against the torch ops it replaces; outputs must be equal exactly.
    def torch_group_by():
        count = torch.bincount(inv, minlength=u)
        return torch.argsort(inv, stable=True), torch.cumsum(count, 0) - count

    ref_group_by = torch_group_by()
    ref_unique_inverse = (uniq, inv)  # torch.unique(ids, sorted=True, return_inverse=True), above
    bag_of = torch.arange(a.n, device=dev) // POOL_BAG
    num_bags = -(-a.n // POOL_BAG)
    pool_scheme, pool_range = ops._owner_map(POOL_OWNERS, "range", a.rows, None, 1)

    def torch_pooled():
        return _library.pooled_request_torch(ids, bag_of, a.rows, POOL_OWNERS, pool_scheme, pool_range, 1,
                                             num_bags)

    ref_pooled = torch_pooled()
    partial_bags = ref_pooled[5].numel()
    # The owner's backward plan: every id an occurrence in a bag of POOL_BAG, pointing at a requested id
    # (drawn) whose group is its distinct row.
    bg_positions = torch.randint(0, max(a.n, 1), (a.n,), generator=torch.Generator().manual_seed(11)).to(dev)
    bg_lengths = torch.bincount(bag_of, minlength=num_bags)

    def torch_bag_groups():
        return _library.bag_groups_torch(inv, bg_positions, bg_lengths, u)

    ref_bag_groups = torch_bag_groups()

    groups = [
        ("coalesce", a.n * (ids.element_size() + row) + u * (ids.element_size() + row), [
            Contender("sparsecomm", lambda: ops.coalesce_rows(ids, values, a.rows),
                      lambda r: check_coalesce(r, ours_bound)),
            Contender("torch coalesce()", torch_coalesce, lambda r: check_coalesce(r, torch_bound)),
            Contender("torch unique+index_add_", unique_index_add, lambda r: check_coalesce(r, torch_bound)),
        ]),
        ("gather", a.n * (ids.element_size() + 2 * row), [
            Contender("sparsecomm", lambda: ops.gather_rows(table, ids),
                      lambda r: count_wrong(r, ref_gather, torch.zeros(()))),
            Contender("torch index_select", lambda: table.index_select(0, ids),
                      lambda r: count_wrong(r, ref_gather, torch.zeros(()))),
        ]),
        (f"gather+pack({OWNERS} peers)", a.n * (ids.element_size() + 2 * row), [
            Contender("sparsecomm", pack_ours, check_packed),
            Contender("torch index_select+copy", pack_torch, check_packed),
        ]),
        ("scatter_add", a.n * (ids.element_size() + row) + 2 * u * row, [
            scatter_contender("sparsecomm", lambda t: ops.scatter_add_rows(t, ids, values), acc),
            scatter_contender("torch index_add_", lambda t: t.index_add_(0, ids, values), dtype),
        ]),
        (f"partition({OWNERS} owners)", a.n * 2 * (ids.element_size() + row), [
            Contender("sparsecomm", lambda: ops.partition_rows(ids, values, OWNERS), check_partition),
            Contender("torch sort+index_select",
                      lambda: (lambda perm: ops.Partition(part.counts, ids[perm], values.index_select(0, perm), perm))(
                          torch.sort(ops.row_owners(ids, OWNERS), stable=True).indices), check_partition),
        ]),
        (f"coalesce+partition({OWNERS})", a.n * (ids.element_size() + row) + u * (ids.element_size() + row), [
            Contender("sparsecomm fused", lambda: ops.coalesce_partition_rows(ids, values, OWNERS, num_rows=a.rows),
                      check_cp),
            Contender("sparsecomm coalesce, partition", two_step_cp, check_cp),
        ]),
        ("group_by", 8 * (2 * a.n + u), [
            Contender("sparsecomm", lambda: ops.group_by(inv, u), lambda r: count_unequal(r, ref_group_by)),
            Contender("torch argsort(stable)+bincount", torch_group_by, lambda r: count_unequal(r, ref_group_by)),
        ]),
        (f"bag_groups(bags of {POOL_BAG})", 8 * (5 * a.n + u), [
            Contender("sparsecomm", lambda: ops.bag_groups(inv, bg_positions, bg_lengths, u),
                      lambda r: count_unequal(r, ref_bag_groups)),
            Contender("torch gather+argsort+repeat_interleave", torch_bag_groups,
                      lambda r: count_unequal(r, ref_bag_groups)),
        ]),
        ("unique_inverse", 8 * (2 * a.n + u), [
            Contender("sparsecomm", lambda: ops.unique_inverse(ids, a.rows),
                      lambda r: count_unequal(r, ref_unique_inverse)),
            Contender("torch unique(sorted, inverse)", lambda: torch.unique(ids, sorted=True, return_inverse=True),
                      lambda r: count_unequal(r, ref_unique_inverse)),
        ]),
        (f"pooled_request({POOL_OWNERS} owners, bags of {POOL_BAG})",
         a.n * (8 + 8 + 8 + 4) + 8 * ref_pooled[0].numel() + 12 * partial_bags, [
            Contender("sparsecomm", lambda: ops.pooled_request(ids, bag_of, POOL_OWNERS, "range", a.rows,
                                                               num_bags=num_bags),
                      lambda r: count_unequal(r, ref_pooled)),
            Contender("torch unique+unique_consecutive", torch_pooled, lambda r: count_unequal(r, ref_pooled)),
        ]),
    ]
    rows: List[Row] = []
    for i, (op, nbytes, contenders) in enumerate(groups, 1):
        _progress(f"kernels: {op} ({i}/{len(groups)}), {len(contenders)} contenders x "
                  f"({a.warmup} warm-up + {a.iters} timed)", t0)
        res = time_interleaved(contenders, warmup=a.warmup, iters=a.iters, device=a.device)
        base = res[contenders[0].name].get("median")
        for c in contenders:
            r = res[c.name]
            med = r.get("median")
            gbs = nbytes / med / 1e9 if med else ""
            rows.append(Row({
                "op": op, "impl": c.name,
                "median_ms": med * 1e3 if med else "error",
                "min_ms": r["min"] * 1e3 if med else "",
                "GB/s": gbs,
                "of_copy": gbs / copy_gbs if med else "",
                "time_vs_sparsecomm": (med / base) if med and base else "",
                "#wrong": int(r["wrong"]),
            }))
            if "error" in r:
                _progress(f"kernels: {op} / {c.name} raised: {r['error']}", t0)
    print_table(rows, f"kernel benchmark (median of interleaved runs; copy bandwidth {copy_gbs:.1f} GB/s)")
    write_outputs(rows, a.json, a.csv)
    wrong = [f"{r.cols['op']} / {r.cols['impl']}" for r in rows if r.cols["#wrong"] != 0]
    if wrong:
        print(f"# WRONG results: {', '.join(wrong)}", flush=True)
        return EXIT_WRONG
    return 0
