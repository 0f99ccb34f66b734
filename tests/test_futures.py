"""Future callbacks a process can exit past (``sparsecomm.collectives.futures``)."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sparsecomm.collectives import futures
from sparsecomm.collectives.groups import run_async

from distributed import launcher_free_env

SCRIPT = Path(__file__).parent / "scripts" / "exit_after_allreduce.py"


@pytest.fixture(autouse=True)
def nothing_left_counted():
    assert futures.drain(timeout=5.0)   # what earlier tests in this process started has finished
    yield
    assert futures.drain(timeout=5.0)
    assert futures.unfinished() == 0


def test_then_counts_a_callback_from_its_call_until_it_is_let_go():
    fut = torch.futures.Future()
    seen = []

    def first(f):
        seen.append(futures.unfinished())   # counted while it runs
        return f.value() + 1

    out = futures.then(futures.then(fut, first), lambda f: f.value() * 10)
    assert futures.unfinished() == 0         # nothing called yet
    thread = threading.Thread(target=fut.set_result, args=(4,))  # completed off the main thread, like gloo's
    thread.start()
    thread.join()
    assert out.wait() == 50
    assert seen == [1]
    assert futures.unfinished() == 0         # both let go once the thread finished


def test_drain_waits_for_a_called_callback_not_yet_let_go():
    callback = futures._Callback(lambda f: 7)
    try:
        assert callback("fut") == 7
        assert futures.unfinished() == 1
        assert futures.drain(timeout=0.05) is False   # still held: the exit would wait for it
    finally:
        del callback                                  # let go: the count returns to zero
    assert futures.unfinished() == 0
    start = time.monotonic()
    assert futures.drain(timeout=1.0) is True
    assert time.monotonic() - start >= futures.GRACE_SECONDS * 0.9   # and waits the grace after the last change


def test_a_worker_job_counts_from_its_submission_until_its_future_is_complete():
    go = threading.Event()
    group = object()                                  # a group of its own: a worker of its own
    first = run_async(lambda: go.wait(5.0) and 3, group=group)
    second = run_async(lambda: 4, group=group)        # queued behind the first: counted already
    counts = []
    second.add_done_callback(lambda f: counts.append(futures.unfinished()))   # runs inside set_result
    assert futures.unfinished() == 2
    assert futures.drain(timeout=0.05) is False
    go.set()
    assert first.wait() == 3 and second.wait() == 4
    assert futures.drain(timeout=5.0) is True
    assert counts == [1]                              # set_result of the second still counted


def test_an_error_in_a_callback_still_lets_it_go():
    fut = torch.futures.Future()

    def fail(f):
        raise ValueError("bad bucket")

    out = futures.then(fut, fail)
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="bad bucket"):
        out.wait()
    assert futures.unfinished() == 0


def _child_count(out):
    out.put(futures.unfinished())


def test_a_forked_child_starts_with_nothing_counted():
    import multiprocessing as mp
    callback = futures._Callback(lambda f: None)
    try:
        callback("fut")
        assert futures.unfinished() == 1
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_child_count, args=(out,))
        child.start()
        got = out.get(timeout=60)
        child.join(60)
        assert got == 0 and child.exitcode == 0
    finally:
        del callback


@pytest.mark.slow
def test_a_script_ending_right_after_an_allreduce_exits_0():
    """Without the drain, about four runs in ten of this script aborted at exit (SIGABRT) on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT)]
    for attempt in range(4):
        out = subprocess.run(cmd, env=launcher_free_env(), capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, (attempt, out.stdout[-2000:], out.stderr[-4000:])
        assert out.stdout.count("done") == 2, out.stdout
