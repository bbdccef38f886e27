"""GPU series labelled with the worker that computes on the GPU, and torch's memory per rank.

Workers report the UUID of their GPU (NVML + ``CUDA_VISIBLE_DEVICES``, here the fake NVML) in
their health reply; the controller turns the replies into role/rank labels on the exporter of the
node where each GPU is. The strongest check scrapes the real exporters (controller node and a
second node's ``NodeExporter``, both over HTTP, fed by the fake NVML and by worker reports made
the way workers make them), turns the scraped samples into promtool input series, and asserts
that the low-utilization alert fires for the right worker's GPU and only for it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from resilient_rl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register, Dispatch
from resilient_rl.runtime.device_poller import DeviceReportPoller
from resilient_rl.runtime.health import HEALTH_GROUPS
from resilient_rl.runtime.worker import WorkerInfo
from resilient_rl.telemetry import (DeviceMetrics, DeviceReport, GpuSampler, MetricsServer, NodeExporter,
                                    ProcessDevices, ProcessSampler, TorchMemoryMetrics, TrainerMetrics,
                                    device_report, gpu_assignments)
from resilient_rl.telemetry.exporter import scrape
from resilient_rl.testing.wait import wait_until
from resilient_rl.runtime.devices import visible_gpu_uuids
from resilient_rl.telemetry.gpu_owners import join_labels, processes_from_reports
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML, NVMLError_DriverNotLoaded

RULES = Path(__file__).resolve().parents[1] / "monitoring" / "rules" / "rrl-alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not on PATH "
                                    "(Debian/Ubuntu: apt-get install prometheus)")
GIB = 2**30


def promtool(*args: str) -> str:
    proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr
COLOCATED = ("actor", "rollout", "ref")


def _nvml(*utilization: int) -> FakeNVML:
    return FakeNVML([FakeGpu(uuid=f"GPU-{c * 8}", utilization_percent=u)
                     for c, u in zip("abcdefgh", utilization)])


# -- worker side -----------------------------------------------------------------------------

@pytest.mark.parametrize("visible, cuda_index, expected", [
    (None, 0, "GPU-aaaaaaaa"),          # every device visible: CUDA index = NVML index
    (None, 2, "GPU-cccccccc"),
    ("2", 0, "GPU-cccccccc"),           # what Ray sets for a one-GPU actor
    ("3,1", 1, "GPU-bbbbbbbb"),
    ("GPU-dddd", 0, "GPU-dddddddd"),    # a UUID prefix
    ("1", 1, None),                     # the process sees one device only
    ("", 0, None),                      # no device visible
])
def test_worker_reports_the_uuid_of_its_cuda_device(monkeypatch, visible, cuda_index, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    report = device_report(cuda_index, nvml=_nvml(1, 2, 3, 4))
    assert report.gpu_uuids == ((expected,) if expected else ())
    # No CUDA here: torch's counters are unknown, not zero.
    assert report.torch_allocated_bytes is None and report.torch_reserved_bytes is None


def test_worker_on_cpu_or_without_nvml_reports_no_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_report(None, nvml=_nvml(5)) == DeviceReport()
    assert visible_gpu_uuids(FakeNVML([FakeGpu("GPU-x")], init_error=NVMLError_DriverNotLoaded)) == ()
    nvml = _nvml(5)
    visible_gpu_uuids(nvml)
    assert nvml.init_calls == 1 and not nvml.initialized  # NVML is released after reading
    assert device_report(0) == DeviceReport()  # this machine: no driver (or no pynvml)


# -- controller side -------------------------------------------------------------------------

def _report(uuid: str | None, allocated: int | None = None, reserved: int | None = None) -> DeviceReport:
    return DeviceReport((uuid,) if uuid else (), allocated, reserved)


def test_assignments_label_each_gpu_with_every_role_of_its_process_per_node():
    processes = [
        ProcessDevices(COLOCATED, 0, None, _report("GPU-a")),
        ProcessDevices(COLOCATED, 1, None, _report("GPU-b")),
        ProcessDevices(("critic",), 0, "node-1", _report("GPU-c")),
        ProcessDevices(("critic",), 1, "node-2", _report(None)),  # a CPU process
        # Two processes of different ranks sharing one GPU.
        ProcessDevices(("rollout",), 10, "node-3", _report("GPU-d")),
        ProcessDevices(("ref",), 2, "node-3", _report("GPU-d")),
    ]
    assert gpu_assignments(processes) == {
        None: {"GPU-a": ("actor+ref+rollout", "0"), "GPU-b": ("actor+ref+rollout", "1")},
        "node-1": {"GPU-c": ("critic", "0")},
        "node-2": {},  # its exporter's labels are cleared
        "node-3": {"GPU-d": ("ref+rollout", "2+10")},
    }
    assert join_labels(["rollout", "actor", "rollout"]) == "actor+rollout"


def test_health_replies_become_processes_with_their_roles_and_node():
    infos = {("main", 1): WorkerInfo(1, 2, 1, 11, "ctrl-node", ("GPU-b",), 5, 6),
             ("main", 0): WorkerInfo(0, 2, 1, 10, "ctrl-node", ("GPU-a",), 3, 4),
             ("critic", 0): WorkerInfo(0, 1, 1, 12, "other")}
    procs = processes_from_reports(infos, {"main": COLOCATED, "critic": ("critic",)}, "ctrl-node")
    assert procs == [ProcessDevices(("critic",), 0, "other", DeviceReport()),
                     ProcessDevices(COLOCATED, 0, None, DeviceReport(("GPU-a",), 3, 4)),
                     ProcessDevices(COLOCATED, 1, None, DeviceReport(("GPU-b",), 5, 6))]


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_torch_memory_per_process_and_absent_on_cpu():
    metrics = TrainerMetrics()
    torch_memory = TorchMemoryMetrics()
    metrics.registry.register(torch_memory)
    with MetricsServer(metrics.registry) as server:
        torch_memory.set_processes([ProcessDevices(("critic",), 0, "n1", _report(None))], {"n1": "node-1"})
        assert not [k for k in _samples(scrape(server.url)) if k[0].startswith("rrl_torch_")]
        torch_memory.set_processes([ProcessDevices(COLOCATED, 1, None, _report("GPU-b", 3 * GIB, 5 * GIB)),
                                    ProcessDevices(("critic",), 0, "n1", _report(None))],
                                   {None: "ctrl", "n1": "node-1"})
        data = _samples(scrape(server.url))
    labels = frozenset({"role": "actor+ref+rollout", "rank": "1", "node": "ctrl", "uuid": "GPU-b"}.items())
    assert data[("rrl_torch_memory_allocated_bytes", labels)] == 3 * GIB
    assert data[("rrl_torch_memory_reserved_bytes", labels)] == 5 * GIB
    assert len([k for k in data if k[0].startswith("rrl_torch_")]) == 2


# -- end to end: exporters -> promtool -> the alert --------------------------------------------

def _worker_reply(rank: int, node_id: str, visible: str, nvml: FakeNVML, monkeypatch) -> WorkerInfo:
    """The health reply of a worker that Ray gave GPU ``visible`` (its cuda:0)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    report = device_report(0, nvml=nvml)
    return WorkerInfo(rank, 2, 1, 1000 + rank, node_id, report.gpu_uuids,
                      8 * GIB + rank, 12 * GIB + rank)


def _input_series(text: str, instance: str, keep: tuple[str, ...]) -> list[str]:
    """promtool input series from a scrape: every sample of ``keep`` families, held constant."""
    out = []
    for (name, labels), value in sorted(_samples(text).items()):
        if name in keep:
            lbl = ", ".join(f'{k}="{v}"' for k, v in sorted({**dict(labels), "instance": instance}.items()))
            out.append(f"{name}{{{lbl}}}|{value}")
    return out


@needs_promtool
def test_low_utilization_alert_fires_for_the_idle_workers_gpu(tmp_path, monkeypatch):
    # Controller node: GPUs a (5% busy) and b (90%) host the colocated ranks 0 and 1; GPU c is
    # idle and unassigned. Node 1: GPU a' (10%) hosts critic rank 0.
    ctrl_nvml, node_nvml = _nvml(5, 90, 0), FakeNVML([FakeGpu("GPU-eeeeeeee", utilization_percent=10)])
    replies = {("main", 0): _worker_reply(0, "ctrl-id", "0", ctrl_nvml, monkeypatch),
               ("main", 1): _worker_reply(1, "ctrl-id", "1", ctrl_nvml, monkeypatch),
               ("critic", 0): _worker_reply(0, "node1-id", "0", node_nvml, monkeypatch)}
    processes = processes_from_reports(replies, {"main": COLOCATED, "critic": ("critic",)}, "ctrl-id")
    assignments = gpu_assignments(processes)

    trainer = TrainerMetrics(run="r")
    trainer.observe_step(7, 1.0)
    devices = DeviceMetrics(registry=trainer.registry, node="ctrl",
                            gpu_sampler=GpuSampler(nvml=ctrl_nvml, all_devices=True),
                            process_sampler=ProcessSampler())
    devices.assign_gpus(assignments.pop(None))
    torch_memory = TorchMemoryMetrics()
    trainer.registry.register(torch_memory)
    torch_memory.set_processes(processes, {None: "ctrl", "node1-id": "node-1"})
    remote = NodeExporter("node-1", nvml=node_nvml)
    target = remote.start()
    try:
        remote.set_gpu_assignments(assignments["node1-id"])
        with MetricsServer(trainer.registry) as server:
            controller_text = scrape(server.url)
        remote_text = scrape(f"http://{target}/metrics")
    finally:
        remote.stop()

    # Every GPU series is labelled; the torch series name the same GPUs.
    gpus = {dict(k[1])["uuid"]: (dict(k[1])["role"], dict(k[1])["rank"])
            for text in (controller_text, remote_text) for k in _samples(text)
            if k[0] == "rrl_gpu_utilization_ratio"}
    assert gpus == {"GPU-aaaaaaaa": ("actor+ref+rollout", "0"), "GPU-bbbbbbbb": ("actor+ref+rollout", "1"),
                    "GPU-cccccccc": ("", ""), "GPU-eeeeeeee": ("critic", "0")}
    torch_series = {dict(k[1])["uuid"]: v for k, v in _samples(controller_text).items()
                    if k[0] == "rrl_torch_memory_allocated_bytes"}
    assert torch_series == {"GPU-aaaaaaaa": 8 * GIB, "GPU-bbbbbbbb": 8 * GIB + 1, "GPU-eeeeeeee": 8 * GIB}

    lines = _series_lines(_input_series(controller_text, "ctrl:9400", ("rrl_gpu_utilization_ratio", "rrl_step"))
                          + _input_series(remote_text, "node-1:9401", ("rrl_gpu_utilization_ratio",)))

    def expected(node: str, instance: str, gpu: str, uuid: str, role: str, rank: str, percent: int) -> str:
        labels = {"severity": "warning", "instance": instance, "node": node, "gpu": gpu, "uuid": uuid,
                  "role": role, "rank": rank}
        return (f"          - exp_labels: {json.dumps(labels)}\n"
                f"            exp_annotations:\n"
                f"              summary: \"GPU {gpu} on {node} under 20% busy while training\"\n"
                f"              description: \"GPU {gpu} ({uuid}, {role} rank {rank}) averaged {percent}% "
                f"utilization over 10 minutes while steps are completing: an input, rollout or "
                f"communication bottleneck.\"")

    _promtool_test(tmp_path, lines, [
        "      - {alertname: RRLGpuUtilizationLow, eval_time: 5m, exp_alerts: []}",
        "      - alertname: RRLGpuUtilizationLow",
        "        eval_time: 30m",
        "        exp_alerts:",
        expected("ctrl", "ctrl:9400", "0", "GPU-aaaaaaaa", "actor+ref+rollout", "0", 5),
        expected("node-1", "node-1:9401", "0", "GPU-eeeeeeee", "critic", "0", 10),
        # 8 GiB of 80 GiB in use: no memory alert.
        "      - {alertname: RRLGpuMemoryNearlyFull, eval_time: 30m, exp_alerts: []}",
    ])


def _series_lines(series: list[str]) -> list[str]:
    lines = []
    for entry in series:
        name_labels, value = entry.rsplit("|", 1)
        values = f"{value}+1x40" if name_labels.startswith("rrl_step") else f"{value}x40"
        lines.append(f"      - series: {json.dumps(name_labels)}\n        values: '{values}'")
    return lines


def _promtool_test(tmp_path, series_lines: list[str], alert_tests: list[str]) -> None:
    test = "\n".join([f"rule_files: [{json.dumps(str(RULES))}]", "evaluation_interval: 1m", "tests:",
                      "  - interval: 1m", "    input_series:", *series_lines, "    alert_rule_test:", *alert_tests])
    path = tmp_path / "gpu_alert_test.yml"
    path.write_text(test + "\n")
    assert "SUCCESS" in promtool("test", "rules", str(path))


@needs_promtool
def test_memory_alert_fires_for_the_process_whose_tensors_fill_its_gpu(tmp_path, monkeypatch):
    nvml = _nvml(50, 50)  # 80 GiB each
    replies = {("main", r): _worker_reply(r, "ctrl-id", str(r), nvml, monkeypatch) for r in (0, 1)}
    replies = {key: WorkerInfo(**{**info.__dict__, "torch_allocated_bytes": alloc * GIB,
                                  "torch_reserved_bytes": 78 * GIB})
               for (key, info), alloc in zip(sorted(replies.items()), (74, 40))}
    processes = processes_from_reports(replies, {"main": COLOCATED}, "ctrl-id")
    trainer = TrainerMetrics(run="r")
    devices = DeviceMetrics(registry=trainer.registry, node="ctrl",
                            gpu_sampler=GpuSampler(nvml=nvml, all_devices=True), process_sampler=ProcessSampler())
    devices.assign_gpus(gpu_assignments(processes)[None])
    torch_memory = TorchMemoryMetrics()
    trainer.registry.register(torch_memory)
    torch_memory.set_processes(processes, {None: "ctrl"})
    with MetricsServer(trainer.registry) as server:
        text = scrape(server.url)
    lines = _series_lines(_input_series(text, "ctrl:9400", ("rrl_gpu_memory_total_bytes",
                                                            "rrl_torch_memory_allocated_bytes",
                                                            "rrl_torch_memory_reserved_bytes")))
    _promtool_test(tmp_path, lines, [
        "      - {alertname: RRLGpuMemoryNearlyFull, eval_time: 5m, exp_alerts: []}",
        "      - alertname: RRLGpuMemoryNearlyFull",
        "        eval_time: 15m",
        "        exp_alerts:",
        '          - exp_labels: {severity: warning, node: ctrl, uuid: GPU-aaaaaaaa, role: actor+ref+rollout, rank: "0"}',
        "            exp_annotations:",
        '              summary: "GPU GPU-aaaaaaaa on ctrl nearly full"',
        "              description: \"torch in actor+ref+rollout rank 0 has reserved 97.5% of GPU GPU-aaaaaaaa's "
        "memory and live tensors fill over 90% of the GPU: an out-of-memory error is near (a longer batch or "
        "response will not fit). Lower the micro-batch or response length, or shard over more GPUs.\"",
    ])


# -- non-blocking health polling (Ray) -------------------------------------------------------

@ray.remote(concurrency_groups=HEALTH_GROUPS)
class _BusyWorker(Worker):
    answers_during_calls = True

    @ray.method(concurrency_group="health")
    def health(self):
        return self.ping()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def block(self, seconds: float) -> bool:
        time.sleep(seconds)
        return True


def test_poller_collects_replies_while_workers_are_busy_and_never_waits(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="poll", cpus_per_bundle=0.1)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(_BusyWorker))
    try:
        busy = group.execute_all_async("block", 60.0)
        poller = DeviceReportPoller(interval_s=0.0)
        poller.reset({})
        def both_replied() -> bool:
            poller.poll([group])
            assert len(poller._pending) <= 2  # at most one call in flight per process
            return len(poller.reports) >= 2

        wait_until(both_replied, 30, 0.05, "a health reply from both busy ranks")
        assert sorted(poller.reports) == [("poll", 0), ("poll", 1)]
        assert len({info.pid for info in poller.reports.values()}) == 2
        # The replies came back while the training-like call was still running.
        ready, _ = ray.wait(busy, num_returns=len(busy), timeout=0)
        assert ready == []
        # A real worker's reply on this CPU machine: no GPU, no torch counters.
        assert all((info.gpu_uuids, info.torch_allocated_bytes, info.torch_reserved_bytes) == ((), None, None)
                   for info in poller.reports.values())
    finally:
        group.shutdown()
