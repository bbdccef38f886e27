"""One step's snapshot as the controller tracks it (:mod:`resilient_rl.workers.snapshots.keeper`):
the object references of every rank's answers and copies, who holds which copy, and how far it
got (complete, failed, unfinished).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Snapshot:
    """One step's snapshot as the controller tracks it."""

    step: int
    trainer_state: dict
    world_sizes: dict[str, int]
    takes: dict[str, list]  # role -> ObjectRef of each rank's copy (what its process's publish_snapshot returned), None where not published
    done: dict[str, list]  # role -> ObjectRef of each rank's take_snapshot answer (the bytes of its copy)
    published: list  # ObjectRef of each publish_snapshot's small answer (its copies are stored)
    holds: list[tuple[Any, list[tuple[str, int]]]]  # ObjectRef of each hold_snapshot, the (role, rank) it keeps
    holders: dict[str, list]  # role -> the (role, rank) holding each rank's peer copy, None where none does
    node: dict[str, list]  # role -> each rank's NodeCopy, None where none
    process_of: dict  # (role, rank) -> key of its process
    sealed: list = dataclasses.field(default_factory=list)  # ObjectRef of each process's seal_snapshot (checksums)
    caller: dict = dataclasses.field(default_factory=dict)  # id of each answer's ObjectRef -> key of the process asked
    failed: bool = False
    complete: bool = False
    # Every answer is in, and those that failed are of processes that died (``suspects``, their
    # keys): each rank may still have a whole copy somewhere. See :meth:`SnapshotKeeper.restore`.
    unfinished: bool = False
    suspects: set = dataclasses.field(default_factory=set)
    carried: bool = False  # left in node memory by an earlier controller of the run (snapshot_carry)
    bytes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # per role and rank, once complete

    def answers(self) -> tuple[list, list]:
        """(each process's take answer, every answer: takes, seals, publishes, holds)."""
        takes = list({id(r): r for rs in self.done.values() for r in rs}.values())
        return takes, takes + self.sealed + self.published + [r for r, _ in self.holds]
