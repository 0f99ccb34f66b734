"""Run a function on N real processes (gloo over a FileStore) and re-raise a rank's failure here."""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
# Ranks fork from a server process that has imported torch and sparsecomm once, instead of each rank being a
# fresh interpreter that imports them itself (2-4 s of CPU per rank, most of the suite's time on 2 cores).
# The server only imports; every rank still starts from untouched module state, with this process's
# environment, working directory and sys.path. SPARSECOMM_TEST_START_METHOD=spawn restores plain spawn.
# Where a GPU is visible the ranks are spawned as before: CUDA cannot be used in a process forked from
# one that initialized it, and the GPU tests must not depend on what the preloaded imports touch.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "sparsecomm",
            "torch._dynamo", "torch.distributed.checkpoint"]  # the last two: imported lazily by DDP, optimizers, DCP
_START_METHOD = os.environ.get("SPARSECOMM_TEST_START_METHOD") or (
    "forkserver" if "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available() else "spawn")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_free_env() -> Dict[str, str]:
    """This environment without any launcher's variables (for starting torchrun/mpirun from a test)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MPI_")) and k not in _LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _entry(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, env: Dict[str, str],
           results, timeout_s: float, clean_exit: bool, backend: str) -> None:
    # The parent's environment as of this call (a forked rank inherits the fork server's), then ``env``.
    os.environ.clear()
    os.environ.update(env)
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash in native code still names the Python frames of every thread
    import torch

    torch.set_num_threads(1)  # N ranks share 2 cores
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        out = fn(rank, world_size, *args)
        results[rank] = ("ok", out)
        if clean_exit:
            dist.barrier()  # without it gloo intermittently aborts at exit
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, env: Optional[Dict[str, str]] = None,
              timeout_s: float = COLLECTIVE_TIMEOUT_S, join_timeout_s: float = 240,
              expect_dead: bool = False, backend: str = "gloo") -> Dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``expect_dead``: some rank is meant to die; skip the closing barrier and
    return what the survivors reported. ``backend``: "gloo" (default) or
    "nccl" (rank r uses GPU r mod the device count).

    Returns:
        ``{rank: return value}`` (return values must be picklable).

    Raises:
        AssertionError: with the failing rank's traceback.
    """
    ctx = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_entry, args=(r, world_size, os.path.join(tmp, "store"), fn, args,
                                                  env, results, timeout_s, not expect_dead, backend), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(join_timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = {r: v[1] for r, v in results.items() if v[0] == "error"}
        if errors:
            r = min(errors)
            raise AssertionError(f"rank {r} of {world_size} failed:\n{errors[r]}")
        if hung:
            raise AssertionError(f"ranks {hung} of {world_size} still running after {join_timeout_s}s")
        missing = [r for r in range(world_size) if r not in results]
        if missing and not expect_dead:
            codes = {r: procs[r].exitcode for r in missing}
            raise AssertionError(f"ranks {missing} died without a result (exit codes {codes})")
        return {r: v[1] for r, v in results.items()}


def expect_value_error(fn: Callable[[], Any], match: str) -> str:
    """Call ``fn``; it must raise ValueError whose message contains ``match``. Returns the message."""
    try:
        fn()
    except ValueError as e:
        assert match in str(e), f"expected {match!r} in {e}"
        return str(e)
    raise AssertionError(f"no ValueError (expected {match!r})")


def run_cases(rank: int, world: int, cases) -> Dict[str, Any]:
    """Run ``(name, fn, args)`` cases in order on this rank: ``{name: fn(rank, world, *args)}``.

    A failing case is re-raised naming the case, the rank and the world size.
    """
    out: Dict[str, Any] = {}
    for name, fn, args in cases:
        try:
            out[name] = fn(rank, world, *args)
        except BaseException as exc:
            raise AssertionError(f"case {name} failed on rank {rank} of {world}") from exc
    return out


def full_weights(model) -> Dict[str, Any]:
    """Every weight of a (possibly DDP-wrapped, parallelized) model as a full tensor, keyed like the
    single-process model's: a sharded table by its ``full_weight()`` (its own state-dict entry is the table
    as a DTensor of id-order chunks, and collective). Tables must be the model's direct children."""
    from sparsecomm.sharded.table import ShardedTable

    out: Dict[str, Any] = {}
    for n, m in getattr(model, "module", model).named_children():
        parts = {"weight": m.full_weight()} if isinstance(m, ShardedTable) else m.state_dict()
        out.update({f"{n}.{k}": v for k, v in parts.items()})
    return out


def weight_diffs(model, reference) -> Dict[str, float]:
    """Per weight, the largest difference between ``model``'s (:func:`full_weights`) and ``reference``'s, which
    must have the same names."""
    got, want = full_weights(model), reference.state_dict()
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {k: float((got[k] - want[k]).abs().max()) for k in want}


def _case_worker(rank: int, world: int, cases) -> Dict[str, Any]:
    return run_cases(rank, world, cases)


def run_case_list(world_size: int, cases, join_timeout_s: float = 300) -> Dict[int, Dict[str, Any]]:
    """:func:`run_cases` of ``cases`` (module-level functions) on ``world_size`` spawned ranks.

    Returns:
        ``{rank: {case name: its result}}``.
    """
    return run_ranks(world_size, _case_worker, list(cases), join_timeout_s=join_timeout_s)


def spawned_fixture(cases, worlds=(2, 3)):
    """A module-scoped pytest fixture: ``(world, run_case_list(world, cases))`` for each world size in ``worlds``."""
    import pytest

    @pytest.fixture(scope="module", params=list(worlds))
    def spawned(request):
        return request.param, run_case_list(request.param, cases)

    return spawned
