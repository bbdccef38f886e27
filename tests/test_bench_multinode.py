"""bench/multinode.py's arguments and its node-loss report, from made-up events (nothing timed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from resilient_rl.faults.harness import RunResult


@pytest.fixture
def multinode(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import multinode

    return multinode


def result(events, files=None, state=None) -> RunResult:
    return RunResult("r", [], events, files or {"a": "1"}, state or {"step": 8}, [8], 8, {8: "ok"}, set(), "", 0.0)


def test_arguments_are_checked(multinode):
    for bad in (["--nodes", "2"], ["--fault-step", "10", "--steps", "10"], ["--warmup", "5", "--steps", "5"]):
        with pytest.raises(SystemExit):
            multinode.parse_args(bad)
    assert multinode.parse_args(["actor.strategy=fsdp"]).overrides == ["actor.strategy=fsdp"]


def test_a_fault_report_splits_the_recovery_by_phase(multinode):
    events = [
        {"event": "failure", "time": 100.2, "cause": "died"},
        {"event": "worker_restarted", "time": 104.0},
        {"event": "worker_restarted", "time": 105.0},
        {"event": "snapshot_restored", "time": 106.5, "duration_s": 0.5, "sources": {"own": 4, "peer": 4}},
        {"event": "recovered", "time": 107.0, "steps_replayed": 0, "source": "snapshot"},
    ]
    ranks = [("main", 2), ("main", 3)]
    starts = SimpleNamespace(at={5: 99.0, 6: 109.0})
    args = SimpleNamespace(fault_step=5)
    r = multinode.loss_report(args, result(events), result([]), 100.0, ranks, starts)
    assert r["split"] == pytest.approx({"detect": 0.2, "restart": 4.8, "rejoin": 1.0, "restore": 1.0,
                                        "complete": 2.0})
    assert r["mttr"] == pytest.approx(9.0) and sum(r["split"].values()) == pytest.approx(r["mttr"])
    assert r["identical"] and r["storage_loads"] == 0 and r["replayed"] == 0
    differs = multinode.loss_report(args, result(events, files={"a": "2"}), result([]), 100.0, ranks, starts)
    assert not differs["identical"]
