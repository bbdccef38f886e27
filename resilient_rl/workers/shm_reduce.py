"""Averaging CPU tensors over ranks that share a host, through shared memory.

A gloo all-reduce of a small buffer between two processes on one busy host costs about 2 ms: the
ring makes several socket round trips, each of which wakes threads of the peer. For the replicas
of a small model on CPU that is as long as a mini-batch's forward and backward, once per
optimizer step. Ranks that can map the same shared-memory segment instead each write their
tensors into a slot of it, meet at a :class:`~resilient_rl.workers.pipe_barrier.PipeBarrier`
and each sum the slots in rank order: no bytes of the tensors cross a socket, and no thread but
the caller's is woken.

The barrier fails the way a collective does: a dead peer makes it raise at once, a hung one
after the group's timeout. Every rank sums the same slots in the same order with the same kernel,
so every rank holds the same bits.

The segment has two sets of slots used in turn: a rank that writes round ``k + 2`` has passed the
barrier of round ``k + 1``, which its peers enter only after reading round ``k``, so one barrier per
round is enough. Its files (the segment and the pipes) are removed as soon as every rank has
opened them, so none outlives the group, whichever process dies.
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from resilient_rl.workers.pipe_barrier import PipeBarrier, create_fifos, unlink_quietly

logger = logging.getLogger(__name__)

#: Where the segment and the pipes are created; a rank that cannot open them there (another host,
#: another IPC namespace) makes the whole group fall back to the group's own all-reduce.
SHM_DIR = "/dev/shm"
#: Largest segment (2 x world x tensors' bytes). Above it a reduction is bandwidth-bound and the
#: group's all-reduce moves the bytes about as fast, without the memory.
MAX_SEGMENT_BYTES = 64 * 2**20


class SharedMemoryReducer:
    """Averages lists of tensors of ``numel`` elements in all over the default group (see the
    module docstring), without allocating: each rank packs its tensors straight into its slot and
    unpacks the mean from a buffer of its own.

    Every rank of the group must call :meth:`average_` the same number of times, in the same order
    as its other collectives, as with any collective."""

    def __init__(self, segment: torch.Tensor, barrier: PipeBarrier):
        self._slots = segment  # [2, world, numel], shared with every rank of the group
        self._barrier = barrier
        self.rank, self.world = barrier.rank, barrier.world
        self._round = 0
        self._mean = torch.empty(segment.shape[2], dtype=segment.dtype)
        self._views: dict[tuple, list[torch.Tensor]] = {}

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Each of ``tensors`` (``numel`` elements together, the same shapes on every rank)
        replaced, in place, by its mean over the group's ranks."""
        slots = self._slots[self._round % 2]
        self._round += 1
        torch.cat([t.reshape(-1) for t in tensors], out=slots[self.rank])
        self._barrier.wait()
        torch.sum(slots, dim=0, out=self._mean)
        self._mean.div_(self.world)
        torch._foreach_copy_(tensors, self._views_like(tensors))

    def _views_like(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the mean buffer shaped like ``tensors`` (made once per list of shapes)."""
        shapes = tuple(t.shape for t in tensors)
        views = self._views.get(shapes)
        if views is None:
            parts = self._mean.split([t.numel() for t in tensors])
            views = self._views[shapes] = [p.view(shape) for p, shape in zip(parts, shapes)]
        return views

    def close(self) -> None:
        self._barrier.close()


def open_reducer(numel: int, dtype: torch.dtype) -> SharedMemoryReducer | None:
    """A reducer for lists of tensors of ``numel`` elements in all of ``dtype`` over the default
    group, or None where shared memory cannot serve every rank (too large, no shared directory, a
    rank on another host). A collective: every rank of the group calls it, at the same point."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = 2 * world * numel * dtype.itemsize
    if nbytes > MAX_SEGMENT_BYTES:  # the same on every rank: no collective needed to agree
        return None
    created: list[str] = []
    segment = barrier = None
    try:
        name = None
        if rank == 0:
            name, created = _create(nbytes, world)
        names = [name]
        dist.broadcast_object_list(names, src=0)
        if names[0] is not None:
            # Each rank looks in its own shared directory: one on another host does not find it.
            prefix = os.path.join(SHM_DIR, names[0])
            segment = _map(prefix, nbytes, numel, dtype, world)
            barrier = PipeBarrier(prefix, rank, world, _group_timeout_s())
        # Write ends open only once every rank's read ends are: two rounds of agreement.
        ok = _everyone(segment is not None and barrier.open_readers())
        ok = _everyone(ok and barrier.open_writers())
    finally:
        for path in created:  # every rank has opened them (or given up): rank 0 removes them
            unlink_quietly(path)
    if not ok:
        if barrier is not None:
            barrier.close()
        logger.info("rank %d: shared memory does not reach every rank; averaging with all-reduce", rank)
        return None
    return SharedMemoryReducer(segment, barrier)


def _create(nbytes: int, world: int) -> tuple[str | None, list[str]]:
    """(name, paths) of a new segment of ``nbytes`` and its pipes in :data:`SHM_DIR` (rank 0);
    (None, []) where they cannot be made."""
    if not os.path.isdir(SHM_DIR) or not hasattr(os, "posix_fallocate"):
        return None, []
    # The creator's pid in the name: a segment left by a rank killed in set-up is removed by the
    # next start on this node once that process is gone (resilient_rl.workers.snapshots.node_sweep).
    name = f"rrl-reduce-{os.getpid()}-{uuid.uuid4().hex}"
    prefix = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(prefix, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None, []
    try:
        # Reserved now, not on first touch: a full tmpfs (a container's small /dev/shm, shared with
        # Ray's object store) refuses here instead of killing a rank with SIGBUS mid-reduction.
        os.posix_fallocate(fd, 0, nbytes)
        return name, [prefix] + create_fifos(prefix, world)
    except OSError:
        unlink_quietly(prefix)
        return None, []
    finally:
        os.close(fd)


def _everyone(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the group (a collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _group_timeout_s() -> float:
    """The default group's collective timeout (torch's default where it cannot be read)."""
    try:
        timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        timeout = dist.constants.default_pg_timeout
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _map(path: str, nbytes: int, numel: int, dtype: torch.dtype, world: int) -> torch.Tensor | None:
    """The segment at ``path`` as a ``[2, world, numel]`` tensor, or None where this rank cannot map it."""
    try:
        if os.path.getsize(path) != nbytes:
            return None
        return torch.from_file(path, shared=True, size=2 * world * numel, dtype=dtype).view(2, world, numel)
    except (OSError, RuntimeError):
        return None


class ReducerCache:
    """The reducers of the current default group, one per buffer size and dtype (an actor and a
    critic in one process each get theirs). A new group (a new generation) starts afresh: the old
    reducers and their segments go with the old group."""

    def __init__(self):
        self._group = None
        self._reducers: dict[tuple[int, torch.dtype], SharedMemoryReducer | None] = {}

    def get(self, numel: int, dtype: torch.dtype) -> SharedMemoryReducer | None:
        """The reducer for lists of tensors of ``numel`` elements in all of ``dtype``, or None (see
        :func:`open_reducer`)."""
        # A collective on the first use of a size and dtype in a group.
        group = dist.group.WORLD
        if group is not self._group:
            for reducer in self._reducers.values():
                if reducer is not None:
                    reducer.close()
            self._group, self._reducers = group, {}
        key = (numel, dtype)
        if key not in self._reducers:
            self._reducers[key] = open_reducer(numel, dtype)
        return self._reducers[key]
