"""A newcomer's mistakes explain themselves, on every rank, before anything changes; output fits a terminal."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import sparsecomm
from distributed import expect_value_error, run_ranks


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user_id_embedding_table_of_a_long_name = nn.EmbeddingBag(200_000, 16, sparse=True)
        self.item = nn.Embedding(1000, 16, sparse=True)

    def forward(self, ids: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.user_id_embedding_table_of_a_long_name(ids) + self.item(items)


def test_plan_without_a_process_group_under_a_launcher_says_to_initialize(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"rank 1 of 2, but torch.distributed is not initialized: call "
                                           r"sparsecomm.init_distributed\(\)"):
        sparsecomm.plan(TwoInputs())


def _sample_worker(rank, world):
    ids, items = torch.randint(0, 200_000, (4, 3)), torch.randint(0, 1000, (4,))
    # Rank 1 alone passes a tuple for a two-argument forward: every rank must hear of it.
    return expect_value_error(lambda: sparsecomm.plan(TwoInputs(), (ids, items) if rank == 1
                                                      else (lambda m: m(ids, items))), "sample_batch")


def test_a_sample_batch_that_does_not_fit_forward_fails_on_every_rank_with_the_fix():
    results = run_ranks(2, _sample_worker)
    for r in range(2):
        assert results[r].startswith("sparsecomm.plan: rank 1: the model could not run on sample_batch (TypeError")
        assert "sample_batch=lambda m: m(a, b)" in results[r]


def _plan_text_worker(rank, world):
    ids, items = torch.randint(0, 200_000, (64, 8)), torch.randint(0, 1000, (64,))
    return str(sparsecomm.plan(TwoInputs(), lambda m: m(ids, items)))


@pytest.mark.parametrize("world", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_printed_plan_fits_120_columns_and_numbers_its_reasons(world):
    text = run_ranks(world, _plan_text_worker)[0]
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120, text
    assert any(line.lstrip().startswith("[1] user_id_embedding_table_of_a_long_name:") for line in lines), text
    assert any(line.lstrip().startswith("[2] item:") for line in lines), text


class EarlyUse(nn.Module):
    """Two grouped sharded tables; with ``early`` the first one's result is read before the second is looked up."""

    def __init__(self, early: bool) -> None:
        super().__init__()
        self.early = early
        self.user = sparsecomm.ShardedEmbedding(50, 4)
        self.item = sparsecomm.ShardedEmbedding(30, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        u = self.user(ids)
        if self.early:
            u = u * u.sum()                            # reads the first result: its round runs here, alone
        i = self.item(ids)
        return u + i


@pytest.mark.parametrize("early", [False, True])
def test_a_grouped_round_split_by_an_early_use_warns_once_naming_the_tables(early, recwarn):
    model = EarlyUse(early)
    sparsecomm.sharded.group_tables(model)
    ids = torch.tensor([[1, 2], [3, 1]])
    out = [model(ids) for _ in range(2)]
    split = [w for w in recwarn if "rounds" in str(w.message)]
    assert len(split) == (1 if early else 0), [str(w.message) for w in recwarn]
    if early:
        assert "in 2 rounds ([user] then [item])" in str(split[0].message)
        assert "Look every table up before using any result" in str(split[0].message)
    u = model.user.full_weight()[ids]
    reference = (u * u.sum() if early else u) + model.item.full_weight()[ids]
    assert torch.equal(out[1], reference)              # the warning changes nothing


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.EmbeddingBag(50_000, 16, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.big(ids)


def test_parallelize_takes_the_optimizer_it_trains_with_from_itself_not_from_the_plan(recwarn):
    sgd_bytes = 50_000 * 16 * 4
    model = Tables()
    p = sparsecomm.plan(model)                                   # made for SGD, the default
    model, opt = sparsecomm.parallelize(model, torch.optim.Adagrad, plan=p, lr=0.1)
    applied = getattr(model, "module", model).sparsecomm_plan
    assert applied.optimizer == "Adagrad" and applied["big"].memory_replicated == 2 * sgd_bytes
    assert "optimizer Adagrad" in str(applied)
    assert not [w for w in recwarn if "the plan was made for" in str(w.message)]   # nothing was predicted
    # With predictions from a sample batch: the same, and a warning that they were priced for SGD.
    model = Tables()
    p = sparsecomm.plan(model, torch.tensor([[1, 2], [3, 4]]))
    with pytest.warns(UserWarning, match="the plan was made for SGD and trains Adagrad.*optimizer=Adagrad"):
        sparsecomm.parallelize(model, torch.optim.Adagrad, plan=p, lr=0.1)
    # A budget the plan fitted for SGD but not with Adagrad's state: refused before anything changes.
    model = Tables()
    p = sparsecomm.plan(model, memory_budget=sgd_bytes)
    before = model.big.weight.detach().clone()
    with pytest.raises(ValueError, match=r"made for SGD; with Adagrad's optimizer state its tables take 6.10 MiB "
                                         r"per rank, over the memory budget of 3.05 MiB: make the plan with "
                                         r"optimizer=Adagrad"):
        sparsecomm.parallelize(model, torch.optim.Adagrad, plan=p, lr=0.1)
    assert isinstance(model.big, nn.EmbeddingBag) and torch.equal(model.big.weight, before)


class Ranker(nn.Module):
    """A table and an MLP: what a wrapper around it, given to plan or parallelize, must not change."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.item = nn.Embedding(1000, 8, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.item(items))


class Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.ranker = inner

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return self.ranker(items)


def _wrappers():
    """``(what, wrap)``: each wrapper plan and parallelize refuse (wrap is called on every rank)."""
    def fsdp2(m):
        fully_shard(m)
        return m

    return [("the model is a DistributedDataParallel: pass the unwrapped model (its .module)", DistributedDataParallel),
            ("the model is a FullyShardedDataParallel: pass the unwrapped model (its .module)",
             lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu"))),
            ("the model is fully_shard-ed at its root: pass it before fully_shard(model)", fsdp2),
            ("its submodule 'ranker' is a DistributedDataParallel: pass the model with 'ranker' unwrapped",
             lambda m: Holder(DistributedDataParallel(m)))]


def _snapshot(model: nn.Module):
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    return [(n, type(m)) for n, m in model.named_modules()], state


def _wrapped_worker(rank, world):
    out = []
    for what, wrap in _wrappers():
        for who, call in (("sparsecomm.plan", lambda m: sparsecomm.plan(m, torch.randint(0, 1000, (4,)))),
                          ("sparsecomm.parallelize", lambda m: sparsecomm.parallelize(m, torch.optim.SGD, lr=0.1))):
            model = wrap(Ranker())
            modules, state = _snapshot(model)
            with pytest.raises(TypeError) as err:
                call(model)
            after_modules, after = _snapshot(model)
            assert after_modules == modules and all(torch.equal(after[k], v) for k, v in state.items()), (who, what)
            out.append(str(err.value))
            assert str(err.value).startswith(f"{who}: rank 0: {what}"), (str(err.value), who, what)
    return out


def test_a_wrapped_model_is_refused_on_every_rank_before_anything_changes():
    results = run_ranks(2, _wrapped_worker)
    assert results[0] == results[1] and len(results[0]) == 8, results
    assert all("parallelize wraps the dense part itself" in m or "dense='fsdp'" in m for m in results[0])
