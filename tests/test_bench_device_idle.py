"""bench/device_idle.py: where a profiled update left the device idle, by the phase the host was in."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType


@pytest.fixture
def device_idle(monkeypatch):
    from resilient_rl.testing.bench_scripts import BENCH

    monkeypatch.syspath_prepend(str(BENCH))
    import device_idle

    return device_idle


def _ev(name, device, start, end, *, annotation=False, id=0, linked=0, scale=1):
    span = SimpleNamespace(start=start * scale, end=end * scale)
    return SimpleNamespace(name=name, device_type=device, time_range=span, is_user_annotation=annotation, id=id,
                           linked_correlation_id=linked)


def _gpu_timeline():
    """A GPU update of 0-100 ms: the host in ``actor.forward`` (10-50, ``logprob.head`` 30-50 in
    it) and ``actor.optimizer`` (60-100); kernels 12-30, 35-50 (two overlapping streams) and 70-95;
    a ``record_function`` range also shown on the device's timeline is not a kernel."""
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    _ms = functools.partial(_ev, scale=1000)
    return [
        _ms("actor.forward", cpu, 10, 50, annotation=True), _ms("logprob.head", cpu, 30, 50, annotation=True),
        _ms("actor.optimizer", cpu, 60, 100, annotation=True),
        _ms("aten::mm", cpu, 11, 12, id=7), _ms("cudaLaunchKernel", cpu, 11, 12, linked=7),
        _ms("aten::nonzero", cpu, 29, 34, id=8), _ms("cudaStreamSynchronize", cpu, 30, 33, linked=8),
        _ms("aten::_fused_adamw_", cpu, 65, 69, id=9),
        _ms("sm90_gemm", cuda, 12, 30, linked=7), _ms("nonzero_kernel", cuda, 35, 45, linked=8),
        _ms("copy_kernel", cuda, 40, 50, linked=8), _ms("adam_kernel", cuda, 70, 95, linked=9),
        _ms("actor.forward", cuda, 12, 50, annotation=True),
        _ms("aten::_local_scalar_dense", cpu, 0, 1),
    ]


def test_gaps_are_the_window_outside_the_merged_kernels(device_idle):
    busy = device_idle.merged([(12, 30), (40, 50), (35, 45), (70, 95)])
    assert busy == [(12, 30), (35, 50), (70, 95)]
    assert device_idle.gaps(busy, (0, 100)) == [(0, 12), (30, 35), (50, 70), (95, 100)]


def test_a_gap_is_charged_to_the_innermost_phase_around_each_part(device_idle):
    phases = [(10, 50, "actor.forward"), (30, 50, "logprob.head"), (60, 100, "actor.optimizer")]
    assert device_idle.charge((0, 12), phases) == {"(none)": 10, "actor.forward": 2}
    assert device_idle.charge((30, 35), phases) == {"logprob.head": 5}
    assert device_idle.charge((50, 70), phases) == {"(none)": 10, "actor.optimizer": 10}


def test_the_report_on_a_gpu_names_phases_gaps_their_launchers_and_the_waits(device_idle):
    lines = device_idle.idle_lines(_gpu_timeline(), cuda=True, top=2)
    text = "\n".join(lines)
    assert "no kernel ran: 42.0 ms in 4 gaps of a 100.0 ms profile" in lines[0]  # 0-12, 30-35, 50-70, 95-100
    by_phase = {line.split()[0]: line.split()[1:] for line in lines[1:5]}
    assert by_phase == {"(none)": ["20.0", "ms", "2", "gaps"],  # 0-10 and 50-60
                        "actor.optimizer": ["15.0", "ms", "2", "gaps"],  # 60-70 and 95-100
                        "logprob.head": ["5.0", "ms", "1", "gaps"], "actor.forward": ["2.0", "ms", "1", "gaps"]}
    # The longest gaps: 50-70 (its kernel after launched by the optimizer), then 0-12.
    longest = lines[lines.index("  longest 2 gaps:") + 1:][:2]
    assert longest[0].split() == ["20.00", "ms", "in", "(none)", "10.00", "ms,", "actor.optimizer", "10.00", "ms,",
                                  "before", "aten::_fused_adamw_"]
    assert longest[1].split() == ["12.00", "ms", "in", "(none)", "10.00", "ms,", "actor.forward", "2.00", "ms,",
                                  "before", "aten::mm"]
    assert "cudaStreamSynchronize 1" in text and "aten::nonzero 1" in text and "aten::_local_scalar_dense 1" in text


def test_on_a_cpu_the_operators_are_the_work_and_python_is_the_gap(device_idle):
    cpu = DeviceType.CPU
    events = [_ev("actor.backward", cpu, 0, 10, annotation=True), _ev("aten::mm", cpu, 1, 4),
              _ev("aten::addmm", cpu, 2, 3), _ev("aten::mul", cpu, 6, 9)]
    assert [k.name for k in device_idle.kernel_events(events, cuda=False)] == ["aten::mm", "aten::addmm", "aten::mul"]
    lines = device_idle.idle_lines(events, cuda=False)
    assert "the host ran no operator" in lines[0] and "in 3 gaps" in lines[0]
    assert lines[1].split()[0] == "actor.backward"


def test_a_profile_without_device_work_says_so(device_idle):
    assert device_idle.idle_lines([_ev("actor.prepare", DeviceType.CPU, 0, 5, annotation=True)], cuda=True) == \
        ["  no device work in the profile"]
