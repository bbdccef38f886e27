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
