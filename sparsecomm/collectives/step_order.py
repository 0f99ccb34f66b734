"""One order for the library's backward collectives on every rank, whatever each rank's graph.

Autograd runs a rank's graph in an order that follows that rank's graph: a
table one rank's batch does not use, an optional feature, a sharded table
beside a replicated one all change when each gradient is ready. Blocking
collectives issued from inside the graph would then start in different
orders on different ranks, and two of them on different groups, entered in
opposite orders, deadlock: each rank waits in the one its peer has not
reached, until the group's timeout. So the library issues its backward
collectives after the graph has run, from one autograd-engine callback per
backward pass, in an order every rank shares:

1. ``PUSH``: the sharded tables' gradient pushes
   (:mod:`sparsecomm.sharded.lookup`), by table set, then round number;
2. ``SYNC``: the DDP hook's fused sparse sync (:mod:`sparsecomm.hooks.hook`).

The callback is queued by the first job of a backward. The DDP hook adds its
job at the step's first bucket, and DDP queues its own finalize (which waits
for the hook's futures) only once its last bucket is ready, so the jobs run
before that finalize. Jobs given to :func:`after_backward` run once every
callback queued so far has run, i.e. after DDP's finalize has assigned the
synchronized gradients: the hook closes its step there. A job's error does
not stop the jobs after it (the hook's job completes DDP's futures, so DDP's
finalize still runs and the model stays usable); the first error is raised
after the ``after_backward`` jobs, from ``loss.backward()``, with its own
type and message.

:func:`anchor` ties tensors to a model's output with no gradient, so that
backward through the output runs their nodes on every rank, even where the
rank's loss does not use them.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

__all__ = ["PUSH", "SYNC", "current_backward", "in_graph", "at_backward_end", "after_backward", "anchor",
           "add_to_output", "JoinShadow"]

PUSH = 0   # sharded tables' gradient pushes
SYNC = 1   # the DDP hook's fused sparse sync

_NO_BACKWARD = -1   # torch's graph task id outside a backward pass


@runtime_checkable
class JoinShadow(Protocol):
    """What a rank that ran out of inputs (``torch.distributed.algorithms.Join``) does in its peers' place.

    A lookup-round set (``sparsecomm.sharded.lookup.TableSet``) implements
    it; the DDP hook calls it, on a joined rank, when DDP's join hook shadows
    the peers' backward.
    """

    def shadow_step(self) -> None:
        """Take part in one step's collectives with no input of this rank's own (collective)."""


@dataclass
class _Backward:
    """The jobs one backward pass registered."""

    jobs: List[Tuple[int, Tuple[Any, ...], int, Callable[[], None]]] = field(default_factory=list)
    after: List[Callable[[], None]] = field(default_factory=list)


_lock = threading.Lock()
_pending: Dict[int, _Backward] = {}
_sequence = itertools.count()


def current_backward() -> Optional[int]:
    """The id of the backward pass running on this thread, or None outside one."""
    task = torch._C._current_graph_task_id()
    return None if task == _NO_BACKWARD else task


def in_graph() -> bool:
    """Whether this thread runs a node of a backward's graph (False in the engine's final callbacks)."""
    return torch._C._current_autograd_node() is not None


def _entry(task: int) -> Tuple[_Backward, bool]:
    with _lock:
        entry = _pending.get(task)
        if entry is not None:
            return entry, False
        entry = _pending[task] = _Backward()
        return entry, True


def at_backward_end(phase: int, key: Tuple[Any, ...], job: Callable[[], None]) -> None:
    """Run ``job`` once this backward's graph has run: by ``phase``, then ``key``, then registration order.

    ``key`` must order the jobs of one phase alike on every rank (e.g. a
    table set's first table and the round number).

    Raises:
        RuntimeError: called outside a backward pass.
    """
    # A job added while the jobs run (by a job) runs in this pass too.
    _add("at_backward_end", lambda entry: entry.jobs.append((phase, key, next(_sequence), job)))


def after_backward(job: Callable[[], None]) -> None:
    """Run ``job`` after every engine callback queued so far in this backward (after DDP's finalize).

    Raises:
        RuntimeError: called outside a backward pass.
    """
    _add("after_backward", lambda entry: entry.after.append(job))


def _add(who: str, add: Callable[[Any], None]) -> None:
    """Record a job in this backward's entry (``add`` runs under the lock); the first one queues the run."""
    task = current_backward()
    if task is None:
        raise RuntimeError(f"sparsecomm: {who} needs a backward pass")
    entry, new = _entry(task)
    with _lock:
        add(entry)
    if new:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _run(task))


def _run(task: int) -> None:
    """Run a backward's jobs in their order, then queue its ``after_backward`` jobs behind DDP's finalize."""
    with _lock:
        entry = _pending[task]
    error: Optional[BaseException] = None
    done = 0
    while True:
        with _lock:
            todo = sorted(entry.jobs[done:], key=lambda j: j[:3])
            entry.jobs[done:] = todo
        if not todo:
            break
        for _, _, _, job in todo:
            try:
                job()
            except BaseException as exc:  # the others still run: DDP's futures must complete
                error = error or exc
        done += len(todo)
    with _lock:
        del _pending[task]
        after = list(entry.after)
    if after or error is not None:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish(after, error))


def _finish(after: Sequence[Callable[[], None]], error: Optional[BaseException]) -> None:
    for job in after:
        try:
            job()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


class _Anchor(torch.autograd.Function):
    """A zero that depends on some tensors and sends them no gradient (``None``)."""

    @staticmethod
    def forward(ctx, like: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.count = len(tensors)
        return like.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None,) * (ctx.count + 1)


def anchor(output: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """``output`` with its first floating tensor that requires grad plus an exact zero that depends on ``tensors``.

    Backward through ``output`` then runs the nodes that made ``tensors`` on
    every rank, each getting no gradient (``None``) from the anchor: a node a
    rank's loss does not reach still runs, with nothing. ``output`` unchanged
    when it has no such tensor.
    """
    target = _first_grad_tensor(output)
    if target is None or not tensors:
        return output
    return _replace_first_grad_tensor(output, target + _Anchor.apply(target, *tensors))


def add_to_output(output: Any, zero: torch.Tensor) -> Any:
    """``output`` with ``zero`` (a 0-dim tensor) added to its first floating tensor that requires grad."""
    target = _first_grad_tensor(output)
    if target is None:
        return output
    return _replace_first_grad_tensor(output, target + zero.to(target.dtype))


def _first_grad_tensor(obj: Any) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad and obj.is_floating_point() else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for x in items:
        t = _first_grad_tensor(x)
        if t is not None:
            return t
    return None


def _replace_first_grad_tensor(obj: Any, new: torch.Tensor) -> Any:
    done = [False]

    def walk(x: Any) -> Any:
        if done[0]:
            return x
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                done[0] = True
                return new
            return x
        if isinstance(x, dict):
            return type(x)((k, walk(v)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)
