"""A sharded optimizer's state dict: each table's row state, whole and in id order, beside the table in its group.

Layout of :func:`state_dict` (what ``ShardedOptimizer.state_dict()`` returns)::

    {"state": {0: {"step": 5}, ...},                       # each table's step, as torch's optimizers keep it
     "param_groups": [{"lr": ..., ...,                     # the group's hyperparameters
                       "params": [0, 1],                   # its tables, numbered as torch does
                       "sharded_rows": [{"step": 5, "exp_avg": T, "exp_avg_sq": T},   # one per table, in order
                                        ...]}]}

where each ``T`` is the row-aligned state of the whole table as the table's own
state dict presents its rows (:func:`sparsecomm.sharded.dcp.as_global`: a
DTensor, one id-order chunk a rank; without peers the full tensor), so
``torch.distributed.checkpoint`` saves it whole and it loads at any world
size and scheme, as a DTensor or full (``full_state_dict=True``).

Why the rows ride in the param groups and not under ``"state"``: torch's
distributed ``set_state_dict`` hands an optimizer the per-parameter state of
the parameters that require grad only, and a table's parameter (its ``weight``
stand-in) must not require grad (DDP would wait for its gradient); every key
of a saved param group reaches the optimizer. ``"state"`` repeats each
table's step only so that it is not empty: DCP hands an optimizer the whole
merged state dict of all optimizers when every ``"state"`` key is an int
(several stateless optimizers would each get every group). A cost of the choice: DCP's
``flatten_optimizer_state_dict=True`` rebuilds a group from the keys the live
groups have, which drops the rows; :func:`load_state_dict` then refuses with
that reason instead of loading a partial state.

:func:`load_state_dict` also takes the per-rank form of earlier versions
(torch's layout plus ``"sharding"``: each table's layout), at the same layout only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sparsecomm.sharded import dcp

__all__ = ["ROWS", "state_dict", "load_state_dict"]

ROWS = "sharded_rows"
_NOT_HYPER = ("params", ROWS)


def _rows_of(opt: Any, table: Any) -> Dict[str, Any]:
    """One table's ``step`` and row state, each tensor as the whole table (collective, one all-to-all)."""
    table.table_set.push_deferred()  # a gradient a defer=True optimizer left pending lands first
    state = opt.state[table.local_weight]
    names = opt.row_state_names
    chunks = dcp.to_id_order(table.layout, [state[n] for n in names], table.group) if names else []
    return {"step": int(state["step"]),
            **{n: dcp.as_global(c, table.layout, table.group) for n, c in zip(names, chunks)}}


def state_dict(opt: Any) -> Dict[str, Any]:
    """``opt``'s state dict in the layout of the module docstring (collective: every rank calls it)."""
    tables = iter(opt.tables())
    groups, index = [], 0
    for g in opt.param_groups:
        rows = [_rows_of(opt, next(tables)) for _ in g["params"]]
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(index, index + len(rows))), ROWS: rows})
        index += len(rows)
    steps = [r["step"] for g in groups for r in g[ROWS]]
    return {"state": {i: {"step": s} for i, s in enumerate(steps)}, "param_groups": groups}


def _entries(opt: Any, sd: Any) -> Tuple[Optional[str], List[Any]]:
    """Each table's saved entry, in ``opt.tables()`` order, or the reason the state does not fit."""
    name = type(opt).__name__
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        return (f"the state has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
                f"{name} has {len(opt.param_groups)}"), []
    entries = []
    for i, (saved, live) in enumerate(zip(groups, opt.param_groups)):
        rows = saved.get(ROWS) if isinstance(saved, dict) else None
        if not isinstance(rows, list):
            return (f"param group {i} holds no {ROWS!r}: not a sharded optimizer's state, or one flattened by "
                    f"torch.distributed.checkpoint (flatten_optimizer_state_dict=True drops them); save it "
                    f"without flattening"), []
        if len(rows) != len(live["params"]) or len(saved.get("params", ())) != len(rows):
            return f"param group {i} holds {len(rows)} tables, {name}'s has {len(live['params'])}", []
        entries.extend(rows)
    return None, entries


def _classified(opt: Any, entries: Sequence[Any]) -> Tuple[List[dcp.Verdict], List[List[Any]]]:
    verdicts, rows = [], []
    for t, (table, entry) in enumerate(zip(opt.tables(), entries)):
        state, got = opt.state[table.local_weight], []
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, (int, torch.Tensor)):
            verdicts.append(dcp.Verdict(dcp.INVALID, (0, (), ""), f"table {t} has no step count"))
        for n in opt.row_state_names:
            v, r = dcp.classify(entry.get(n) if isinstance(entry, dict) else None, table.layout,
                                tuple(state[n].shape[1:]))
            if v.kind == dcp.MISSING:
                v = v._replace(kind=dcp.INVALID, problem=f"table {t} has no {n!r} rows (a state of another rule?)")
            elif v.problem:
                v = v._replace(problem=f"table {t} {n!r}: {v.problem}")
            verdicts.append(v)
            got.append(r)
        rows.append(got)
    return verdicts, rows


def _place(table: Any, state: Dict[str, Any], names: Sequence[str], got: Sequence[torch.Tensor],
           kinds: Sequence[str]) -> None:
    """Copy one table's loaded row state into ``state``: chunks come home in one all-to-all, full tensors are indexed."""
    chunked = [n for n, k in zip(names, kinds) if k == dcp.CHUNKS]
    sent = [r.to(state[n]) for n, r, k in zip(names, got, kinds) if k == dcp.CHUNKS]
    local = dict(zip(chunked, dcp.from_id_order(table.layout, sent, table.group) if sent else []))
    owned = table.layout.owned_ids()
    for n, r, k in zip(names, got, kinds):
        if k == dcp.FULL:
            local[n] = r[owned.to(r.device)]
        table.layout.put_owned_rows(state[n], local[n])


@torch.no_grad()
def load_state_dict(opt: Any, sd: Dict[str, Any]) -> None:
    """Load ``sd`` into ``opt`` (collective); see ``ShardedOptimizer.load_state_dict``."""
    if isinstance(sd, dict) and "sharding" in sd:
        return _load_local(opt, sd)
    tables, names = opt.tables(), opt.row_state_names
    problem, entries = _entries(opt, sd)
    if problem is None:
        verdicts, rows = _classified(opt, entries)
    else:
        verdicts, rows = [dcp.Verdict(dcp.INVALID, (0, (), ""), problem)], []
    # Past the agreement every rank has one valid verdict per row tensor: nothing changed before it.
    kinds = dcp.agree_on(verdicts, tables[0].group if tables else None, f"{type(opt).__name__}.load_state_dict")
    for t, (table, entry) in enumerate(zip(tables, entries)):
        table.table_set.push_deferred()  # a pending gradient must not land on the loaded state
        state = opt.state[table.local_weight]
        _place(table, state, names, rows[t], kinds[t * len(names):(t + 1) * len(names)])
        state["step"] = int(entry["step"])
    _set_hyperparameters(opt, sd["param_groups"])
    return None


def _set_hyperparameters(opt: Any, saved_groups: Sequence[Dict[str, Any]]) -> None:
    for g, saved in zip(opt.param_groups, saved_groups):
        g.update({k: v for k, v in saved.items() if k not in _NOT_HYPER})
    for table in opt.tables():
        table.drop_hot()  # the replica's optimizer rows are stale now


def _local_problem(opt: Any, sd: Dict[str, Any], ids: Sequence[Any]) -> Optional[str]:
    tables, saved = opt.tables(), sd.get("sharding")
    if not isinstance(saved, list) or len(saved) != len(tables) or len(ids) != len(tables) \
            or len(sd.get("param_groups", ())) != len(opt.param_groups):
        return f"the state has no ownership maps for {len(tables)} tables (not a sharded optimizer state of this model?)"
    for i, (table, layout, pid) in enumerate(zip(tables, saved, ids)):
        mine = table.layout.describe()
        if layout != mine:
            return (f"table {i} was saved as {layout} but is {mine} here; to reshard, save and load the "
                    f"state_dict() of this version, or a directory checkpoint with sparsecomm.sharded.save/load")
        for n in opt.row_state_names:
            t = sd["state"].get(pid, {}).get(n)
            want = (table.layout.num_local, *opt.state[table.local_weight][n].shape[1:])
            if t is None or t.shape != want:
                return (f"table {i} state {n!r} has shape {None if t is None else tuple(t.shape)}, "
                        f"expected {tuple(want)}")
    return None


def _load_local(opt: Any, sd: Dict[str, Any]) -> None:
    """The per-rank form of earlier versions: torch's layout of this rank's rows plus each table's layout."""
    ids = [i for g in sd.get("param_groups", ()) for i in g["params"]]
    problem = _local_problem(opt, sd, ids)
    if problem:
        raise ValueError(f"{type(opt).__name__}.load_state_dict: {problem}")
    for table, pid in zip(opt.tables(), ids):
        saved, state = sd["state"].get(pid, {}), opt.state[table.local_weight]
        for n in opt.row_state_names:
            table.layout.put_owned_rows(state[n], saved[n])
        if "step" in saved:
            state["step"] = int(saved["step"])
    _set_hyperparameters(opt, sd["param_groups"])
