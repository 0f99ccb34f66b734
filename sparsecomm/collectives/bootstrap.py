"""Start torch.distributed from whatever launched this process: torchrun, mpirun, srun, or nothing."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from sparsecomm.collectives import groups
from sparsecomm.collectives.futures import wait_kept
from sparsecomm.collectives.launchers import detect_launcher, free_port
from sparsecomm.types import Topology, optional_int

__all__ = ["detect_launcher", "init_distributed", "shutdown", "topology"]

_topology: Optional[Topology] = None


def _my_address(single_node: bool) -> str:
    if single_node:
        return "127.0.0.1"
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    # Debian maps the hostname to 127.0.1.1: ask the routing table for a real interface instead.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent
            return s.getsockname()[0]
    except OSError:
        return host


def _rendezvous(launcher: str, topo: Topology) -> Tuple[str, int]:
    """MASTER_ADDR/PORT from the environment, or rank 0's address broadcast over MPI."""
    addr, port = os.environ.get("MASTER_ADDR"), optional_int(os.environ.get("MASTER_PORT"))
    if addr and port:
        return addr, port
    if launcher == "none":
        return "127.0.0.1", free_port()
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            f"sparsecomm.init_distributed: launched by {launcher} but MASTER_ADDR/MASTER_PORT are not set and "
            f"mpi4py is not installed to share rank 0's address. Install it (pip install 'sparsecomm[mpi]') "
            f"or export MASTER_ADDR and MASTER_PORT on every rank.") from exc
    comm = MPI.COMM_WORLD
    if comm.Get_size() != topo.world_size:
        raise RuntimeError(f"MPI world size {comm.Get_size()} != launcher's {topo.world_size}")
    endpoint = None
    if comm.Get_rank() == 0:
        endpoint = (addr or _my_address(topo.local_world_size == topo.world_size), port or free_port())
    return comm.bcast(endpoint, root=0)


def init_distributed(backend: Optional[str] = None,
                     timeout: Union[float, datetime.timedelta] = datetime.timedelta(minutes=5)) -> Topology:
    """Initialize torch.distributed from the launcher's environment and return the topology.

    Understands torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR/PORT``), Open MPI (``OMPI_COMM_WORLD_*``),
    MPICH/Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``) and Slurm
    (``SLURM_PROCID``, ...). Under MPI/Slurm without ``MASTER_ADDR``, rank 0
    picks a free port and broadcasts its address with mpi4py. With no launcher
    it starts a world of one. Safe to call twice (returns the topology).

    Args:
        backend: "nccl" or "gloo"; default NCCL when CUDA is available, else gloo.
            With CUDA, the device is set from the local rank.
        timeout: collective timeout (seconds or timedelta): a rank that dies
            makes the others raise after at most this long.

    Returns:
        The :class:`Topology` (rank, world size, local rank/size, node rank);
        it also feeds the node-level aggregation of the sparse path
        (``LOCAL_WORLD_SIZE`` is exported for it).

    Raises:
        RuntimeError: under MPI/Slurm with neither MASTER_ADDR/PORT nor mpi4py.
    """
    global _topology
    launcher, topo = detect_launcher()
    if dist.is_initialized():
        _topology = _topology or Topology(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                          local_rank=topo.local_rank, local_world_size=topo.local_world_size,
                                          node_rank=topo.node_rank)
        return _topology
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(topo.local_rank % max(1, torch.cuda.device_count()))
    addr, port = _rendezvous(launcher, topo)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(topo.local_world_size))
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=topo.rank,
                            world_size=topo.world_size, timeout=timeout)
    _topology = topo
    return topo


def topology() -> Topology:
    """The topology of the running job (a world of one before :func:`init_distributed`)."""
    return _topology or detect_launcher()[1]


def shutdown() -> None:
    """Leave cleanly: a barrier first, then destroy every group, and forget the library's cached ones.

    gloo can abort at exit when a rank destroys its groups while a peer's last
    collective is still in flight (the barrier), and a cached group would keep
    gloo's threads alive into interpreter shutdown (the forget).

    The barrier's work is kept (:func:`~sparsecomm.collectives.futures.keep`:
    until the default group's next few kept works, so normally until the
    interpreter exits). gloo's worker thread drops its reference to a work just after
    ``wait()`` returns; were that the last one, the work's destructor would
    need the GIL on that thread, while the main thread, holding the GIL, may
    already be joining that thread in the group's destructor (when the last
    owner of the group, such as DDP's reducer, is freed as the script ends):
    a deadlock at exit. Kept, the work's last owner is the main thread.
    """
    global _topology
    if dist.is_initialized():
        try:
            wait_kept(dist.barrier(async_op=True), None)
        finally:
            dist.destroy_process_group()
            groups.forget()
    _topology = None
