"""A model build that finds the GPU still held by another process (a rank's dead process whose
memory the driver has not released yet) waits for the memory and builds again
(resilient_rl.workers.held_memory). No GPU here: the device's memory readings are faked; the
build's own error is torch's."""

from __future__ import annotations

import gc
import logging
import types
import weakref

import pytest
import torch

from resilient_rl.testing.clock import FakeClock
from resilient_rl.testing.held_memory import CUDA_MESSAGE
from resilient_rl.workers import held_memory
from resilient_rl.workers.held_memory import GIB, DeviceMemory, builds_when_memory_frees, device_memory

TOTAL = 80 * GIB


class _Readings:
    """The device's memory as the driver would report it: ``held`` bytes outside this process for
    the first ``reads_held`` readings, then ``after``."""

    def __init__(self, held: int, reads_held: int = 10**9, after: int = GIB // 2):
        self.held, self.reads_held, self.after, self.reads = held, reads_held, after, 0

    def __call__(self, device):
        assert device is not None and device.type == "cuda"
        self.reads += 1
        outside = self.held if self.reads <= self.reads_held else self.after
        return DeviceMemory(free=TOTAL - outside - 3 * GIB, total=TOTAL, reserved=3 * GIB)


class _Worker:
    """A role worker's build as ``init_model`` is: it raises torch's error while ``refuse()``."""

    role, rank = "actor", 1

    def __init__(self, refuse, timeout_s: float = 30.0):
        self.cfg = types.SimpleNamespace(recovery=types.SimpleNamespace(restart_timeout_s=timeout_s))
        self._plan = types.SimpleNamespace(device=torch.device("cuda", 0))
        self.refuse, self.calls = refuse, 0

    @builds_when_memory_frees
    def init_model(self, empty: bool = False) -> bool:
        self.calls += 1
        if self.refuse(self):
            raise torch.OutOfMemoryError(CUDA_MESSAGE)
        return True


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    """The waits' clock: time moves only when the wait sleeps, so deadlines are exact."""
    fake = FakeClock()
    monkeypatch.setattr(held_memory, "time", types.SimpleNamespace(monotonic=fake, sleep=fake.sleep))
    return fake


def test_a_build_refused_while_another_process_holds_the_gpu_waits_for_it_and_builds_again(monkeypatch, caplog):
    readings = _Readings(held=76 * GIB, reads_held=5)
    monkeypatch.setattr(held_memory, "device_memory", readings)
    worker = _Worker(refuse=lambda w: readings.reads <= readings.reads_held)
    with caplog.at_level(logging.WARNING, logger=held_memory.__name__):
        assert worker.init_model(empty=True) is True
    assert worker.calls == 2
    assert readings.reads > readings.reads_held + 1  # it waited for the release, and for it to settle
    text = caplog.text
    assert "actor rank 1 ran out of GPU memory in init_model with 76.0 GiB of the device's 80.0 GiB held outside " \
           "this process" in text
    assert "actor rank 1 finished init_model after waiting" in text


def test_a_build_the_device_cannot_hold_is_not_retried(monkeypatch):
    monkeypatch.setattr(held_memory, "device_memory", _Readings(held=GIB // 2))  # the context only: ours
    worker = _Worker(refuse=lambda w: True)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        worker.init_model()
    assert worker.calls == 1


def test_memory_that_never_comes_free_ends_the_wait_at_the_restart_timeout(monkeypatch, clock):
    readings = _Readings(held=76 * GIB)
    monkeypatch.setattr(held_memory, "device_memory", readings)
    worker = _Worker(refuse=lambda w: True, timeout_s=30.0)
    started = clock()
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        worker.init_model()
    assert worker.calls == 2  # the build, then once more after the wait ran out
    assert clock() - started == pytest.approx(30.0)
    assert readings.reads == 2 + round(30.0 / held_memory.POLL_S)  # one at each failure, one at each poll


def test_off_a_gpu_a_build_out_of_memory_raises_at_once():
    assert device_memory(torch.device("cpu")) is None and device_memory(None) is None
    worker = _Worker(refuse=lambda w: True)
    worker._plan = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(torch.OutOfMemoryError):
        worker.init_model()
    assert worker.calls == 1


def test_what_the_failed_build_allocated_is_freed_before_the_next_one(monkeypatch):
    readings = _Readings(held=76 * GIB, reads_held=3)
    monkeypatch.setattr(held_memory, "device_memory", readings)
    left: list[weakref.ref] = []

    class Part:  # a module of a half-built model: FSDP modules hold reference cycles
        def __init__(self):
            self.me = self

    def refuse(worker):
        if left:
            assert left[0]() is None, "the failed build's modules are still alive"
            return False
        part = Part()
        left.append(weakref.ref(part))
        return True

    gc.disable()  # only the wait's own collection may free the cycle
    try:
        assert _Worker(refuse=refuse).init_model() is True
    finally:
        gc.enable()


def test_an_error_that_stops_the_run_says_how_much_another_process_held(monkeypatch):
    from resilient_rl.config.schema import load_config
    from resilient_rl.workers import out_of_memory

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"allocated_bytes.all.current": GIB,
                                                                    "reserved_bytes.all.current": 3 * GIB})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=TOTAL))
    monkeypatch.setattr(held_memory, "device_memory", _Readings(held=76 * GIB))
    error = out_of_memory.device_memory_error(torch.OutOfMemoryError(CUDA_MESSAGE), "init_model", "actor",
                                              load_config(None, []), None, torch.device("cuda", 0))
    assert str(error).startswith("ran out of GPU memory in init_model; torch held 1.0 GiB allocated, 3.0 GiB reserved "
                                 "of the device's 80.0 GiB, and 76.0 GiB was held outside this process (another "
                                 "process on this GPU). To need less: ")
    monkeypatch.setattr(held_memory, "device_memory", _Readings(held=GIB // 2))  # a CUDA context: not named
    error = out_of_memory.device_memory_error(torch.OutOfMemoryError(CUDA_MESSAGE), "init_model", "actor",
                                              load_config(None, []), None, torch.device("cuda", 0))
    assert "held outside" not in str(error)


def _half_made_once(module, monkeypatch):
    """``module``'s ``get_optimizer_state_dict`` (which makes a fresh optimizer's state) runs out of
    memory once, leaving one parameter's state unmade, as a restore on a held GPU would."""
    real, failed = module.get_optimizer_state_dict, []

    def half_made(model, optimizer, *args, **kwargs):
        out = real(model, optimizer, *args, **kwargs)
        if not failed:
            failed.append(True)
            optimizer.state.pop(next(iter(optimizer.state)))
            raise torch.OutOfMemoryError(CUDA_MESSAGE)
        return out

    monkeypatch.setattr(module, "get_optimizer_state_dict", half_made)
    return failed


def _rank_on_a_held_gpu(monkeypatch):
    """A rebuilt rank (its optimizer has no state yet) on a GPU another process holds a while."""
    from test_rank_state import Rank

    monkeypatch.setattr(held_memory, "device_memory", _Readings(held=76 * GIB, reads_held=3))
    rank = Rank()
    rank.engine.plan = types.SimpleNamespace(device=torch.device("cuda", 0))
    rank.checkpointer.held_wait_s = 30.0
    return rank


def _optimizer_tensors(rank) -> list[torch.Tensor]:
    state = rank.engine.optimizer.state_dict()["state"]
    return [t for i in sorted(state) for _, t in sorted(state[i].items())]


def test_a_snapshot_restore_that_runs_out_on_a_held_gpu_starts_again_once_it_is_free(monkeypatch):
    from test_rank_state import Rank, same

    from resilient_rl.workers.snapshots import state as snapshot_state

    rank = Rank()
    rank.train(0)
    rank.snapshots.take_snapshot(1)
    _, taken = rank.snapshots.publish_snapshot(1)
    fresh = _rank_on_a_held_gpu(monkeypatch)
    failed = _half_made_once(snapshot_state, monkeypatch)
    assert fresh.snapshot_restorer.load_snapshot(1, taken) is True
    assert failed  # the first attempt ran out; the second made the whole state again
    assert same(fresh.fingerprint(), rank.fingerprint())
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(fresh), _optimizer_tensors(rank), strict=True))


def test_a_checkpoint_load_that_runs_out_on_a_held_gpu_starts_again_once_it_is_free(monkeypatch, tmp_path):
    from test_rank_state import Rank, same

    from resilient_rl.workers import rank_state

    rank = Rank()
    rank.train(0)
    records = rank.checkpointer.save_checkpoint(str(tmp_path), None, "step_1/actor", False)
    fresh = _rank_on_a_held_gpu(monkeypatch)
    failed = _half_made_once(rank_state, monkeypatch)
    assert fresh.checkpointer.load_checkpoint(str(tmp_path), None, "step_1/actor", records, 1) is True
    assert failed
    assert same(fresh.fingerprint()[:3], rank.fingerprint()[:3])  # the RNG is not in a checkpoint of one rank
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(fresh), _optimizer_tensors(rank), strict=True))
