"""monitoring/: Prometheus config and alert rules, and the queries of every dashboard.

Checks, from cheapest to strongest: files parse and are wired to each other; every PromQL
expression names only series that resilient_rl.telemetry exports; a real Prometheus server using
this config scrapes a live exporter and answers every query. What promtool checks (the config,
the rules and every dashboard query accepted, the alerts firing on the scenarios they are written
for) is in test_monitoring_promtool.py. The dashboards themselves (generator, Grafana schema,
grid, variables) are checked in test_dashboards.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from resilient_rl.telemetry import FileSDWriter, MetricsServer
from resilient_rl.testing.monitoring import (DATASOURCE_UID, MONITORING, RULES, alert_rules, dashboard_queries,
                                             exported_names, free_port, grafana_to_promql, metric_names,
                                             populated_registry)
from resilient_rl.testing.wait import wait_until


# -- structure -----------------------------------------------------------------------------

def test_metric_name_extraction_finds_names_and_skips_promql_syntax():
    expr = ('sum by (role, le) (rate(rrl_x_bucket{run=~"$run", a="rrl_not_me"}[$__rate_interval]))'
            ' / on () group_left () rrl_y offset 10m or vector(0) > bool 1e3')
    assert metric_names(expr) == {"rrl_x_bucket", "rrl_y"}
    assert metric_names("rrl_a - (rrl_b offset 10m or rrl_c * 0)") == {"rrl_a", "rrl_b", "rrl_c"}


#: Series Prometheus itself writes for every target (the exporter-down alert reads it).
PROMETHEUS_SERIES = {"up"}


def test_every_query_uses_only_exported_metric_names():
    exported = exported_names()
    queries = dashboard_queries() + [(r["alert"], r["expr"]) for r in alert_rules()]
    assert len(queries) > 50
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        unknown = names - exported - PROMETHEUS_SERIES
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


def test_every_alert_rule_is_documented_with_its_severity():
    """monitoring/README.md's "Alerts" table names exactly the rules of rules/rrl-alerts.yml, each
    with the severity the rule sets: an alert added, renamed or dropped must be documented."""
    readme = (MONITORING / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    documented = dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M))
    assert documented == {r["alert"]: r["labels"]["severity"] for r in alert_rules()}


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
