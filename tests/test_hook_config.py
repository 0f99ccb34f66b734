"""The DDP hook's settings (HookConfig) and its state's step bookkeeping (StepWork).

Validation and the step object need no process group; the state's pickling
runs on one real rank (gloo over a FileStore).
"""

import dataclasses
import pickle

import pytest
import torch
import torch.nn as nn

from sparsecomm.hooks import HookConfig, SparseCommState
from sparsecomm.hooks.step import PendingSync, StepWork
from sparsecomm.types import SyncMethod

from distributed import run_ranks

# (option, bad value, what the message must show of the value)
BAD_OPTIONS = [
    ("compression", "int8", "'int8'"),
    ("overrides", {"emb.weight": "broadcast"}, "'broadcast'"),
    ("scheme", "modulo", "'modulo'"),
    ("nonfinite", "ignore", "'ignore'"),
    ("reclassify_every", -1, "-1"),
    ("history", -1, "-1"),
    ("tune_samples", 0, "0"),
    ("tune_every", -5, "-5"),
    ("eager_sparse", "sometimes", "'sometimes'"),
]


@pytest.mark.parametrize("option,value,shown", BAD_OPTIONS, ids=[o for o, _, _ in BAD_OPTIONS])
def test_a_bad_option_raises_a_value_error_naming_it(option, value, shown):
    named = "override" if option == "overrides" else option  # "override for 'emb.weight' must be ..."
    with pytest.raises(ValueError) as config_error:
        HookConfig(**{option: value})
    message = str(config_error.value)
    assert message.startswith(named) and shown in message, message
    # The state validates its options before touching a process group (none exists here).
    with pytest.raises(ValueError) as state_error:
        SparseCommState(**{option: value})
    assert str(state_error.value) == message


def test_an_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="compresion"):
        SparseCommState(compresion="bf16")


def test_the_config_is_frozen_copies_its_overrides_and_pickles():
    mine = {"emb.weight": "allgather"}
    config = HookConfig(compression="none", overrides=mine, tune=True, tune_every=7)
    assert config.compression is None  # "none" is read as None
    mine["other.weight"] = "densify"
    assert config.overrides == {"emb.weight": "allgather"}  # the caller's dict stays theirs
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tune = False
    clone = pickle.loads(pickle.dumps(config))
    assert clone == config and clone.tune_every == 7
    assert dataclasses.replace(config, compression="bf16").compression == "bf16"
    with pytest.raises(ValueError, match="compression"):
        dataclasses.replace(config, compression="int8")


def test_state_attributes_read_and_revalidate_the_config():
    state = SparseCommState.__new__(SparseCommState)  # the settings alone: no process group
    state.config = HookConfig(scheme="range", overlap_sparse=True)
    derived = {"local_world_size", "latency_bytes", "history"}  # the state's are the values in use
    for f in dataclasses.fields(HookConfig):
        if f.name not in derived:
            assert getattr(state, f.name) == getattr(state.config, f.name), f.name
    state.compression = "fp16"
    assert state.config.compression == "fp16" and state.config.scheme == "range"
    with pytest.raises(ValueError, match="nonfinite"):
        state.nonfinite = "ignore"
    assert state.config.nonfinite == "propagate"


def test_step_work_holds_takes_and_cleans_up_once_per_backward():
    step = StepWork()
    items = [PendingSync(f"t{i}", torch.zeros(1), SyncMethod.ALLGATHER, "allgather", i + 1, lambda out: out)
             for i in range(3)]
    futures = [step.hold(it) for it in items]
    assert step.has_held and [f is it.future for f, it in zip(futures, items)] == [True] * 3
    assert step.take_held() == items and not step.has_held and step.take_held() == []
    assert step.take_futures() == futures and step.take_futures() == []
    assert not step.claim_cleanup()  # no sparse tables covered: nothing to clear
    step.clears_empty = True
    assert step.claim_cleanup() and not step.claim_cleanup()  # once per backward
    p = nn.Parameter(torch.zeros(2, 2))
    step.note_empty(p)
    assert step.end_cleanup() == [p] and step.end_cleanup() == []
    assert step.claim_cleanup()  # the next backward queues its own


def test_step_work_lets_go_of_kept_objects_when_the_next_step_opens_on_its_thread():
    import threading
    import weakref

    step = StepWork()
    step.open(1)
    kept = torch.zeros(3)
    freed_on = []
    weakref.finalize(kept, lambda: freed_on.append(threading.current_thread()))
    worker = threading.Thread(target=step.keep, args=(kept, [kept]))   # kept from another thread, as a job does
    worker.start()
    worker.join()
    del kept
    assert not step.open(1) and not freed_on   # the same backward's next bucket: the same step holds it
    step.close()
    assert not freed_on                    # still held after DDP's finalize
    assert step.open(2)
    assert freed_on == [threading.main_thread()]
    # A step that never closed (its backward failed) lets go of its objects when the next one opens, too.
    again = torch.zeros(1)
    gone = []
    weakref.finalize(again, lambda: gone.append(True))
    step.keep(again)
    del again
    step.open(3)   # step 2 never closed
    assert gone == [True]


class _Tables(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.dense = nn.Embedding(10, 4)


def _pickle_worker(rank, world):
    config = HookConfig(compression="bf16", overrides={"emb.weight": "allgather"}, latency_bytes=1e4, history=7)
    state = SparseCommState(model=_Tables(), config=config, tune=True)  # options apply over the config
    same = SparseCommState(compression="bf16", overrides={"emb.weight": "allgather"}, latency_bytes=1e4,
                           history=7, tune=True)
    assert state.config == same.config == dataclasses.replace(config, tune=True)
    assert state.step.clears_empty and state.param_names and state.hint_once("dense.weight")
    state.record("allgather", 10, 20, 0.5)
    clone = pickle.loads(pickle.dumps(state))
    return dict(config=clone.config == state.config, compression=clone.compression, tune=clone.tune,
                maxlen=clone.history.maxlen, latency=clone.latency_bytes, group=clone.process_group,
                fresh_step=clone.step is not state.step and not clone.step.clears_empty,
                names=clone.param_names, hinted=not clone.hint_once("dense.weight"),
                sent=clone.stats["allgather"].bytes_sent, dense_names=sorted(clone.dense_embedding_names))


def test_state_pickles_with_its_config_and_without_its_group():
    out = run_ranks(1, _pickle_worker)[0]
    assert out == dict(config=True, compression="bf16", tune=True, maxlen=7, latency=1e4, group=None,
                       fresh_step=True, names={}, hinted=True, sent=10, dense_names=["dense.weight"])
