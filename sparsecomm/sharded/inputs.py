"""The checks of a sharded table's lookup input, made before anything is exchanged.

None of them raises: a bad input must still reach the round's first
collective, whose metadata carries this rank's verdict
(:class:`~sparsecomm.collectives.sharded_wire.InputStatus`) so that every
rank raises together. Everything ``F.embedding`` / ``F.embedding_bag``
would refuse after the exchange (on this rank only) is refused here, before it.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from sparsecomm.collectives.sharded_wire import InputStatus
from sparsecomm.types import WireStatus

__all__ = ["check_ids", "bad_input", "check_bag_input", "bag_lengths"]


def check_ids(ids: Any, num_embeddings: int, device: torch.device, name: str) -> Tuple[torch.Tensor, InputStatus]:
    """The flat, contiguous int64 ids of a lookup and the verdict on them (empty ids unless OK).

    ``name`` (the table's class) starts this rank's own message.
    """
    if not isinstance(ids, torch.Tensor):
        return _none(device), bad_input(f"{name}: input must be a tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int32, torch.int64):
        return _none(device), bad_input(f"{name}: input must be int32 or int64, got {ids.dtype}")
    if ids.device != device:
        return _none(device), bad_input(f"{name}: input is on {ids.device} but the table is on {device}")
    flat = ids.reshape(-1)
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= num_embeddings:
            bad = lo if lo < 0 else hi
            return flat.new_empty(0, dtype=torch.int64), InputStatus(
                WireStatus.ID_RANGE, bad,
                f"{name}: input contains id {bad}, outside [0, {num_embeddings}); nothing was exchanged")
    return flat.to(torch.int64).contiguous(), InputStatus()   # a strided input's ids, laid out for the kernels


def _none(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def bad_input(message: str) -> InputStatus:
    """The verdict on an input that is not valid (type, dtype, device, offsets): ``BAD_INPUT``."""
    return InputStatus(WireStatus.BAD_INPUT, 0, message)


def check_bag_input(input: Any, offsets: Any, per_sample_weights: Any, *, mode: str, include_last_offset: bool,
                    weight: torch.Tensor) -> Optional[str]:
    """What is wrong with a bag lookup's shape, offsets or per-sample weights, or None.

    ``mode`` and ``include_last_offset`` as the table's; ``weight``: its
    shard (the device and dtype the inputs must have). The ids themselves
    are :func:`check_ids`'s.
    """
    if not isinstance(input, torch.Tensor):
        return None  # reported by check_ids
    if input.dim() == 2:
        if offsets is not None:
            return "offsets must be None when input is 2-D (B, L)"
    elif input.dim() == 1:
        problem = _offsets_problem(input, offsets, include_last_offset, weight.device)
        if problem:
            return problem
    else:
        return f"input must be 1-D (with offsets) or 2-D (B, L), got shape {tuple(input.shape)}"
    if per_sample_weights is not None:
        return _weights_problem(input, per_sample_weights, mode, weight)
    return None


def _offsets_problem(input: torch.Tensor, offsets: Any, include_last_offset: bool, device: torch.device
                     ) -> Optional[str]:
    if offsets is None:
        return "offsets are required when input is 1-D"
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        return "offsets must be a 1-D int32/int64 tensor"
    if offsets.device != device:
        return f"offsets are on {offsets.device} but the table is on {device}"
    if include_last_offset and offsets.numel() == 0:
        return "include_last_offset=True needs at least one offset"
    if offsets.numel():
        if int(offsets[0]) != 0:
            return f"offsets[0] must be 0, got {int(offsets[0])}"
        if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > input.numel():
            return f"offsets must be non-decreasing and at most len(input) = {input.numel()}"
        if include_last_offset and int(offsets[-1]) != input.numel():
            # torch documents this as the input's length; its embedding_bag backward reads out of
            # bounds when ids follow the last offset (garbage gradients, or an IndexError when sparse).
            return (f"include_last_offset=True: the last offset must be len(input) = {input.numel()}, "
                    f"got {int(offsets[-1])}")
    return None


def _weights_problem(input: torch.Tensor, per_sample_weights: Any, mode: str, weight: torch.Tensor
                     ) -> Optional[str]:
    if mode != "sum":
        return f"per_sample_weights need mode='sum', not {mode!r}"
    if not isinstance(per_sample_weights, torch.Tensor) or per_sample_weights.shape != input.shape:
        return "per_sample_weights must be a tensor of the input's shape"
    if per_sample_weights.dtype != weight.dtype:
        return f"per_sample_weights must have the table's dtype {weight.dtype}, got {per_sample_weights.dtype}"
    if per_sample_weights.device != weight.device:
        return f"per_sample_weights are on {per_sample_weights.device} but the table is on {weight.device}"
    return None


def bag_lengths(input: torch.Tensor, offsets: Optional[torch.Tensor], n: int, include_last_offset: bool,
                device: torch.device) -> torch.Tensor:
    """Ids per bag of a checked bag input (the ``n`` flat ids are the bags' ids one bag after the other)."""
    if input.dim() == 2:
        return torch.full((input.shape[0],), input.shape[1], dtype=torch.int64, device=device)
    offsets = offsets.to(torch.int64)
    if include_last_offset:
        return offsets[1:] - offsets[:-1]
    return torch.diff(offsets, append=torch.tensor([n], dtype=torch.int64, device=device))
