"""A rank's state is declared once (workers/rank_state.py): a part a role registers is carried by
checkpoints, by snapshots (in the process and through node memory's JSON metadata) and restored
by both, with no other change."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from resilient_rl.errors import CheckpointError
from resilient_rl.workers.snapshots import meta as snapshot_meta
from resilient_rl.workers.checkpointing import RankCheckpointer
from resilient_rl.workers.rank_state import RankState, states_of
from resilient_rl.workers.snapshots.parts import attach_snapshot_parts


class Visits:
    """A role's own piece of state: a count and a small tensor (as a data sampler's would be)."""

    def __init__(self):
        self.count, self.seen = 0, torch.zeros(3, dtype=torch.int64)

    def state_dict(self):
        return {"count": self.count, "seen": self.seen.clone()}

    def load_state_dict(self, state):
        self.count, self.seen = int(state["count"]), state["seen"].clone()


class Rank:
    """Rank 0 of 1 of a trainable role, without Ray: a model, AdamW, a schedule and Visits."""

    role, rank, world_size = "actor", 0, 1

    def __init__(self, form: str = "fused"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{form: True})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        self.engine = SimpleNamespace(model=model, optimizer=opt, scheduler=sched)
        self.visits = Visits()
        states_of(self.engine).register("visits", self.visits)
        self.checkpointer = RankCheckpointer(lambda: states_of(self.engine), lambda: (0, 1, None), "actor",
                                             staging=False)
        attach_snapshot_parts(self, lambda: states_of(self.engine), lambda: (0, 1), self.checkpointer)

    def train(self, step: int) -> None:
        e = self.engine
        e.model(torch.full((2, 4), float(step))).pow(2).mean().backward()
        e.optimizer.step()
        e.optimizer.zero_grad(set_to_none=True)
        e.scheduler.step()
        self.visits.count += 1
        self.visits.seen[step % 3] += 1

    def fingerprint(self) -> tuple:
        e = self.engine
        return ({k: v.clone() for k, v in e.model.state_dict().items()}, e.scheduler.last_epoch,
                self.visits.count, self.visits.seen.clone(), torch.get_rng_state().clone())


def same(a: tuple, b: tuple) -> bool:
    weights_a, *rest_a = a
    weights_b, *rest_b = b
    return all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a) and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(rest_a, rest_b))


def test_a_registered_part_is_snapshotted_and_restored():
    rank = Rank()
    rank.train(0)
    rank.snapshots.take_snapshot(1)
    _, taken = rank.snapshots.publish_snapshot(1)
    at = rank.fingerprint()
    rank.train(1)
    torch.rand(4)
    assert not same(rank.fingerprint(), at)
    assert rank.snapshot_restorer.load_snapshot(1) is True  # its own copy
    assert same(rank.fingerprint(), at)
    # A copy read by another process from node memory: the metadata's JSON carries the part too.
    meta = {k: v for k, v in taken["roles"]["actor"].items() if k != "data"}
    back = snapshot_meta.decode(snapshot_meta.encode(meta), "test")
    assert back["extra"]["states"]["visits"]["count"] == 1
    assert torch.equal(back["extra"]["states"]["visits"]["seen"], torch.tensor([1, 0, 0]))
    assert torch.equal(back["extra"]["states"]["rng"]["torch"], meta["extra"]["states"]["rng"]["torch"])
    fresh = Rank()
    assert fresh.snapshot_restorer.load_snapshot(1, dict(back, data=taken["roles"]["actor"]["data"])) is True
    assert same(fresh.fingerprint(), at)


def test_a_registered_part_is_checkpointed_and_restored(tmp_path):
    rank = Rank()
    rank.train(0)
    rank.train(1)
    records = rank.checkpointer.save_checkpoint(str(tmp_path), None, "step_2/actor", False)
    at = rank.fingerprint()
    rank.train(2)
    torch.rand(4)
    assert rank.checkpointer.load_checkpoint(str(tmp_path), None, "step_2/actor", records, 1) is True
    assert same(rank.fingerprint(), at)
    # A rank that registers a part the checkpoint does not hold is told which one.
    other = Rank()
    states_of(other.engine).register("sampler", Visits())
    with pytest.raises(CheckpointError, match="sampler"):
        other.checkpointer.load_checkpoint(str(tmp_path), None, "step_2/actor", records, 1)


def test_a_part_name_is_taken_once():
    state = RankState(SimpleNamespace())
    with pytest.raises(ValueError, match="already has a part named 'rng'"):
        state.register("rng", Visits())
    with pytest.raises(ValueError, match="'model'"):
        state.register("model", Visits())
    assert state.rank_local() == ("rng",)


def test_a_checkpoint_of_the_other_adamw_form_loads_into_the_form_the_optimizer_was_built_with(tmp_path):
    """A checkpoint carries its AdamW form (fused or foreach) in its parameter groups; a rank built
    with the other form loads it and keeps its own, with each step count where its form reads it,
    and goes on as the rank that wrote it does, within fp32 rounding."""
    from resilient_rl.config.schema import OptimConfig
    from resilient_rl.workers.optimizer import build_optimizer

    assert build_optimizer(torch.nn.Linear(2, 2), OptimConfig()).defaults["fused"] is True  # the CPU has the kernel
    for saved_form, loaded_form in (("foreach", "fused"), ("fused", "foreach")):
        writer = Rank(saved_form)
        writer.train(0)
        writer.train(1)
        records = writer.checkpointer.save_checkpoint(str(tmp_path / saved_form), None, "step_2/actor", False)
        reader = Rank(loaded_form)
        reader.train(0)  # moments to load into
        assert reader.checkpointer.load_checkpoint(str(tmp_path / saved_form), None, "step_2/actor", records, 1)
        opt = reader.engine.optimizer
        assert all(g[loaded_form] is True and not g["fused" if loaded_form == "foreach" else "foreach"]
                   for g in opt.param_groups)
        for p in reader.engine.model.parameters():
            step = opt.state[p]["step"]
            assert step.dtype == torch.float32 and float(step) == 2.0
        writer.train(2)
        reader.train(2)
        for a, b in zip(writer.engine.model.parameters(), reader.engine.model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
