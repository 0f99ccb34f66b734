"""Directory checkpoints of sharded tables that load at any world size, and full-table export.

Layout of a checkpoint directory written at world size N::

    manifest.json                 written last: world size, tables, file sizes and sha256s
    shard-00000-of-0000N.pt       rank r's rows of every table: ids, values, optimizer rows, step
    ...
    dense.pt                      rank 0: the model's other state, optimizer hyperparameters, `extra`

Every file is written to a temporary name, flushed to disk and renamed into
place (``os.replace``); the manifest is removed first and written last, after
every rank's file is in place. So an interrupted save leaves either no
manifest or files whose checksums do not match it, and :func:`load` refuses
both with a message; it never loads a mix silently.

:func:`load` reshards: each rank reads every shard file (memory-mapped, so
only the rows it takes are read into memory), keeps the rows that it owns
under the *current* world size and scheme, and checks that every one of its
rows arrived exactly once. Values, optimizer moments and step counts all move
with their rows. The checksums are split among the ranks (each file is hashed
by one rank, not by all of them). All checks are agreed across ranks: if any
rank refuses, all refuse, before anything is modified. The directory must be one that every
rank sees (a shared filesystem across nodes), since every rank may need rows
from every shard.

This format stays beside ``torch.distributed.checkpoint`` (which the tables'
and optimizers' state dicts serve: :mod:`sparsecomm.sharded.dcp`) rather than
wrapping it, for what DCP does not do: checksums agreed across ranks before
anything is modified, :func:`export_full` offline without processes, and the
manifest the planner reads (``Plan.from_checkpoint``).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from sparsecomm.collectives.sharded_exchange import sharded_group
from sparsecomm.version import __version__
from sparsecomm.collectives.objects import agree, all_gather_objects, barrier, world
from sparsecomm.sharded import files
from sparsecomm.sharded.combined import ParallelOptimizer
from sparsecomm.sharded.model import flush, sharded_modules
from sparsecomm.sharded.optimizer import ShardedOptimizer
from sparsecomm.sharded.table import left_out_of_state_dicts

__all__ = ["save", "load", "verify", "export_full", "CheckpointError"]

FORMAT = "sparsecomm.sharded.checkpoint/1"
MANIFEST = "manifest.json"
DENSE = "dense.pt"
_SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, torn, or does not fit the model it is loaded into."""


def _shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def _tables_and_group(model: nn.Module):
    tables = sharded_modules(model)
    if not tables:
        if getattr(_unwrap(model), "sparsecomm_plan", None) is None:
            raise ValueError(f"{type(model).__name__} contains no ShardedEmbedding/ShardedEmbeddingBag")
        # A parallelized model whose plan sharded nothing: the checkpoint holds its replicated parts.
        group = sharded_group(getattr(model, "process_group", None))
        rank, world_size = world(group)
        return tables, group, rank, world_size
    group = tables[0][1].group
    ws = {(t.layout.world_size, t.layout.rank) for _, t in tables}
    if len(ws) != 1:
        raise ValueError("all sharded tables of a checkpoint must live on the same process group")
    return tables, group, tables[0][1].layout.rank, tables[0][1].layout.world_size


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if type(model).__name__ == "DistributedDataParallel" else model


def _dense_state(model: nn.Module, tables) -> Dict[str, Any]:
    """The model's state without its sharded tables (they travel in the shard files; theirs is collective)."""
    if any(n == "" for n, _ in tables):  # the model is itself a table
        return {}
    with left_out_of_state_dicts([t for _, t in tables]):
        return _unwrap(model).state_dict()


def _optimizer_tables(optimizer: Optional[ShardedOptimizer], tables) -> Dict[str, Any]:
    if optimizer is None:
        return {}
    by_weight = {id(t.local_weight): name for name, t in tables}
    out = {}
    for p in optimizer.state:
        name = by_weight.get(id(p))
        if name is None:
            raise ValueError("the optimizer updates a sharded table that is not in the model being saved")
        out[name] = p
    return out


def _split(optimizer: Any) -> Tuple[Optional[ShardedOptimizer], Dict[str, torch.optim.Optimizer]]:
    """The sharded optimizer and the replicated parts (a :class:`ParallelOptimizer` holds both)."""
    if isinstance(optimizer, ParallelOptimizer):
        return optimizer.sharded, {k: o for k, o in optimizer.parts.items() if k != "sharded"}
    if optimizer is not None and not isinstance(optimizer, ShardedOptimizer):
        raise TypeError(f"optimizer must be a sharded optimizer or the ParallelOptimizer of sparsecomm.parallelize, "
                        f"got {type(optimizer).__name__} (pass a dense optimizer's state_dict() in extra=)")
    return optimizer, {}


def _plan_of(model: nn.Module) -> Optional[Dict[str, Any]]:
    plan = getattr(_unwrap(model), "sparsecomm_plan", None)
    return plan.to_dict() if plan is not None else None


def save(directory: str, model: nn.Module, optimizer: Any = None, extra: Any = None) -> Dict[str, Any]:
    """Write a checkpoint of ``model`` (and its sharded optimizer) into ``directory``; collective.

    Each rank writes its shard of every sharded table (values, ownership map,
    optimizer rows and step); rank 0 also writes the model's remaining
    (replicated) state, the optimizer's hyperparameters and ``extra``, then
    the manifest. Returns when the checkpoint is complete on every rank.

    Args:
        directory: created if needed; an older checkpoint there is replaced
            (its manifest goes first, so a crash midway never looks complete).
        model: the model (or DDP wrapper) holding the sharded tables.
        optimizer: the sharded optimizer of those tables, or the
            ``ParallelOptimizer`` of ``sparsecomm.parallelize`` (its replicated
            parts' state is saved too), if any.
        extra: anything ``torch.load(weights_only=True)`` can read back
            (e.g. the dense optimizer's and LR scheduler's ``state_dict()``,
            the epoch); :func:`load` returns it.

    Returns:
        The manifest (as written to ``manifest.json``).
    """
    tables, group, rank, world_size = _tables_and_group(model)
    flush(model)  # open rounds run, and a deferred gradient lands in the shards before they are written
    optimizer, replicated = _split(optimizer)
    by_table = _optimizer_tables(optimizer, tables)
    os.makedirs(directory, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(directory, MANIFEST)):
        os.remove(os.path.join(directory, MANIFEST))
        files.fsync_dir(directory)
    barrier(group)

    payload: Dict[str, Any] = {"format": FORMAT, "rank": rank, "world_size": world_size, "tables": {}}
    summary: Dict[str, Any] = {}
    for name, t in tables:
        # CPU copies: a checkpoint loads on any machine, and load() maps it to the CPU anyway.
        entry: Dict[str, Any] = {"layout": t.layout.describe(), "ids": t.layout.owned_ids().cpu(),
                                 "weight": t.layout.owned_rows(t.local_weight.detach()).cpu(), "optimizer": None}
        p = by_table.get(name)
        if p is not None:
            state = optimizer.state[p]
            entry["optimizer"] = {"kind": type(optimizer).__name__, "step": int(state["step"]),
                                  "rows": {k: t.layout.owned_rows(state[k]).cpu()
                                           for k in optimizer.row_state_names}}
        payload["tables"][name] = entry
        summary[name] = {"rows": t.layout.num_local,
                         "row_state": {k: list(v.shape[1:]) for k, v in
                                       (entry["optimizer"] or {}).get("rows", {}).items()}}
    fname = _shard_name(rank, world_size)
    written = {fname: files.atomic_write(os.path.join(directory, fname), lambda f: torch.save(payload, f))}
    if rank == 0:
        groups = []
        if optimizer is not None:
            weight_names = {id(t.weight): n for n, t in tables}  # a param group lists a table's `weight`
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "tables": [weight_names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        # Replicated optimizers hold the same state on every rank (DDP keeps them in step): rank 0's is saved.
        dense = {"format": FORMAT, "model": _dense_state(model, tables), "optimizer_groups": groups,
                 "replicated_optimizers": {k: o.state_dict() for k, o in replicated.items()}, "extra": extra}
        written[DENSE] = files.atomic_write(os.path.join(directory, DENSE), lambda f: torch.save(dense, f))

    gathered = all_gather_objects((written, summary), group)

    manifest = {
        "format": FORMAT, "world_size": world_size, "created_unix": time.time(),
        "sparsecomm": __version__, "torch": torch.__version__,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "replicated_optimizers": {k: type(o).__name__ for k, o in replicated.items()},
        "plan": _plan_of(model),
        "tables": {name: {"num_embeddings": t.num_embeddings, "embedding_dim": t.embedding_dim,
                          "dtype": str(t.local_weight.dtype).replace("torch.", ""), "scheme": t.scheme,
                          "owner": t.owner, "kind": type(t).__name__,
                          "rows_per_rank": [g[1][name]["rows"] for g in gathered],
                          "optimizer_rows": gathered[0][1][name]["row_state"]}
                   for name, t in tables},
        "files": {k: v for g in gathered for k, v in g[0].items()},
    }
    if rank == 0:
        text = json.dumps(manifest, indent=1, sort_keys=True).encode()
        files.atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(text))
        for stale in os.listdir(directory):
            # Shards of an older checkpoint at another world size: not in the manifest, never read.
            if _SHARD_RE.match(stale) and stale not in manifest["files"]:
                os.remove(os.path.join(directory, stale))
    barrier(group)
    return manifest


def verify(directory: str, share: Tuple[int, int] = (0, 1)) -> Dict[str, Any]:
    """Check that ``directory`` holds a complete, untorn checkpoint; return its manifest.

    Args:
        directory: the checkpoint directory.
        share: ``(i, n)``: hash only every n-th file of the sorted file list,
            starting at the i-th (the default hashes all). :func:`load` gives
            each of its n ranks one share, so every file is hashed once in all;
            every file's presence and size are checked whatever the share.

    Raises:
        CheckpointError: no manifest (incomplete or interrupted save), an
            unreadable manifest, a missing file, or a file whose size or
            sha256 differs from the manifest's (torn or replaced).
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} has no {MANIFEST}: not a complete sparsecomm checkpoint "
                              f"(a save that was interrupted leaves none)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}): torn write?") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown format {manifest.get('format') if isinstance(manifest, dict) else None!r}"
                              f", expected {FORMAT!r}")
    n = manifest.get("world_size")
    expected = {_shard_name(r, n) for r in range(n)} | {DENSE} if isinstance(n, int) and n >= 1 else None
    if expected is None or set(manifest.get("files", {})) != expected:
        raise CheckpointError(f"{path}: the file list does not match world size {n}")
    index, every = share
    if not 0 <= index < every:
        raise ValueError(f"share must be (i, n) with 0 <= i < n, got {share!r}")
    for k, (name, info) in enumerate(sorted(manifest["files"].items())):
        fpath = os.path.join(directory, name)
        if not os.path.exists(fpath):
            raise CheckpointError(f"{fpath} is missing (the manifest lists it)")
        size = os.path.getsize(fpath)
        if size != info["bytes"]:
            raise CheckpointError(f"{fpath} is {size} bytes but the manifest says {info['bytes']}: "
                                  f"torn or overwritten after the checkpoint was written")
        if k % every == index and files.sha256(fpath) != info["sha256"]:
            raise CheckpointError(f"{fpath} does not match its sha256 in the manifest: "
                                  f"corrupted or from another checkpoint")
    return manifest


def _check_fits(manifest: Dict[str, Any], tables, optimizer: Optional[ShardedOptimizer], strict: bool) -> None:
    saved = manifest["tables"]
    names = [n for n, _ in tables]
    missing = [n for n in names if n not in saved]
    if missing:
        raise CheckpointError(f"the checkpoint has no table(s) {missing} (it has {sorted(saved)})")
    if strict and set(saved) - set(names):
        raise CheckpointError(f"the checkpoint has table(s) {sorted(set(saved) - set(names))} that the model "
                              f"lacks (strict=True)")
    opt_tables = _optimizer_tables(optimizer, tables)
    for name, t in tables:
        s = saved[name]
        if (s["num_embeddings"], s["embedding_dim"]) != (t.num_embeddings, t.embedding_dim):
            raise CheckpointError(f"table {name!r}: the checkpoint holds {s['num_embeddings']} x "
                                  f"{s['embedding_dim']}, the model has {t.num_embeddings} x {t.embedding_dim}")
        if sum(s["rows_per_rank"]) != t.num_embeddings:
            raise CheckpointError(f"table {name!r}: the shards hold {sum(s['rows_per_rank'])} rows, "
                                  f"expected {t.num_embeddings}")
        if name in opt_tables:
            if manifest.get("optimizer") != type(optimizer).__name__:
                raise CheckpointError(f"table {name!r}: the checkpoint has optimizer state of "
                                      f"{manifest.get('optimizer')}, loading into {type(optimizer).__name__}")
            want = {k: list(optimizer.state[opt_tables[name]][k].shape[1:]) for k in optimizer.row_state_names}
            if s["optimizer_rows"] != want:
                raise CheckpointError(f"table {name!r}: the optimizer rows are {s['optimizer_rows']} in the "
                                      f"checkpoint, {want} here (e.g. row-wise vs element-wise Adagrad)")


def _reshard(directory: str, manifest: Dict[str, Any], tables, optimizer: Optional[ShardedOptimizer]
             ) -> Dict[str, Dict[str, Any]]:
    """This rank's rows of every table, taken from every old shard; checks each row arrives once."""
    # Rows are staged on the CPU, where the shard files are mapped: ids, slots
    # and the staging buffers share one device, whatever the tables' device.
    cpu = torch.device("cpu")
    opt_tables = _optimizer_tables(optimizer, tables)
    out: Dict[str, Dict[str, Any]] = {}
    for name, t in tables:
        # Staged in id order (a spread shard's rows too), written to the shard at the end.
        entry = {"weight": torch.empty((t.layout.num_local, t.embedding_dim), dtype=t.local_weight.dtype,
                                       device=cpu),
                 "filled": torch.zeros(t.layout.num_local, dtype=torch.int32, device=cpu), "rows": {},
                 "steps": set(), "optimizer": name in opt_tables}
        if name in opt_tables:
            for k in optimizer.row_state_names:
                state = optimizer.state[opt_tables[name]][k]
                entry["rows"][k] = torch.empty((t.layout.num_local, *state.shape[1:]), dtype=state.dtype,
                                               device=cpu)
        out[name] = entry
    n = manifest["world_size"]
    for r in range(n):
        fname = _shard_name(r, n)
        shard = torch.load(os.path.join(directory, fname), map_location="cpu", mmap=True, weights_only=True)
        if shard.get("format") != FORMAT or shard.get("rank") != r or shard.get("world_size") != n:
            raise CheckpointError(f"{fname} is not rank {r} of {n} of this checkpoint")
        for name, t in tables:
            s = shard["tables"].get(name)
            if s is None:
                raise CheckpointError(f"{fname} has no table {name!r}")
            ids, weight = s["ids"], s["weight"]
            if ids.dim() != 1 or weight.shape != (ids.shape[0], t.embedding_dim) or ids.shape[0] != \
                    manifest["tables"][name]["rows_per_rank"][r]:
                raise CheckpointError(f"{fname}: table {name!r} rows do not match the manifest")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.num_embeddings):
                raise CheckpointError(f"{fname}: table {name!r} holds ids outside [0, {t.num_embeddings})")
            ids = ids.to(cpu)
            mine = t.layout.owns(ids).nonzero().squeeze(1)
            slots = t.layout.positions(ids[mine])  # on the ids' device: the CPU
            e = out[name]
            e["weight"][slots] = weight[mine].to(e["weight"].dtype)
            e["filled"].index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
            if e["optimizer"]:
                opt = s.get("optimizer")
                if opt is None:
                    raise CheckpointError(f"{fname}: table {name!r} was saved without optimizer state")
                for k, dst in e["rows"].items():
                    dst[slots] = opt["rows"][k][mine].to(dst.dtype)
                # Every optimizer counts steps (SGD too, though its rule ignores them).
                e["steps"].add(int(opt["step"]))
        del shard
    for name, e in out.items():
        bad = int((e["filled"] != 1).sum())
        if bad:
            raise CheckpointError(f"table {name!r}: {bad} of this rank's rows are missing or duplicated "
                                  f"across the shard files")
        if len(e["steps"]) > 1:
            raise CheckpointError(f"table {name!r}: the shards disagree on the optimizer step {sorted(e['steps'])}")
    return out


def load(directory: str, model: nn.Module, optimizer: Any = None, strict: bool = True) -> Any:
    """Load a checkpoint written by :func:`save` at any world size and scheme; collective.

    Every rank verifies the manifest and every file's size, and hashes its
    share of the files (each file is hashed by one rank, agreed by all),
    takes the rows it owns now (with their optimizer rows and step), and
    loads the model's replicated state and the optimizer's hyperparameters.
    Nothing is modified until every rank has succeeded.

    Args:
        directory: the checkpoint directory.
        model: the model (or DDP wrapper) at the current world size.
        optimizer: the sharded optimizer to restore (must be of the type
            saved), or the ``ParallelOptimizer`` of ``sparsecomm.parallelize``
            (with the same replicated optimizers as saved).
        strict: refuse a checkpoint whose tables or replicated state keys
            differ from the model's (as ``load_state_dict(strict=True)``).

    Returns:
        The ``extra`` passed to :func:`save`.

    Raises:
        ValueError (``CheckpointError``): on every rank, when any rank finds
            the checkpoint incomplete, torn, or not fitting the model; the
            message names the rank and the problem.
    """
    tables, group, _, _ = _tables_and_group(model)
    flush(model)  # a deferred gradient lands first (the checkpoint then replaces what it updated)
    optimizer, replicated = _split(optimizer)
    what = f"sparsecomm.sharded.load refused {directory}"
    manifest = error = None
    try:
        # Each rank hashes its share of the files; the agreement below is the
        # one collective that makes a mismatch anywhere everyone's refusal.
        manifest = verify(directory, share=(0, 1) if group is None else world(group))
        _check_fits(manifest, tables, optimizer, strict)
        kinds = {k: type(o).__name__ for k, o in replicated.items()}
        if replicated and manifest.get("replicated_optimizers") != kinds:
            raise CheckpointError(f"the checkpoint holds replicated optimizers {manifest.get('replicated_optimizers')}"
                                  f", loading into {kinds}")
    except (CheckpointError, OSError, KeyError, TypeError) as exc:
        error = str(exc) or repr(exc)
    agree(error, group, what)

    new = dense = None
    try:
        new = _reshard(directory, manifest, tables, optimizer)
        dense = torch.load(os.path.join(directory, DENSE), map_location="cpu", weights_only=True)
        target = _dense_state(model, tables)
        if strict and set(dense["model"]) != set(target):
            raise CheckpointError(f"the replicated model state differs: missing {sorted(set(target) - set(dense['model']))}"
                                  f", unexpected {sorted(set(dense['model']) - set(target))}")
        if optimizer is not None and len(dense["optimizer_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"the optimizer had {len(dense['optimizer_groups'])} param groups, "
                                  f"it has {len(optimizer.param_groups)} now")
        for k, o in replicated.items():
            # Checked here, before anything changed: a state for other parameters is refused.
            saved = dense["replicated_optimizers"][k]
            if len(saved["param_groups"]) != len(o.param_groups) or any(
                    len(a["params"]) != len(b["params"]) for a, b in zip(saved["param_groups"], o.param_groups)):
                raise CheckpointError(f"the replicated optimizer {k!r} had other parameters when it was saved")
    except Exception as exc:  # any failure on any rank: everyone refuses, nothing changed
        error = f"{type(exc).__name__}: {exc}"
    agree(error, group, what)

    with torch.no_grad():
        opt_tables = _optimizer_tables(optimizer, tables)
        for name, t in tables:
            e = new[name]
            t.drop_hot()  # its replicated rows and their optimizer state are stale now
            t.layout.put_owned_rows(t.local_weight, e["weight"])
            if name in opt_tables:
                state = optimizer.state[opt_tables[name]]
                for k, v in e["rows"].items():
                    t.layout.put_owned_rows(state[k], v)
                if e["steps"]:
                    state["step"] = e["steps"].pop()
        with left_out_of_state_dicts([t for _, t in tables]):
            _unwrap(model).load_state_dict(dense["model"], strict=False)
        if optimizer is not None:
            for g, saved in zip(optimizer.param_groups, dense["optimizer_groups"]):
                g.update({k: v for k, v in saved.items() if k not in ("params", "tables")})
        for k, o in replicated.items():
            o.load_state_dict(dense["replicated_optimizers"][k])
    return dense["extra"]


def export_full(directory: str, names: Optional[List[str]] = None) -> Dict[str, torch.Tensor]:
    """Assemble the full, unsharded tables from a checkpoint (offline: no process group).

    Args:
        directory: a checkpoint written by :func:`save`, at any world size.
        names: tables to export (default: all).

    Returns:
        ``{name: (num_embeddings, embedding_dim) tensor}``, ready for
        ``nn.Embedding.from_pretrained`` or ``ShardedEmbedding.load_full_weight``.

    Raises:
        CheckpointError: as :func:`verify`, or rows missing from the shards.
    """
    manifest = verify(directory)
    names = sorted(manifest["tables"]) if names is None else names
    n = manifest["world_size"]
    full, filled = {}, {}
    for name in names:
        s = manifest["tables"].get(name)
        if s is None:
            raise CheckpointError(f"the checkpoint has no table {name!r}")
        full[name] = torch.empty(s["num_embeddings"], s["embedding_dim"], dtype=getattr(torch, s["dtype"]))
        filled[name] = torch.zeros(s["num_embeddings"], dtype=torch.int32)
    for r in range(n):
        shard = torch.load(os.path.join(directory, _shard_name(r, n)), map_location="cpu", mmap=True,
                           weights_only=True)
        for name in names:
            s = shard["tables"][name]
            full[name][s["ids"]] = s["weight"]
            filled[name].index_add_(0, s["ids"], torch.ones_like(s["ids"], dtype=torch.int32))
    for name in names:
        if bool((filled[name] != 1).any()):
            raise CheckpointError(f"table {name!r}: rows missing or duplicated across the shards")
    return full
