"""The chaos suite's fixtures (its Ray cluster, the fault-free reference runs) and its summary;
the run they are built on is in :mod:`suite`."""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import uuid

import pytest

from resilient_rl.env import fail_fast_on_dead_actors
from resilient_rl.faults.harness import run_training
from resilient_rl.faults.storage import register as register_faulty_storage
from suite import FSDP, RESULTS, chaos_overrides, ensure_ray, fault_free_run

# The suite's clusters handle dead actors as the trainer's own do (see resilient_rl.env).
fail_fast_on_dead_actors()

# The fault-injecting faulty:// storage is opt-in: on here, before the suite's Ray cluster starts,
# so its workers can open it too.
register_faulty_storage()


@pytest.fixture
def chaos_ray():
    """The suite's local cluster, started on first use, and again after a test that replaced it
    with a cluster of its own (``test_node_loss.py``) and shut that down."""
    return ensure_ray()


def pytest_sessionfinish(session, exitstatus):
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def node_memory(tmp_path):
    """A node-memory folder of the test's own (``recovery.snapshot_node_dir``; under ``/dev/shm``
    where it is writable), removed after it: what the test's runs leave there is theirs alone to
    sweep or keep, whatever other tests run at the same time (``pytest -n``)."""
    where = f"/dev/shm/rrl-test-{uuid.uuid4().hex[:8]}" if os.access("/dev/shm", os.W_OK) else str(tmp_path / "shm")
    os.makedirs(where)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="session")
def chaos_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chaos"))


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A folder every worker of a ``pytest -n`` session sees (None without ``-n``)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return str(tmp_path_factory.getbasetemp().parent / "chaos-shared")


@pytest.fixture(scope="session")
def reference(chaos_dir, shared_dir):
    """The fault-free run every scenario is compared with (trained once per session)."""
    return fault_free_run(chaos_dir, "reference", shared=shared_dir)


@pytest.fixture(scope="session")
def fsdp_reference(chaos_dir, shared_dir):
    """The fault-free run of the scenarios that shard the trained roles with FSDP2."""
    return fault_free_run(chaos_dir, "reference-fsdp", *FSDP, shared=shared_dir)


@pytest.fixture
def chaos_run(chaos_ray, chaos_dir, request):
    """Run the chaos config under a schedule; records the result for the session summary."""

    def run(schedule, *extra: str, name: str | None = None, hooks: tuple = ()):
        if name is None:
            digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
            name = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40] + "-" + digest
        result = run_training(chaos_overrides(chaos_dir) + list(extra), name, schedule, hooks=hooks)
        RESULTS.append(result)
        return result

    return run


def _brief(result) -> dict:
    """What the session summary needs of one run under faults (plain values: with ``pytest -n``
    it travels from the worker that ran the test to the one that writes the summary)."""
    return {"faults": sum(1 for f in result.schedule.faults if f.fired) if result.schedule else 0,
            "recoveries": [(e["duration_s"], e["steps_replayed"]) for e in result.events_of("recovered")],
            "useful_s": sum(row.get("timing/step_s", 0.0) for row in result.history), "wall_s": result.wall_s}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The runs under faults a test recorded in ``RESULTS`` go into its teardown report."""
    if call.when == "teardown":
        item.user_properties.extend(("chaos_run", _brief(r)) for r in RESULTS)
        RESULTS.clear()
    yield


SUMMARY: list[dict] = []


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        SUMMARY.extend(value for key, value in report.user_properties if key == "chaos_run")


def pytest_terminal_summary(terminalreporter):
    if not SUMMARY:
        return
    faults = sum(r["faults"] for r in SUMMARY)
    recoveries = [rec for r in SUMMARY for rec in r["recoveries"]]
    durations = [duration for duration, _ in recoveries]
    replayed = sum(steps for _, steps in recoveries)
    useful = sum(r["useful_s"] for r in SUMMARY)
    wall = sum(r["wall_s"] for r in SUMMARY)
    tr = terminalreporter
    tr.section("chaos summary")
    tr.write_line(f"runs under faults: {len(SUMMARY)}; faults injected: {faults}; recoveries: {len(recoveries)}")
    if durations:
        tr.write_line(f"recovery time: mean {statistics.mean(durations):.1f}s, max {max(durations):.1f}s; "
                      f"steps replayed: {replayed}")
    if wall:
        tr.write_line(f"goodput (useful step time / wall time of the faulted runs): {useful / wall:.2f}")
    if os.environ.get("RRL_CHAOS_SEED"):
        tr.write_line(f"soak seed: {os.environ['RRL_CHAOS_SEED']}")
