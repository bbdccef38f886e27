"""A real Prometheus scraping a real training run: every dashboard query and alert answers.

Prometheus (the Debian ``prometheus`` binary) runs on loopback with a copy of
``monitoring/prometheus.yml`` whose file_sd reads the run's targets file and whose scrape and
rule intervals are 1s. The run trains 8 steps on a local Ray cluster, checkpointing every 2
steps, with actor rank 1 SIGKILLed during step 4. Everything is then checked through
Prometheus's HTTP API, over the time range of the run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from resilient_rl.errors import TelemetryError
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.telemetry import GpuSampler, sample_value, scrape
from resilient_rl.testing.monitoring import (MONITORING, alert_rules, dashboard_queries, free_port,
                                             grafana_to_promql)
from resilient_rl.testing.wait import wait_until
from resilient_rl.config.schema import load_config
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.telemetry.nodes import RemoteNodeExporter
from resilient_rl.trainer.hooks import TrainerHook

pytestmark = pytest.mark.ray

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus server binary is not on PATH "
    "(Debian/Ubuntu: apt-get install prometheus; .ci/run installs it)")

STEPS = 8
#: Prometheus's scrape and rule-evaluation interval in these tests, seconds.
SCRAPE_S = 1.0
SMALL = [f"trainer.total_steps={STEPS}", "trainer.progress_bar=false", "data.batch_size=16",
         "actor.mini_batch_size=8", "critic.mini_batch_size=8", "actor.ppo_epochs=2", "critic.ppo_epochs=2",
         "data.num_prompts=64", "ray.cpus_per_worker=0.05", "checkpoint.save_every=2",
         "recovery.call_timeout_s=30", "recovery.restart_timeout_s=60",
         "data.val_num_prompts=8", "trainer.test_freq=2"]  # the dashboards' validation panel has data
# A comparison with a number at the end of an alert condition (label matchers compare strings).
THRESHOLD = re.compile(r"\s*(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?![\w.:])")


def without_thresholds(expr: str) -> str:
    """An alert expression without its comparisons with numbers: the values it tests."""
    return THRESHOLD.sub("", expr)


class Prometheus:
    """A Prometheus server on loopback, started from ``config`` and stopped by its pid."""

    def __init__(self, config: Path, data_dir: Path, log: Path) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
             f"--web.listen-address={self.base[len('http://'):]}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=self._log)
        wait_until(self._ready, 60, 0.25, "Prometheus to become ready", ignore=(OSError,))

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}: {Path(self._log.name).read_text()}")
        with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as response:
            return response.status == 200

    def api(self, path: str, **params: str | float) -> dict | list:
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # a bad query answers 400 with the reason
            body = json.loads(exc.read())
        assert body["status"] == "success", f"{path} {params}: {body.get('error')}"
        return body["data"]

    def value(self, query: str) -> float | None:
        """The single value of an instant query, None when it returns nothing."""
        result = self.api("query", query=query)["result"]
        assert len(result) <= 1, f"{query}: expected one series, got {result}"
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class HoldRecovery(TrainerHook):
    """Trainer hook: a recovery stays in its rejoining state for ``seconds``, so that an outage
    lasts long enough for a scrape to see it, however fast the recovery would have been."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_recovery_state(self, trainer, state) -> None:
        if getattr(state, "value", state) == "rejoining":
            time.sleep(self.seconds)


def prometheus_config(tmp_path: Path, targets_file: Path) -> Path:
    """A copy of monitoring/ whose file_sd reads ``targets_file``, every interval SCRAPE_S."""
    config_dir = tmp_path / "monitoring"
    shutil.copytree(MONITORING / "rules", config_dir / "rules")
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    every = f"{SCRAPE_S:g}s"
    config["global"].update(scrape_interval=every, scrape_timeout=every, evaluation_interval=every)
    config["rule_files"] = [str(config_dir / "rules" / "*.yml")]
    (job,) = config["scrape_configs"]
    job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
    path = config_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@needs_prometheus
def test_prometheus_scrapes_a_run_with_a_failure_and_every_query_answers(ray_cluster, tmp_path):
    cfg = load_config(None, SMALL + [f"trainer.output_dir={tmp_path / 'runs'}", "trainer.run_name=e2e",
                                     f"checkpoint.root={tmp_path / 'ckpt'}"])
    schedule = FaultSchedule().at_step(4).kill("actor", 1, delay_s=0.1)
    trainer = PPOTrainer(cfg, hooks=[schedule, HoldRecovery(SCRAPE_S * 2.5)])
    targets = trainer.telemetry.file_sd.path
    assert targets == trainer.run_dir.path / "prometheus_targets.json"
    prom = Prometheus(prometheus_config(tmp_path, targets), tmp_path / "tsdb", tmp_path / "prometheus.log")
    try:
        start = time.time()
        trainer.fit()
        assert schedule.faults[0].fired and schedule.faults[0].pid is not None
        assert trainer.recovery.recoveries == 1
        # Every worker process (the restarted one too) gave a device report: on CPU, no GPU and
        # no torch counters, so no rrl_gpu_* or rrl_torch_* series.
        reports = trainer.telemetry.device_reports.reports
        assert set(reports) == set(trainer.roles.known_workers)
        assert {r.pid for r in reports.values()} == {pid for pid, _ in trainer.roles.known_workers.values()}
        assert all((r.gpu_uuids, r.torch_allocated_bytes) == ((), None) for r in reports.values())

        # The exporter stays up until Prometheus holds the final state of the run.
        def final_state_scraped():
            return (prom.value("rrl_step") == STEPS and prom.value("rrl_checkpoint_last_committed_step") == STEPS
                    and prom.value("rrl_recoveries_total") == 1)
        wait_until(final_state_scraped, 30, 0.25, "a scrape of the run's final state", ignore=(OSError,))
        # A few more scrapes of it: rates over the run need two samples of every series, those
        # that appeared with the recovery too, however quickly the run went.
        scrapes = prom.value("count_over_time(rrl_step[10m])")
        wait_until(lambda: prom.value("count_over_time(rrl_step[10m])") >= scrapes + 2, 30, 0.25,
                   "two more scrapes of the run's final state", ignore=(OSError,))
        rules = wait_until(lambda: [r for g in prom.api("rules")["groups"] for r in g["rules"]
                                    if r["health"] != "unknown"], 30, 0.25, "an evaluation of the alert rules",
                           ignore=(OSError,))
        end = time.time()

        targets_up = prom.api("targets")["activeTargets"]
        assert [(t["labels"]["run"], t["health"]) for t in targets_up] == [("e2e", "up")]
        assert targets_up[0]["scrapeUrl"] == trainer.telemetry.url

        # Restarts, recoveries and lost work moved, and agree with the trainer's own account.
        restarts = prom.api("query", query="rrl_worker_restarts_total")["result"]
        assert [(r["metric"]["role"], r["metric"]["rank"]) for r in restarts] == [("actor", "1")]
        assert float(restarts[0]["value"][1]) >= 1
        assert prom.value("rrl_steps_replayed_total") == trainer.recovery.steps_replayed
        assert prom.value("sum(rrl_failures_total)") == 1
        assert 0 < prom.value("rrl_goodput_ratio") < 1
        # The recovery, phase by phase (replay: until the failed step was done again), and its cost.
        for phase in ("detect", "restart", "rejoin", "restore", "replay"):
            assert prom.value(f'rrl_recovery_phase_seconds_count{{phase="{phase}"}}') == 1, phase
        assert prom.value('rrl_recovery_phase_seconds_sum{phase="restart"}') > 0
        assert prom.value("sum(rrl_lost_seconds_total)") > 0
        assert 0 < prom.value("rrl_ettr_ratio") < 1
        window = f"{int(end - start) + 5}s"
        # The killed worker was seen down, and is up again.
        assert prom.value(f'min_over_time(rrl_worker_up{{role="actor", rank="1"}}[{window}])') == 0
        assert prom.value('rrl_worker_up{role="actor", rank="1"}') == 1
        assert prom.value(f'max_over_time(rrl_phase_duration_seconds_count{{phase="old_log_prob"}}[{window}])') \
            >= STEPS
        # Worker processes instead of GPUs: one series per process, under its first role (the
        # colocated placement hosts every role, the critic too, in the actor's processes).
        procs = prom.api("query", query="rrl_process_resident_memory_bytes")["result"]
        assert sorted((p["metric"]["role"], p["metric"]["rank"]) for p in procs) == [("actor", "0"), ("actor", "1")]
        assert len(procs) == len(trainer.roles.known_workers)

        present = set(prom.api("label/__name__/values"))
        # GPU series and torch's GPU memory per rank exist only on a machine with GPUs.
        device_only = ("rrl_gpu_", "rrl_torch_")
        has_gpus = any(name.startswith(device_only) for name in present)
        queries = [(where, grafana_to_promql(expr)) for where, expr in dashboard_queries()]
        queries += [(f"alert {r['alert']}", without_thresholds(r["expr"])) for r in alert_rules()]
        empty = []
        for where, query in queries:
            result = prom.api("query_range", query=query, start=start, end=end, step=1)["result"]
            if not result and not (not has_gpus and any(prefix in query for prefix in device_only)):
                empty.append(f"{where}: {query}")
        assert not empty, "queries without data over the run:\n" + "\n".join(empty)

        assert len(rules) == len(alert_rules())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    finally:
        trainer.shutdown()
        prom.stop()
    assert not targets.exists(), "the targets file is removed when the run stops"


def test_alert_thresholds_are_stripped_and_only_they():
    assert without_thresholds('rrl_worker_up{role!="", x=~"1"} == 0') == 'rrl_worker_up{role!="", x=~"1"}'
    assert without_thresholds("changes(rrl_step[10m]) == 0\nand on (instance) (max by (instance) (rrl_up) > 0)") \
        == "changes(rrl_step[10m])\nand on (instance) (max by (instance) (rrl_up))"
    assert without_thresholds("rrl_a - rrl_b offset 10m > 1e3") == "rrl_a - rrl_b offset 10m"
    for rule in alert_rules():
        assert not re.search(r"[<>]|==", without_thresholds(rule["expr"]).replace("!=", "")), rule["alert"]


def test_node_exporter_actor_serves_its_node_and_reports_a_busy_port(ray_cluster):
    node_id = ray_cluster.get_runtime_context().get_node_id()
    exporter = RemoteNodeExporter(node_id, "n-test", "127.0.0.1", 0, "", 0.0, timeout_s=60)
    try:
        exporter.set_processes({("actor", 0): os.getpid()})
        text = scrape(f"http://{exporter.target}/metrics")
        labels = {"role": "actor", "rank": "0", "node": "n-test"}
        assert sample_value(text, "rrl_process_resident_memory_bytes", labels) > 0
        assert sample_value(text, "rrl_process_cpu_seconds_total", labels) > 0
        if not GpuSampler().available:
            assert "rrl_gpu_" not in text  # absent, not zero
        port = int(exporter.target.rsplit(":", 1)[1])
        with pytest.raises(TelemetryError, match=f"node n-busy: .*port {port} is already in use"):
            RemoteNodeExporter(node_id, "n-busy", "127.0.0.1", port, "", 0.0, timeout_s=60)
    finally:
        exporter.stop()
    with pytest.raises(TelemetryError):
        scrape(f"http://{exporter.target}/metrics", timeout=2)
