"""Which launcher started this process, from its environment: one table of launcher variables.

torchrun, Open MPI, MPICH / Intel MPI and Slurm each export the rank, the
world size and the node layout under names of their own. This module is the
only reader of those variables: :func:`detect_launcher` serves
``init_distributed`` and the node layout of the sparse path
(:func:`env_local_world_size`), and :func:`launcher_variable` tells a
benchmark which variables to strip before it starts ranks of its own.
No torch.distributed here.

A new launcher is one row of ``LAUNCHERS``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Tuple

from sparsecomm.types import Topology, optional_int

__all__ = ["Launcher", "LAUNCHERS", "detect_launcher", "env_local_world_size", "launcher_variable", "free_port"]


@dataclass(frozen=True)
class Launcher:
    """The variables one launcher exports.

    Attributes:
        name: what :func:`detect_launcher` reports.
        rank, world_size, local_rank, local_world_size: the variables' names.
        prefixes: every variable of this launcher starts with one of these
            (stripped from a child's environment), besides the four above.
        local_size: reads the local world size where one variable is not
            enough (Slurm's task counts), else None.
    """

    name: str
    rank: str
    world_size: str
    local_rank: str
    local_world_size: str
    prefixes: Tuple[str, ...] = ()
    local_size: Optional[Callable[[Mapping[str, str]], Optional[int]]] = None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> Optional[int]:
    # SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; SLURM_TASKS_PER_NODE looks like "4(x2)".
    value = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not value:
        return None
    return int(value.split("(")[0].split(",")[0])


# In order of precedence (torchrun started under mpirun is torchrun's ranks).
LAUNCHERS = (
    Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             ("MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")),
    Launcher("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", ("OMPI_", "PMIX_")),
    Launcher("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ("PMI_", "MPI_LOCAL")),
    Launcher("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", ("SLURM_",),
             local_size=_slurm_tasks_per_node),
)


def detect_launcher(env: Optional[Mapping[str, str]] = None) -> Tuple[str, Topology]:
    """Read rank, world size and node layout from the environment.

    Returns:
        ``(launcher, topology)``; launcher is "torchrun", "openmpi", "mpich",
        "slurm" or "none" (a plain single process).
    """
    env = os.environ if env is None else env
    for launcher in LAUNCHERS:
        rank, size = optional_int(env.get(launcher.rank)), optional_int(env.get(launcher.world_size))
        if rank is None or size is None:
            continue
        local_rank = optional_int(env.get(launcher.local_rank))
        local_size = (launcher.local_size(env) if launcher.local_size is not None
                      else optional_int(env.get(launcher.local_world_size)))
        if local_size is None:
            local_size, local_rank = 1, 0
        local_rank = rank % local_size if local_rank is None else local_rank
        return launcher.name, Topology(rank=rank, world_size=size, local_rank=local_rank,
                                       local_world_size=local_size, node_rank=rank // max(1, local_size))
    return "none", Topology()


def env_local_world_size() -> Optional[int]:
    """Ranks per node as the launcher tells it, or None without a launcher."""
    launcher, topo = detect_launcher()
    return None if launcher == "none" else topo.local_world_size


def launcher_variable(name: str) -> bool:
    """Whether the environment variable ``name`` belongs to some launcher (a child started anew drops it)."""
    for launcher in LAUNCHERS:
        if name in (launcher.rank, launcher.world_size, launcher.local_rank, launcher.local_world_size):
            return True
        if name.startswith(launcher.prefixes):
            return True
    return False


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on now, on ``host`` (all interfaces by default): for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


