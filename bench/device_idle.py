"""Where a profiled pass left its device idle: the gaps between its kernels, by the phase the host
was in, the longest of them, and the host calls that wait for the device.

The trainer marks the phases of an update with ``torch.profiler.record_function`` ranges
(``actor.prepare``, ``actor.forward``, ``actor.loss``, ``actor.backward``, ``actor.clip``,
``actor.optimizer``, ``actor.metrics``, and ``logprob.pack`` and ``logprob.head`` inside a forward;
``resilient_rl/workers/update_loop.py``, ``policy.py``, ``logprob.py``). A gap in which no kernel
ran is time the host spent launching, in Python, or waiting: split at the phases' bounds, each
part is charged to the innermost phase around it (``(none)`` outside every phase). Each long gap
also names the operator that launched the kernel that ended it. Host calls that block until the
device has caught up (``cudaStreamSynchronize``, a pageable ``cudaMemcpy``, ``cudaFree``, ...) and
the operators that read a device value back (``aten::_local_scalar_dense``, ``aten::nonzero``) are
counted: after each, the device idles until the host has launched again.

On a CPU the "kernels" are the operators (``aten::*``), and a gap is the host's time outside every
operator (Python, the framework's bookkeeping): a check of the script and of the phases.
"""

from __future__ import annotations

from collections import Counter

from torch.autograd import DeviceType

#: Host runtime calls that return only once the device has done what they wait for.
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpyAsync", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost")
#: Operators that read a device value back to the host (each one a synchronisation on a GPU).
READBACK_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                "aten::unique", "aten::_unique2", "aten::repeat_interleave")

Interval = tuple[float, float]


def _span(e) -> Interval:
    return e.time_range.start, e.time_range.end


def kernel_events(events, cuda: bool) -> list:
    """The events that are the device's own work: on a GPU its kernels, copies and sets (not a
    ``record_function`` range shown on its timeline); on a CPU the operators."""
    if not cuda:
        return [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU}
    return [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and e.name not in cpu_names]


def merged(spans: list[Interval]) -> list[Interval]:
    """``spans`` as disjoint intervals in order (overlapping or touching ones joined)."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def gaps(busy: list[Interval], window: Interval) -> list[Interval]:
    """The parts of ``window`` outside the disjoint, ordered ``busy`` intervals."""
    out, at = [], window[0]
    for start, end in busy:
        if start > at:
            out.append((at, min(start, window[1])))
        at = max(at, end)
    if window[1] > at:
        out.append((at, window[1]))
    return [(a, b) for a, b in out if b > a]


def phase_ranges(events) -> list[tuple[float, float, str]]:
    """The host's ``record_function`` ranges: ``(start, end, name)``."""
    return [(*_span(e), e.name) for e in events
            if e.device_type == DeviceType.CPU and getattr(e, "is_user_annotation", False)]


def innermost(phases: list[tuple[float, float, str]], at: float) -> str:
    """The name of the shortest phase around time ``at``, ``(none)`` outside every phase."""
    around = [(end - start, name) for start, end, name in phases if start <= at < end]
    return min(around)[1] if around else "(none)"


def charge(gap: Interval, phases: list[tuple[float, float, str]]) -> dict[str, float]:
    """Microseconds of ``gap`` per innermost phase, the gap cut at every phase bound inside it."""
    cuts = sorted({gap[0], gap[1], *(t for s, e, _ in phases for t in (s, e) if gap[0] < t < gap[1])})
    out: dict[str, float] = {}
    for a, b in zip(cuts, cuts[1:]):
        name = innermost(phases, (a + b) / 2)
        out[name] = out.get(name, 0.0) + (b - a)
    return out


def launcher(events, kernel) -> str:
    """The operator that launched ``kernel`` (by correlation id), else the kernel's own name."""
    corr = getattr(kernel, "linked_correlation_id", 0)
    if corr:
        for e in events:
            if e.id == corr and e.device_type == DeviceType.CPU and not getattr(e, "linked_correlation_id", 0):
                return e.name
    return kernel.name


def host_waits(events) -> tuple[Counter, Counter]:
    """Counts and microseconds of :data:`WAITING_CALLS` and :data:`READBACK_OPS`, by name."""
    count, micros = Counter(), Counter()
    for e in events:
        if e.device_type == DeviceType.CPU and (e.name in WAITING_CALLS or e.name in READBACK_OPS):
            count[e.name] += 1
            micros[e.name] += e.time_range.end - e.time_range.start
    return count, micros


def idle_lines(events, cuda: bool, top: int = 6) -> list[str]:
    """The report (see the module docs), times in ms."""
    events = list(events)
    kernels = kernel_events(events, cuda)
    if not kernels:
        return ["  no device work in the profile"]
    spans = [_span(e) for e in events]
    window = (min(s for s, _ in spans), max(e for _, e in spans))
    holes = gaps(merged([_span(k) for k in kernels]), window)
    phases = phase_ranges(events)
    by_phase: dict[str, list[float]] = {}
    for gap in holes:
        for name, micros in charge(gap, phases).items():
            entry = by_phase.setdefault(name, [0.0, 0])
            entry[0] += micros
            entry[1] += 1
    total = sum(b - a for a, b in holes)
    what = "no kernel ran" if cuda else "the host ran no operator"
    lines = [f"  idle by phase ({what}: {total / 1e3:.1f} ms in {len(holes)} gaps of a "
             f"{(window[1] - window[0]) / 1e3:.1f} ms profile):"]
    for name, (micros, n) in sorted(by_phase.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"    {name:<36} {micros / 1e3:9.1f} ms  {n:6d} gaps")
    starts = sorted(kernels, key=lambda k: k.time_range.start)
    first_after = {}
    for gap in sorted(holes, key=lambda g: g[0] - g[1])[:top]:
        after = next((k for k in starts if k.time_range.start >= gap[1]), None)
        first_after[gap] = launcher(events, after) if after is not None else "(the end of the profile)"
    lines.append(f"  longest {min(top, len(holes))} gaps:")
    for gap, after in first_after.items():
        parts = sorted(charge(gap, phases).items(), key=lambda kv: -kv[1])
        where = parts[0][0] if len(parts) == 1 else ", ".join(f"{n} {m / 1e3:.2f} ms" for n, m in parts)
        lines.append(f"    {(gap[1] - gap[0]) / 1e3:9.2f} ms  in {where}, before {after}")
    count, micros = host_waits(events)
    if count:
        lines.append("  host calls that wait for the device: " + ", ".join(
            f"{name} {count[name]} ({micros[name] / 1e3:.1f} ms)" for name in sorted(count, key=lambda n: -count[n])))
    return lines
