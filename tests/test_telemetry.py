"""Telemetry: metrics scraped over HTTP from a live exporter (the server, the trainer's series and
their checks), and the file_sd targets file. GPU and process sampling and the node exporter are
tested in tests/test_telemetry_devices.py, the trainer's telemetry hook in
tests/test_telemetry_hook.py."""

from __future__ import annotations

import json

import pytest

from resilient_rl.errors import TelemetryError
from resilient_rl.telemetry import PHASE_LABELS, FileSDWriter, MetricsServer, TrainerMetrics
from resilient_rl.testing.clock import FakeClock
from resilient_rl.testing.scrape import names, samples, value


@pytest.fixture
def trainer(clock: FakeClock):
    metrics = TrainerMetrics(run="unit", clock=clock)
    with MetricsServer(metrics.registry) as server:
        yield metrics, server


# -- exporter ------------------------------------------------------------------------------

def test_server_resolves_port_zero_and_serves_private_registry(trainer):
    metrics, server = trainer
    assert server.port and server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    data = samples(server.url)
    assert value(data, "rrl_run_info", run="unit") == 1.0
    assert value(data, "rrl_step") == 0.0
    # Only our registry: the global one's process_/python_ series are not served.
    assert all(name.startswith("rrl_") for name in names(data))


def test_port_in_use_raises_telemetry_error_naming_port():
    registry = TrainerMetrics().registry
    with MetricsServer(registry) as first:
        second = MetricsServer(registry, port=first.port)
        with pytest.raises(TelemetryError, match=rf"127\.0\.0\.1:{first.port}.*in use"):
            second.start()
        assert not second.running
        port = first.port
    # stop() released the port: a new server can bind it again.
    with MetricsServer(registry, port=port) as again:
        assert again.port == port
        assert value(samples(again.url), "rrl_step") == 0.0


def test_disabled_server_is_a_noop():
    server = MetricsServer(TrainerMetrics().registry, enabled=False)
    assert server.start() is server
    assert not server.running and server.port is None and server.url is None
    server.stop()


def test_unbindable_address_raises_telemetry_error():
    with pytest.raises(TelemetryError, match="203.0.113.7"):
        MetricsServer(TrainerMetrics().registry, bind_address="203.0.113.7").start()


# -- trainer metrics -----------------------------------------------------------------------

def test_observe_step_moves_gauges_counters_and_histograms(trainer):
    metrics, server = trainer
    metrics.observe_step(1, 0.2, {"gen": 0.12, "update_actor": 0.05}, tokens=512,
                         reward_mean=0.25, losses={"actor": 1.5}, kl=0.01, lr=1e-5)
    metrics.observe_step(2, 3.0, {"gen": 2.0, "update_actor": 0.7, "update_critic": 0.2},
                         tokens=488, reward_mean=0.5, losses={"actor": 1.25, "critic": 0.5},
                         kl=0.02, lr={"actor": 2e-5, "critic": 1e-4})
    data = samples(server.url)
    assert value(data, "rrl_step") == 2
    assert value(data, "rrl_step_duration_seconds_count") == 2
    assert value(data, "rrl_step_duration_seconds_sum") == pytest.approx(3.2)
    assert value(data, "rrl_step_duration_seconds_bucket", le="0.25") == 1
    assert value(data, "rrl_step_duration_seconds_bucket", le="2.5") == 1
    assert value(data, "rrl_step_duration_seconds_bucket", le="5.0") == 2
    assert value(data, "rrl_step_duration_seconds_bucket", le="+Inf") == 2
    assert value(data, "rrl_phase_duration_seconds_count", phase="gen") == 2
    assert value(data, "rrl_phase_duration_seconds_sum", phase="gen") == pytest.approx(2.12)
    assert value(data, "rrl_phase_duration_seconds_count", phase="update_critic") == 1
    # Every phase is exported from the start, so rate() over it never lacks a series.
    for phase in PHASE_LABELS:
        assert value(data, "rrl_phase_duration_seconds_count", phase=phase) is not None
    assert value(data, "rrl_tokens_total") == 1000
    assert value(data, "rrl_reward_mean") == 0.5
    assert value(data, "rrl_actor_loss") == 1.25
    assert value(data, "rrl_critic_loss") == 0.5
    assert value(data, "rrl_kl") == 0.02
    assert value(data, "rrl_learning_rate", role="actor") == 2e-5
    assert value(data, "rrl_learning_rate", role="critic") == 1e-4


def test_signals_absent_until_reported(trainer):
    metrics, server = trainer
    metrics.observe_step(1, 0.1, losses={"actor": 0.3})
    data = names(samples(server.url))
    assert "rrl_actor_loss" in data
    assert not {"rrl_critic_loss", "rrl_reward_mean", "rrl_kl", "rrl_goodput_ratio",
                "rrl_learning_rate"} & data
    metrics.set_goodput(useful_s=90.0, wall_s=120.0)
    assert value(samples(server.url), "rrl_goodput_ratio") == 0.75


def test_observe_step_rejects_unknown_phase_loss_and_negative_values(trainer):
    metrics, server = trainer
    with pytest.raises(TelemetryError, match="'rollout'"):
        metrics.observe_step(1, 0.1, {"rollout": 0.1})
    with pytest.raises(TelemetryError, match="'value'"):
        metrics.observe_step(1, 0.1, losses={"value": 0.1})
    with pytest.raises(TelemetryError, match="tokens"):
        metrics.observe_step(1, 0.1, tokens=-5)
    # Nothing was half-recorded by the rejected calls.
    data = samples(server.url)
    assert value(data, "rrl_step_duration_seconds_count") == 0
    assert value(data, "rrl_tokens_total") == 0


def test_workers_restarts_failures_and_recoveries(trainer):
    metrics, server = trainer
    metrics.set_workers_up("actor", 0, "n0", True)
    metrics.set_workers_up("actor", 1, "n0", True)
    metrics.set_workers_up("actor", 1, "n0", False)
    metrics.record_failure("died")
    metrics.record_restart("actor", 1, "died")
    metrics.record_restart("actor", 1, "died")
    metrics.record_restart("critic", 0, "timeout")
    metrics.record_recovery(duration_s=7.5, steps_replayed=3)
    metrics.record_recovery(duration_s=40.0, steps_replayed=2)
    data = samples(server.url)
    assert value(data, "rrl_worker_up", role="actor", rank="0", node="n0") == 1
    assert value(data, "rrl_worker_up", role="actor", rank="1", node="n0") == 0
    assert value(data, "rrl_worker_restarts_total", role="actor", rank="1", cause="died") == 2
    assert value(data, "rrl_worker_restarts_total", role="critic", rank="0", cause="timeout") == 1
    assert value(data, "rrl_failures_total", cause="died") == 1
    assert value(data, "rrl_recoveries_total") == 2
    assert value(data, "rrl_steps_replayed_total") == 5
    assert value(data, "rrl_recovery_duration_seconds_count") == 2
    assert value(data, "rrl_recovery_duration_seconds_bucket", le="10.0") == 1
    assert value(data, "rrl_recovery_duration_seconds_bucket", le="60.0") == 2

    # The replacement of actor 1 runs on another node: the old series must disappear, or
    # the worker-down alert would fire forever on a 0 nobody updates.
    metrics.set_workers_up("actor", 1, "n1", True)
    data = samples(server.url)
    assert value(data, "rrl_worker_up", role="actor", rank="1", node="n0") is None
    assert value(data, "rrl_worker_up", role="actor", rank="1", node="n1") == 1
    metrics.remove_worker("actor", 1)
    assert value(samples(server.url), "rrl_worker_up", role="actor", rank="1", node="n1") is None


def test_counters_with_known_labels_are_exported_at_0_from_the_start(trainer):
    """A new controller's failure and NaN series exist at 0 before their first event, so the
    increase() of a range panel or an alert sees that event (a series born at 1 hides it)."""
    from resilient_rl.errors import Cause
    from resilient_rl.telemetry.metrics import NONFINITE_OUTCOMES

    metrics, server = trainer
    data = samples(server.url)
    assert all(value(data, "rrl_failures_total", cause=c.value) == 0 for c in Cause)
    pairs = [(q, a) for q, actions in NONFINITE_OUTCOMES.items() for a in actions]
    assert all(value(data, "rrl_nonfinite_total", quantity=q, action=a) == 0 for q, a in pairs)
    metrics.record_failure("died")
    assert value(samples(server.url), "rrl_failures_total", cause="died") == 1


def test_every_nonfinite_outcome_of_every_policy_is_exported_from_the_start():
    from types import SimpleNamespace

    from resilient_rl.recovery.nonfinite import Finding, NonFiniteGuard
    from resilient_rl.telemetry.metrics import NONFINITE_OUTCOMES

    for mode in ("skip", "rollback", "raise"):
        guard = NonFiniteGuard(SimpleNamespace(nonfinite=mode, max_nonfinite=3), emit=lambda *a, **k: None,
                               can_roll_back=True)
        for quantity in ("reward", "kl", "loss", "metric"):
            action = guard._action(Finding(quantity, None, 1.0))
            assert action in NONFINITE_OUTCOMES[quantity], (mode, quantity, action)
    # Past the budget, under every policy:
    assert all("raised" in NONFINITE_OUTCOMES[q] for q in ("reward", "kl", "loss", "metric"))


def test_checkpoint_series_and_age(trainer, clock):
    metrics, server = trainer
    clock.now += 120
    data = samples(server.url)
    # No commit yet: step and timestamp absent, age counts from the start.
    assert value(data, "rrl_checkpoint_last_committed_step") is None
    assert value(data, "rrl_checkpoint_last_committed_timestamp_seconds") is None
    assert value(data, "rrl_checkpoint_age_seconds") == 120

    metrics.record_checkpoint_save(duration_s=4.0, stall_s=0.3, nbytes=1_000_000, step=10)
    committed = clock.now
    clock.now += 30
    metrics.record_checkpoint_save(duration_s=6.0, stall_s=0.2, nbytes=500_000, step=20)
    clock.now += 45
    metrics.record_checkpoint_load(duration_s=0.4)
    metrics.record_corrupt_checkpoint()
    metrics.record_corrupt_snapshot("node")
    data = samples(server.url)
    assert value(data, "rrl_checkpoint_last_committed_step") == 20
    assert value(data, "rrl_checkpoint_last_committed_timestamp_seconds") == committed + 30
    assert value(data, "rrl_checkpoint_age_seconds") == 45
    assert metrics.checkpoint_age() == 45
    assert value(data, "rrl_checkpoint_save_duration_seconds_count") == 2
    assert value(data, "rrl_checkpoint_save_duration_seconds_sum") == 10.0
    assert value(data, "rrl_checkpoint_stall_seconds_sum") == pytest.approx(0.5)
    assert value(data, "rrl_checkpoint_load_duration_seconds_count") == 1
    assert value(data, "rrl_checkpoint_bytes_total") == 1_500_000
    assert value(data, "rrl_checkpoint_corrupt_total") == 1
    assert value(data, "rrl_snapshot_corrupt_total", source="node") == 1

    # A resumed run reports the checkpoint it started from.
    metrics.set_last_committed(step=7, timestamp=clock.now - 600)
    assert value(samples(server.url), "rrl_checkpoint_age_seconds") == 600


def test_observe_phase_records_a_known_phase_only(trainer):
    metrics, server = trainer
    metrics.observe_phase("checkpoint", 0.25)
    with pytest.raises(TelemetryError, match="'save'"):
        metrics.observe_phase("save", 0.1)
    with pytest.raises(TelemetryError, match="checkpoint"):
        metrics.observe_phase("checkpoint", -1.0)
    data = samples(server.url)
    assert value(data, "rrl_phase_duration_seconds_count", phase="checkpoint") == 1
    assert value(data, "rrl_phase_duration_seconds_sum", phase="checkpoint") == 0.25


def test_useful_time_is_a_running_total_that_rolls_back():
    from resilient_rl.telemetry.goodput import UsefulTime

    u = UsefulTime()
    for step, seconds in ((1, 1.0), (2, 2.0), (3, 4.0)):
        u.record(step, seconds)
    assert u.total == 7.0
    u.rollback(1)  # a recovery restored step 1: steps 2 and 3 are replayed
    assert u.total == 1.0
    u.record(2, 0.5)
    u.record(2, 0.25)  # recorded again: replaces, never double counts
    assert u.total == 1.25


# -- file_sd -------------------------------------------------------------------------------

def test_file_sd_writer_keeps_targets_file_current(tmp_path):
    path = tmp_path / "targets" / "run1.json"
    writer = FileSDWriter(path)
    writer.update([("10.0.0.5:9400", {"job": "resilient-rl", "run": "run1", "node": "n0"}),
                   ("10.0.0.6:9400", {"job": "resilient-rl", "run": "run1", "node": "n1"})])
    groups = json.loads(path.read_text())
    assert sorted((g["targets"], g["labels"]["node"]) for g in groups) == [
        (["10.0.0.5:9400"], "n0"), (["10.0.0.6:9400"], "n1")]

    writer.add("[::1]:9401", {"job": "resilient-rl", "run": "run1", "node": "n1"})
    writer.remove("10.0.0.5:9400")
    groups = json.loads(path.read_text())
    assert groups == [{"targets": ["10.0.0.6:9400", "[::1]:9401"],
                       "labels": {"job": "resilient-rl", "run": "run1", "node": "n1"}}]
    # Written through a temporary file that never lingers next to the targets.
    assert sorted(p.name for p in path.parent.iterdir()) == ["run1.json"]
    assert oct(path.stat().st_mode & 0o777) == "0o644"

    writer.close()
    assert not path.exists()


@pytest.mark.parametrize("target, labels, match", [
    ("localhost", {}, "host:port"),
    ("localhost:99999", {}, "host:port"),
    ("localhost:9400", {"__address__": "x"}, "__address__"),
    ("localhost:9400", {"bad-name": "x"}, "bad-name"),
    ("localhost:9400", {"rank": 3}, "'rank' must be a string"),
])
def test_file_sd_writer_rejects_bad_targets(tmp_path, target, labels, match):
    writer = FileSDWriter(tmp_path / "t.json")
    with pytest.raises(TelemetryError, match=match):
        writer.add(target, labels)
    assert not (tmp_path / "t.json").exists()


def test_file_sd_path_must_match_prometheus_glob(tmp_path):
    with pytest.raises(TelemetryError, match=r"\.json"):
        FileSDWriter(tmp_path / "targets.yml")


def test_a_run_that_saves_no_checkpoint_exports_no_checkpoint_age(clock):
    """checkpoint.save_every=0: an age counting from the start would only grow, and keep the
    checkpoint alert firing for the whole run."""
    metrics = TrainerMetrics(run="unit", clock=clock, saves_checkpoints=False)
    clock.now += 3600
    names = {s.name for family in metrics.registry.collect() for s in family.samples}
    assert "rrl_checkpoint_age_seconds" not in names and "rrl_step" in names


def test_the_telemetry_hook_knows_whether_the_run_saves_checkpoints(tmp_path):
    from resilient_rl.config.schema import load_config
    from resilient_rl.run.folder import RunDir
    from resilient_rl.telemetry.hook import TelemetryHook

    for save_every, exported in ((0, False), (5, True)):
        cfg = load_config(None, [f"checkpoint.save_every={save_every}", f"trainer.output_dir={tmp_path}"])
        hook = TelemetryHook(cfg, RunDir(str(tmp_path), cfg.trainer.run_name), lambda listener: None)
        names = {s.name for family in hook.metrics.registry.collect() for s in family.samples}
        assert ("rrl_checkpoint_age_seconds" in names) is exported


def test_a_lost_node_marks_every_worker_on_it_down(tmp_path, monkeypatch):
    """The failure names the first rank heard of; the others on a node that no longer answers are
    down too. A node that answers keeps its other workers up; a failure during a recovery marks
    down the same way (without counting another failure)."""
    from types import SimpleNamespace

    from resilient_rl.config.schema import load_config
    from resilient_rl.run.folder import RunDir
    from resilient_rl.telemetry import hook as hook_module

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}"])
    hook = hook_module.TelemetryHook(cfg, RunDir(str(tmp_path), cfg.trainer.run_name), lambda listener: None)
    hook.pool = SimpleNamespace(roles_of=lambda group: ("actor",))
    hook.node_id = "ctrl"
    hook._workers = {("actor", 0): (1, "ctrl"), ("actor", 1): (999991, "n2"), ("actor", 2): (999992, "n2"),
                     ("actor", 3): (999993, "n3"), ("actor", 4): (999994, "n3")}
    for (role, rank), (_, node) in hook._workers.items():
        hook.metrics.set_workers_up(role, rank, node, True)
    monkeypatch.setattr(hook_module, "node_answers", lambda node: node != "n2")

    def up() -> dict[int, float]:
        return {int(s.labels["rank"]): s.value for family in hook.metrics.registry.collect()
                for s in family.samples if s.name == "rrl_worker_up"}

    hook._on_event["failure"]({"cause": "died", "group": "actor", "rank": 1})
    assert up() == {0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0}
    hook._on_event["failure_during_recovery"]({"cause": "died", "group": "actor", "rank": 3, "state": "rejoining"})
    assert up() == {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0}  # n3 answers: only the named rank
