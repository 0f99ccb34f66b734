"""A sharded table's rows on the wire: its ``compression`` setting, checked, and the code its fingerprint carries.

``compression`` None (exact), ``"bf16"`` or ``"fp16"`` is the dtype the
table's rows, partial pooled bags and gradient rows travel in between ranks
(:mod:`sparsecomm.sharded.lookup` casts them; what arrives is cast back to
the table's dtype before it is used or summed). Every rank must set the same
value, between steps (``group_tables(..., compression=)`` and
``parallelize(..., sparse_compression=)`` do): the code joins the table's
fingerprint, so a round on ranks that disagree raises ``ValueError`` on every rank.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["Compression", "WIRE_CODES", "WIRE_DTYPES", "check_compression", "with_compression", "to_wire",
           "from_wire"]

# A wire setting's dtype, and its code in a table's fingerprint (0: the table's own dtype).
WIRE_DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}
WIRE_CODES = {None: 0, "fp16": 1, "bf16": 2}


def check_compression(value: Any) -> Optional[str]:
    """``value`` as a wire setting (``"none"`` reads as None); ``ValueError`` for anything else."""
    if value == "none":
        return None
    if not isinstance(value, (str, type(None))) or value not in WIRE_CODES:
        raise ValueError(f"compression must be 'bf16', 'fp16' or None, got {value!r}")
    return value


def with_compression(hook_options: Optional[Dict[str, Any]], compression: Optional[str]) -> Dict[str, Any]:
    """The DDP hook's options with ``sparse_compression=compression`` for the replicated tables' rows, unless they
    set their own (``sparse_compression``, or a ``config`` that has one): ``parallelize`` and ``replan`` both wrap."""
    options = dict(hook_options or {})
    if compression is not None and "sparse_compression" not in options and \
            getattr(options.get("config"), "sparse_compression", None) is None:
        options["sparse_compression"] = compression
    return options


class Compression:
    """The ``compression`` attribute of a sharded table (a checked setting; the module docstring says what it does)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else obj.__dict__.get(self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        value = check_compression(value)
        busy = obj.table_set.busy() if "_set" in obj.__dict__ else None
        if busy is not None and value != obj.__dict__.get(self.attr):   # its rows would travel in two dtypes
            raise ValueError(f"compression cannot change now: {busy}; set it between steps")
        obj.__dict__[self.attr] = value


def to_wire(tables: Sequence[Any], blocks: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each table's float rows in its wire dtype (``compression``) where they travel to peers; the rest as they are."""
    return [b.to(t.wire_dtype) if t.wire_dtype is not None and t.group is not None and b.is_floating_point() else b
            for t, b in zip(tables, blocks)]


def from_wire(tables: Sequence[Any], blocks: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Rows that arrived in a table's wire dtype back in the table's own, before anything uses or sums them."""
    return [b.to(t.local_weight.dtype) if b.is_floating_point() and b.dtype != t.local_weight.dtype else b
            for t, b in zip(tables, blocks)]
