"""In-process stand-ins for the trainable roles, as the checkpoint coordinator sees them.

:class:`LocalCheckpointRoles` has the ``groups`` that
:class:`~resilient_rl.checkpoint.coordinator.CheckpointCoordinator` talks to. Each rank of a
group is a :class:`LocalCheckpointRank`: the workers' own
:class:`~resilient_rl.workers.checkpointing.RankCheckpointer` over a tiny model, AdamW and an LR
schedule, with the real background shard writer. So a coordinator test saves, commits and
restores real sharded checkpoints without Ray, and meets the faults a worker process meets:

- :meth:`LocalCheckpointGroup.restart` replaces a rank by a fresh one, as Ray does with a
  process that died: its background writer and the save it was writing are gone;
- slow, failing and unavailable storage comes from ``faulty://`` (:mod:`resilient_rl.faults.storage`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from resilient_rl.testing.local_group import CheckpointOnlyPool
from resilient_rl.workers.checkpointing import RankCheckpointer
from resilient_rl.workers.rank_state import states_of


class LocalCheckpointRank:
    """One rank of a trainable role, in this process: ``engine`` (model, optimizer, scheduler) and
    the checkpointer a worker hands its state."""

    def __init__(self, role: str, rank: int, world_size: int):
        self.role, self.rank, self.world_size = role, rank, world_size
        model = torch.nn.Linear(8, 8)
        with torch.no_grad():  # the same weights on every rank, as FSDP replicas start
            model.weight.copy_(torch.arange(64, dtype=torch.float32).reshape(8, 8) / 64)
            model.bias.zero_()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        self.engine = SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler)
        self.checkpointer = RankCheckpointer(lambda: states_of(self.engine), lambda: (rank, world_size, None), role,
                                             staging=False)

    def train_step(self, step: int) -> None:
        """One deterministic update (AdamW gets its state, so the optimizer is saved too)."""
        e = self.engine
        x = torch.full((2, 8), float(step))
        loss = e.model(x).pow(2).mean()
        e.optimizer.zero_grad()
        loss.backward()
        e.optimizer.step()
        e.scheduler.step()

    def close(self) -> None:
        self.checkpointer.close()


class LocalCheckpointGroup:
    """The ranks of one role; each call runs on every rank and returns the per-rank results."""

    def __init__(self, role: str, world_size: int):
        self.role = role
        self.ranks = [LocalCheckpointRank(role, r, world_size) for r in range(world_size)]
        self._gone: list[LocalCheckpointRank] = []  # restarted ranks: their writers still finish

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def save_checkpoint(self, *args):
        return [r.checkpointer.save_checkpoint(*args) for r in self.ranks]

    def checkpoint_done(self, timeout_s: float = 0.0):
        return [r.checkpointer.checkpoint_done(timeout_s) for r in self.ranks]

    def load_checkpoint(self, *args):
        return [r.checkpointer.load_checkpoint(*args) for r in self.ranks]

    def train_step(self, step: int) -> None:
        for r in self.ranks:
            r.train_step(step)

    def restart(self, rank: int) -> None:
        """``rank``'s process died and was restarted: a fresh rank without a writer."""
        self._gone.append(self.ranks[rank])
        self.ranks[rank] = LocalCheckpointRank(self.role, rank, self.world_size)

    def close(self) -> None:
        for r in self.ranks + self._gone:
            r.close()


class LocalCheckpointRoles(CheckpointOnlyPool):
    """``groups`` of trainable roles (default: actor and critic, one rank each).

    The ranks hold whole tensors, not FSDP shards: a group of several ranks saves and commits
    like a sharded one, but only a one-rank group's checkpoint loads back."""

    def __init__(self, world_sizes: dict[str, int] | None = None):
        super().__init__({role: LocalCheckpointGroup(role, n)
                          for role, n in (world_sizes or {"actor": 1, "critic": 1}).items()})

    def train_step(self, step: int) -> None:
        for g in self.groups.values():
            g.train_step(step)

    def close(self) -> None:
        for g in self.groups.values():
            g.close()

    def __enter__(self) -> "LocalCheckpointRoles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
