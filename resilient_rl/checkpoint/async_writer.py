"""Background writing of staged shards: one thread, one save in flight.

The training step is blocked only while :func:`~resilient_rl.checkpoint.sharded.stage` copies
the state to host memory; :class:`AsyncShardWriter` then writes it while training goes on.
Submitting a new save while one is still being written first waits for it, so a caller never
has more than one outstanding save (and never more than two staged copies in memory).
:meth:`AsyncShardWriter.stage_and_submit` also keeps the staged buffers for the next save, so
the stall of later saves is a plain memory copy, without page faults on fresh memory.
:meth:`AsyncShardWriter.preallocate` sizes and allocates those buffers ahead of the first save
(on the writer's thread), so that the first save stalls no longer than the later ones.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Mapping
from typing import Any

from resilient_rl.checkpoint.manifest import FileRecord
from resilient_rl.checkpoint.sharded import (StagedShard, allocate_staging, default_rank, stage,
                                             staging_spec, write_shard)
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.checkpoint.write_guard import not_committed
from resilient_rl.errors import CheckpointError, CheckpointTimeoutError

log = logging.getLogger(__name__)


class AsyncShardWriter:
    """Writes staged shards on one background thread; exceptions come back through the future."""

    def __init__(self, name: str = "rrl-ckpt-writer", buffers: StagedShard | None = None,
                 generation: int | None = None):
        """``buffers``: host buffers to stage the first save into (e.g. those of a writer that
        was closed after a recovery); nothing may still be reading them. ``generation``: the
        process-group generation this writer's saves belong to; a save still writing after its
        step was committed by a later one drops its files (:mod:`~resilient_rl.checkpoint.write_guard`)."""
        self.generation = generation
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.RLock()
        self._pending: cf.Future[list[FileRecord]] | None = None
        self._buffers: StagedShard | None = buffers
        self._preparing: cf.Future[StagedShard] | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        """Whether a save is still being written."""
        pending = self._pending
        return pending is not None and not pending.done()

    @property
    def buffers(self) -> StagedShard | None:
        """The host buffers the next :meth:`stage_and_submit` stages into (None before any).

        Buffers being allocated by :meth:`preallocate` show up once allocated."""
        preparing = self._preparing
        if preparing is not None and preparing.done() and preparing.exception() is None:
            return preparing.result()
        return self._buffers

    def preallocate(self, state: Mapping[str, Any], rank: int | None = None, *,
                    world_size: int = 1, rank_local: tuple[str, ...] = ()) -> cf.Future[StagedShard]:
        """Allocate, on the writer's thread, the host buffers a save of ``state`` stages into.

        Only the shapes are read here (no copy), so this costs the caller next to nothing; the
        allocation runs after any save in flight, and the next :meth:`stage_and_submit` waits
        for it (waiting for a half-done allocation is never slower than allocating). ``state``
        may be part of what is saved later (the model, before the optimizer has state): buffers
        allocated earlier are kept. A failed allocation (e.g. no pinned memory left) is logged
        and the save allocates as usual. Returns the allocation's future."""
        rank = default_rank() if rank is None else rank
        spec = staging_spec(state, rank, rank_local=rank_local)
        with self._lock:
            if self._closed:
                raise CheckpointError("AsyncShardWriter is closed; cannot preallocate")
            previous, base = self._preparing, self._buffers

            def allocate() -> StagedShard:
                # The pool has one thread: an earlier preallocation has finished by now.
                reuse = base
                if previous is not None and not previous.cancelled() and previous.exception() is None:
                    reuse = previous.result()
                return allocate_staging(spec, rank, world_size, rank_local=tuple(rank_local),
                                        reuse=reuse)

            self._preparing = self._pool.submit(allocate)
            return self._preparing

    def _take_prepared(self) -> StagedShard | None:
        """Wait for a preallocation in progress and adopt its buffers (caller holds the lock)."""
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            try:
                self._buffers = preparing.result()
            except Exception as exc:  # noqa: BLE001 -- the save itself allocates instead
                log.warning("preallocating checkpoint staging buffers failed (%r); the next save "
                            "allocates its own", exc)
        return self._buffers

    def submit(self, staged: StagedShard, storage: Storage, dir_path: str,
               rank: int | None = None) -> cf.Future[list[FileRecord]]:
        """Start writing ``staged`` to ``dir_path``; waits for the previous save first.

        The previous save's outcome (records or error) stays in its own future."""
        with self._lock:
            if self._closed:
                raise CheckpointError("AsyncShardWriter is closed; cannot submit a save")
            if self._pending is not None:
                cf.wait([self._pending])
            guard = not_committed(storage, dir_path, self.generation)
            self._pending = self._pool.submit(write_shard, staged, storage, dir_path, rank, guard=guard)
            return self._pending

    def stage_and_submit(self, state: Mapping[str, Any], storage: Storage, dir_path: str,
                         rank: int | None = None, rank_local: tuple[str, ...] = ()
                         ) -> cf.Future[list[FileRecord]]:
        """Stage ``state`` into the host buffers of this writer's previous save, then submit it.

        Waits for the save in flight first (its buffers are about to be overwritten). Reusing
        the buffers makes the step stall a plain memory copy; the cost is one staged copy of
        the shard kept in memory between saves."""
        with self._lock:
            if self._closed:
                raise CheckpointError("AsyncShardWriter is closed; cannot submit a save")
            if self._pending is not None:
                cf.wait([self._pending])
            staged = stage(state, rank, rank_local=rank_local, reuse=self._take_prepared())
            self._buffers = staged
            return self.submit(staged, storage, dir_path, rank)

    def wait(self, timeout: float | None = None) -> list[FileRecord] | None:
        """Wait for the save in flight (if any) and return its records; re-raises its error.

        Raises CheckpointTimeoutError (a TimeoutError) when it does not finish within
        ``timeout`` seconds; ``timeout=0`` polls."""
        pending = self._pending
        if pending is None:
            return None
        try:
            return pending.result(timeout=timeout)
        except cf.TimeoutError as exc:
            if pending.done():  # the write itself raised a TimeoutError
                raise
            raise CheckpointTimeoutError(
                f"the background checkpoint write did not finish within {timeout}s") from exc

    def close(self, timeout: float | None = None) -> StagedShard | None:
        """Wait for the save in flight (its error, if any, is logged, not raised) and stop.

        Returns the staging buffers (a preallocation still running is waited for, one not
        started is skipped) for a new writer to reuse, or None when a write may still be
        reading them (it did not finish within ``timeout``)."""
        with self._lock:
            self._closed = True
            buffers, self._buffers = self._buffers, None
            preparing, self._preparing = self._preparing, None
        if preparing is not None:
            preparing.cancel()  # only succeeds if it has not started; else the shutdown waits for it
        pending = self._pending
        if pending is not None:
            done, _ = cf.wait([pending], timeout=timeout)
            if not done:
                log.warning("closing AsyncShardWriter with a save still being written")
            elif pending.exception() is not None:
                log.warning("the last background checkpoint write failed: %r", pending.exception())
        idle = pending is None or pending.done()
        self._pool.shutdown(wait=idle)
        if not idle:
            return None
        if preparing is not None and preparing.done() and not preparing.cancelled() \
                and preparing.exception() is None:
            buffers = preparing.result()
        return buffers

    def __enter__(self) -> "AsyncShardWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
