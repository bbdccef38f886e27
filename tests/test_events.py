"""The schema of ``events.jsonl``: typed events, the one reader, the bus, and the emitters' fit."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
from pathlib import Path

import pytest

import resilient_rl
from resilient_rl.errors import RunFolderError
from resilient_rl.events import (EVENT_TYPES, SCHEMA_VERSION, Event, EventBus, EventSchemaError, UnknownEvent,
                                 event_to_json, make_event, parse_event, read_events)
from resilient_rl.run.folder import RunDir

#: One event of every kind, with values of the types its emitter passes.
SAMPLES: dict[str, dict] = {
    "worker_restarted": {"group": "rrl_r_ab12_main", "rank": 1, "pid": 4343, "node": "n0", "role": "actor",
                         "cause": "died"},
    "kill_unresponsive": {"group": "rrl_r_ab12_main", "rank": 0, "pid": 4242, "node": "n0"},
    "leave_collectives": {"ranks": [["rrl_r_ab12_main", 0], ["rrl_r_ab12_main", 1]]},
    "kill_hung": {"group": "rrl_r_ab12_main", "rank": 0, "pid": 4242, "node": None,
                  "reason": "inside 'update_actor' without progress for 31.0s"},
    "failure": {"step": 4, "role": "actor", "rank": 1, "cause": "died", "message": "actor died",
                "group": "rrl_r_ab12_main"},
    "failure_during_recovery": {"state": "rejoining", "role": None, "rank": None, "cause": "timeout",
                                "message": "rendezvous timed out", "group": None},
    "recovery_state": {"state": "rejoining", "failed_step": 4},
    "recovery_backoff": {"in_a_row": 3, "wait_s": 2.0},
    "recovered": {"failed_step": 4, "restored_step": 2, "steps_replayed": 1, "duration_s": 3.25,
                  "restarted": [["rrl_r_ab12_main", 1]], "generation": 2, "source": "checkpoint",
                  "phases": {"detect": 0.01, "restart": 2.5, "rejoin": 0.25, "restore": 0.5},
                  "rejoined": ["rrl_r_ab12_main"]},
    "aborted": {"reason": "max_restarts=0 exceeded", "role": "critic", "rank": 0, "last_committed_step": None},
    "lease_acquired": {"holder": "host:123:abcd", "token": 3, "expires_at": 1.7e9,
                       "previous": {"holder": "host:99:ef", "token": 2}},
    "checkpoint_started": {"step": 2, "stall_s": 0.01},
    "checkpoint_committed": {"step": 2, "duration_s": 0.2, "stall_s": 0.01, "bytes": 1234, "known_good": True},
    "checkpoint_skipped": {"step": 4, "reason": "slow", "in_row": 1, "detail": "still writing step 2"},
    "checkpoint_abandoned": {"step": 4, "reason": "writer_lost"},
    "checkpoint_refused": {"step": 4, "role": "actor", "reason": "the saved state of actor holds NaN or Inf"},
    "checkpoint_corrupt": {"step": 4, "reason": "checksum mismatch"},
    "checkpoint_restored": {"step": 2, "duration_s": 0.1, "source": "file:///ckpt/r/step_00000002"},
    "snapshot_restored": {"step": 5, "duration_s": 0.2, "sources": {"own": 1, "peer": 1}},
    "snapshot_unusable": {"step": 5, "reason": "every copy of actor rank(s) [1] is lost"},
    "snapshot_corrupt": {"step": 5, "role": "actor", "rank": 1, "source": "node",
                         "reason": "checksum xxh3_64:1 does not match the recorded xxh3_64:0"},
    "spare_adopted": {"group": "rrl_run_ab12_main", "rank": 1, "role": "actor"},
    "checkpoints_set_aside": {"steps": [4, 6], "continued_from": 2, "source": "file:///ckpt/r/step_00000002"},
    "nonfinite": {"step": 3, "quantity": "reward", "role": None, "action": "skipped", "count": 2.0},
    "nonfinite_rollback": {"failed_step": 3, "restored_step": 2, "quantity": "loss"},
    "decode_eager": {"step": 3, "reason": "RuntimeError: cannot capture"},
    "bench_step_start": {"step": 5},
}


def test_every_kind_has_a_sample_and_round_trips_through_a_json_line():
    assert set(SAMPLES) == set(EVENT_TYPES)
    for kind, fields in SAMPLES.items():
        ev = make_event(kind, time=1700000000.25, **fields)
        assert type(ev) is EVENT_TYPES[kind] and ev.kind == kind and ev.payload() == fields
        line = json.dumps(event_to_json(ev))
        obj = json.loads(line)
        assert (obj["event"], obj["v"], obj["time"]) == (kind, SCHEMA_VERSION, 1700000000.25)
        assert parse_event(obj) == ev


def test_events_are_frozen():
    ev = make_event("checkpoint_started", step=2, stall_s=0.1)
    with pytest.raises(AttributeError):
        ev.step = 3  # type: ignore[misc]
    assert isinstance(ev.time, float) and ev.time > 0  # now, when not given


def test_an_unknown_or_missing_field_is_refused_naming_it():
    with pytest.raises(EventSchemaError, match=r"event 'failure': unknown field 'replayed'"):
        make_event("failure", **SAMPLES["failure"], replayed=2)
    missing = {k: v for k, v in SAMPLES["recovered"].items() if k != "steps_replayed"}
    with pytest.raises(EventSchemaError, match=r"event 'recovered': missing field 'steps_replayed'"):
        make_event("recovered", **missing)
    with pytest.raises(EventSchemaError, match=r"unknown event kind 'after_close'"):
        make_event("after_close", step=9)
    with pytest.raises(ValueError):  # EventSchemaError is a ValueError too
        make_event("checkpoint_started", step=2)


def test_optional_fields_default_to_none_and_are_written_as_null():
    ev = make_event("nonfinite", step=1, quantity="checkpoint", role="actor", action="refused")
    assert ev.count is None and event_to_json(ev)["count"] is None
    assert make_event("checkpoint_committed", step=1, duration_s=0.1, stall_s=0.0, bytes=1).known_good is None


def test_run_dir_writes_typed_events_and_refuses_a_drifted_emitter(tmp_path):
    rd = RunDir(str(tmp_path), "r")
    rd.event("checkpoint_abandoned", step=4, reason="recovery")
    with pytest.raises(EventSchemaError, match="'reason'"):
        rd.event("checkpoint_abandoned", step=5)
    (line,) = rd.events_path.read_text().splitlines()  # the refused event wrote nothing
    obj = json.loads(line)
    assert obj["event"] == "checkpoint_abandoned" and obj["v"] == SCHEMA_VERSION and "time" in obj
    assert rd.read_events() == [obj]


def _write(path: Path, *objs, tail: str = "") -> None:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs) + tail)


def test_the_reader_skips_a_torn_last_line_with_a_warning(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    ev = event_to_json(make_event("checkpoint_started", time=1.0, step=2, stall_s=0.1))
    _write(path, ev, tail='{"event": "checkpoint_committed", "v": 1, "ti')
    with caplog.at_level(logging.WARNING):
        assert read_events(path) == [ev]
        assert read_events(tmp_path) == [ev]  # the run folder names the same file
    assert "torn last line" in caplog.text and str(path) in caplog.text
    assert read_events(tmp_path / "absent") == []


def test_a_damaged_line_is_an_error_naming_file_line_and_field(tmp_path):
    path = tmp_path / "events.jsonl"
    good = event_to_json(make_event("checkpoint_started", time=1.0, step=2, stall_s=0.1))
    _write(path, good, {**good, "stall": 0.2})
    with pytest.raises(RunFolderError, match=r"events\.jsonl: line 2: event 'checkpoint_started': unknown field 'stall'"):
        read_events(path)
    _write(path, good, {"v": 1, "time": 2.0})
    with pytest.raises(RunFolderError, match=r"line 2: no event kind"):
        read_events(path)


def test_a_newer_version_or_unknown_kind_is_kept_unchecked(tmp_path):
    """A reader older than the writer (``status`` of a run a newer trainer writes) shows what it knows."""
    path = tmp_path / "events.jsonl"
    newer = {"event": "failure", "v": SCHEMA_VERSION + 1, "time": 5.0, "step": 4, "where": "elsewhere"}
    unknown = {"event": "spare_promoted", "v": SCHEMA_VERSION, "time": 6.0, "rank": 3}
    known = event_to_json(make_event("failure", time=7.0, **SAMPLES["failure"]))
    _write(path, newer, unknown, known)
    assert read_events(path) == [newer, unknown, known]
    typed = read_events(path, typed=True)
    assert typed[0] == UnknownEvent(kind="failure", time=5.0, version=SCHEMA_VERSION + 1,
                                    data={"step": 4, "where": "elsewhere"})
    assert typed[1].kind == "spare_promoted" and isinstance(typed[1], UnknownEvent)
    assert isinstance(typed[2], Event) and typed[2].step == 4
    assert [event_to_json(e) for e in typed] == [newer, unknown, known]  # written back as read


def test_an_unversioned_line_is_read_as_version_one(tmp_path, caplog):
    """Lines written before events were versioned: same fields, no ``v``; missing optional fields are filled."""
    path = tmp_path / "events.jsonl"
    old = {"time": 3.0, "event": "checkpoint_committed", "step": 2, "duration_s": 0.2, "stall_s": 0.0, "bytes": 9}
    odd = {"time": 4.0, "event": "recovered", "failed_step": 4, "restored_step": 2, "replayed_steps": 1}
    _write(path, old, odd)
    with caplog.at_level(logging.WARNING):
        rows = read_events(path)
    assert rows[0] == {"event": "checkpoint_committed", "v": SCHEMA_VERSION, "time": 3.0, "step": 2,
                       "duration_s": 0.2, "stall_s": 0.0, "bytes": 9, "known_good": None}
    assert rows[1] == odd and "replayed_steps" in caplog.text
    with pytest.raises(EventSchemaError, match="bad schema version"):
        parse_event({**old, "v": "1"})


def test_the_bus_survives_a_failing_subscriber_and_unsubscribes(caplog):
    bus, seen = EventBus(), []

    def broken(ev):
        raise RuntimeError("tracker down")

    bus.subscribe(broken)
    stop = bus.subscribe(seen.append)
    ev = make_event("checkpoint_started", step=1, stall_s=0.0)
    with caplog.at_level(logging.ERROR):
        bus.publish(ev)
    assert seen == [ev] and "tracker down" in caplog.text and "checkpoint_started" in caplog.text
    stop()
    stop()  # idempotent
    bus.publish(ev)
    assert seen == [ev]


def test_a_subscription_to_event_types_hears_only_those_and_each_subscription_is_its_own():
    from resilient_rl.events.kinds import CheckpointCommitted, CheckpointStarted

    bus, started, both, every = EventBus(), [], [], []
    bus.subscribe(started.append, CheckpointStarted)
    bus.subscribe(both.append, CheckpointStarted, CheckpointCommitted)
    first = bus.subscribe(every.append)
    bus.subscribe(every.append)  # the same function twice: two subscriptions
    events = [make_event("checkpoint_started", step=1, stall_s=0.0),
              make_event("checkpoint_corrupt", step=2, reason="checksum"),
              make_event("checkpoint_committed", step=1, duration_s=0.1, stall_s=0.0, bytes=1)]
    for ev in events:
        bus.publish(ev)
    assert started == events[:1] and both == [events[0], events[2]]
    assert every == [e for e in events for _ in range(2)]
    first()
    bus.publish(events[1])
    assert every[-2:] == [events[2], events[1]] and len(every) == 7


def test_run_dir_publishes_on_its_bus_after_writing(tmp_path):
    rd = RunDir(str(tmp_path), "r")
    seen = []
    rd.bus.subscribe(lambda ev: seen.append((ev, len(rd.read_events()))))
    rd.subscribe(lambda ev: (_ for _ in ()).throw(RuntimeError("a broken tracker")))
    rd.event("checkpoint_corrupt", step=2, reason="checksum")
    (ev, lines), = seen
    assert ev.kind == "checkpoint_corrupt" and ev.step == 2 and lines == 1


# ---------------------------------------------------------------------------- the emitters fit their types
def _calls(path: Path):
    """(line, kind, keyword names, has ``**``) of every literal-kind event call in ``path``:
    ``x.event("kind", ...)``, ``x.emit("kind", ...)``, ``x.on_event("kind", ...)`` and recovery's
    helpers ``self._kill(pool, key, known, "kind", killed, ...)`` and ``self._report("kind", attempt, ...)``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, args = node.func.attr, node.args
        if name in ("event", "emit", "on_event", "_emit") and args and isinstance(args[0], ast.Constant):
            kind, implied = args[0].value, set()
        elif name == "_kill" and len(args) > 3 and isinstance(args[3], ast.Constant):
            kind, implied = args[3].value, {"group", "rank", "pid", "node"}
        elif name == "_report" and args and isinstance(args[0], ast.Constant):
            kind, implied = args[0].value, {"role", "rank", "group", "cause", "message"}
        else:
            continue
        keywords = {k.arg for k in node.keywords if k.arg is not None} | implied
        yield node.lineno, kind, keywords, any(k.arg is None for k in node.keywords)


def test_every_emitter_in_the_code_passes_the_fields_of_its_kind():
    root = Path(resilient_rl.__file__).parent
    files = sorted(root.rglob("*.py")) + sorted((root.parent / "bench").glob("*.py"))
    found, wrong = set(), []
    for path in files:
        for lineno, kind, keywords, spread in _calls(path):
            where = f"{path.relative_to(root.parent)}:{lineno}"
            cls = EVENT_TYPES.get(kind)
            if cls is None:
                wrong.append(f"{where}: unknown kind {kind!r}")
                continue
            found.add(kind)
            fields = {f.name for f in dataclasses.fields(cls) if f.name != "time"}
            required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING} - {"time"}
            if keywords - fields:
                wrong.append(f"{where}: {kind} has no field(s) {sorted(keywords - fields)}")
            if not spread and required - keywords:
                wrong.append(f"{where}: {kind} lacks field(s) {sorted(required - keywords)}")
    assert wrong == []
    assert found == set(EVENT_TYPES), f"kinds nothing emits: {sorted(set(EVENT_TYPES) - found)}"


# ---------------------------------------------------------------------------- real runs
def _all_valid(path: Path) -> list[str]:
    kinds = []
    for line in path.read_text().splitlines():
        ev = parse_event(json.loads(line))
        assert isinstance(ev, Event), f"not a known event: {line}"
        assert json.loads(line)["v"] == SCHEMA_VERSION
        kinds.append(ev.kind)
    return kinds


def test_a_local_training_run_writes_only_valid_events(tmp_path):
    from resilient_rl.config.schema import load_config
    from resilient_rl.faults.nonfinite import NonFiniteAdvantage, NonFiniteReward
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, ["trainer.total_steps=3", "trainer.progress_bar=false", "data.batch_size=8",
                             "data.num_prompts=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                             "actor.ppo_epochs=1", "critic.ppo_epochs=1", "model.hidden_size=32",
                             "model.num_layers=1", "model.intermediate_size=64", "telemetry.enabled=false",
                             "trainer.device=cpu", "trainer.loggers=[jsonl]", f"trainer.output_dir={tmp_path}/runs",
                             f"checkpoint.root={tmp_path}/ckpt", "trainer.run_name=ev"])
    trainer = PPOTrainer(cfg, roles_factory=LocalRoles, hooks=[NonFiniteReward(steps=[1]), NonFiniteAdvantage(steps=[2])])
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    kinds = _all_valid(trainer.run_dir.events_path)
    assert "nonfinite" in kinds
    assert [e["event"] for e in read_events(trainer.run_dir)] == kinds


def test_checkpoint_coordinator_events_are_valid_lines(tmp_path):
    """The coordinator's real emitters (lease, save, commit, abandon, restore) through RunDir.event."""
    from resilient_rl.config.schema import load_config
    from resilient_rl.errors import WorkerDiedError
    from resilient_rl.faults.storage import FaultPlan, faulty_url
    from resilient_rl.testing.checkpoint_roles import LocalCheckpointRoles
    from resilient_rl.checkpoint.coordinator import CheckpointCoordinator

    url, options = faulty_url(str(tmp_path / "ckpt"), FaultPlan(slow_s=0.05), name=f"ev-{tmp_path.name}")
    flat = [f"checkpoint.root={url}", f"checkpoint.storage_options.target_protocol={options['target_protocol']}",
            f"checkpoint.storage_options.name={options['name']}"]
    flat += [f"checkpoint.storage_options.plan.{k}={'null' if v is None else v}" for k, v in options["plan"].items()]
    cfg = load_config(None, ["trainer.run_name=ev", f"trainer.output_dir={tmp_path}/runs", "trainer.total_steps=100",
                             "checkpoint.save_every=2", *flat])
    rd = RunDir(cfg.trainer.output_dir, cfg.trainer.run_name)
    coord = CheckpointCoordinator(cfg, on_event=rd.event)
    coord.acquire_lease()
    try:
        with LocalCheckpointRoles() as roles:
            for step in (2, 4):
                roles.train_step(step)
                coord.save(roles, step, {"step": step}, "digest")
                if step == 2:
                    coord.wait(roles)
            roles.groups["critic"].restart(0)
            with pytest.raises(WorkerDiedError):
                coord.wait(roles)
            assert coord.restore(roles)["step"] == 2
    finally:
        coord.release_lease()
    kinds = _all_valid(rd.events_path)
    assert {"lease_acquired", "checkpoint_started", "checkpoint_committed", "checkpoint_abandoned",
            "checkpoint_restored"} <= set(kinds)
