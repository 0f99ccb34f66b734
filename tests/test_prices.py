"""The planner's prices (``sparsecomm.prices``): the optimizer's work per row measured in the job, else a constant.

With peers and a sample batch, ``sparsecomm.plan`` times the optimizer's
rule on every table width and the link, takes the slowest rank's numbers,
and prices each table's optimizer work with them: the same plan and prices
on every rank, said in the reasons. Without peers the documented constant
prices it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import sparsecomm
from sparsecomm.planner import TablePlan
from sparsecomm.prices import OPTIMIZER_BYTE_PRICE, JobPrices, predict, time_rows

from distributed import spawned_fixture


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.EmbeddingBag(200_000, 16, mode="sum", sparse=True)
        self.wide = nn.Embedding(100_000, 32, sparse=True)
        self.mlp = nn.Linear(48, 1)

    def forward(self, x):
        return self.mlp(torch.cat([self.big(x), self.wide(x).sum(1)], 1))


def sample(rank):
    return torch.randint(0, 5000, (64, 4), generator=torch.Generator().manual_seed(rank))


def case_measured(rank, world, optimizer):
    p = sparsecomm.plan(Model(), sample(rank), optimizer=optimizer)
    assert p.latency_bytes and p.latency_bytes > 0
    out = {}
    for name, t in p.tables.items():
        assert t.measured_optimizer and t.optimizer_row_bytes > 0, (name, t)
        out[name] = (t.optimizer_row_bytes, t.bytes_replicated, t.bytes_sharded, t.placement, t.scheme, t.owner)
    return out


CASES = [(f"measured-{o}", case_measured, (o,)) for o in ("SGD", "Adagrad", "Adam")]
spawned = spawned_fixture(CASES, worlds=(2,))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_rank_plans_with_the_same_measured_prices(spawned, case):
    world, out = spawned
    results = [out[r][case] for r in range(world)]
    assert all(r == results[0] for r in results), results


def test_one_process_prices_with_the_constant():
    p = sparsecomm.plan(Model(), sample(0), optimizer="Adagrad")
    for t in p.tables.values():
        assert not t.measured_optimizer
        assert t.optimizer_row_bytes == pytest.approx(4 * t.embedding_dim * 4 * OPTIMIZER_BYTE_PRICE)


@pytest.mark.parametrize("optimizer", ["SGD", "Adagrad", "Adam"])
def test_a_row_is_timed_and_priced_in_link_bytes(optimizer):
    seconds = time_rows(optimizer, 16, torch.float32, rows=512)
    assert 0 < seconds < 1e-3
    prices = JobPrices(latency_bytes=1e4, bytes_per_s=1e8, row_s={(16, "float32"): seconds})
    t = TablePlan("t", "EmbeddingBag", 1000, 16, "float32")
    predict(t, 64, 2, [100, 80], 150, optimizer, prices)
    assert t.measured_optimizer and t.optimizer_row_bytes == pytest.approx(seconds * 1e8)
    # the replica updates all 150 distinct rows of the step, each owner half of them: the optimizer term differs
    # by 150 - 75 rows at the measured price on top of the link bytes
    assert t.bytes_replicated > 150 * t.optimizer_row_bytes and t.bytes_sharded > 75 * t.optimizer_row_bytes
    with pytest.raises(ValueError, match="no owner-side twin"):
        time_rows("RMSprop", 16, torch.float32)
