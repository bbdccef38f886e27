"""One rank of a trainable role hosted in this process, with the worker-group calls that
:class:`~resilient_rl.checkpoint.coordinator.CheckpointCoordinator` makes.

It runs the real worker checkpoint code (:class:`~resilient_rl.workers.checkpointing.RankCheckpointer`)
around a single-process engine, so the controller's save/commit/restore protocol can be tested
without Ray. A group call returns one result per rank, as a Ray worker group's does.
"""

from __future__ import annotations


from resilient_rl.runtime.pool import STATEFUL_ROLES
from resilient_rl.workers.checkpointing import RankCheckpointer
from resilient_rl.workers.rank_state import states_of


class LocalRank:
    """Rank 0 of a world of 1 holding ``engine`` (model, optimizer, scheduler), with the
    checkpointer a worker hands its state (synchronous saves need no staging)."""

    def __init__(self, role: str, engine):
        self.role, self.engine = role, engine
        self.checkpointer = RankCheckpointer(lambda: states_of(engine), lambda: (0, 1, None), role, staging=False)


class LocalGroup:
    """A worker group of one :class:`LocalRank`."""

    world_size = 1

    def __init__(self, rank: LocalRank):
        self.rank = rank

    def save_checkpoint(self, *args) -> list:
        return [self.rank.checkpointer.save_checkpoint(*args)]

    def checkpoint_done(self, timeout_s: float = 0.0) -> list:
        return [self.rank.checkpointer.checkpoint_done(timeout_s)]

    def load_checkpoint(self, *args) -> list:
        return [self.rank.checkpointer.load_checkpoint(*args)]


class CheckpointOnlyPool:
    """The part of a worker pool the checkpoint coordinator uses: the groups it saves and loads."""

    def __init__(self, groups: dict[str, LocalGroup]):
        self.groups = groups

    def checkpoint_groups(self) -> list[tuple[str, LocalGroup]]:
        return [(role, self.groups[role]) for role in STATEFUL_ROLES if role in self.groups]


def local_roles(**engines) -> CheckpointOnlyPool:
    """Engines of this process as the stateful roles of a pool, for the checkpoint coordinator."""
    return CheckpointOnlyPool({role: LocalGroup(LocalRank(role, e)) for role, e in engines.items()})
