"""A snapshot's non-tensor state and its restore into a rank's engine.

The tensors of a snapshot are packed by :mod:`resilient_rl.workers.snapshots.buffers`; what rides
along as plain values is the optimizer's hyperparameters per group and non-tensor state (gathered
by :func:`optim_extras` at the take) and every plain part of the rank's
:class:`~resilient_rl.workers.rank_state.RankState` (schedule, RNG, what the role registered).
:func:`restore_state` writes them all back, with the tensors.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from resilient_rl.workers.optimizer import keep_built_form
from resilient_rl.workers.rank_state import states_of
from resilient_rl.workers.snapshots.buffers import Layout, copy_in

#: Version of the snapshot dict's layout (3: the plain parts under ``extra["states"]``).
FORMAT = 3


def optim_extras(optimizer) -> tuple[list[dict], dict[str, Any]]:
    """The optimizer's hyperparameters per group (without ``params``) and the non-tensor values
    of its per-parameter state (by parameter index and key)."""
    groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
    scalars: dict[str, Any] = {}
    index = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            for key, value in (optimizer.state.get(p) or {}).items():
                if not torch.is_tensor(value):
                    scalars[f"{index}/{key}"] = copy.deepcopy(value)
            index += 1
    return groups, scalars


def restore_state(engine, snap: dict, tensors: Callable[[], list]) -> None:
    """Write ``snap`` into ``engine`` (``model``, ``optimizer``, its rank state's plain parts) in
    place: tensors (``tensors()``: the rank's named tensors), optimizer hyperparameters and
    non-tensor state, then every plain part (schedule, RNG, ...). Bit-identical to the state it was
    taken from."""
    if snap.get("format") != FORMAT:
        raise ValueError(f"snapshot format {snap.get('format')!r} is not {FORMAT}")
    e = engine
    layout = Layout.from_list(snap["layout"])
    extra = snap["extra"]
    states_of(e).check_plain_state(extra["states"])
    has_optim_state = any(entry.name.startswith("optim/") for entry in layout.entries) or extra["optim_scalars"]
    if has_optim_state and not e.optimizer.state:
        # A rebuilt optimizer has no state to write into: create it the way a checkpoint load
        # does (a zero-learning-rate step; every value is overwritten below).
        get_optimizer_state_dict(e.model, e.optimizer)
    elif not has_optim_state and e.optimizer.state:
        e.optimizer.state.clear()
    copy_in(layout, snap["data"], tensors())
    if len(extra["param_groups"]) != len(e.optimizer.param_groups):
        raise ValueError(f"snapshot does not match the state at optim/param_groups: "
                         f"{len(extra['param_groups'])} groups, the rank's {len(e.optimizer.param_groups)}")
    for group, saved in zip(e.optimizer.param_groups, extra["param_groups"]):
        group.update(copy.deepcopy(saved))
    params = [p for g in e.optimizer.param_groups for p in g["params"]]
    for key, value in extra["optim_scalars"].items():
        index, name = key.split("/", 1)
        e.optimizer.state[params[int(index)]][name] = copy.deepcopy(value)
    keep_built_form(e.optimizer)
    states_of(e).load_plain_state(extra["states"])
