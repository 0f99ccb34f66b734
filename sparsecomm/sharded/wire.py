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

from typing import Any, Optional

import torch

__all__ = ["Compression", "WIRE_CODES", "WIRE_DTYPES", "check_compression"]

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


class Compression:
    """The ``compression`` attribute of a sharded table (a checked setting; the module docstring says what it does)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else obj.__dict__.get(self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.attr] = check_compression(value)
