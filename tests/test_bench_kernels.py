"""The kernel benchmark's checks: seeded, a tolerance that fits the dtype, exit 3 on a wrong result."""

import torch

from sparsecomm import ops
from sparsecomm.bench import kernels

TINY = ["--n", "3000", "--rows", "400", "--d", "8", "--iters", "1", "--warmup", "3"]


def test_tiny_run_is_correct_and_exits_0(capsys):
    assert kernels.run(TINY) == 0
    out = capsys.readouterr()
    assert "copy bandwidth" in out.out and "WRONG" not in out.out
    assert "(10/10)" in out.err  # progress, one line per op


def test_a_wrong_kernel_makes_the_run_exit_3(monkeypatch, capsys):
    real = ops.coalesce_rows

    def off_by_a_little(ids, values, num_rows=None):
        u, s = real(ids, values, num_rows)
        return u, s * (1 + 1e-4)  # far above fp32 rounding, far below what a loose 1e-4 tolerance would see

    monkeypatch.setattr(ops, "coalesce_rows", off_by_a_little)
    assert kernels.run(TINY) == kernels.EXIT_WRONG
    assert "WRONG results: coalesce / sparsecomm" in capsys.readouterr().out


def test_summation_bound_admits_any_order_and_is_tight():
    g = torch.Generator().manual_seed(0)
    n = 3000
    for dtype, acc in ((torch.float32, torch.float32), (torch.float16, torch.float32),
                       (torch.bfloat16, torch.float32), (torch.float16, torch.float16)):
        x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        exact = x.double().sum()
        bound = kernels.summation_bound(torch.tensor(n), x.double().abs().sum(), dtype, acc, exact)
        for perm in (torch.arange(n), torch.randperm(n, generator=g)):
            # Recursive summation in `acc`, rounding every step, then once to `dtype`.
            got = x[perm].to(acc).cumsum(0)[-1].to(dtype)
            assert abs(got.double() - exact) <= bound, (dtype, acc)
        if acc == torch.float32:
            assert bound < 1e-3 * x.double().abs().sum()  # n u of float32, not vacuous
    # Rounding every step in fp16 over 3000 terms proves nothing (m u > 1): the bound says so.
    assert kernels.summation_bound(torch.tensor(3000), torch.tensor(1.0), torch.float16) == float("inf")
