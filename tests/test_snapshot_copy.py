"""The worker-side copy path of in-memory snapshots (workers/snapshots/take.py, workers/snapshots/buffers.py):
a round trip restores model, optimizer, schedule and RNG bit for bit, in place, on plain modules
and on an FSDP2 model (gloo, world size 1)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from resilient_rl.workers.snapshots import buffers as snapshot_buffers
from resilient_rl.workers.rank_state import states_of
from resilient_rl.workers.snapshots.parts import attach_snapshot_parts
from resilient_rl.workers.snapshots.buffers import Layout, named_tensors


class Rank:
    """A stateful role's rank without Ray (rank 0 of 1): a model, AdamW and a LambdaLR, and the
    snapshot parts its worker would have."""

    rank, world_size = 0, 1

    def __init__(self, build, role: str = "actor"):
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        self.role = role
        self.engine = SimpleNamespace(model=model, optimizer=opt, scheduler=sched)
        self.resets = 0
        self.checkpointer = self  # what a restore asks of the rank's checkpointer: reset, load, re-stage
        attach_snapshot_parts(self, lambda: states_of(self.engine), lambda: (self.rank, self.world_size), self)

    def snapshot(self, step: int, roles=None) -> dict:
        """Take and publish the snapshot of ``step``, as the controller asks a process: the copies."""
        self.snapshots.take_snapshot(step, roles)
        return self.snapshots.publish_snapshot(step, roles)[1]

    def reset(self):
        self.resets += 1

    def prepare_staging(self):
        return False

    def while_held(self, attempt, states, what):
        attempt()  # no GPU another process could hold

    def train(self, seed: int) -> torch.Tensor:
        e = self.engine
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        noise = torch.rand(())  # consumes the global RNG: restored RNG must replay it
        loss = (e.model(x).pow(2).mean() + noise * 0).sum()
        loss.backward()
        e.optimizer.step()
        e.optimizer.zero_grad(set_to_none=True)
        e.scheduler.step()
        return noise

    def fingerprint(self) -> dict:
        e = self.engine
        out = {n: t.detach().clone() for n, t in named_tensors(e.model, e.optimizer)}
        out["lr"] = e.optimizer.param_groups[0]["lr"]
        out["sched"] = e.scheduler.state_dict()["last_epoch"]
        out["rng"] = torch.get_rng_state().clone()
        return out


def mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def roundtrip(rank: Rank, other: Rank, via_pickle: bool):
    """Train ``rank`` 2 steps, snapshot, train on; load the snapshot into ``other`` (or
    ``rank`` itself) and check the state and the continued training are identical."""
    for s in range(2):
        rank.train(s)
    done = rank.snapshots.take_snapshot(2)
    stored, taken = rank.snapshots.publish_snapshot(2)
    assert taken["step"] == 2 and list(taken["roles"]) == ["actor"] and stored == {"step": 2}
    assert done == {"step": 2, "bytes": {"actor": taken["roles"]["actor"]["bytes"]}, "node_failed": {}}
    snap = taken["roles"]["actor"]
    at_snapshot = rank.fingerprint()
    if via_pickle:  # as Ray hands it over (what publish_snapshot returned): the buffer as a read-only view
        snap = pickle.loads(pickle.dumps(taken, protocol=5))
        snap["roles"]["actor"]["data"].setflags(write=False)
    rank.train(2)
    noise_a = rank.train(3)
    after_a = rank.fingerprint()
    assert other.snapshot_restorer.load_snapshot(2, None if other is rank else snap) is True
    assert_same(other.fingerprint(), at_snapshot)
    other.train(2)
    noise_b = other.train(3)
    assert torch.equal(noise_a, noise_b)
    assert_same(other.fingerprint(), after_a)


def test_own_copy_round_trip_in_place():
    rank = Rank(mlp)
    params = [p for p in rank.engine.model.parameters()]
    roundtrip(rank, rank, via_pickle=False)
    assert [p for p in rank.engine.model.parameters()] == params  # written in place, not replaced
    assert rank.resets == 1


def test_copy_into_a_fresh_rank_whose_optimizer_has_no_state():
    rank, fresh = Rank(mlp), Rank(mlp)
    assert not fresh.engine.optimizer.state
    roundtrip(rank, fresh, via_pickle=True)


@pytest.mark.parametrize("form", ["foreach", "fused"])
def test_a_handed_over_copy_written_through_the_staging_buffers_restores_the_rank(monkeypatch, form):
    """The staged path (a pageable copy into GPU tensors) in a whole restore, forced here with host
    tensors and small windows: model, optimizer (either AdamW form), schedule and RNG come back
    bit for bit and the rank trains on as the one that took the copy."""
    monkeypatch.setattr(snapshot_buffers, "wants_staging", lambda flat, dst: True)
    monkeypatch.setattr("resilient_rl.workers.snapshots.staged.STAGE_BYTES", 96)
    rank, fresh = Rank(mlp), Rank(mlp)
    for r in (rank, fresh):
        e = r.engine
        e.optimizer = torch.optim.AdamW(e.model.parameters(), lr=1e-2, weight_decay=0.1, **{form: True})
        e.scheduler = torch.optim.lr_scheduler.LambdaLR(e.optimizer, lambda s: 1.0 / (1 + s))
    roundtrip(rank, fresh, via_pickle=True)


def test_snapshot_before_the_optimizer_had_state_clears_it():
    rank = Rank(mlp)
    snap = rank.snapshot(0)["roles"]["actor"]
    before = rank.fingerprint()
    assert not any(e[0].startswith("optim/") for e in snap["layout"])
    rank.train(0)
    assert rank.engine.optimizer.state
    assert rank.snapshot_restorer.load_snapshot(0) is True
    assert not rank.engine.optimizer.state
    assert_same(rank.fingerprint(), before)
    # The next step is AdamW's first again (its step counter restarts at 1).
    rank.train(0)
    assert all(float(s["step"]) == 1.0 for s in rank.engine.optimizer.state.values())


def test_taken_copy_is_not_changed_by_later_training_and_ring_keeps_two():
    rank = Rank(mlp)
    rank.train(0)
    first = rank.snapshot(1)["roles"]["actor"]
    kept = first["data"].copy()
    rank.train(1)
    rank.snapshot(2)
    assert np.array_equal(first["data"], kept)  # the second copy went into the other buffer
    rank.train(2)
    rank.snapshot(3)
    assert sorted(rank.snapshots.own) == [2, 3]
    assert rank.snapshots.has_snapshot(3) and not rank.snapshots.has_snapshot(1)
    mem = rank.snapshots.snapshot_memory()
    assert mem["own_bytes"] == 2 * first["bytes"] and mem["held_bytes"] == 0


def test_mismatch_names_the_path():
    rank = Rank(mlp)
    rank.train(0)
    snap = rank.snapshot(1)["roles"]["actor"]
    other = Rank(lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)))
    other.train(0)
    with pytest.raises(ValueError, match=r"model/0\.weight has shape \(5, 4\), the rank's \(6, 4\)"):
        other.snapshot_restorer.load_snapshot(1, snap)
    renamed = Rank(lambda: nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3)))  # no Tanh: "1." not "2."
    renamed.train(0)
    with pytest.raises(ValueError, match=r"model/2\.weight: not in the rank's state"):
        renamed.snapshot_restorer.load_snapshot(1, snap)


def test_layout_is_self_describing_and_aligned():
    rank = Rank(mlp)
    rank.train(0)
    snap = rank.snapshot(1)["roles"]["actor"]
    layout = Layout.from_list(snap["layout"])
    assert all(e.offset % snapshot_buffers.ALIGN == 0 for e in layout.entries)
    views = layout.views(torch.from_numpy(snap["data"]))
    got = dict(zip((e.name for e in layout.entries), views))
    for name, t in named_tensors(rank.engine.model, rank.engine.optimizer):
        assert torch.equal(got[name], t)
    assert {n.rsplit("/", 1)[-1] for n in got if n.startswith("optim/")} == {"step", "exp_avg", "exp_avg_sq"}


def test_copy_reports_progress_per_chunk(monkeypatch):
    from resilient_rl.runtime import progress

    rank = Rank(mlp)
    rank.train(0)
    monkeypatch.setattr(snapshot_buffers, "CHUNK_BYTES", 64)
    before = progress.snapshot().advances
    snap = rank.snapshot(1)["roles"]["actor"]
    layout = Layout.from_list(snap["layout"])
    chunks = list(snapshot_buffers._chunks(layout, len(layout.entries)))
    assert len(chunks) > 4 and sum(len(c) for c in chunks) == len(layout.entries)
    assert progress.snapshot().advances - before == len(chunks)  # one report per chunk copied
    assert rank.snapshot_restorer.load_snapshot(1) is True


def fsdp_mlp():
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def test_fsdp2_round_trip(single_rank_group):
    rank, fresh = Rank(fsdp_mlp), Rank(fsdp_mlp)
    assert all(hasattr(p, "to_local") for p in rank.engine.model.parameters())
    roundtrip(rank, fresh, via_pickle=True)
    assert all(hasattr(s["exp_avg"], "to_local") for s in fresh.engine.optimizer.state.values())
    roundtrip(rank, rank, via_pickle=False)


def test_a_root_left_gathered_by_a_forward_without_backward_is_copied_as_its_shards(single_rank_group):
    """FSDP2 keeps the root's parameters gathered after a no-grad forward (log-probs): a survivor
    of a step cut short there must still copy, and be restored into, its shards."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model)  # one unit, the root (as on CPU)
    shards = [t.data_ptr() for _, t in named_tensors(model, None)]
    with torch.no_grad():
        model(torch.ones(2, 4))
    assert not hasattr(next(model.parameters()), "to_local")  # gathered
    assert [t.data_ptr() for _, t in named_tensors(model, None)] == shards


def test_one_take_for_the_colocated_roles_and_hold_keeps_a_peer_bundle():
    from resilient_rl.runtime.rank_host import RankHost

    actor, critic = Rank(mlp), Rank(mlp, role="critic")
    host = RankHost()  # one process hosting both roles
    host.add("actor", actor)
    host.add("critic", critic)
    actor.train(0)
    critic.train(1)
    done = actor.snapshots.take_snapshot(1, ["actor", "critic"])
    _, taken = actor.snapshots.publish_snapshot(1, ["actor", "critic"])
    assert done["bytes"] == {role: taken["roles"][role]["bytes"] for role in ("actor", "critic")}
    assert sorted(taken["roles"]) == ["actor", "critic"] and critic.snapshots.has_snapshot(1)
    with pytest.raises(ValueError, match="hosts no ref rank 0"):
        actor.snapshots.take_snapshot(1, ["ref"])
    # Another process (rank 1 here, a host of its own) holds the bundle.
    peer = Rank(mlp)
    peer.rank = 1
    answer = peer.held_snapshots.hold_snapshot(1, [[("actor", 0), ("critic", 0)]], [pickle.loads(pickle.dumps(taken))])
    assert answer == {"step": 1, "kept": 2}
    held = peer.held_snapshots.held_snapshot(1, "critic", 0)
    assert held is not None and np.array_equal(held["data"], taken["roles"]["critic"]["data"])
    assert peer.snapshots.snapshot_memory()["held_bytes"] == sum(done["bytes"].values())
    # The critic restores from the held copy (as the controller hands it over).
    critic.train(2)
    assert critic.snapshot_restorer.load_snapshot(1, held) is True
    again = critic.snapshot(5)["roles"]["critic"]
    layout = Layout.from_list(held["layout"])
    assert all(torch.equal(a, b) for a, b in zip(layout.views(torch.from_numpy(again["data"])),
                                                 layout.views(torch.from_numpy(held["data"].copy()))))


def test_a_publish_waits_for_its_take_and_fails_with_it():
    import threading

    rank = Rank(mlp)
    rank.train(0)
    got = {}
    publish = threading.Thread(target=lambda: got.update(out=rank.snapshots.publish_snapshot(1, None, 30.0)))
    publish.start()  # on the "snapshot" thread, possibly before the call thread's take
    rank.snapshots.take_snapshot(1)
    publish.join(30)
    assert got["out"][0] == {"step": 1} and got["out"][1]["roles"]["actor"]["step"] == 1

    def broken():
        raise RuntimeError("copy failed")

    rank.snapshots.tensors = broken
    with pytest.raises(RuntimeError, match="copy failed"):
        rank.snapshots.take_snapshot(2)
    with pytest.raises(RuntimeError, match=r"actor copy of step 2 is gone \(RuntimeError: copy failed\)"):
        rank.snapshots.publish_snapshot(2, None, 30.0)  # at once, not after the timeout
    with pytest.raises(RuntimeError, match="no actor copy of step 3 after 0s"):
        rank.snapshots.publish_snapshot(3, None, 0.01)  # never taken


def test_a_slot_is_not_written_while_ray_may_still_store_its_publish(monkeypatch):
    from resilient_rl.workers.snapshots import take as snapshot_mod

    rank = Rank(mlp)
    rank.train(0)
    first = rank.snapshot(1)["roles"]["actor"]  # its slot is being stored until the next publish starts
    kept = first["data"].copy()
    rank.train(1)
    rank.snapshots.take_snapshot(2)
    rank.train(2)
    monkeypatch.setattr(snapshot_mod, "SLOT_WAIT_S", 0.05)
    rank.snapshots.take_snapshot(3)  # the only slot not kept is step 1's, still published: it gets a new buffer
    assert np.array_equal(first["data"], kept)
    assert not np.shares_memory(first["data"], rank.snapshots.own[3][1]["data"])
    # The usual order: the next publish starts (so step 1's was stored) before the take that reuses its slot.
    rank.snapshots.publish_snapshot(3)
    slot_of_2 = rank.snapshots.own[2][0]
    reused = rank.snapshots.ring.buffers[slot_of_2].data_ptr()
    rank.train(3)
    rank.snapshots.take_snapshot(4)
    assert rank.snapshots.own[4][0] == slot_of_2 and rank.snapshots.ring.buffers[slot_of_2].data_ptr() == reused
