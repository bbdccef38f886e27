"""Worker side of checkpoints: what a trainable role saves and how it comes back.

A role's state is its :class:`~resilient_rl.workers.rank_state.RankState`: model and optimizer
shards (DTensors under FSDP2), its LR schedule, its RNG state (rank-local) and any part the role
registered. Saving stages the shards to host memory (the only part the training step
waits for) and writes them in a background thread; the controller asks later whether the write
finished and commits the step once every rank of every role has written. Loading fills the
current (possibly differently sharded) state from the saved chunks, so a run saved on N ranks
resumes on M.

The host buffers an async save stages into are allocated ahead of the first save
(:meth:`RankCheckpointer.prepare_staging`, in the writer's thread), because allocating
them inside the first save's stall costs seconds on a GPU (registering pinned host memory).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

import torch

from resilient_rl.checkpoint import AsyncShardWriter, FileRecord, Storage, load_shard_into, stage, write_shard
from resilient_rl.checkpoint.retry import is_outage
from resilient_rl.errors import CheckpointFormatError, StorageError
from resilient_rl.runtime.dispatch import Dispatch, register
from resilient_rl.workers.held_memory import forget_optimizer_state, retry_while_held
from resilient_rl.workers.rank_state import RankState


def _records(records: list[FileRecord], finite: bool = True) -> list[dict]:
    """The records as JSON, each marked with whether this rank's saved tensors were all finite
    (the controller refuses to commit a step with any ``"finite": false``)."""
    return [{**r.to_json(), "finite": finite} for r in records]


def state_is_finite(state) -> bool:
    """Whether every floating-point tensor in a (nested) state dict is finite on this rank.

    DTensors are checked through their local shard (each rank checks its own); one reduction per
    tensor and one host sync per device. A state mixes devices (on GPU, Adam's ``step`` counters
    stay on the host), so the flags are reduced per device before they meet."""
    flags: dict[torch.device, list[torch.Tensor]] = {}

    def walk(obj) -> None:
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif torch.is_tensor(obj):
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            if (t.is_floating_point() or t.is_complex()) and t.numel():
                flags.setdefault(t.device, []).append(torch.isfinite(t).all())

    walk(state)
    return all(bool(torch.stack(per_device).all()) for per_device in flags.values())


def storage_failure(exc: StorageError) -> dict:
    """What a rank reports instead of its records when its shards could not be written: the
    controller skips the checkpoint (an outage) or stops the run (a permanent error) instead of
    treating a storage failure as a crashed worker."""
    return {"storage_error": str(exc)[:1000], "outage": is_outage(exc)}


class RankCheckpointer:
    """Save, poll and load of one rank's :class:`~resilient_rl.workers.rank_state.RankState`: a
    collaborator of the worker that hosts the rank, handed what it reads at each use.

    ``states``: the rank's state now (None before a model is built; the engine is rebuilt after a
    recovery). ``place``: the rank's (rank, world size, process-group generation) now (a warm
    spare takes a rank, a rejoin starts a generation). ``label`` names the writer's thread.
    ``staging``: whether saves are asynchronous and periodic, so that their host buffers are
    allocated ahead of the first (:meth:`prepare_staging`). ``held_wait_s``: how long a load that
    runs out of GPU memory another process holds waits for it (:meth:`while_held`; None: not at all)."""

    def __init__(self, states: Callable[[], RankState | None], place: Callable[[], tuple[int, int, int | None]],
                 label: str, staging: bool, held_wait_s: float | None = None) -> None:
        self._states, self._place, self.label, self.staging = states, place, label, staging
        self.held_wait_s = held_wait_s
        self._writer: AsyncShardWriter | None = None
        self._storages: dict = {}
        self._staging_prepared: frozenset = frozenset()  # parts of the state whose buffers are allocated
        self._save_finite = True  # whether the state of the save in flight was all finite

    def _storage(self, root: str, storage_options: dict | None) -> Storage:
        key = (root, repr(sorted((storage_options or {}).items())))
        if key not in self._storages:
            self._storages[key] = Storage(root, storage_options)
        return self._storages[key]

    def _new_writer(self, buffers=None) -> AsyncShardWriter:
        rank, _, generation = self._place()
        return AsyncShardWriter(name=f"ckpt-{self.label}-{rank}", buffers=buffers, generation=generation)

    def _checkpoint_writer(self) -> AsyncShardWriter:
        if self._writer is None:
            self._writer = self._new_writer()
        return self._writer

    def reset(self) -> None:
        """Drop a write left over from before a recovery (its step is never committed).

        The staging buffers are kept for the next writer when nothing is writing from them."""
        writer, self._writer = self._writer, None
        self._staging_prepared = frozenset()
        if writer is not None:
            buffers = writer.close(timeout=30)
            if buffers is not None:
                self._writer = self._new_writer(buffers)

    def close(self) -> None:
        """Finish the write in flight (up to 30 s) and stop the writer."""
        if self._writer is not None:
            self._writer.close(timeout=30)
            self._writer = None

    def prepare_staging(self) -> bool:
        """Allocate the host buffers of the next async save now, in the writer's thread.

        Call it once the model is built (sizes the model's buffers) and after every update
        (sizes the optimizer's once it has state; a no-op afterwards). AdamW's moments exist only
        after its first step, and they must not be created early: ``get_optimizer_state_dict``
        on an optimizer without state runs a zero-learning-rate step, which AdamW counts as its
        first, changing every later update. Nothing is allocated while checkpoints are off or
        synchronous. Returns whether an allocation was started."""
        states = self._states()
        if not self.staging or states is None or "optim" in self._staging_prepared:
            return False
        if states.optimizer_started():
            state, part = states.checkpoint_state(), "optim"
        elif "model" not in self._staging_prepared:
            state, part = {"model": states.model_state()}, "model"
        else:
            return False
        rank, world_size, _ = self._place()
        self._checkpoint_writer().preallocate(state, rank, world_size=world_size, rank_local=states.rank_local())
        self._staging_prepared = self._staging_prepared | {part}
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, storage_options: dict | None, rel_dir: str, async_save: bool):
        """Save this rank's shards under ``rel_dir``; async returns None at once (poll with
        :meth:`done`). A synchronous save that the storage refuses returns :func:`storage_failure`."""
        storage = self._storage(root, storage_options)
        states, (rank, _, _) = self._states(), self._place()
        state = states.checkpoint_state()
        self._save_finite = state_is_finite(state)
        if not async_save:
            try:
                return _records(write_shard(stage(state, rank, rank_local=states.rank_local(), copy=False), storage,
                                            rel_dir, rank), self._save_finite)
            except StorageError as exc:
                return storage_failure(exc)
        self._checkpoint_writer().stage_and_submit(state, storage, rel_dir, rank, rank_local=states.rank_local())
        return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def checkpoint_done(self, timeout_s: float = 0.0):
        """Records of the last async save once written; None while it is still being written;
        ``[]`` when this process holds no save (it was restarted, or its writer was reset: the
        save the controller waits for is lost); :func:`storage_failure` when the storage
        refused the write."""
        if self._writer is None:
            return []
        try:
            if not timeout_s and self._writer.busy:
                return None
            records = self._writer.wait(timeout=timeout_s or 0)
        except cf.TimeoutError:
            return None
        except StorageError as exc:
            return storage_failure(exc)
        return [] if records is None else _records(records, self._save_finite)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, root: str, storage_options: dict | None, rel_dir: str, files: list[dict],
             saved_world_size: int) -> bool:
        """Fill model, optimizer, schedule (and the rank-local parts, on the same world size) from ``rel_dir``."""
        self.reset()
        storage = self._storage(root, storage_options)
        records = [FileRecord.from_json(f) for f in files]
        states, (rank, world_size, _) = self._states(), self._place()

        def load() -> None:
            loaded = load_shard_into(states.checkpoint_state(), storage, rel_dir, records, verify=True, rank=rank)
            try:
                states.load_checkpoint_state(loaded, same_world_size=saved_world_size == world_size)
            except KeyError as exc:
                raise CheckpointFormatError(f"{rel_dir}: {exc.args[0]}") from exc

        self.while_held(load, states, "its checkpoint load")
        self.prepare_staging()
        return True

    def while_held(self, attempt: Callable[[], None], states: RankState, what: str) -> None:
        """``attempt()``, a load of the rank's whole state (``what``); where it runs out of GPU
        memory another process still holds (the process this one replaced), the optimizer state it
        left half made is dropped and it runs again once that memory is free, within
        :attr:`held_wait_s` (:func:`~resilient_rl.workers.held_memory.retry_while_held`)."""
        if self.held_wait_s is None:
            attempt()
            return
        engine = states.engine
        retry_while_held(attempt, lambda: getattr(getattr(engine, "plan", None), "device", None), self.held_wait_s,
                         f"{self.label} rank {self._place()[0]}", what, undo=lambda: forget_optimizer_state(engine))
