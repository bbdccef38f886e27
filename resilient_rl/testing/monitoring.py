"""Read the repository's ``monitoring/`` folder the way its tests do.

For tests of the Prometheus config, the alert rules and the Grafana dashboards: the PromQL of
every dashboard panel, annotation and variable and of every alert rule, the metric names an
expression uses, Grafana's variables replaced by what they expand to, and a registry that
holds every series :mod:`resilient_rl.telemetry` can export (GPUs from
:class:`~resilient_rl.testing.fake_nvml.FakeNVML`). ``monitoring/`` sits beside the package in
a source checkout; it is not shipped in the wheel.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import yaml

from resilient_rl.telemetry import (DeviceMetrics, DeviceReport, GpuSampler, ProcessDevices, ProcessSampler,
                                    TorchMemoryMetrics, TrainerMetrics)
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML
from resilient_rl.telemetry.recovery_metrics import RECOVERY_PHASES, RecoveryMetrics
from resilient_rl.runtime.master_env import free_port  # noqa: F401  (the tests take it from here)

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
DASHBOARDS = sorted((MONITORING / "grafana" / "dashboards").glob("*.json"))
RULES = MONITORING / "rules" / "rrl-alerts.yml"
DATASOURCE_UID = "rrl-prometheus"

PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                "group_right", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # string literals
    s = re.sub(r"\{[^}]*\}", "", s)                          # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)                         # ranges, subqueries
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    found = set()
    for m in re.finditer(r"(?<![A-Za-z0-9_:.$])[A-Za-z_:][A-Za-z0-9_:]*", s):
        name = m.group(0)
        followed_by_call = re.match(r"\s*\(", s[m.end():]) is not None
        if name.lower() in PROMQL_WORDS or followed_by_call:
            continue
        found.add(name)
    return found


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables by what they expand to on a query."""
    expr = re.sub(r"\$__\w+", "1m", expr)                   # $__rate_interval, $__range
    expr = expr.replace("$window", "10m")                    # the rate window's default
    return re.sub(r"\$\{?\w+\}?", ".*", expr)                # $run, ${node} (regex matchers)


def load_dashboards() -> list[dict]:
    """Every committed dashboard's JSON, in file name order."""
    return [json.loads(path.read_text()) for path in DASHBOARDS]


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, annotation and variable query."""
    out = []
    for board in load_dashboards():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{board['uid']}/{panel['title']}/{target['refId']}", target["expr"]))
        for ann in board["annotations"]["list"]:
            if "expr" in ann:
                out.append((f"{board['uid']}/annotation {ann['name']}", ann["expr"]))
        for var in board["templating"]["list"]:
            if var["type"] == "interval":  # a list of windows (the rate window), no query
                continue
            query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
            m = re.fullmatch(r"label_values\((\w+(?:\{[^}]*\})?),\s*\w+\)", query)
            assert m, f"{board['uid']}: variable {var['name']} query {query!r} is not label_values"
            out.append((f"{board['uid']}/variable {var['name']}", m.group(1)))
    return out


def alert_rules() -> list[dict]:
    """Every alert rule of ``monitoring/rules/rrl-alerts.yml``, across its groups."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def populated_registry() -> tuple[TrainerMetrics, DeviceMetrics]:
    """A registry with every series the telemetry package can export, each with a value."""
    trainer = TrainerMetrics(run="check")
    trainer.observe_step(1, 0.5, {"gen": 0.2, "update_actor": 0.1}, tokens=100, reward_mean=0.1,
                         losses={"actor": 0.5, "critic": 0.25}, kl=0.01, lr={"actor": 1e-5})
    trainer.set_goodput(8.0, 10.0)
    trainer.observe_validation(0.2, 0.1)
    trainer.set_workers_up("actor", 0, "n0", True)
    trainer.set_workers_up("actor", 1, "n1", True)
    trainer.record_failure("died")
    trainer.record_restart("actor", 1, "died")
    trainer.record_recovery(5.0, 2)
    trainer.record_checkpoint_save(1.0, 0.1, 1024, 1)
    trainer.record_checkpoint_load(0.2)
    trainer.record_corrupt_checkpoint()
    trainer.record_nonfinite("loss", "skipped")
    trainer.record_checkpoint_skipped("storage")
    recovery = RecoveryMetrics(trainer.registry, ettr=lambda: 0.9, lost={"controller": 30.0})
    recovery.observe_phases({phase: 0.5 for phase in RECOVERY_PHASES})
    recovery.record_lost("died", 2.0)
    devices = DeviceMetrics(
        registry=trainer.registry, node="n0",
        gpu_sampler=GpuSampler(nvml=FakeNVML([FakeGpu(uuid="GPU-0000")]), all_devices=True),
        process_sampler=ProcessSampler({("actor", 0): os.getpid()}))
    devices.assign_gpus({"GPU-0000": ("actor", 0)})
    torch_memory = TorchMemoryMetrics()
    trainer.registry.register(torch_memory)
    torch_memory.set_processes([ProcessDevices(("actor",), 0, None, DeviceReport(("GPU-0000",), 2**30, 2**31))],
                               {None: "n0"})
    return trainer, devices


def exported_names() -> set[str]:
    """Names of every sample :func:`populated_registry` exports."""
    trainer, _ = populated_registry()
    return {s.name for family in trainer.registry.collect() for s in family.samples}
