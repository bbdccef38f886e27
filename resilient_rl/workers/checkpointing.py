"""Worker side of checkpoints: what a trainable role saves and how it comes back.

A role's state is its :class:`~resilient_rl.workers.rank_state.RankState`: model and optimizer
shards (DTensors under FSDP2), its LR schedule, its RNG state (rank-local) and any part the role
registered. Saving stages the shards to host memory (the only part the training step
waits for) and writes them in a background thread; the controller asks later whether the write
finished and commits the step once every rank of every role has written. Loading fills the
current (possibly differently sharded) state from the saved chunks, so a run saved on N ranks
resumes on M.

The host buffers an async save stages into are allocated ahead of the first save
(:meth:`CheckpointMixin.prepare_checkpoint_staging`, in the writer's thread), because allocating
them inside the first save's stall costs seconds on a GPU (registering pinned host memory).
"""

from __future__ import annotations

import concurrent.futures as cf

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from resilient_rl.checkpoint import AsyncShardWriter, FileRecord, Storage, load_shard_into, stage, write_shard
from resilient_rl.checkpoint.retry import is_outage
from resilient_rl.runtime.dispatch import Dispatch, register
from resilient_rl.errors import CheckpointFormatError, StorageError
from resilient_rl.workers.rank_state import states_of


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


class CheckpointMixin:
    """Adds save/poll/load of ``self.engine`` (model, optimizer, scheduler) to a role worker."""

    _writer: AsyncShardWriter | None = None
    _storages: dict | None = None
    _staging_prepared: frozenset = frozenset()  # parts of the state whose buffers are allocated
    _save_finite: bool = True  # whether the state of the save in flight was all finite

    def _storage(self, root: str, storage_options: dict | None) -> Storage:
        if self._storages is None:
            self._storages = {}
        key = (root, repr(sorted((storage_options or {}).items())))
        if key not in self._storages:
            self._storages[key] = Storage(root, storage_options)
        return self._storages[key]

    def _state(self) -> dict:
        """What a checkpoint of this rank saves: its :class:`~resilient_rl.workers.rank_state.RankState`."""
        return states_of(self.engine).checkpoint_state()

    def _rank_local(self) -> tuple[str, ...]:
        return states_of(self.engine).rank_local()

    def reset_checkpoint_writer(self) -> None:
        """Drop a write left over from before a recovery (its step is never committed).

        The staging buffers are kept for the next writer when nothing is writing from them."""
        writer, self._writer = self._writer, None
        self._staging_prepared = frozenset()
        if writer is not None:
            buffers = writer.close(timeout=30)
            if buffers is not None:
                self._writer = self._new_writer(buffers)

    def _new_writer(self, buffers=None) -> AsyncShardWriter:
        return AsyncShardWriter(name=f"ckpt-{getattr(self, 'role', 'worker')}-{self.rank}", buffers=buffers,
                                generation=getattr(self, "generation", None))

    def _checkpoint_writer(self) -> AsyncShardWriter:
        if self._writer is None:
            self._writer = self._new_writer()
        return self._writer

    def prepare_checkpoint_staging(self) -> bool:
        """Allocate the host buffers of the next async save now, in the writer's thread.

        Call it once the model is built (sizes the model's buffers) and after every update
        (sizes the optimizer's once it has state; a no-op afterwards). AdamW's moments exist only
        after its first step, and they must not be created early: ``get_optimizer_state_dict``
        on an optimizer without state runs a zero-learning-rate step, which AdamW counts as its
        first, changing every later update. Nothing is allocated while checkpoints are off or
        synchronous. Returns whether an allocation was started."""
        cfg = getattr(self, "cfg", None)  # hosts without a run config (export tools) only load
        e = getattr(self, "engine", None)
        if cfg is None or e is None or "optim" in self._staging_prepared:
            return False
        if not (cfg.checkpoint.async_save and cfg.checkpoint.save_every > 0):
            return False
        if e.optimizer.state:
            state, part = self._state(), "optim"
        elif "model" not in self._staging_prepared:
            state, part = {"model": get_model_state_dict(e.model)}, "model"
        else:
            return False
        self._checkpoint_writer().preallocate(state, self.rank, world_size=self.world_size, rank_local=self._rank_local())
        self._staging_prepared = self._staging_prepared | {part}
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, storage_options: dict | None, rel_dir: str, async_save: bool):
        """Save this rank's shards under ``rel_dir``; async returns None at once (poll with checkpoint_done).

        A synchronous save that the storage refuses returns :func:`storage_failure`."""
        storage = self._storage(root, storage_options)
        state = self._state()
        self._save_finite = state_is_finite(state)
        if not async_save:
            try:
                return _records(write_shard(stage(state, self.rank, rank_local=self._rank_local(), copy=False), storage,
                                            rel_dir, self.rank), self._save_finite)
            except StorageError as exc:
                return storage_failure(exc)
        self._checkpoint_writer().stage_and_submit(state, storage, rel_dir, self.rank, rank_local=self._rank_local())
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
        """Fill model, optimizer, schedule (and RNG, on the same world size) from ``rel_dir``."""
        self.reset_checkpoint_writer()
        storage = self._storage(root, storage_options)
        records = [FileRecord.from_json(f) for f in files]
        template = self._state()
        loaded = load_shard_into(template, storage, rel_dir, records, verify=True, rank=self.rank)
        try:
            states_of(self.engine).load_checkpoint_state(loaded, same_world_size=saved_world_size == self.world_size)
        except KeyError as exc:
            raise CheckpointFormatError(f"{rel_dir}: {exc.args[0]}") from exc
        self.prepare_checkpoint_staging()
        return True
