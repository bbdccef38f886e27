"""Checkpoints written the way a 2-rank worker group writes them, for tests of the checkpoint code.

:func:`checkpoint_root` picks a storage (local folder, ``memory://`` or the moto S3 server of the
tests' ``moto`` fixture); :func:`save_step` stages and writes every rank's shard of a small
state (:func:`step_state`) plus the controller's trainer state, and commits the step;
:func:`load_step` reads one rank's shard back. Retries are fast (:data:`FAST`), so a test of
storage faults does not sleep through real backoff. :func:`listings` records the folders a storage
lists; :func:`faulty_store` is a ``memory://`` root behind a fault-injecting filesystem that counts
(and may delay) every request, listing like a folder tree or like an object store.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import torch

from resilient_rl.checkpoint import CheckpointManager, RetryPolicy, Storage, load_shard_into, stage, write_shard
from resilient_rl.checkpoint.manifest import FileRecord
from resilient_rl.faults.storage import FaultPlan, FaultyFileSystem, faulty_url

#: Retries with millisecond backoff.
FAST = RetryPolicy(attempts=5, initial_s=0.001, max_s=0.01)


def checkpoint_root(kind: str, tmp_path, moto: Any) -> tuple[str, dict | None]:
    """``(root URL, storage options)`` of a fresh checkpoint root of ``kind`` (local, memory, s3).

    ``moto`` is the tests' moto fixture: a server, or the reason it cannot start (the test is
    then skipped)."""
    if kind == "local":
        return str(tmp_path / "ckpt"), None
    if kind == "memory":
        return f"memory://mgr-{uuid.uuid4().hex}", None
    if isinstance(moto, str):
        import pytest

        pytest.skip(f"moto_server cannot start here: {moto}")
    return f"s3://ckpt/{uuid.uuid4().hex}", moto.storage_options


def faulty_store(plan: FaultPlan | None = None, strategy: str = "") -> tuple[str, dict, FaultyFileSystem]:
    """A fresh ``memory://`` root behind a :class:`FaultyFileSystem` following ``plan``: its URL,
    storage options and the filesystem instance that every Storage opened with them shares (its
    ``requests`` and ``on_request`` see what they ask). ``strategy="put"`` has it write and list
    like an object store (a folder tree in one recursive listing); by default it lists folder by
    folder."""
    name = uuid.uuid4().hex
    url, options = faulty_url(f"memory://store-{name}", plan, name=name)
    fs = fsspec.filesystem("faulty", **options)
    if strategy:
        fs.rrl_write_strategy = strategy
    return url, options, fs


def step_state(step: int, rank: int) -> dict:
    """A rank's state at ``step``: a replicated tensor and a rank-local RNG entry."""
    return {"w": torch.arange(6, dtype=torch.float32) * step, "step": step,
            "rng": {"seed": 1000 * step + rank, "state": torch.full((64,), rank, dtype=torch.uint8)}}


def save_step(manager: CheckpointManager, step: int, world: int = 2, commit: bool = True,
              storage: Storage | None = None) -> dict:
    """Write the ``actor`` shards of ``world`` ranks (played in turn) and the trainer state of
    ``step``; commit it unless ``commit`` is false. Returns the file records per role."""
    storage = storage or Storage(manager.storage.url, manager.storage_options, FAST)
    records = []
    for rank in range(world):
        staged = stage(step_state(step, rank), rank, world_size=world, rank_local=("rng",))
        records += write_shard(staged, storage, manager.role_dir(step, "actor"), rank)
    manager.write_trainer_state(step, {"step": step, "data": {"epoch": 0, "index": 3 * step}})
    if commit:
        manager.commit(step, {"actor": records}, {"actor": world}, config_digest="cfg-1")
    return {"actor": records}


def save_shard_files(manager: CheckpointManager, step: int, ranks: int, roles: tuple[str, ...] = ("actor", "critic"),
                     content: Callable[[str, int, str], bytes] | None = None) -> None:
    """Commit ``step`` with the file pair (``.safetensors``, ``.json``) of ``ranks`` ranks in each
    of ``roles``, as many files as a real save but no state: ``content(role, rank, suffix)`` is a
    file's bytes (by default a few bytes naming it)."""
    files = {}
    for role in roles:
        records = []
        for rank in range(ranks):
            for suffix in (".safetensors", ".json"):
                name = f"shard_{rank:05d}{suffix}"
                data = content(role, rank, suffix) if content else f"{role}{step}{rank}{suffix}".encode()
                rec = manager.storage.write_bytes_atomic(Storage.join(manager.step_rel(step), role, name), data)
                records.append(FileRecord(name, rec.size, rec.sha256))
        files[role] = records
    manager.write_trainer_state(step, {"step": step})
    manager.commit(step, files, {role: ranks for role in roles}, verify_content=False)


def load_step(manager: CheckpointManager, step: int, rank: int = 0) -> dict:
    """Rank ``rank``'s ``actor`` state of committed ``step``."""
    template = {"w": torch.zeros(6), "rng": {"seed": 0, "state": torch.zeros(64, dtype=torch.uint8)}, "step": 0}
    return load_shard_into(template, Storage(manager.role_dir(step, "actor"), manager.storage_options), "",
                           manager.role_files(step, "actor"), rank=rank)


@contextlib.contextmanager
def listings(storage: Storage) -> Iterator[list[tuple[str, str]]]:
    """Record every listing ``storage`` makes inside the block, in order, as ``("find", path)``
    (a whole tree) or ``("ls", path)`` (one folder's names)."""
    calls: list[tuple[str, str]] = []
    real = {name: getattr(storage, name) for name in ("find", "ls")}

    def counted(name: str):
        def call(path: str = "", *args: Any, **kwargs: Any) -> Any:
            calls.append((name, path))
            return real[name](path, *args, **kwargs)
        return call
    for name in real:
        setattr(storage, name, counted(name))
    try:
        yield calls
    finally:
        for name in real:
            delattr(storage, name)
