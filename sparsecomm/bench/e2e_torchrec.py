"""TorchRec's ``DistributedModelParallel`` as a contender of the end-to-end benchmark (``bench/e2e.py``).

The same DLRM-like model, as TorchRec builds it: the tables in one
``EmbeddingBagCollection`` (ids as a ``KeyedJaggedTensor``), placed by
TorchRec's own planner (on CPU it offers table-wise, column-wise and
data-parallel shardings; its pick is printed), the tables' optimizer fused
into backward (fbgemm), the dense part under DDP with torch's optimizer.
It starts from the same weights as every other method and its first step
is checked against the same float64 reference.

The same optimizer rule on both sides: TorchRec divides the pooled
embeddings' gradients by the world size (``comm_ops``' gradient division,
on by default), so its tables see DDP's averaged gradients; SGD
(``EXACT_SGD``) takes the same learning rate, Adagrad (``EXACT_ADAGRAD``)
the same rate and eps with its accumulators started at the same 0.1 as
torch's. The first step is checked like every method's. fbgemm's CPU
kernels have no Adam: with Adam it is listed as skipped.

Needs ``pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0`` and
TorchRec's pure-Python dependencies (benchmarks/RESULTS.md); without them
the benchmark lists it as skipped and says so.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["missing", "TorchRecDLRM", "build", "batch_input", "local_weights_wrong", "memory_bytes", "bytes_moved"]

DENSE_FEATURES = 16
_INITIAL_ACCUMULATOR = 0.1  # bench/e2e.py's Adagrad


def missing(optimizer: Optional[str] = None) -> Optional[str]:
    """Why TorchRec cannot run here (with ``optimizer``), or None."""
    if optimizer == "adam":
        return "fbgemm's CPU kernels offer no Adam (only exact SGD and exact / row-wise Adagrad)"
    for module in ("torchrec", "fbgemm_gpu"):
        if importlib.util.find_spec(module) is None:
            return (f"{module} is not installed (pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 and "
                    f"its pure-Python dependencies, benchmarks/RESULTS.md)")
    return None


class TorchRecDLRM(nn.Module):
    """bench/e2e.py's DLRM with its tables in one EmbeddingBagCollection (built on the meta device)."""

    def __init__(self, rows: Sequence[int], dim: int) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        super().__init__()
        self.features = [f"f{i}" for i in range(len(rows))]
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=r, feature_names=[f],
                               pooling=PoolingType.SUM) for i, (r, f) in enumerate(zip(rows, self.features))],
            device=torch.device("meta"))
        self.bottom = nn.Sequential(nn.Linear(DENSE_FEATURES, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(dim * (len(rows) + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, kjt: Any, dense: torch.Tensor) -> torch.Tensor:
        pooled = self.ebc(kjt).to_dict()
        return self.top(torch.cat([self.bottom(dense)] + [pooled[f] for f in self.features], 1)).squeeze(1)


def _fused_params(optimizer: str, lr: float) -> Dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if optimizer == "sgd":
        return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}
    return {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": lr, "eps": 1e-10}


def build(base: nn.Module, rows: Sequence[int], dim: int, optimizer: str, optimizers: Dict[str, Any]):
    """``(model, dense optimizer, plan text)``: DMP with TorchRec's own plan, from ``base``'s weights."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    cls, kw = optimizers[optimizer]
    sharder = EmbeddingBagCollectionSharder(fused_params=_fused_params(optimizer, kw["lr"]))
    model = DistributedModelParallel(TorchRecDLRM(rows, dim), device=torch.device("cpu"), sharders=[sharder])
    state = model.state_dict()
    with torch.no_grad():
        for i, table in enumerate(base.tables):
            _copy_shards(state[f"ebc.embedding_bags.t{i}.weight"], table.weight)
        for name, value in base.state_dict().items():
            if not name.startswith("tables."):
                state[name].copy_(value)
        if optimizer == "adagrad":
            for per_table in model.fused_optimizer.state_dict()["state"].values():
                for key, st in per_table.items():
                    if key.endswith("momentum1"):
                        for shard in _shards(st):
                            shard.fill_(_INITIAL_ACCUMULATOR)
    dense = [p for name, p in model.named_parameters() if not name.startswith("ebc.")]
    return model, cls(dense, **kw), str(model.plan)


def _shards(t: Any) -> List[torch.Tensor]:
    if hasattr(t, "local_shards"):
        return [s.tensor for s in t.local_shards()]
    if hasattr(t, "to_local"):
        return [t.to_local()]
    return [t]


def _offsets(t: Any) -> List[Sequence[int]]:
    if hasattr(t, "local_shards"):
        return [s.metadata.shard_offsets for s in t.local_shards()]
    return [[0, 0]]


def _copy_shards(sharded: Any, full: torch.Tensor) -> None:
    for shard, (row, col) in zip(_shards(sharded), _offsets(sharded)):
        shard.copy_(full[row:row + shard.shape[0], col:col + shard.shape[1]])


def batch_input(b: Dict[str, Any], features: int):
    """The benchmark's batch as TorchRec's input: a KeyedJaggedTensor of every table's bags, and the dense part."""
    from torchrec import KeyedJaggedTensor

    ids = b["ids"]
    lengths = torch.cat([torch.full((x.shape[0],), x.shape[1], dtype=torch.int32) for x in ids])
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(features)], values=torch.cat([x.reshape(-1) for x in ids]),
                            lengths=lengths)
    return kjt, b["dense"]


def local_weights_wrong(model: nn.Module, expected: Dict[str, torch.Tensor], tolerance: float) -> int:
    """Tensors (this rank's table shards and the dense parameters) off the float64 reference's step."""
    wrong = 0
    for name, value in model.state_dict().items():
        if "ebc.embedding_bags." in name:
            i = int(name.split(".t")[-1].split(".")[0])
            full = expected[f"tables.{i}.weight"]
            for shard, (row, col) in zip(_shards(value), _offsets(value)):
                ref = full[row:row + shard.shape[0], col:col + shard.shape[1]]
                wrong += int(not torch.allclose(shard.double(), ref, rtol=tolerance, atol=tolerance))
        elif name in expected:
            wrong += int(not torch.allclose(value.double(), expected[name], rtol=tolerance, atol=tolerance))
    return wrong


def memory_bytes(model: nn.Module, dense_optimizer: torch.optim.Optimizer) -> int:
    """This rank's shards, the fused optimizer's state, the dense parameters and their optimizer state."""
    def size(x: Any) -> int:
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        return sum(s.numel() * s.element_size() for s in _shards(x)) if isinstance(x, torch.Tensor) or \
            hasattr(x, "local_shards") else 0

    total = sum(size(v) for v in model.state_dict().values())
    total += size(model.fused_optimizer.state_dict()["state"])
    for s in dense_optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return total


def bytes_moved(batch: int, bag: int, dim: int, tables: int, n: int, dense_bytes: int) -> float:
    """Per rank and direction, table-wise: the ids to each table's owner, pooled rows back, their gradients out.

    (N-1)/N per table of the bags' ids (int64 values + int32 lengths) and of
    the pooled rows (float32), plus the dense part's ring all-reduce.
    """
    if n == 1:
        return 0.0
    per_table = batch * (bag * 8 + 4) + batch * dim * 4
    return (n - 1) / n * tables * per_table + 2 * (n - 1) / n * dense_bytes
