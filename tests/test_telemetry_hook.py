"""The trainer's telemetry hook, on single-process roles (no Ray): a run's metrics exported and
its endpoint published, failed workers and lost steps, node exporters' ports and timeouts, ETTR
across controllers."""

from __future__ import annotations

import json
import socket
import time

import pytest

from resilient_rl.errors import TelemetryError
from resilient_rl.telemetry import PHASE_LABELS, PHASES, scrape
from resilient_rl.testing.scrape import samples, value


def local_trainer(tmp_path, *extra: str):
    from resilient_rl.config.schema import load_config
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, ["trainer.total_steps=3", "trainer.progress_bar=false", "data.batch_size=8",
                             "data.num_prompts=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                             "actor.ppo_epochs=1", "critic.ppo_epochs=1", "model.hidden_size=32",
                             "model.num_layers=1", "model.intermediate_size=64",
                             f"trainer.output_dir={tmp_path}", "trainer.run_name=local", *extra])
    return PPOTrainer(cfg, roles_factory=LocalRoles)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A 3-step single-process run with telemetry, fitted once; (trainer, rows, log text)."""
    import logging

    trainer = local_trainer(tmp_path_factory.mktemp("local"))
    handler = logging.Handler()
    records: list[str] = []
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("resilient_rl.telemetry.hook")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        rows = trainer.fit()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    yield trainer, rows, "\n".join(records)
    trainer.shutdown()


def test_node_exporters_are_called_with_the_telemetry_timeout(tmp_path, monkeypatch):
    from resilient_rl.telemetry import hook as telemetry_hook

    seen = {}

    class FakeNodeExporter:
        def __init__(self, node_id, node, bind_address, port, advertise_host, gpu_max_age_s, timeout_s):
            seen[node_id] = timeout_s
            self.target = f"{advertise_host}:9999"

    monkeypatch.setattr(telemetry_hook, "RemoteNodeExporter", FakeNodeExporter)
    trainer = local_trainer(tmp_path, "telemetry.call_timeout_s=7", "recovery.call_timeout_s=900")
    try:
        trainer.telemetry._start_node_exporter("n1", {"n1": ("node-1", "10.0.0.2")})
    finally:
        trainer.shutdown()
    assert seen == {"n1": 7.0}


def test_every_trainer_phase_is_exported():
    from resilient_rl.trainer import step

    assert step.PHASES is PHASES  # one definition, imported by the step
    assert PHASE_LABELS == PHASES + ("checkpoint",)


def test_hook_exports_a_run_and_publishes_its_endpoint(local_run):
    trainer, rows, log = local_run
    hook = trainer.telemetry
    assert trainer.ckpt.metrics is hook
    url = hook.url
    assert url in log
    data = samples(url)
    last = rows[-1]
    assert value(data, "rrl_step") == 3
    assert value(data, "rrl_step_duration_seconds_count") == 3
    assert value(data, "rrl_step_duration_seconds_sum") == pytest.approx(sum(r["timing/step_s"] for r in rows))
    assert value(data, "rrl_phase_duration_seconds_sum", phase="old_log_prob") == pytest.approx(
        sum(r["timing/old_log_prob_s"] for r in rows))
    assert value(data, "rrl_tokens_total") == sum(r["tokens"] for r in rows)
    assert value(data, "rrl_reward_mean") == last["reward/mean"]
    assert value(data, "rrl_actor_loss") == last["actor/pg_loss"]
    assert value(data, "rrl_critic_loss") == last["critic/vf_loss"]
    assert value(data, "rrl_kl") == last["actor/reward_kl_penalty"]
    assert value(data, "rrl_learning_rate", role="critic") == last["critic/lr"]
    assert 0 < value(data, "rrl_goodput_ratio") <= 1
    node = hook.node
    for role in ("actor", "critic", "ref", "rollout"):
        assert value(data, "rrl_worker_up", role=role, rank="0", node=node) == 1
    # Every engine runs in this process: its CPU and memory are exported once.
    cpu = [k for k in data if k[0] == "rrl_process_cpu_seconds_total"]
    assert cpu == [("rrl_process_cpu_seconds_total",
                    frozenset({"role": "actor", "rank": "0", "node": node}.items()))]
    assert json.loads((trainer.run_dir.path / "prometheus_targets.json").read_text()) == [
        {"targets": [url.split("/")[2]], "labels": {"job": "resilient-rl", "run": "local", "node": node}}]


def test_hook_marks_failed_workers_down_and_drops_lost_steps_from_goodput(local_run):

    trainer, rows, _ = local_run
    hook = trainer.telemetry
    node = hook.node
    emit = trainer.run_dir.event  # the hook counts the run's events
    # a survivor reporting a broken collective is not down itself
    emit("failure", step=2, role="actor", rank=0, group="local", cause="collective", message="peer gone")
    assert value(samples(hook.url), "rrl_worker_up", role="actor", rank="0", node=node) == 1
    # a death names the process: every role in it is down
    emit("failure", step=2, role="actor", rank=0, group="local", cause="died", message="actor 0 died")
    emit("worker_restarted", group="local", rank=0, pid=1, node="n", role="actor", cause="died")
    emit("nonfinite", step=2, quantity="loss", role="actor", action="skipped", count=1.0)
    data = samples(hook.url)
    assert value(data, "rrl_worker_up", role="actor", rank="0", node=node) == 0
    assert value(data, "rrl_worker_up", role="critic", rank="0", node=node) == 0
    assert value(data, "rrl_failures_total", cause="died") == 1
    assert value(data, "rrl_worker_restarts_total", role="actor", rank="0", cause="died") == 1
    assert value(data, "rrl_nonfinite_total", quantity="loss", action="skipped") == 1

    trainer.step = 1  # what restoring the checkpoint of step 1 does: steps 2 and 3 are lost
    t_before = time.monotonic()
    emit("recovered", failed_step=3, restored_step=1, steps_replayed=1, duration_s=1.5, restarted=[["local", 0]],
         generation=2, phases={"detect": 0.25, "restart": 1.0, "rejoin": 0.125, "restore": 0.125})
    data = samples(hook.url)
    t_after = time.monotonic()
    useful = rows[0]["timing/step_s"]
    started = hook.time.started
    # Step 1 counts, and the replay in flight since the recovery (at most t_after - t_before).
    assert useful / (t_after - started) <= value(data, "rrl_goodput_ratio") <= (
        (useful + t_after - t_before) / (t_before - started))
    assert value(data, "rrl_lost_seconds_total", cause="collective") >= sum(r["timing/step_s"] for r in rows[1:])
    assert 0 < value(data, "rrl_ettr_ratio") <= 1
    for phase, seconds in (("detect", 0.25), ("restart", 1.0), ("rejoin", 0.125), ("restore", 0.125)):
        assert value(data, "rrl_recovery_phase_seconds_sum", phase=phase) == seconds
    assert value(data, "rrl_recovery_phase_seconds_count", phase="replay") == 0
    hook.observe_step({"step": 2, "timing/step_s": 0.01})  # a lost step replayed
    assert value(samples(hook.url), "rrl_recovery_phase_seconds_count", phase="replay") == 0
    hook.observe_step({"step": 3, "timing/step_s": 0.01})  # the failed step is done again
    assert value(samples(hook.url), "rrl_recovery_phase_seconds_count", phase="replay") == 1
    assert value(data, "rrl_worker_up", role="actor", rank="0", node=node) == 1
    assert value(data, "rrl_recoveries_total") == 1 and value(data, "rrl_steps_replayed_total") == 1

    url = hook.url
    trainer.shutdown()
    assert not (trainer.run_dir.path / "prometheus_targets.json").exists()
    ledger = json.loads((trainer.run_dir.path / "ettr.json").read_text())  # for the run's next controller
    assert ledger["useful"][-1][0] == 3 and ledger["lost_s"]["collective"] > 0
    with pytest.raises(TelemetryError):
        scrape(url, timeout=2)


def test_hook_port_in_use_is_a_clear_error_and_disabled_telemetry_starts_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        trainer = local_trainer(tmp_path, f"telemetry.port={port}")
        with pytest.raises(TelemetryError, match=f"port {port} is already in use"):
            trainer.fit()
        assert trainer.roles is None
    trainer = local_trainer(tmp_path, "telemetry.enabled=false", "trainer.total_steps=1")
    assert trainer.telemetry is None and trainer.ckpt.metrics is None
    trainer.fit()
    trainer.shutdown()
    assert not (trainer.run_dir.path / "prometheus_targets.json").exists()



def test_node_exporters_use_the_base_port_on_every_host_and_the_next_ones_on_a_shared_host(tmp_path, monkeypatch):
    """One port per machine or pod (a Kubernetes scrape annotation names one); nodes of a test
    cluster sharing a host get one port each."""
    from resilient_rl.telemetry import hook as telemetry_hook

    class FakeNodeExporter:
        def __init__(self, node_id, node, bind_address, port, advertise_host, gpu_max_age_s, timeout_s):
            self.node, self.target = node, f"{advertise_host}:{port}"

        def stop(self):
            pass

    monkeypatch.setattr(telemetry_hook, "RemoteNodeExporter", FakeNodeExporter)
    trainer = local_trainer(tmp_path, "telemetry.worker_port_base=9401")
    hook = trainer.telemetry
    table = {"a": ("pod-a", "10.0.0.2"), "b": ("pod-b", "10.0.0.3"), "c": ("host-c1", "10.0.0.9"),
             "d": ("host-c2", "10.0.0.9")}
    try:
        for node_id in table:
            hook.node_exporters[node_id] = hook._start_node_exporter(node_id, table)
        assert [e.target for e in hook.node_exporters.values()] == [
            "10.0.0.2:9401", "10.0.0.3:9401", "10.0.0.9:9401", "10.0.0.9:9402"]
    finally:
        trainer.shutdown()


def test_ettr_continues_in_the_run_folder_after_a_crashed_controller(tmp_path):
    """The next controller of a run reads the ledger its crashed predecessor left: the pause and
    the steps trained again are lost, and ETTR spans both controllers while goodput is its own."""
    first = local_trainer(tmp_path)
    try:
        first.fit()
    finally:
        first.shutdown()
    run = first.run_dir.path
    before = json.loads((run / "ettr.json").read_text())
    assert before["useful"][-1][0] == 3 and before["wall_s"] >= before["useful"][-1][1] > 0
    # As if it had been SIGKILLed 100 s ago: its record still says running, its ledger is old.
    record = json.loads((run / "controller.json").read_text())
    (run / "controller.json").write_text(json.dumps({**record, "state": "running", "ended_at": None}))
    (run / "ettr.json").write_text(json.dumps({**before, "updated_at": before["updated_at"] - 100.0}))

    second = local_trainer(tmp_path)  # no checkpoints with local roles: it trains steps 1-3 again
    try:
        second.fit()
        data = samples(second.telemetry.url)
        lost = value(data, "rrl_lost_seconds_total", cause="controller")
        assert lost >= 100.0 + before["useful"][-1][1] - 1e-9
        assert value(data, "rrl_ettr_ratio") < value(data, "rrl_goodput_ratio")
    finally:
        second.shutdown()
    after = json.loads((run / "ettr.json").read_text())
    assert after["wall_s"] >= before["wall_s"] + 100.0 and after["lost_s"]["controller"] == pytest.approx(lost)
