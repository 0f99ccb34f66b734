"""``collectives.objects.all_gather_objects``: every rank's object, in one all-gather when they are small.

On real gloo ranks (worlds 2 and 3): small objects, one rank's large
object among small ones, tensors inside, against what each rank gave; the
number of all-gathers (one when every object fits the first, two
otherwise); a peer that announces an impossible size (too large,
negative) makes every other rank raise instead of allocating from it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sparsecomm.collectives import objects
from sparsecomm.collectives.objects import INLINE_BYTES, all_gather_objects
from distributed import spawned_fixture


def _mine(rank, big):
    """Rank ``rank``'s object: a verdict and counts, or (``big``) one over the first all-gather's room."""
    if big:
        return {"rank": rank, "rows": torch.arange(INLINE_BYTES + 7 * rank, dtype=torch.int64)}
    return (None if rank else "rank 0 refuses", [rank] * (rank + 1), ("table", rank))


def _counted(fn):
    """``fn()`` and how many all-gathers it made."""
    calls, real = [], dist.all_gather
    dist.all_gather = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        return fn(), len(calls)
    finally:
        dist.all_gather = real


def case_objects(rank, world):
    for bigs in ([], [world - 1], list(range(world))):
        got, gathers = _counted(lambda: all_gather_objects(_mine(rank, rank in bigs), dist.group.WORLD))
        assert gathers == (2 if bigs else 1), (bigs, gathers)
        for r, theirs in enumerate(got):
            want = _mine(r, r in bigs)
            if r in bigs:
                assert theirs["rank"] == r and torch.equal(theirs["rows"], want["rows"])
            else:
                assert theirs == want, (r, theirs, want)
    return True


def case_bad_peer(rank, world):
    """Rank 0 sends headers announcing 2**40 bytes, then -5; every other rank raises, naming it, and allocates
    nothing from it."""
    for size in (1 << 40, -5):
        if rank == 0:
            first = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
            first[:8] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
            dist.all_gather([torch.empty_like(first) for _ in range(world)], first)
            continue
        with pytest.raises(ValueError, match=f"rank 0 announced a pickled object of {size} bytes"):
            all_gather_objects("fine", dist.group.WORLD)
    return True


CASES = [("objects", case_objects, ()), ("bad-peer", case_bad_peer, ())]
spawned = spawned_fixture(CASES)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_on_ranks(spawned, case):
    world, out = spawned
    assert all(out[r][case] for r in range(world)), f"world {world}, {case}"


def test_no_peers():
    assert all_gather_objects({"a": 1}, None) == [{"a": 1}]
    assert objects.world(None) == (0, 1)
