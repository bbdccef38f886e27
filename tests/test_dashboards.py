"""monitoring/grafana/dashboards: what monitoring/dashboards.py generates, and Grafana reads.

The committed JSON is the generator's output (``--write``/``--check`` work); every panel, query,
variable and annotation uses the provisioned Prometheus datasource, panels sit on the 24-column
grid without overlapping, every ``$variable`` is defined, and every field is one Grafana's
schema knows (a round trip through grafana-foundation-sdk's types changes nothing).
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import yaml

from resilient_rl.testing.monitoring import DASHBOARDS, MONITORING, load_dashboards


def provisioned_datasource_uid() -> str:
    (ds,) = yaml.safe_load(
        (MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus"
    return ds["uid"]


def _overlaps(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def dashboard_problems(board: dict, datasource_uid: str, panel_types: set[str]) -> list[str]:
    """What would make Grafana show a broken dashboard: every problem found, as text."""
    problems = []
    uid = board.get("uid", "?")
    ds = {"type": "prometheus", "uid": datasource_uid}
    variables = {v["name"] for v in board["templating"]["list"]}
    exprs = [(f"variable {v['name']}", v["query"]) for v in board["templating"]["list"]]
    for v in board["templating"]["list"]:
        if v.get("type") == "interval":  # a list of windows (the rate window): no datasource, no query
            if not v.get("query") or not v.get("current", {}).get("value"):
                problems.append(f"{uid}/variable {v['name']}: an interval variable needs its windows and a default")
            continue
        if v.get("datasource") != ds:
            problems.append(f"{uid}/variable {v['name']}: datasource {v.get('datasource')}")
    for ann in board["annotations"]["list"]:
        if ann.get("datasource") != ds or not ann.get("expr", "").strip():
            problems.append(f"{uid}/annotation {ann.get('name')}: needs datasource {ds} and an expr")
        exprs.append((f"annotation {ann.get('name')}", ann.get("expr", "")))
    ids = [p.get("id") for p in board["panels"]]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"{uid}: panel ids {ids} are not unique")
    for i, panel in enumerate(board["panels"]):
        where = f"{uid}/{panel.get('title')}"
        if panel.get("type") == "row":  # a row header: no query; it spans the grid, above its panels
            pos = panel["gridPos"]
            if (pos["x"], pos["w"], pos["h"]) != (0, 24, 1) or panel.get("panels"):
                problems.append(f"{where}: a row header spans the grid (x=0, w=24, h=1), got {pos}")
            problems += [f"{where}: overlaps {other['title']}" for other in board["panels"][:i]
                         if _overlaps(pos, other["gridPos"])]
            continue
        if panel.get("type") not in panel_types:
            problems.append(f"{where}: unknown panel type {panel.get('type')!r}")
        if panel.get("datasource") != ds:
            problems.append(f"{where}: datasource {panel.get('datasource')}, not {ds}")
        pos = panel["gridPos"]
        if not (pos["x"] >= 0 and pos["y"] >= 0 and pos["w"] > 0 and pos["h"] > 0
                and pos["x"] + pos["w"] <= 24):
            problems.append(f"{where}: gridPos {pos} is outside the 24-column grid")
        problems += [f"{where}: overlaps {other['title']}" for other in board["panels"][:i]
                     if _overlaps(pos, other["gridPos"])]
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{where}: no query")
        ref_ids = [t.get("refId") for t in targets]
        if len(ref_ids) != len(set(ref_ids)):
            problems.append(f"{where}: refIds {ref_ids} are not unique")
        for t in targets:
            if t.get("datasource") != ds or not t.get("expr", "").strip():
                problems.append(f"{where}/{t.get('refId')}: needs datasource {ds} and an expr")
            exprs.append((f"{panel.get('title')}/{t.get('refId')}", t.get("expr", "")))
    for where, expr in exprs:
        used = {m.group(1) or m.group(2) for m in re.finditer(r"\$(\w+)|\$\{(\w+)", expr)}
        undefined = {v for v in used if not v.startswith("__")} - variables
        if undefined:
            problems.append(f"{uid}/{where}: undefined variable(s) {sorted(undefined)}")
    return problems


def test_dashboards_are_valid_grafana_json():
    panel_types = known_panel_types()
    boards = load_dashboards()
    assert {b["uid"] for b in boards} == {"rrl-training", "rrl-throughput", "rrl-reliability",
                                          "rrl-gpus"}
    assert [p.stem for p in DASHBOARDS] == sorted(b["uid"] for b in boards)
    for board in boards:
        assert board["title"].startswith("resilient-rl")
        assert 36 <= board["schemaVersion"] <= 41
        assert dashboard_problems(board, provisioned_datasource_uid(), panel_types) == []


def test_dashboard_check_finds_each_kind_of_breakage():
    # The check above must be able to fail: break a good dashboard in every way it looks for.
    uid, panel_types = provisioned_datasource_uid(), known_panel_types()
    board = json.loads((MONITORING / "grafana/dashboards/rrl-training.json").read_text())
    first, second = board["panels"][0], board["panels"][1]
    first["type"] = "timeserie"
    first["gridPos"] = dict(second["gridPos"], w=30)
    second["id"] = first["id"]
    second["datasource"] = {"type": "prometheus", "uid": "other"}
    second["targets"][0]["expr"] = 'rrl_step{run=~"$run", node=~"$nod"}'
    board["panels"][2]["targets"] = []
    board["panels"].append({"type": "row", "id": 999, "title": "half row", "panels": [],
                            "gridPos": {"x": 0, "y": 1000, "w": 12, "h": 1}})
    problems = "\n".join(dashboard_problems(board, uid, panel_types))
    for expected in ["unknown panel type 'timeserie'", "outside the 24-column grid",
                     "overlaps", "are not unique", "datasource {'type': 'prometheus', 'uid': "
                     "'other'}", "undefined variable(s) ['nod']", "no query", "a row header spans the grid"]:
        assert expected in problems


# -- the generator (monitoring/dashboards.py, grafana-foundation-sdk) -----------------------

def generator():
    """monitoring/dashboards.py as a module (it is a script, not part of the package)."""
    pytest.importorskip("grafana_foundation_sdk", reason="the dev extra is not installed")
    spec = importlib.util.spec_from_file_location("rrl_dashboards", MONITORING / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def panels():
    """monitoring/dashboard_panels.py, the generator's vocabulary (beside it on the path it adds)."""
    generator()
    import dashboard_panels

    return dashboard_panels


def known_panel_types() -> set[str]:
    """The panel plugins Grafana ships, as grafana-foundation-sdk knows them."""
    pytest.importorskip("grafana_foundation_sdk", reason="the dev extra is not installed")
    from grafana_foundation_sdk.cog import plugins, runtime
    plugins.register_default_plugins()
    return set(runtime.Runtime().panelcfg_variants)


def test_committed_dashboards_are_the_generators_output():
    gen = generator()
    boards = gen.dashboards()
    assert sorted(boards) == [p.name for p in DASHBOARDS]
    for name, board in boards.items():
        assert (gen.DASHBOARDS_DIR / name).read_text() == gen.render(board), \
            f"{name} is not monitoring/dashboards.py's output: run it with --write"
    assert panels().DATASOURCE_UID == provisioned_datasource_uid()


def test_generator_check_and_write(tmp_path, monkeypatch, capsys):
    gen = generator()
    monkeypatch.setattr(gen, "DASHBOARDS_DIR", tmp_path)
    assert gen.main(["--check"]) == 1                       # nothing written yet
    (tmp_path / "hand-made.json").write_text("{}")
    assert gen.main(["--write"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in DASHBOARDS]
    assert gen.main(["--check"]) == 0
    path = tmp_path / "rrl-gpus.json"
    path.write_text(path.read_text().replace('"w": 12', '"w": 13', 1))
    assert gen.main(["--check"]) == 1
    assert "out of date: rrl-gpus.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not fit a 24-column grid"):
        gen.ts_panel("too wide", [("rrl_step", "")], w=25)


def sdk_round_trip(board: dict) -> dict:
    """``board`` decoded into grafana-foundation-sdk's types and encoded again."""
    known_panel_types()  # registers the panel and query types, so their fields are decoded
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard
    return json.loads(json.dumps(Dashboard.from_json(board), cls=JSONEncoder))


def test_committed_dashboards_use_only_fields_grafanas_schema_knows():
    # Decoding drops what the schema does not know (a misspelt option, a stray key), so a
    # dashboard that survives the round trip unchanged has no such field.
    extras = panels().PROMETHEUS_ANNOTATION_EXTRAS
    for board in load_dashboards():
        for ann in board["annotations"]["list"]:
            assert ann["datasource"]["type"] == "prometheus"
            for key in extras:  # read by Grafana's Prometheus datasource, not in the SDK's type
                ann.pop(key)
        assert sdk_round_trip(board) == board, board["uid"]

    broken = load_dashboards()[0]
    broken["panels"][-1]["fieldConfig"]["defaults"]["custom"]["fillOpacityy"] = 10
    broken["panels"][-1]["targets"][0]["legend"] = "{{instance}}"
    broken["templating"]["list"][0]["multiple"] = True
    round_tripped = sdk_round_trip(broken)
    assert "fillOpacityy" not in round_tripped["panels"][-1]["fieldConfig"]["defaults"]["custom"]
    assert "legend" not in round_tripped["panels"][-1]["targets"][0]
    assert "multiple" not in round_tripped["templating"]["list"][0]


@pytest.mark.parametrize("alert, metric, window, by, condition", [
    ("RRLRestartStorm", "rrl_worker_restarts_total", "10m", "run", "> 5"),
    ("RRLNonFiniteValues", "rrl_nonfinite_total", "30m", "run, quantity, action", "> 0"),
])
def test_alerts_on_event_counters_count_as_the_range_panels_do(alert, metric, window, by, condition):
    """The alerts that count a counter's events across controller restarts use the PromQL of the
    dashboards' range panels (``increments``), so what fires an alert and what a panel shows agree."""
    rules = yaml.safe_load((MONITORING / "rules" / "rrl-alerts.yml").read_text())
    (rule,) = [r for group in rules["groups"] for r in group["rules"] if r.get("alert") == alert]
    expected = f"round({panels().increments(metric, window, by=by, matchers='')}) {condition}"
    assert re.sub(r"\s+", "", rule["expr"]) == re.sub(r"\s+", "", expected)
