"""All-to-all through shared memory, for gloo groups whose ranks share one host.

gloo's all-to-all goes through TCP sockets and two threads of its own per
process; inside a training step on a busy host every hand-off between those
threads waits for a core, which costs far more than copying the bytes
(``docs/DESIGN.md``, "Shared-memory all-to-all"; figures in
``benchmarks/RESULTS.md``). When every rank of a gloo group runs on the same host, the
library's synchronous all-to-alls (:func:`sparsecomm.collectives.transport.all_to_all`)
go through one shared segment instead: a slot per ordered pair of ranks,
filled and emptied chunk by chunk by the callers themselves (C++:
``csrc/shm_alltoall.cpp``).

- Set up on a group's first synchronous CPU all-to-all (collective: every rank
  of the group makes that call at the same point, as for any collective).
  Used only when every rank agrees: all on Linux, one host (same host name,
  boot id, network and pid namespaces), ``SPARSECOMM_SHM`` not ``0`` on any rank, and every rank could
  map the segment; otherwise the group keeps gloo, decided the same on all.
- The segment is a ``/dev/shm`` file that rank 0 creates with every page
  reserved (a full ``/dev/shm`` fails the set-up, not a later write) and
  unlinks as soon as every rank mapped it: nothing is left behind when a
  process dies.
- Honours the group's timeout; a waiting rank checks every 100 ms that the
  peers it waits for are alive, and a rank that fails (timeout, dead peer,
  sizes that disagree) marks the segment failed: every peer in or entering an
  all-to-all of the group raises at once.
- Asynchronous all-to-alls (a prefetched request) stay on gloo: they run on
  gloo's own thread while the caller goes on.
"""

from __future__ import annotations

import os
import sys
import uuid
import warnings
import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.groups import group_key, group_timeout
from sparsecomm.collectives.objects import all_gather_objects

__all__ = ["ENV_VAR", "Transport", "transport", "run", "run_segments", "active"]

# "0" turns the shared-memory all-to-all off (on any rank: then on every rank of the group).
ENV_VAR = "SPARSECOMM_SHM"
# One slot per ordered pair of ranks; the segment stays within _MAX_SEGMENT (larger messages go in chunks).
_SLOT_BYTES = 1 << 20
_MIN_SLOT_BYTES = 64 << 10
_MAX_SEGMENT = 48 << 20   # below Docker's default 64 MB /dev/shm, with room for others

class Transport(NamedTuple):
    """A group's shared-memory all-to-all: the mapped segment, and the group's timeout (fixed at creation)."""

    segment: object        # sparsecomm._C.ShmAllToAll
    world: int
    timeout_seconds: float


# Per process group (the object; WORLD for None): its transport, or None where the group keeps gloo. Weak keys:
# holding a group here would keep it (and gloo's threads) alive past destroy_process_group, into interpreter
# shutdown, where a gloo thread releasing a finished collective's tensors aborts the process.
_TRANSPORTS: "weakref.WeakKeyDictionary[object, Optional[Transport]]" = weakref.WeakKeyDictionary()


def _host_id() -> str:
    """This host as far as sharing memory goes: host name, boot id, network and pid namespaces (ranks in
    separate network namespaces are emulated hosts, as in ``benchmarks/cluster.py``: their traffic must take
    the emulated links, so they count as different hosts; ranks in separate pid namespaces could not check
    that their peers are alive)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    spaces = []
    for ns in ("net", "pid"):   # pid: a peer's pid must mean the same process here (its liveness is checked)
        try:
            spaces.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            spaces.append("")
    return "/".join([os.uname().nodename, boot, *spaces])


def slot_bytes(world: int) -> int:
    """Bytes per channel slot for ``world`` ranks (1 MiB; less for large worlds, so that the segment's
    ``world * (world - 1)`` slots stay within 48 MiB up to 28 ranks; 64 KiB at least)."""
    per_pair = _MAX_SEGMENT // max(1, world * (world - 1))
    return max(_MIN_SLOT_BYTES, min(_SLOT_BYTES, per_pair // 4096 * 4096))


def active(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group``'s all-to-alls already go through shared memory (False before its first one)."""
    return _TRANSPORTS.get(group_key(group)) is not None


def transport(group: Optional[dist.ProcessGroup]) -> Optional[Transport]:
    """``group``'s shared-memory transport, or None (gloo); sets it up on the first call (collective)."""
    key = group_key(group)
    if key in _TRANSPORTS:
        return _TRANSPORTS[key]
    _TRANSPORTS[key] = None
    if dist.get_backend(group) != "gloo":
        return None
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if n == 1:
        return None
    wanted = os.environ.get(ENV_VAR, "1") != "0" and sys.platform.startswith("linux")
    peers = group if group is not None else dist.group.WORLD   # all_gather_objects reads None as "no peers"
    infos = all_gather_objects((wanted, _host_id()), peers)
    if not all(w for w, _ in infos) or len({h for _, h in infos}) != 1:
        return None
    slot = slot_bytes(n)
    path, made, error = None, None, None
    if me == 0:
        path = f"/dev/shm/sparsecomm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            made = _make(path, True, me, n, slot)
        except Exception as exc:  # noqa: BLE001 - any failure here must reach the peers as "no", not escape
            error = str(exc)
            if os.path.exists(path):
                os.unlink(path)   # created, then could not be reserved or mapped
            path = None
    path = all_gather_objects(path, peers)[0]
    if path is not None and me != 0:
        try:
            made = _make(path, False, me, n, slot)
        except Exception as exc:  # noqa: BLE001 - as above
            error = str(exc)
    if made is None and error is None:
        error = "rank 0 could not create the segment"
    errors = all_gather_objects(error if made is None else None, peers)
    if me == 0 and path is not None:
        os.unlink(path)  # every rank has it mapped (or gave up): nothing stays in /dev/shm
    failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if failed is not None:
        if me == 0:
            warnings.warn(f"sparsecomm: the shared-memory all-to-all is unavailable on this group (rank {failed[0]}: "
                          f"{failed[1]}); its all-to-alls use gloo", RuntimeWarning, stacklevel=3)
        return None
    timeout = group_timeout(group)
    _TRANSPORTS[key] = Transport(made, n, timeout.total_seconds() if timeout is not None else 1800.0)
    return _TRANSPORTS[key]


def _make(path: str, create: bool, rank: int, world: int, slot: int):
    from sparsecomm import _C

    return _C.ShmAllToAll(path, create, rank, world, slot)


def _split_bytes(t: torch.Tensor, splits: Optional[List[int]], n: int) -> List[int]:
    rows = t.shape[0] if t.dim() else 1
    row_bytes = t.numel() * t.element_size() // rows if rows else 0
    if splits is None:
        if rows % n:
            raise ValueError(f"all_to_all: {rows} rows do not split evenly over {n} ranks")
        return [rows // n * row_bytes] * n
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"all_to_all: splits {splits} do not cover {rows} rows over {n} ranks")
    return [int(s) * row_bytes for s in splits]


def run(shm: Transport, recv: torch.Tensor, send: torch.Tensor, recv_splits: Optional[List[int]],
        send_splits: Optional[List[int]]) -> None:
    """``all_to_all_single(recv, send, recv_splits, send_splits)`` through ``shm`` (CPU tensors)."""
    s_bytes, r_bytes = _split_bytes(send, send_splits, shm.world), _split_bytes(recv, recv_splits, shm.world)
    src = send.contiguous()
    dst = recv if recv.is_contiguous() else torch.empty_like(recv, memory_format=torch.contiguous_format)
    shm.segment.run(src.data_ptr(), s_bytes, dst.data_ptr(), r_bytes, shm.timeout_seconds)
    if dst is not recv:
        recv.copy_(dst)


def run_segments(shm: Transport, send: List[List[Tuple[int, int]]], recv: List[List[Tuple[int, int]]]) -> None:
    """One all-to-all through ``shm`` whose messages are lists of ``(address, bytes)`` pieces: ``send[j]``
    what goes to rank j, in order; ``recv[j]`` where rank j's message lands. The caller keeps the memory
    alive and writable for the call."""
    shm.segment.run_segments(send, recv, shm.timeout_seconds)
