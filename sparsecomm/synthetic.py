"""Seeded synthetic row ids for tests, benchmarks and examples (nothing downloaded)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

__all__ = ["zipf_ids", "uniform_ids"]


def zipf_ids(n: int, num_rows: int, alpha: float = 1.1, seed: int = 0, dtype: torch.dtype = torch.int64,
             shuffle: bool = True, popularity_seed: int = 0) -> torch.Tensor:
    """Draw ``n`` ids in ``[0, num_rows)`` with ``P(rank k) ~ k**-alpha`` (bounded Zipf).

    Args:
        n: number of ids.
        num_rows: table size.
        alpha: skew; 0 is uniform, ~1.1 is typical of word and item frequencies.
        seed: RNG seed of the draw: the same arguments give the same ids.
        dtype: int32 or int64.
        shuffle: map frequency ranks to ids through a random permutation, so
            the hot ids are scattered over the table as in real data.
        popularity_seed: seed of that permutation, independent of ``seed``:
            draws with different seeds (e.g. one per rank) share the same hot
            ids, as the workers of one job share the same popular items.

    Returns:
        ``(n,)`` tensor of ids.
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -float(alpha)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), num_rows - 1)
    if shuffle:
        ranks = _popularity(num_rows, popularity_seed)[ranks]
    return torch.from_numpy(ranks.astype(np.int64)).to(dtype)


_PERMS: dict = {}


def _popularity(num_rows: int, seed: int) -> np.ndarray:
    # Cached: a million-row permutation costs more than most draws.
    key = (num_rows, seed)
    if key not in _PERMS:
        if len(_PERMS) > 8:
            _PERMS.clear()
        _PERMS[key] = np.random.default_rng(0x5EED + seed).permutation(num_rows)
    return _PERMS[key]


def uniform_ids(n: int, num_rows: int, seed: int = 0, dtype: torch.dtype = torch.int64,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw ``n`` ids uniformly from ``[0, num_rows)`` (seeded)."""
    g = generator or torch.Generator().manual_seed(seed)
    return torch.randint(0, num_rows, (n,), generator=g, dtype=torch.int64).to(dtype)
