"""Worker side of in-memory snapshots: a rank's state copied to host memory after a step.

A snapshot is the rank's state exactly as a checkpoint sees it (:meth:`CheckpointMixin._state`:
model and optimizer shards, LR schedule, RNG), with every DTensor reduced to this rank's local
shard and every tensor copied to host memory. :meth:`SnapshotMixin.take_snapshot` keeps the
newest copy in the process and returns it, so the controller's object reference keeps a second
copy in Ray's object store (owned by the controller: it outlives this process).
:meth:`SnapshotMixin.hold_snapshot` makes this rank keep a ring neighbour's copy (a third copy,
on another node where there is one). :meth:`SnapshotMixin.load_snapshot` fills the rank from its
own copy or from one handed to it.

Snapshots are never resharded: a copy is loaded only into the same rank of the same world size
(the controller falls back to a storage checkpoint otherwise).
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from resilient_rl.controller.dispatch import Dispatch, register

#: Snapshot steps a rank keeps of its own and of each neighbour it holds for (the newest complete
#: one and the one in flight).
KEEP = 2


def host_copy(obj: Any) -> Any:
    """A deep copy of a nested state with every tensor (a DTensor: its local shard) on the host."""
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    if torch.is_tensor(obj):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.detach().to("cpu", copy=True)
    return obj


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state."""
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    return 0


def fill_like(template: Any, copy: Any, path: str = "") -> Any:
    """``copy`` shaped like ``template``: each host tensor copied to the template's device, and
    wrapped back into a DTensor with the template's mesh and placements where the template has one.

    Always a copy, never a view: the optimizer keeps the tensors it is loaded with and updates
    them in place, which must not change the snapshot they came from."""
    if isinstance(template, dict):
        if not isinstance(copy, dict) or set(copy) != set(template):
            raise ValueError(f"snapshot does not match the state at {path or '/'}: keys differ")
        return {k: fill_like(v, copy[k], f"{path}/{k}") for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        if not isinstance(copy, (list, tuple)) or len(copy) != len(template):
            raise ValueError(f"snapshot does not match the state at {path}: lengths differ")
        return type(template)(fill_like(t, c, f"{path}/{i}") for i, (t, c) in enumerate(zip(template, copy)))
    if torch.is_tensor(template):
        if not torch.is_tensor(copy):
            raise ValueError(f"snapshot does not match the state at {path}: not a tensor")
        if hasattr(template, "to_local"):
            from torch.distributed.tensor import DTensor

            local = template.to_local()
            if copy.shape != local.shape:
                raise ValueError(f"snapshot shard at {path} has shape {tuple(copy.shape)}, the rank's "
                                 f"{tuple(local.shape)}")
            return DTensor.from_local(copy.to(local.device, copy=True), template.device_mesh, template.placements,
                                      run_check=False, shape=template.shape, stride=template.stride())
        return copy.to(template.device, copy=True)
    return copy


class SnapshotMixin:
    """Adds take/hold/load of in-memory snapshots to a role worker with a CheckpointMixin."""

    _own_snapshots: dict | None = None  # step -> this rank's copy
    _held_snapshots: dict | None = None  # (owner role, owner rank) -> {step: copy}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_snapshot(self, step: int) -> dict:
        """Copy this rank's state to host memory; keep it and return it (for the object store).

        Returns ``{"step", "rank", "world_size", "bytes", "state"}``."""
        state = host_copy(self._state())
        if self._own_snapshots is None:
            self._own_snapshots = {}
        self._own_snapshots[int(step)] = state
        for old in sorted(self._own_snapshots)[:-KEEP]:
            del self._own_snapshots[old]
        return {"step": int(step), "rank": self.rank, "world_size": self.world_size, "bytes": state_bytes(state),
                "state": state}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hold_snapshot(self, step: int, owner_role: str, owner_rank: int, snapshot: dict) -> dict:
        """Keep the copy of ``step`` of ``owner_role`` rank ``owner_rank`` (this rank is its ring
        peer, of the same role or another); returns its size.

        A rank that is its own peer (nothing else to hold it) keeps nothing more: its copy is in
        its own memory and in the object store."""
        nbytes = int(snapshot["bytes"])
        own = owner_role == getattr(self, "role", None) and int(owner_rank) == self.rank
        if not own:
            if self._held_snapshots is None:
                self._held_snapshots = {}
            held = self._held_snapshots.setdefault((owner_role, int(owner_rank)), {})
            held[int(step)] = snapshot
            for old in sorted(held)[:-KEEP]:
                del held[old]
        return {"step": int(step), "bytes": nbytes, "held": not own}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def held_snapshot(self, step: int, owner_role: str, owner_rank: int) -> dict | None:
        """The copy of ``step`` this rank holds for ``owner_role`` rank ``owner_rank``, or None
        (it was restarted since)."""
        return ((self._held_snapshots or {}).get((owner_role, int(owner_rank))) or {}).get(int(step))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def has_snapshot(self, step: int) -> bool:
        """Whether this process still has its own copy of ``step``."""
        return int(step) in (self._own_snapshots or {})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def snapshot_memory(self) -> dict:
        """Host bytes this rank spends on snapshots: its own copies and the neighbours' it holds."""
        own = sum(state_bytes(s) for s in (self._own_snapshots or {}).values())
        held = sum(int(s["bytes"]) for h in (self._held_snapshots or {}).values() for s in h.values())
        return {"own_bytes": own, "held_bytes": held}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_snapshot(self, step: int, source: Any = None, timeout_s: float = 60.0) -> bool:
        """Fill model, optimizer, schedule and RNG from a snapshot of ``step``; False when the
        copy is not available here (the controller then tries the next source).

        ``source``: None for this process's own copy; ``[ref]`` (an ObjectRef wrapped in a list,
        so that Ray hands it over unresolved) for a copy in the object store, read here within
        ``timeout_s``; a snapshot dict for one handed over by value."""
        step = int(step)
        if source is None:
            state = (self._own_snapshots or {}).get(step)
        elif isinstance(source, list):
            try:
                snap = ray.get(source[0], timeout=timeout_s)
            except Exception:  # lost with its node, or its task failed: not available
                return False
            state = snap["state"] if snap is not None and snap.get("step") == step else None
        else:
            state = source["state"] if source.get("step") == step else None
        if state is None:
            return False
        self.reset_checkpoint_writer()
        loaded = fill_like(self._state(), state)
        e = self.engine
        set_model_state_dict(e.model, loaded["model"])
        set_optimizer_state_dict(e.model, e.optimizer, loaded["optim"])
        e.scheduler.load_state_dict(loaded["scheduler"])
        torch.set_rng_state(loaded["rng"]["torch"])
        if self._own_snapshots is None:
            self._own_snapshots = {}
        self._own_snapshots[step] = state
        self.prepare_checkpoint_staging()
        return True
