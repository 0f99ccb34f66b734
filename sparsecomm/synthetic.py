"""Seeded synthetic row ids for tests, benchmarks and examples (nothing downloaded)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

__all__ = ["zipf_ids", "uniform_ids"]


def zipf_ids(n: int, num_rows: int, alpha: float = 1.1, seed: int = 0, dtype: torch.dtype = torch.int64,
             shuffle: bool = True) -> torch.Tensor:
    """Draw ``n`` ids in ``[0, num_rows)`` with ``P(rank k) ~ k**-alpha`` (bounded Zipf).

    Args:
        n: number of ids.
        num_rows: table size.
        alpha: skew; 0 is uniform, ~1.1 is typical of word and item frequencies.
        seed: RNG seed: the same arguments give the same ids.
        dtype: int32 or int64.
        shuffle: map frequency ranks to ids through a fixed random permutation,
            so the hot ids are scattered over the table as in real data.

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
        ranks = np.random.default_rng(seed + 0x5EED).permutation(num_rows)[ranks]
    return torch.from_numpy(ranks.astype(np.int64)).to(dtype)


def uniform_ids(n: int, num_rows: int, seed: int = 0, dtype: torch.dtype = torch.int64,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw ``n`` ids uniformly from ``[0, num_rows)`` (seeded)."""
    g = generator or torch.Generator().manual_seed(seed)
    return torch.randint(0, num_rows, (n,), generator=g, dtype=torch.int64).to(dtype)
