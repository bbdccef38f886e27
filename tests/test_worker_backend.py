"""Reading the process group's backend string: the NCCL abort branch of a group's teardown."""

from __future__ import annotations

import pytest

from resilient_rl.runtime import worker


@pytest.mark.parametrize("backend, expected", [
    ("nccl", True),
    ("cpu:gloo,cuda:nccl", True),  # how rendezvous creates every GPU group
    ("cuda:nccl,cpu:gloo", True),
    ("CPU:GLOO, CUDA:NCCL", True),
    ("gloo", False),
    ("cpu:gloo", False),
    ("cpu:gloo,cuda:gloo", False),
    ("", False),
])
def test_uses_nccl_reads_each_device_part(backend, expected):
    assert worker.uses_nccl(backend) is expected


@pytest.mark.parametrize("backend,expected", [("cpu:gloo,cuda:nccl", ["abort"]), ("gloo", ["destroy"])])
def test_teardown_aborts_nccl_groups_and_destroys_gloo_ones(monkeypatch, backend, expected):
    """A GPU group is "cpu:gloo,cuda:nccl": its teardown must take the abort path, since
    destroying a communicator with a dead peer can block; a gloo group is destroyed."""
    calls: list[str] = []
    monkeypatch.setattr(worker.dist, "get_backend", lambda *a, **k: backend)
    monkeypatch.setattr(worker.dist, "is_initialized", lambda: True)  # teardown runs on a live group
    monkeypatch.setattr(worker.dist.distributed_c10d, "_abort_process_group",
                        lambda *a, **k: calls.append("abort"), raising=False)
    monkeypatch.setattr(worker.dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    worker.destroy_process_group()
    assert calls == expected


@pytest.mark.parametrize("preset, expected", [
    ({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}),  # the user's choice
    ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": None}),  # its older name
])
def test_a_gpu_group_is_created_with_nccl_errors_raised_not_ending_the_process(monkeypatch, preset, expected):
    """torch's default watchdog mode ends a process whose NCCL collective failed or timed out:
    a survivor of a dead peer would die instead of raising and rejoining, as it does on gloo.
    The variable must be set before torch builds the group, which reads it then."""
    import os
    import types

    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    for name, value in preset.items():
        monkeypatch.setenv(name, value)
    seen = {}

    def init_process_group(backend, **kwargs):
        seen["backend"] = backend
        seen["env"] = {name: os.environ.get(name) for name in expected}

    monkeypatch.setattr(worker.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(worker.torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(worker, "cuda_device_index", lambda local_rank: 0)
    monkeypatch.setattr(worker.rendezvous, "join_store", lambda *a, **k: object())
    monkeypatch.setattr(worker.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(worker.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(worker, "export_identity", lambda identity: None)
    monkeypatch.setattr(worker, "_PG_STATE", dict(worker._PG_STATE, generation=None, cuda_device=None))
    rank = types.SimpleNamespace(rank=0, world_size=1, identity=types.SimpleNamespace(local_rank=0))
    assert worker.RankWorker.rendezvous(rank, 1, "127.0.0.1", 1, backend="nccl") == 1
    assert seen == {"backend": "cpu:gloo,cuda:nccl", "env": expected}


def test_leaving_aborts_the_nccl_groups_outside_the_default_one():
    """The weight channel's NCCL communicator is not torch's default group: leaving aborts it by
    the abort it registered when it was built, until it is gone."""
    from resilient_rl.runtime import leave_collective

    calls = []
    leave_collective.abort_on_leave("weight channel", lambda: calls.append("abort"))
    try:
        leave_collective.leave_collectives("a peer died")
        assert calls == ["abort"]
    finally:
        leave_collective.abort_on_leave("weight channel", None)
    leave_collective.leave_collectives("again")
    assert calls == ["abort"]
    leave_collective.forget()


def test_a_rank_that_left_an_aborted_nccl_group_has_not_left_the_next_one(monkeypatch):
    """Leaving aborts an NCCL default group, which de-initialises it in torch: the next
    rendezvous finds no group to destroy, and must still count the new one as not left, or the
    rank's group would be rejoined at every later recovery (WorkerInfo.left)."""
    import types

    from resilient_rl.runtime import leave_collective

    monkeypatch.setattr(leave_collective, "abort_nccl", lambda: True)  # the abort of a GPU group
    leave_collective.leave_collectives("a peer died")
    assert leave_collective.has_left()
    monkeypatch.setattr(worker.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(worker.rendezvous, "join_store", lambda *a, **k: object())
    monkeypatch.setattr(worker.dist, "is_initialized", lambda: False)  # as the abort left it
    monkeypatch.setattr(worker.dist, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(worker, "export_identity", lambda identity: None)
    monkeypatch.setattr(worker, "_PG_STATE", dict(worker._PG_STATE, generation=1, cuda_device=None))
    rank = types.SimpleNamespace(rank=0, world_size=1, identity=types.SimpleNamespace(local_rank=0))
    try:
        assert worker.RankWorker.rendezvous(rank, 2, "127.0.0.1", 1, backend="gloo") == 2
        assert not leave_collective.has_left()
    finally:
        leave_collective.forget()
