"""What one forward of a sample batch shows the planner: each table's distinct ids and bags on this rank."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = ["IdCapture", "Sample", "sample_ids", "sample_problem"]


@dataclasses.dataclass
class Sample:
    """What one forward of a sample batch showed of each table on one rank."""

    ids: Dict[str, torch.Tensor]        # distinct ids per table
    bags: Dict[str, Tuple[int, int]]    # bag tables: (bags looked up, ids in them)


def _bag_count(m: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """``(bags, ids)`` of one ``nn.EmbeddingBag`` call (a 2-D input: its rows; 1-D: its offsets)."""
    ids = args[0]
    if ids.dim() == 2:
        return int(ids.shape[0]), int(ids.numel())
    offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    bags = 0 if offsets is None else int(offsets.numel()) - int(bool(m.include_last_offset))
    return max(0, bags), int(ids.numel())


class IdCapture:
    """Records the ids (and bags) the given tables look up while it is open: forward pre-hooks on their modules.

    What a sample batch's forward shows (:func:`sample_ids`), or what a training
    step's forwards look up (the placement trial measures its sample-batch plan
    on the job's own first step this way). :meth:`close` removes the hooks.
    """

    def __init__(self, modules: Sequence[Tuple[str, nn.Module]]) -> None:
        self._seen: Dict[str, List[torch.Tensor]] = {n: [] for n, _ in modules}
        self._bags: Dict[str, Tuple[int, int]] = {n: (0, 0) for n, m in modules if isinstance(m, nn.EmbeddingBag)}
        self._handles = [m.register_forward_pre_hook(functools.partial(self._grab, name), with_kwargs=True)
                         for name, m in modules]

    def _grab(self, name: str, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self._seen[name].append(args[0].detach().reshape(-1).to("cpu", torch.int64))
        if name in self._bags:
            b, k = _bag_count(module, args, kwargs)
            self._bags[name] = (self._bags[name][0] + b, self._bags[name][1] + k)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def sample(self) -> Sample:
        """What was looked up so far: the distinct ids per table, and the bags of bag tables."""
        return Sample({n: torch.unique(torch.cat(v)) if v else torch.empty(0, dtype=torch.int64)
                       for n, v in self._seen.items()}, dict(self._bags))


def sample_ids(model: nn.Module, modules: Sequence[Tuple[str, nn.Module]], sample_batch: Any) -> Sample:
    """Distinct ids (and bags) each table sees in one forward of ``sample_batch`` on this rank (no gradient)."""
    capture = IdCapture(modules)
    try:
        with torch.no_grad():
            if callable(sample_batch) and not isinstance(sample_batch, (torch.Tensor, nn.Module)):
                sample_batch(model)
            else:
                model(sample_batch)
    finally:
        capture.close()
    return capture.sample()


def sample_problem(error: Exception, sample_batch: Any) -> str:
    """What went wrong running the model on a sample batch, and how a sample batch is passed."""
    how = ("a sample batch is passed to the model as one argument, model(sample_batch); for a forward that takes "
           "several arguments, pass a function that calls the model: sample_batch=lambda m: m(a, b)")
    if callable(sample_batch) and not isinstance(sample_batch, (torch.Tensor, nn.Module)):
        how = "sample_batch is a function: it was called as sample_batch(model)"
    return f"the model could not run on sample_batch ({type(error).__name__}: {error}); {how}"
