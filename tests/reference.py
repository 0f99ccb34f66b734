"""A model trained under DDP + the hook beside the same model trained in one process on every rank's batch."""

import copy
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm


def hook_against_single(base: nn.Module, overrides: Dict[str, str], data: Callable[[int, int], Tuple],
                        rank: int, world: int, lr: float, steps: int = 5) -> Tuple[float, List[str]]:
    """Train ``base`` under ``register(overrides=...)`` and alone on all ranks' batches ``data(rank, step)``.

    Returns:
        The largest parameter difference after ``steps`` SGD steps (MSE loss),
        and the hook's paths that carried traffic.
    """
    single = copy.deepcopy(base)
    ours = DDP(copy.deepcopy(base))
    state = sparsecomm.register(ours, overrides=overrides)
    opts = [torch.optim.SGD(ours.parameters(), lr=lr), torch.optim.SGD(single.parameters(), lr=lr)]
    for step in range(steps):
        whole = tuple(torch.cat(z) for z in zip(*[data(r, step) for r in range(world)]))
        for model, opt, (x, y) in ((ours, opts[0], data(rank, step)), (single, opts[1], whole)):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(ours.module.parameters(), single.parameters()))
    return diff, sorted(state.stats)
