"""Worker side of checkpoints: what a trainable role saves and how it comes back.

A role's state is its model and optimizer shards (DTensors under FSDP2), its LR schedule and its
RNG state (rank-local). Saving stages the shards to host memory (the only part the training step
waits for) and writes them in a background thread; the controller asks later whether the write
finished and commits the step once every rank of every role has written. Loading fills the
current (possibly differently sharded) state from the saved chunks, so a run saved on N ranks
resumes on M.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from resilient_rl.checkpoint import AsyncShardWriter, FileRecord, Storage, load_shard_into, stage, write_shard
from resilient_rl.controller.dispatch import Dispatch, register

#: Flat-key prefixes whose values differ per rank (each rank saves and restores its own).
RANK_LOCAL = ("rng",)


def _records(records: list[FileRecord]) -> list[dict]:
    return [r.to_json() for r in records]


class CheckpointMixin:
    """Adds save/poll/load of ``self.engine`` (model, optimizer, scheduler) to a role worker."""

    _writer: AsyncShardWriter | None = None
    _storages: dict | None = None

    def _storage(self, root: str, storage_options: dict | None) -> Storage:
        if self._storages is None:
            self._storages = {}
        key = (root, repr(sorted((storage_options or {}).items())))
        if key not in self._storages:
            self._storages[key] = Storage(root, storage_options)
        return self._storages[key]

    def _state(self) -> dict:
        e = self.engine
        return {
            "model": get_model_state_dict(e.model),
            "optim": get_optimizer_state_dict(e.model, e.optimizer),
            "scheduler": e.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
        }

    def reset_checkpoint_writer(self) -> None:
        """Drop a write left over from before a recovery (its step is never committed)."""
        if self._writer is not None:
            self._writer.close(timeout=30)
            self._writer = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, storage_options: dict | None, rel_dir: str, async_save: bool):
        """Save this rank's shards under ``rel_dir``; async returns None at once (poll with checkpoint_done)."""
        storage = self._storage(root, storage_options)
        state = self._state()
        if not async_save:
            return _records(write_shard(stage(state, self.rank, rank_local=RANK_LOCAL, copy=False), storage, rel_dir,
                                        self.rank))
        if self._writer is None:
            self._writer = AsyncShardWriter(name=f"ckpt-{self.role}-{self.rank}")
        self._writer.stage_and_submit(state, storage, rel_dir, self.rank, rank_local=RANK_LOCAL)
        return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def checkpoint_done(self, timeout_s: float = 0.0):
        """Records of the last async save once written; None while it is still being written."""
        if self._writer is None:
            return []
        try:
            if not timeout_s and self._writer.busy:
                return None
            records = self._writer.wait(timeout=timeout_s or 0)
        except cf.TimeoutError:
            return None
        return None if records is None else _records(records)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, root: str, storage_options: dict | None, rel_dir: str, files: list[dict],
                        saved_world_size: int) -> bool:
        """Fill model, optimizer, schedule (and RNG, on the same world size) from ``rel_dir``."""
        self.reset_checkpoint_writer()
        storage = self._storage(root, storage_options)
        records = [FileRecord.from_json(f) for f in files]
        template = self._state()
        loaded = load_shard_into(template, storage, rel_dir, records, verify=True, rank=self.rank)
        e = self.engine
        set_model_state_dict(e.model, loaded["model"])
        set_optimizer_state_dict(e.model, e.optimizer, loaded["optim"])
        e.scheduler.load_state_dict(loaded["scheduler"])
        if saved_world_size == self.world_size and "rng" in loaded:
            torch.set_rng_state(loaded["rng"]["torch"])
        return True
