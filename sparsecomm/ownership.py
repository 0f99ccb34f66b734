"""Row ownership: which rank owns each row of a table, named once for Python.

A scheme maps a row id to one of N owners (docs/DESIGN.md, "Ownership"):

- ``hash``: ``splitmix64(id) mod N``: balanced under Zipf skew and for
  consecutive ids (the default);
- ``range``: ``id // range_size`` with ``range_size = ceil(V / N)``:
  contiguous blocks, an owner's rows are one slice;
- ``table``: every row on one ``owner`` (table-wise placement: a lookup
  talks to one rank, which can pool whole bags).

The kernels (``csrc/owner_map.h``, shared by the CPU and CUDA sources) compute
the owner from a scheme *code*; this module is the one place that turns a
scheme's name into that code and back, validates it, and derives a range
scheme's block size. Every rank runs the same arithmetic, so every rank agrees
on every row's owner without talking.

:class:`OwnerMap` is a whole map as the kernels take it (scheme code, owner
count, range size or owner, stride), built and validated here for :mod:`sparsecomm.ops`
and :mod:`sparsecomm._cuda`.

Adding a scheme: a member of :class:`~sparsecomm.types.PartitionScheme`, its
code in ``_CODES`` here, and its owner function in ``csrc/owner_map.h``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

from sparsecomm.types import PartitionScheme

__all__ = ["PartitionScheme", "scheme_of", "scheme_code", "scheme_from_code", "range_size", "owner_range_size",
           "describe_code", "OwnerMap"]

# The code each scheme has in the kernels and on the wire (csrc/owner_map.h: SPARSECOMM_SCHEME_*).
_CODES = {PartitionScheme.HASH: 0, PartitionScheme.RANGE: 1, PartitionScheme.TABLE: 2}
_NAMES = {code: scheme for scheme, code in _CODES.items()}


def scheme_of(scheme: Union[str, PartitionScheme]) -> PartitionScheme:
    """The scheme named by ``scheme``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return PartitionScheme(scheme)
    except ValueError:
        known = ", ".join(repr(s.value) for s in PartitionScheme)
        raise ValueError(f"scheme must be one of {known}, got {scheme!r}") from None


def scheme_code(scheme: Union[str, PartitionScheme]) -> int:
    """The kernels' (and the wire's) code of ``scheme``."""
    return _CODES[scheme_of(scheme)]


def scheme_from_code(code: int) -> PartitionScheme:
    """The scheme a code stands for.

    Raises:
        ValueError: no scheme has this code (a peer of another version, or corrupted metadata).
    """
    try:
        return _NAMES[int(code)]
    except KeyError:
        raise ValueError(f"no partition scheme has code {code!r} (known: {sorted(_NAMES)})") from None


def describe_code(code: int) -> str:
    """A scheme code for an error message: its name, or the raw number when no scheme has it."""
    scheme = _NAMES.get(code)
    return scheme.value if scheme is not None else str(code)


def range_size(num_rows: int, num_owners: int) -> int:
    """Rows per owner under the range scheme: ``ceil(V / N)``, at least 1."""
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    return max(1, -(-int(num_rows) // int(num_owners)))


def owner_range_size(scheme: Union[str, PartitionScheme], num_owners: int, num_rows: Optional[int],
                     given: Optional[int] = None, owner: Optional[int] = None) -> int:
    """The parameter the kernels take for ``scheme`` (their ``range_size`` argument).

    Range scheme: ``given``, else ``ceil(V / N)``; table scheme: ``owner``,
    the rank that holds every row; hash scheme: 1 (unused).

    Raises:
        ValueError: the range scheme with neither ``given`` nor ``num_rows``, or a ``given`` below 1; the table
            scheme without an owner in ``[0, num_owners)``.
    """
    kind = scheme_of(scheme)
    if kind is PartitionScheme.TABLE:
        if not isinstance(owner, int) or isinstance(owner, bool) or not 0 <= owner < num_owners:
            raise ValueError(f"scheme='table' needs owner, the rank holding the table, in [0, {num_owners}); "
                             f"got {owner!r}")
        return owner
    if kind is not PartitionScheme.RANGE:
        return 1
    if given is None:
        if num_rows is None:
            raise ValueError("scheme='range' needs num_rows (or range_size)")
        return range_size(num_rows, num_owners)
    if given < 1:
        raise ValueError(f"range_size must be >= 1, got {given}")
    return int(given)


class OwnerMap(NamedTuple):
    """An owner map as the kernels take it: ``owner(id) = (bucket(id) // stride) % num_owners``.

    The fields are in the order of the kernels' arguments (``csrc/owner_map.h``'s
    ``OwnerMap``), so ``op(..., *owner_map)`` passes them.

    Attributes:
        num_owners: owners (ranks), >= 1.
        scheme: the scheme's code (:func:`scheme_code`).
        range_size: rows per bucket under the range scheme, >= 1; the owner of every row under the table
            scheme, >= 0; 1 under the hash scheme, which ignores it.
        stride: consecutive buckets that map to one owner, >= 1.
    """

    num_owners: int
    scheme: int
    range_size: int
    stride: int

    @classmethod
    def of(cls, num_owners: int, scheme: Union[str, PartitionScheme], num_rows: Optional[int] = None,
           range_size: Optional[int] = None, stride: int = 1, owner: Optional[int] = None) -> "OwnerMap":
        """The map that :func:`sparsecomm.ops.partition_rows`' owner arguments name.

        Args:
            num_owners: a positive int.
            scheme: a scheme's name.
            num_rows: the table's rows ``V``: the range scheme's default ``range_size`` is ``ceil(V / N)``.
            range_size: the range scheme's bucket size, overriding that default.
            stride: a positive int.
            owner: the table scheme's owner, in ``[0, num_owners)`` (other schemes ignore it).

        Raises:
            ValueError: naming the bad argument.
        """
        if not isinstance(num_owners, int) or num_owners < 1:
            raise ValueError(f"num_owners must be a positive int, got {num_owners!r}")
        code = scheme_code(scheme)
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be a positive int, got {stride!r}")
        return cls(num_owners, code, owner_range_size(scheme, num_owners, num_rows, range_size, owner), stride)

    def check(self) -> "OwnerMap":
        """Return this map if the kernels can evaluate it (``owner_map_error`` in ``csrc/owner_map.h``).

        Raises:
            ValueError: an unknown scheme code, a size below 1 that the map would divide by, or a negative owner.
        """
        scheme = scheme_from_code(self.scheme)
        if self.num_owners < 1:
            raise ValueError(f"num_owners must be >= 1, got {self.num_owners}")
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if scheme is PartitionScheme.RANGE and self.range_size < 1:
            raise ValueError(f"range_size must be >= 1, got {self.range_size}")
        if scheme is PartitionScheme.TABLE and self.range_size < 0:
            raise ValueError(f"the table scheme's owner must be >= 0, got {self.range_size}")
        return self
