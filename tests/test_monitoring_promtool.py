"""monitoring/ under promtool: the Prometheus config and alert rules pass ``promtool check``, so
does every dashboard query (as a recording rule), each alert fires on the scenario it is written
for and only then, and the reliability panels count restarts and down workers as they happened.
Skipped where promtool is not on PATH; the rest of monitoring/ is checked in
test_monitoring_config.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from resilient_rl.testing.monitoring import (MONITORING, RULES, alert_rules, dashboard_queries, grafana_to_promql,
                                             load_dashboards)


# -- promtool ------------------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not on PATH "
                                    "(Debian/Ubuntu: apt-get install prometheus)")


def promtool(*args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return output


def expressions_hold(tmp_path: Path, series: list[dict], checks: list[dict], interval: str = "1m") -> None:
    """``promtool test rules`` of PromQL ``checks`` (expr, eval_time, exp_samples) on input ``series``."""
    path = tmp_path / "expressions_test.yml"
    path.write_text(yaml.safe_dump({"tests": [{"interval": interval, "input_series": series,
                                               "promql_expr_test": checks}]}))
    assert "SUCCESS" in promtool("test", "rules", str(path))


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
      # A new controller on another port at minute 5: 3 restarts counted by the old one inside the
      # window, then its series ends; 3 by the new one, whose series first appears (at 1) inside
      # the window and still counts in full.
      - series: 'rrl_worker_restarts_total{{run="r", instance="c:1", role="actor", rank="0", cause="died"}}'
        values: '0 1 2 3 3'
      - series: 'rrl_worker_restarts_total{{run="r", instance="c:2", role="actor", rank="0", cause="died"}}'
        values: '_ _ _ _ _ _ 1 2 3 3 3 3'
      - series: 'rrl_worker_restarts_total{{run="r", instance="c:1", role="critic", rank="0", cause="died"}}'
        values: '0x11'
    alert_rule_test:
      - {{alertname: RRLRestartStorm, eval_time: 7m, exp_alerts: []}}
      - alertname: RRLRestartStorm
        eval_time: 9m
        exp_alerts:
          - exp_labels: {{severity: critical, run: r}}
            exp_annotations:
              summary: "Restart storm in run r"
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
      - series: 'rrl_nonfinite_total{{run="r", instance="c:1", quantity="loss", action="skipped"}}'
        values: '_ _ _ 1x40'
      - series: 'rrl_nonfinite_total{{run="ok", instance="ok:1", quantity="reward", action="zeroed"}}'
        values: '0x40'
    alert_rule_test:
      - {{alertname: RRLNonFiniteValues, eval_time: 2m, exp_alerts: []}}
      - alertname: RRLNonFiniteValues
        eval_time: 4m
        exp_alerts:
          - exp_labels: {{severity: warning, run: r, quantity: loss, action: skipped}}
            exp_annotations:
              summary: "Non-finite loss in run r (skipped)"
              description: "1 step(s) met NaN or Inf in loss in the last 30 minutes and the trainer skipped them (trainer.nonfinite). Look at the run's nonfinite events: a diverging learning rate, a reward function returning NaN, or a poisoned checkpoint."
      - {{alertname: RRLNonFiniteValues, eval_time: 40m, exp_alerts: []}}

  - interval: 1m
    input_series:
      # The controller's exporter stops answering at minute 5 (its series go stale); a node's answers.
      - series: 'up{{job="resilient-rl", instance="c:1"}}'
        values: '1x4 0x30'
      - series: 'up{{job="resilient-rl", instance="n1:1"}}'
        values: '1x35'
    alert_rule_test:
      - {{alertname: RRLExporterDown, eval_time: 5m, exp_alerts: []}}
      - alertname: RRLExporterDown
        eval_time: 8m
        exp_alerts:
          - exp_labels: {{severity: critical, job: resilient-rl, instance: "c:1"}}
            exp_annotations:
              summary: "resilient-rl exporter c:1 down"
              description: "The exporter at c:1 has not answered a scrape for 2 minutes: the controller or its node is gone, and the run's other alerts cannot fire for it."

  - interval: 1m
    input_series:
      # A new controller on the same port at minute 5: its restart counter starts again at 0, and
      # 8 restarts follow within 10 minutes of the old value 6.
      - series: 'rrl_worker_restarts_total{{run="r", instance="c:1", role="actor", rank="0", cause="died"}}'
        values: '6x4 0 1 2 3 4 5 6 7 8 8'
    alert_rule_test:
      - alertname: RRLRestartStorm
        eval_time: 14m
        exp_alerts:
          - exp_labels: {{severity: critical, run: r}}
            exp_annotations:
              summary: "Restart storm in run r"
              description: "8 worker restarts in the last 10 minutes (threshold 5). Look at rrl_worker_restarts_total by cause and role: a bad node, OOM or a crashing rank."

  - interval: 1m
    input_series:
      # A new controller on the same port at minute 5 exports the series at 0; a NaN at minute 8
      # leaves it below the old controller's value.
      - series: 'rrl_nonfinite_total{{run="r", instance="c:1", quantity="loss", action="skipped"}}'
        values: '0 1 2 2 2 0 0 0 1 1 1'
    alert_rule_test:
      - alertname: RRLNonFiniteValues
        eval_time: 9m
        exp_alerts:
          - exp_labels: {{severity: warning, run: r, quantity: loss, action: skipped}}
            exp_annotations:
              summary: "Non-finite loss in run r (skipped)"
              description: "3 step(s) met NaN or Inf in loss in the last 30 minutes and the trainer skipped them (trainer.nonfinite). Look at the run's nonfinite events: a diverging learning rate, a reward function returning NaN, or a poisoned checkpoint."

  - interval: 1m
    input_series:
      # Two runs: run a's GPU idles while only run b makes progress (run a is stuck, not starved).
      - series: 'rrl_gpu_utilization_ratio{{instance="n0:1", run="a", node="n0", gpu="0", uuid="GPU-a", role="actor", rank="0"}}'
        values: '0.05x40'
      - series: 'rrl_step{{instance="ca:1", run="a"}}'
        values: '5x40'
      - series: 'rrl_step{{instance="cb:1", run="b"}}'
        values: '0+1x40'
    alert_rule_test:
      - {{alertname: RRLGpuUtilizationLow, eval_time: 30m, exp_alerts: []}}

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
    series = [
        {"series": 'rrl_worker_restarts_total{run="r", role="actor", rank="1", cause="died"}',
         "values": "_ _ 1 1 3 3 3"},
        {"series": 'rrl_worker_restarts_total{run="r", role="critic", rank="0", cause="died"}',
         "values": "_ _ _ _ _ _ 1"},
        {"series": 'rrl_worker_up{run="r", role="actor", rank="1", node="n0"}',
         "values": "1 1 0 1 1 1 1"},
        {"series": 'rrl_worker_up{run="r", role="actor", rank="0", node="n0"}',
         "values": "1x6"}]
    checks = [
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
    ]
    expressions_hold(tmp_path, series, checks)


@needs_promtool
def test_range_panels_count_every_event_across_a_controller_restart(tmp_path):
    """The counters of a new controller start again from nothing. On the same address the series
    resets (the panels counted 0 for the range: the value now less the higher old one, clamped);
    on a new port the old series ends inside the range (its events were dropped). A series the new
    controller exports at 0 has its first event counted by increase(); one that appears at 1 is
    counted by the difference to the value a range ago. Windows of 10 minutes, read at 11m."""
    in_range = grafana_to_promql(panel_expr("rrl-reliability", "Restarts (range)", "stat").replace("$__range", "10m"))
    by_cause = grafana_to_promql(panel_expr("rrl-reliability", "Failures by cause", "timeseries")
                                 .replace("$__interval", "10m"))
    born = 'rrl_failures_total{run="r", instance="c:3", cause="hang"}'
    series = [
        # Same address: 2 restarts before the range, 1 inside it, the restart at 5m, 1 more.
        {"series": 'rrl_worker_restarts_total{run="r", instance="c:1", role="actor", rank="0", cause="died"}',
         "values": "2 2 2 3 3 _ 0 1 1 1 1 1"},
        # A new port: 1 failure of the old controller inside the range, 2 of the new one, which
        # exports the series at 0 from its start.
        {"series": 'rrl_failures_total{run="r", instance="c:1", cause="died"}', "values": "0 0 1 1 1"},
        {"series": 'rrl_failures_total{run="r", instance="c:2", cause="died"}',
         "values": "_ _ _ _ _ _ 0 1 2 2 2 2"},
        # A series born at 1 by its first event.
        {"series": born, "values": "_ _ _ _ _ _ _ _ _ 1 1 1"}]
    checks = [
        {"expr": in_range, "eval_time": "11m", "exp_samples": [{"labels": "{}", "value": 2}]},
        # increase() extrapolates the old controller's series past its end (by half a scrape): round.
        {"expr": f"round({by_cause})", "eval_time": "11m",
         "exp_samples": [{"labels": '{cause="died"}', "value": 3}, {"labels": '{cause="hang"}', "value": 1}]},
        # What increase() alone makes of the series born at 1: nothing.
        {"expr": f"sum(increase({born}[10m]))", "eval_time": "11m", "exp_samples": [{"labels": "{}", "value": 0}]},
    ]
    expressions_hold(tmp_path, series, checks)


@needs_promtool
def test_lost_time_panels_count_what_was_lost_in_the_range_across_controllers(tmp_path):
    """A new controller seeds its lost-time counter with the run's history: 100 s lost before the
    range; the old controller loses 20 s more inside it, then crashes; the new one (another port)
    starts at 100 + 20 + 30 (its predecessor's pause) and loses 10 s more: 60 s in the range,
    not the 160 s the new series shows."""
    in_range = grafana_to_promql(panel_expr("rrl-reliability", "Lost time (range)", "stat").replace("$__range", "10m"))
    by_cause = grafana_to_promql(panel_expr("rrl-reliability", "Lost time by cause", "timeseries")
                                 .replace("$__interval", "10m"))
    series = [
        {"series": 'rrl_lost_seconds_total{run="r", instance="c:1", cause="died"}',
         "values": "100 100 100 120 120"},
        {"series": 'rrl_lost_seconds_total{run="r", instance="c:2", cause="died"}',
         "values": "_ _ _ _ _ _ 150 150 160 160 160 160"},
        # Another run, untouched in the range.
        {"series": 'rrl_lost_seconds_total{run="other", instance="o:1", cause="died"}', "values": "7x11"}]
    checks = [
        {"expr": in_range, "eval_time": "11m",
         "exp_samples": [{"labels": "{}", "value": 60}]},
        {"expr": by_cause, "eval_time": "11m",
         "exp_samples": [{"labels": '{cause="died"}', "value": 60}]},
    ]
    expressions_hold(tmp_path, series, checks)


@needs_promtool
def test_throughput_panels_read_the_true_rate_of_steps_longer_than_grafanas_rate_interval(tmp_path):
    """Steps of 60 s (1,000 tokens each), scraped every 2 s. Grafana's $__rate_interval is then
    four scrapes, 8 s, at the default one-hour range: a rate over it reads 0 between steps. The
    per-step panels take the rate window instead (10 minutes by default), and read about 1 step
    a minute and 16.7 tokens a second at any time."""
    scrapes = 15 * 30  # 15 minutes
    steps = " ".join(str(i // 30) for i in range(scrapes))
    tokens = " ".join(str(1000 * (i // 30)) for i in range(scrapes))
    checks = []
    for uid, title, panel_type, low, high in (
            ("rrl-training", "Steps / min", "stat", 0.9, 1.1), ("rrl-training", "Tokens / s", "stat", 15, 18.4),
            ("rrl-throughput", "Steps / min", "timeseries", 0.9, 1.1),
            ("rrl-throughput", "Tokens / s", "timeseries", 15, 18.4)):
        expr = grafana_to_promql(panel_expr(uid, title, panel_type).replace("$__rate_interval", "8s"))
        for at in ("12m10s", "12m30s", "12m50s"):  # just after a step, between two, just before one
            checks.append({"expr": f"({expr} > bool {low}) * ({expr} < bool {high})", "eval_time": at,
                           "exp_samples": [{"labels": "{}", "value": 1}]})
    series = [
        {"series": 'rrl_step_duration_seconds_count{run="r", instance="c:1"}', "values": steps},
        {"series": 'rrl_tokens_total{run="r", instance="c:1"}', "values": tokens}]
    expressions_hold(tmp_path, series, checks, interval="2s")
