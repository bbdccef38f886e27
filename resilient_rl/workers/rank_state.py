"""A rank's state, declared in one place: what a checkpoint saves, what a snapshot copies, and
what both restore.

A stateful role (actor, critic) holds tensors, its model and its optimizer, and plain parts: its
LR schedule, the process's RNG, and any part a role adds with :meth:`RankState.register`. A plain
part is a ``Stateful`` as ``torch.distributed.checkpoint`` defines it (``state_dict()`` and
``load_state_dict()``) of small values: numbers, strings, containers of them, small tensors.

- A checkpoint (:mod:`resilient_rl.workers.checkpointing`) saves the tensors through torch's
  distributed state dicts (sharded; resharded by a load at another world size) and every plain
  part by name (:meth:`RankState.checkpoint_state`).
- A snapshot (:mod:`resilient_rl.workers.snapshots.take`) packs the tensors into one host buffer
  (:func:`~resilient_rl.workers.snapshots.buffers.named_tensors`) and carries every plain part by
  name (:meth:`RankState.plain_state`).

So a new piece of state is registered once, and checkpoints, snapshots and both restores carry it.
A rank-local part (the RNG) is each rank's own: a load at another world size leaves it as it is.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from resilient_rl.workers.optimizer import keep_built_form
from resilient_rl.workers.snapshots.buffers import named_tensors

#: The names of the tensor parts (a plain part may not take them).
TENSOR_PARTS = ("model", "optim")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def load_schedule(scheduler, state: dict) -> None:
    """Load a saved LR schedule, keeping this run's base learning rates.

    A LambdaLR's state holds the base rates it was built with, and loading it would silently put
    back the saved run's: a resume that changes ``actor.optim.lr`` (allowed, see
    ``config/resume.py``) would train on at the old rate. The schedule's position is the saved one;
    the rates are this config's, applied at once (with an unchanged config this is the very value
    the saved step computed, so a resumed run stays bit-identical)."""
    base_lrs = list(scheduler.base_lrs)  # this run's optim.lr (a schedule's step never changes them)
    scheduler.load_state_dict(state)
    scheduler.base_lrs = base_lrs
    lrs = [base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, base_lrs)]
    for group, base, lr in zip(scheduler.optimizer.param_groups, base_lrs, lrs):
        group["initial_lr"] = base
        group["lr"] = lr
    scheduler._last_lr = lrs


class Schedule:
    """The engine's LR schedule as a part (loaded with this run's base rates, :func:`load_schedule`)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        return self.engine.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_schedule(self.engine.scheduler, state)


class TorchRng:
    """The process's torch CPU random number generator as a part."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).clone())


@dataclasses.dataclass(frozen=True)
class Part:
    stateful: Stateful
    rank_local: bool = False


class RankState:
    """The state of one role's rank, over its ``engine`` (``model``, ``optimizer``, ``scheduler``,
    read at each use: an engine rebuilt in place is followed)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.parts: dict[str, Part] = {"scheduler": Part(Schedule(engine)), "rng": Part(TorchRng(), rank_local=True)}

    def register(self, name: str, stateful: Stateful, rank_local: bool = False) -> None:
        """Add a plain part: from now on checkpoints and snapshots carry it, and their loads restore it."""
        if name in TENSOR_PARTS or name in self.parts:
            raise ValueError(f"a rank's state already has a part named {name!r}")
        self.parts[name] = Part(stateful, rank_local)

    def rank_local(self) -> tuple[str, ...]:
        """The parts each rank saves its own of (the others are the same on every rank)."""
        return tuple(name for name, part in self.parts.items() if part.rank_local)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """The state a checkpoint saves: the model's and the optimizer's state dicts (sharded)
        and every plain part's."""
        e = self.engine
        return {"model": get_model_state_dict(e.model), "optim": get_optimizer_state_dict(e.model, e.optimizer),
                **{name: part.stateful.state_dict() for name, part in self.parts.items()}}

    def model_state(self) -> dict[str, Any]:
        """The model's state dict as a checkpoint saves it (sharded)."""
        return get_model_state_dict(self.engine.model)

    def optimizer_started(self) -> bool:
        """Whether the optimizer has state yet (AdamW's moments exist after its first step)."""
        return bool(self.engine.optimizer.state)

    def load_checkpoint_state(self, loaded: dict[str, Any], same_world_size: bool) -> None:
        """Load what :meth:`checkpoint_state` saved; a rank-local part only at the world size it
        was saved at. A plain part the checkpoint does not hold is an error naming it."""
        missing = [name for name in self.parts if name not in loaded]
        if missing:
            raise KeyError(f"the checkpoint holds no {', '.join(missing)} state")
        e = self.engine
        set_model_state_dict(e.model, loaded["model"])
        set_optimizer_state_dict(e.model, e.optimizer, loaded["optim"])
        keep_built_form(e.optimizer)  # a checkpoint of the other AdamW form (fused, foreach) carries its own
        for name, part in self.parts.items():
            if same_world_size or not part.rank_local:
                part.stateful.load_state_dict(loaded[name])

    # ------------------------------------------------------------------ snapshots
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors a snapshot packs, in a fixed order (model, then optimizer state)."""
        return named_tensors(self.engine.model, self.engine.optimizer)

    def plain_state(self) -> dict[str, Any]:
        """A copy of every plain part's state, for a snapshot."""
        return {name: copy.deepcopy(part.stateful.state_dict()) for name, part in self.parts.items()}

    def check_plain_state(self, states: dict[str, Any]) -> None:
        """A ValueError naming the parts a snapshot's copy lacks (checked before anything is written)."""
        missing = [name for name in self.parts if name not in states]
        if missing:
            raise ValueError(f"snapshot holds no {', '.join(missing)} state")

    def load_plain_state(self, states: dict[str, Any]) -> None:
        """Restore every plain part from a snapshot's copy (see :meth:`check_plain_state`)."""
        self.check_plain_state(states)
        for name, part in self.parts.items():
            part.stateful.load_state_dict(copy.deepcopy(states[name]))


def states_of(engine) -> RankState:
    """``engine``'s :class:`RankState`, made on first use and kept on the engine (where a role
    registers its own parts)."""
    states = getattr(engine, "states", None)
    if not isinstance(states, RankState):
        states = RankState(engine)
        engine.states = states
    return states
