"""monitoring/: Prometheus config and alert rules, and the queries of every dashboard.

Checks, from cheapest to strongest: files parse and are wired to each other; every PromQL
expression names only series that resilient_rl.telemetry exports; promtool accepts the config,
the rules and every dashboard query, and the alerts fire on the scenarios they are written for;
a real Prometheus server using this config scrapes a live exporter and answers every query.
The dashboards themselves (generator, Grafana schema, grid, variables) are checked in
test_dashboards.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from resilient_rl.telemetry import FileSDWriter, MetricsServer
from resilient_rl.testing.monitoring import (DATASOURCE_UID, MONITORING, RULES, alert_rules, dashboard_queries,
                                             exported_names, free_port, grafana_to_promql, load_dashboards,
                                             metric_names, populated_registry)
from resilient_rl.testing.wait import wait_until


# -- structure -----------------------------------------------------------------------------

def test_metric_name_extraction_finds_names_and_skips_promql_syntax():
    expr = ('sum by (role, le) (rate(rrl_x_bucket{run=~"$run", a="rrl_not_me"}[$__rate_interval]))'
            ' / on () group_left () rrl_y offset 10m or vector(0) > bool 1e3')
    assert metric_names(expr) == {"rrl_x_bucket", "rrl_y"}
    assert metric_names("rrl_a - (rrl_b offset 10m or rrl_c * 0)") == {"rrl_a", "rrl_b", "rrl_c"}


def test_every_query_uses_only_exported_metric_names():
    exported = exported_names()
    queries = dashboard_queries() + [(r["alert"], r["expr"]) for r in alert_rules()]
    assert len(queries) > 50
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} not exported by resilient_rl.telemetry"


def test_every_exported_series_family_is_used_somewhere():
    # Not a rule of Prometheus, but a series no panel or alert shows is easy to forget.
    used = set().union(*(metric_names(e) for _, e in dashboard_queries()),
                       *(metric_names(r["expr"]) for r in alert_rules()))
    trainer, _ = populated_registry()
    unused = [f.name for f in trainer.registry.collect()
              if not any(s.name in used for s in f.samples)]
    assert not unused, f"series not shown on any dashboard or alert: {unused}"


def test_grafana_provisioning_and_compose_are_wired_together():
    datasources = yaml.safe_load(
        (MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["uid"] == DATASOURCE_UID and ds["type"] == "prometheus"
    providers = yaml.safe_load(
        (MONITORING / "grafana/provisioning/dashboards/rrl.yml").read_text())["providers"]
    dashboards_dir = providers[0]["options"]["path"]

    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    mounts = {}
    for name, service in compose["services"].items():
        assert service.get("network_mode") == "host" or service.get("ports"), name
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (MONITORING / source).exists(), f"{name} mounts missing {source}"
                mounts[target] = source
    assert mounts[dashboards_dir] == "./grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    assert mounts["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"
    assert mounts["/etc/prometheus/rules"] == "./rules"
    assert mounts["/etc/prometheus/targets"] == "./targets"


def test_prometheus_config_uses_file_sd_and_loads_rules():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "2s"
    assert any(RULES.match(pattern) for pattern in
               [str(MONITORING / p) for p in config["rule_files"]])
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["targets/*.json"]


def test_alert_rules_have_for_severity_and_annotations():
    rules = alert_rules()
    assert {"RRLNoProgress", "RRLRestartStorm", "RRLWorkerDown", "RRLCheckpointTooOld",
            "RRLGpuUtilizationLow"} <= {r["alert"] for r in rules}
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# -- promtool ------------------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not on PATH "
                                    "(Debian/Ubuntu: apt-get install prometheus)")


def promtool(*args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return output


@needs_promtool
def test_promtool_accepts_config_and_rules():
    assert "SUCCESS" in promtool("check", "config", str(MONITORING / "prometheus.yml"))
    assert f"SUCCESS: {len(alert_rules())} rules found" in promtool("check", "rules", str(RULES))


@needs_promtool
def test_promtool_accepts_every_dashboard_query(tmp_path):
    queries = dashboard_queries()
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"rrl_dashboard_query_{i}", "expr": grafana_to_promql(expr)}
        for i, (_, expr) in enumerate(queries)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    assert f"SUCCESS: {len(queries)} rules found" in promtool("check", "rules", str(path))


ALERT_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'rrl_worker_up{{instance="c:1", role="actor", rank="1", node="n0"}}'
        values: '1 1 0x10'
      - series: 'rrl_worker_up{{instance="c:1", role="actor", rank="0", node="n0"}}'
        values: '1x30'
    alert_rule_test:
      - {{alertname: RRLWorkerDown, eval_time: 3m, exp_alerts: []}}
      - alertname: RRLWorkerDown
        eval_time: 5m
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "c:1", role: actor, rank: "1", node: n0}}
            exp_annotations:
              summary: "Worker actor/1 down on n0"
              description: "Worker actor rank 1 on node n0 has been down for more than 2 minutes."

  - interval: 1m
    input_series:
      # A restart series that first appears inside the window still counts in full.
      - series: 'rrl_worker_restarts_total{{instance="c:1", role="actor", rank="0", cause="died"}}'
        values: '_ _ _ 1 2 3 4 5 6 6 6 6'
      - series: 'rrl_worker_restarts_total{{instance="c:1", role="critic", rank="0", cause="died"}}'
        values: '0x11'
    alert_rule_test:
      - {{alertname: RRLRestartStorm, eval_time: 7m, exp_alerts: []}}
      - alertname: RRLRestartStorm
        eval_time: 9m
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "c:1"}}
            exp_annotations:
              summary: "Restart storm on c:1"
              description: "6 worker restarts in the last 10 minutes (threshold 5). Look at rrl_worker_restarts_total by cause and role: a bad node, OOM or a crashing rank."

  - interval: 1m
    input_series:
      - series: 'rrl_step{{instance="stuck:1"}}'
        values: '0+1x5 5x40'
      - series: 'rrl_worker_up{{instance="stuck:1", role="actor", rank="0", node="n0"}}'
        values: '1x45'
      - series: 'rrl_step{{instance="busy:1"}}'
        values: '0+1x45'
      - series: 'rrl_worker_up{{instance="busy:1", role="actor", rank="0", node="n0"}}'
        values: '1x45'
    alert_rule_test:
      - {{alertname: RRLNoProgress, eval_time: 15m, exp_alerts: []}}
      - alertname: RRLNoProgress
        eval_time: 25m
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "stuck:1"}}
            exp_annotations:
              summary: "No training progress on stuck:1"
              description: "No training step completed for 15 minutes while workers are up: a hung collective, a stuck rollout or a recovery loop."

  - interval: 1m
    input_series:
      - series: 'rrl_checkpoint_age_seconds{{instance="c:1"}}'
        values: '0+60x60'
      - series: 'rrl_step{{instance="c:1"}}'
        values: '0+30x60'
      - series: 'rrl_checkpoint_last_committed_step{{instance="c:1"}}'
        values: '0x60'
    alert_rule_test:
      - {{alertname: RRLCheckpointTooOld, eval_time: 34m, exp_alerts: []}}
      - alertname: RRLCheckpointTooOld
        eval_time: 40m
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "c:1"}}
            exp_annotations:
              summary: "No checkpoint committed for 30 minutes on c:1"
              description: "The last committed checkpoint is 40m 0s old. Check checkpoint storage and rrl_checkpoint_save_duration_seconds."
      - {{alertname: RRLCheckpointTooFarBehind, eval_time: 20m, exp_alerts: []}}
      - alertname: RRLCheckpointTooFarBehind
        eval_time: 25m
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "c:1"}}
            exp_annotations:
              summary: "Last checkpoint is more than 500 steps behind on c:1"
              description: "750 steps were trained since the last committed checkpoint; a crash now would replay them."

  - interval: 1m
    input_series:
      # Exported at 0 from the start (every reason); two saves skipped at 71m and 72m.
      - series: 'rrl_checkpoint_skipped_total{{instance="c:1", run="r", reason="storage"}}'
        values: '0x70 1 2 2x80'
      - series: 'rrl_checkpoint_skipped_total{{instance="c:1", run="r", reason="slow"}}'
        values: '0x152'
    alert_rule_test:
      - {{alertname: RRLCheckpointsSkipped, eval_time: 70m, exp_alerts: []}}
      - alertname: RRLCheckpointsSkipped
        eval_time: 75m
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "c:1", reason: storage}}
            exp_annotations:
              summary: "Checkpoints skipped (storage) on c:1"
              description: "2 checkpoint save(s) skipped in the last hour (storage). Check the checkpoint storage; the run stops after checkpoint.max_skipped skips in a row, its last committed checkpoint intact."
      - {{alertname: RRLCheckpointsSkipped, eval_time: 140m, exp_alerts: []}}

  - interval: 1m
    input_series:
      - series: 'rrl_gpu_utilization_ratio{{instance="n0:1", node="n0", gpu="0", uuid="GPU-a", role="actor", rank="0"}}'
        values: '0.05x40'
      - series: 'rrl_gpu_utilization_ratio{{instance="n0:1", node="n0", gpu="1", uuid="GPU-b", role="", rank=""}}'
        values: '0x40'
      - series: 'rrl_gpu_utilization_ratio{{instance="n0:1", node="n0", gpu="2", uuid="GPU-c", role="actor", rank="1"}}'
        values: '0.9x40'
      - series: 'rrl_step{{instance="c:1"}}'
        values: '0+1x40'
    alert_rule_test:
      - alertname: RRLGpuUtilizationLow
        eval_time: 30m
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "n0:1", node: n0, gpu: "0", uuid: GPU-a, role: actor, rank: "0"}}
            exp_annotations:
              summary: "GPU 0 on n0 under 20% busy while training"
              description: "GPU 0 (GPU-a, actor rank 0) averaged 5% utilization over 10 minutes while steps are completing: an input, rollout or communication bottleneck."

  - interval: 1m
    input_series:
      # A NaN loss skipped at minute 3 (its series appears then); nothing after: the alert
      # holds for the 30-minute window, then clears.
      - series: 'rrl_nonfinite_total{{instance="c:1", quantity="loss", action="skipped"}}'
        values: '_ _ _ 1x40'
      - series: 'rrl_nonfinite_total{{instance="ok:1", quantity="reward", action="zeroed"}}'
        values: '0x40'
    alert_rule_test:
      - {{alertname: RRLNonFiniteValues, eval_time: 2m, exp_alerts: []}}
      - alertname: RRLNonFiniteValues
        eval_time: 4m
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "c:1", quantity: loss, action: skipped}}
            exp_annotations:
              summary: "Non-finite loss on c:1 (skipped)"
              description: "1 step(s) met NaN or Inf in loss in the last 30 minutes and the trainer skipped them (trainer.nonfinite). Look at the run's nonfinite events: a diverging learning rate, a reward function returning NaN, or a poisoned checkpoint."
      - {{alertname: RRLNonFiniteValues, eval_time: 40m, exp_alerts: []}}

  - interval: 1m
    input_series:
      # ETTR over the run's life sinks below 70% at minute 10 and stays there.
      - series: 'rrl_ettr_ratio{{instance="c:1"}}'
        values: '0.9x9 0.6x80'
      - series: 'rrl_ettr_ratio{{instance="ok:1"}}'
        values: '0.95x90'
    alert_rule_test:
      - {{alertname: RRLEffectiveTrainingTimeLow, eval_time: 60m, exp_alerts: []}}
      - alertname: RRLEffectiveTrainingTimeLow
        eval_time: 75m
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "c:1"}}
            exp_annotations:
              summary: "Effective training time under 70% on c:1"
              description: "Over the run's whole life only 60% of wall time went to steps that count. See rrl_lost_seconds_total by cause and rrl_recovery_phase_seconds for where the rest went."
"""


@needs_promtool
def test_alerts_fire_on_their_scenarios_and_only_then(tmp_path):
    path = tmp_path / "alerts_test.yml"
    path.write_text(ALERT_TESTS.format(rules=json.dumps(str(RULES))))
    assert "SUCCESS" in promtool("test", "rules", str(path))


def panel_expr(uid: str, title: str, panel_type: str) -> str:
    (board,) = [b for b in load_dashboards() if b["uid"] == uid]
    (panel,) = [p for p in board["panels"] if p["title"] == title and p["type"] == panel_type]
    (target,) = panel["targets"]
    return target["expr"]


@needs_promtool
def test_restart_and_worker_down_panels_show_what_happened(tmp_path):
    # A worker's restart series is first exported at 1, on its first restart; increase()
    # would count that as 0. The panels count it, and a later one, exactly.
    restarts = grafana_to_promql(panel_expr("rrl-reliability", "Restarts by worker", "timeseries"))
    in_range = grafana_to_promql(panel_expr("rrl-reliability", "Restarts (range)", "stat")
                                 .replace("$__range", "10m"))
    down = grafana_to_promql(panel_expr("rrl-reliability", "Workers down", "timeseries"))
    actor1 = '{role="actor", rank="1"}'
    tests = {"tests": [{
        "interval": "1m",
        "input_series": [
            {"series": 'rrl_worker_restarts_total{run="r", role="actor", rank="1", cause="died"}',
             "values": "_ _ 1 1 3 3 3"},
            {"series": 'rrl_worker_restarts_total{run="r", role="critic", rank="0", cause="died"}',
             "values": "_ _ _ _ _ _ 1"},
            {"series": 'rrl_worker_up{run="r", role="actor", rank="1", node="n0"}',
             "values": "1 1 0 1 1 1 1"},
            {"series": 'rrl_worker_up{run="r", role="actor", rank="0", node="n0"}',
             "values": "1x6"}],
        "promql_expr_test": [
            {"expr": restarts, "eval_time": "2m",
             "exp_samples": [{"labels": actor1, "value": 1}]},
            {"expr": restarts, "eval_time": "3m",
             "exp_samples": [{"labels": actor1, "value": 0}]},
            {"expr": restarts, "eval_time": "4m",
             "exp_samples": [{"labels": actor1, "value": 2}]},
            {"expr": restarts, "eval_time": "6m",
             "exp_samples": [{"labels": actor1, "value": 0},
                             {"labels": '{role="critic", rank="0"}', "value": 1}]},
            {"expr": in_range, "eval_time": "6m", "exp_samples": [{"labels": "{}", "value": 4}]},
            {"expr": down, "eval_time": "2m", "exp_samples": [
                {"labels": '{run="r", role="actor", rank="1", node="n0"}', "value": 1}]},
            {"expr": down, "eval_time": "3m", "exp_samples": []},
        ]}]}
    path = tmp_path / "panels_test.yml"
    path.write_text(yaml.safe_dump(tests))
    assert "SUCCESS" in promtool("test", "rules", str(path))


# -- a real Prometheus server --------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus")


def _api(base: str, path: str, **params: str) -> dict:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture
def live_prometheus(tmp_path):
    """This repository's prometheus.yml and rules, scraping a live exporter via file_sd."""
    if PROMETHEUS is None:
        pytest.skip("the prometheus server binary is not on PATH")
    config_dir = tmp_path / "monitoring"
    config_dir.mkdir()
    shutil.copy(MONITORING / "prometheus.yml", config_dir)
    shutil.copytree(MONITORING / "rules", config_dir / "rules")
    trainer, _ = populated_registry()
    with MetricsServer(trainer.registry) as server:
        sd = FileSDWriter(config_dir / "targets" / "check.json")
        sd.add(server.target, {"job": "resilient-rl", "run": "check", "node": "ctrl"})
        port = free_port()
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
        try:
            yield f"http://127.0.0.1:{port}", trainer
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            sd.close()


def test_real_prometheus_scrapes_a_run_and_answers_every_query(live_prometheus):
    base, trainer = live_prometheus
    # Three scrapes (2s apart) give rate() two or more samples to work with.
    def scraped_enough():
        trainer.observe_step(int(time.time()), 0.3, {"gen": 0.1}, tokens=10)
        result = _api(base, "query", query="count_over_time(rrl_step[1m])")["result"]
        return result and float(result[0]["value"][1]) >= 3
    wait_until(scraped_enough, 60, 0.25, "three scrapes of the exporter", ignore=(OSError,))

    present = {r["metric"]["__name__"] for r in _api(
        base, "query", query='group by (__name__) ({__name__=~"rrl_.+"})')["result"]}
    for where, expr in dashboard_queries():
        missing = metric_names(expr) - present
        assert not missing, f"{where}: {sorted(missing)} not scraped"
        _api(base, "query", query=grafana_to_promql(expr))  # raises on a query error

    # honor_labels: the exporter's own node label wins over the target's, not exported_node.
    up = _api(base, "query", query='rrl_worker_up{role="actor", rank="1"}')["result"]
    assert [r["metric"]["node"] for r in up] == ["n1"]
    assert up[0]["metric"]["run"] == "check" and "exported_node" not in up[0]["metric"]
    assert _api(base, "label/run/values", **{"match[]": "rrl_run_info"}) == ["check"]

    def rules_evaluated():
        groups = _api(base, "rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else None
    rules = wait_until(rules_evaluated, 30, 0.25, "a first evaluation of every alert rule", ignore=(OSError,))
    assert len(rules) == len(alert_rules())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError"))
                                                     for r in rules if r["health"] != "ok"]


def test_grafana_is_loopback_only_and_has_no_default_password():
    import re

    grafana = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())["services"]["grafana"]
    env = grafana["environment"]
    assert re.fullmatch(r"\$\{GRAFANA_LISTEN:-127\.0\.0\.1\}", env["GF_SERVER_HTTP_ADDR"])
    # ${VAR:?message} makes `docker compose up` fail while the variable is unset or empty.
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", env["GF_SECURITY_ADMIN_PASSWORD"])
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_prometheus_cannot_be_shut_down_from_the_network():
    """No lifecycle API (``/-/quit``, ``/-/reload`` for anyone reaching the port) and loopback by default."""
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    command = compose["services"]["prometheus"]["command"]
    assert not any(arg.startswith("--web.enable-lifecycle") for arg in command)
    listen = next(arg for arg in command if arg.startswith("--web.listen-address="))
    assert listen.endswith(":-127.0.0.1:9090}"), listen
