"""Future callbacks and work objects a process can exit past (``sparsecomm.collectives.futures``)."""

import ctypes
import hashlib
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from sparsecomm.collectives import futures
from sparsecomm.collectives.groups import run_async

from distributed import launcher_free_env, run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "exit_after_allreduce.py"
SYNC_SCRIPT = Path(__file__).parent / "scripts" / "exit_after_sync.py"


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


class _Work:
    """Stands for a collective's work: waitable, and weakly referenceable as torch's are."""

    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True
        return True


def test_keep_holds_a_work_for_the_groups_next_kept_works():
    group, other = object(), object()
    work = _Work()
    alive = weakref.ref(work)
    assert futures.keep(work, group) is work
    del work
    for _ in range(futures.KEPT_WORKS - 1):
        futures.keep(_Work(), group)
        futures.keep(_Work(), other)   # another group's works do not push it out
    assert alive() is not None
    futures.keep(_Work(), group)       # the group's KEPT_WORKS-th work since: let go
    assert alive() is None
    assert futures.keep(None, group) is None   # a transport without a work object


def test_wait_kept_waits_and_keeps():
    group = object()
    work = _Work()
    futures.wait_kept(work, group)
    assert work.waited and futures.kept(group)[-1] is work
    futures.wait_kept(None, group)   # torch's answer on a rank outside the group: nothing to wait for


def _new_kept_works(rank, world):
    from sparsecomm.collectives.dense import broadcast_, max_over_ranks
    from sparsecomm.collectives.objects import all_gather_objects
    world_group = torch.distributed.group.WORLD   # the library's objects helpers read None as "no peers"
    calls = {"max_over_ranks": (None, lambda: max_over_ranks([float(rank)], None, torch.device("cpu"))),
             "broadcast_": (None, lambda: broadcast_(torch.full((2,), float(rank)), 0, None)),
             "all_gather_objects": (world_group, lambda: all_gather_objects(rank, world_group))}
    out = {}
    for name, (group, call) in calls.items():
        before = futures.kept(group)
        result = call()
        new = [w for w in futures.kept(group) if not any(w is b for b in before)]
        out[name] = (len(new), all(w.is_completed() for w in new), result)
    return out


def test_the_librarys_synchronous_collectives_keep_their_works():
    got = run_ranks(2, _new_kept_works)
    for rank in range(2):
        res = got[rank]
        assert res["max_over_ranks"][:2] == (1, True) and res["max_over_ranks"][2] == [1.0]
        assert res["broadcast_"][:2] == (1, True) and res["broadcast_"][2].tolist() == [0.0, 0.0]
        assert res["all_gather_objects"][0] >= 1 and res["all_gather_objects"][1:] == (True, [0, 1])


def _hash_for(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hashlib.sha256(bytes(1 << 22)).digest()   # hashlib lets the GIL go on large inputs: this thread runs


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are read from /proc")


@needs_proc
def test_settle_threads_waits_for_a_running_thread():
    busy = threading.Thread(target=_hash_for, args=(1.0,))
    busy.start()
    try:
        time.sleep(0.05)
        t0 = time.monotonic()
        assert futures.settle_threads(timeout=0.2) is False   # it kept running: gave up at the timeout
        assert 0.2 <= time.monotonic() - t0 < 0.6
    finally:
        busy.join()
    assert futures.settle_threads(timeout=5.0) is True


def _named_and_parked(name: bytes, ready, done):
    libc = ctypes.CDLL(None)
    libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)   # PR_SET_NAME: any bytes, cut to 15
    ready.set()
    done.wait(30)


@needs_proc
def test_a_thread_name_that_is_not_text_is_read():
    ready, done = threading.Event(), threading.Event()
    odd = threading.Thread(target=_named_and_parked, args=(b"ab) R c\xff\xfe", ready, done))
    odd.start()
    try:
        assert ready.wait(30)
        assert isinstance(futures._running_threads(), int)   # read, whatever its name
        assert futures.settle_threads(timeout=5.0) is True     # and it sleeps: not running
    finally:
        done.set()
        odd.join()


def _exits_0(script: Path, ranks: int, runs: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(script)]
    for attempt in range(runs):
        out = subprocess.run(cmd, env=launcher_free_env(), capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, (attempt, out.stdout[-2000:], out.stderr[-4000:])
        assert out.stdout.count("done") == ranks, out.stdout


@pytest.mark.slow
def test_a_script_ending_right_after_a_synchronous_collective_exits_0():
    """Without kept works and the settled exit, most runs of this script aborted at exit (SIGABRT) here."""
    _exits_0(SYNC_SCRIPT, ranks=4, runs=6)


@pytest.mark.slow
def test_a_script_ending_right_after_an_allreduce_exits_0():
    """Without the drain, about four runs in ten of this script aborted at exit (SIGABRT) on this machine."""
    _exits_0(SCRIPT, ranks=2, runs=4)
