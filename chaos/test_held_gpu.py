"""A warm spare takes a killed rank's GPU before the driver has released the dead process's memory
(resilient_rl.workers.held_memory): its first model build runs out of memory, waits for that
memory to come free and builds again, and the run recovers with nothing replayed, ending as the
fault-free one did.

No GPU here: in the worker processes the device's memory readings and the builds' allocation
failure are faked (resilient_rl.testing.held_memory). The kill, the spare, the builds, the wait and
the restore are the real ones.
"""

from __future__ import annotations

import hashlib

import pytest

from resilient_rl.faults.harness import check_invariants, run_training
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.recovery.states import RecoveryState
from resilient_rl.testing import held_memory
from resilient_rl.trainer.hooks import TrainerHook
from suite import RESULTS, chaos_overrides

FAST = ("checkpoint.save_every=20", "recovery.snapshot_every=1", "recovery.spares=1")


class _DeadRankHoldsItsGpu(TrainerHook):
    """When the recovery starts, the killed rank's GPU is still held (for ``seconds`` after the
    first build it refuses)."""

    def __init__(self, path: str, rank: int, seconds: float):
        self.path, self.rank, self.seconds, self.held = path, rank, seconds, False

    def on_recovery_state(self, trainer, state) -> None:
        if state is RecoveryState.RECOVERING and not self.held:
            held_memory.hold(self.path, self.rank, self.seconds)
            self.held = True


@pytest.fixture
def held_gpu_cluster(tmp_path):
    """A local cluster of this test's own, whose worker processes see the faked device (the
    suite's cluster is started again by the next test that needs it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    path = str(tmp_path / "held")
    ray.init(address="local", num_cpus=32, include_dashboard=False, namespace="rrl-held-gpu",
             object_store_memory=256 * 1024**2, log_to_driver=False, configure_logging=False,
             runtime_env={"worker_process_setup_hook": "resilient_rl.testing.held_memory.dead_rank_holds_its_gpu",
                          "env_vars": {held_memory.ENV: path}})
    try:
        yield path
    finally:
        ray.shutdown()


def test_a_spare_waits_for_the_dead_ranks_gpu_memory_then_builds(reference, chaos_dir, held_gpu_cluster, request):
    path = held_gpu_cluster
    name = "held-gpu-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    schedule = FaultSchedule().after_snapshot(4).kill("actor", 1, in_call="update_actor")
    result = run_training(chaos_overrides(chaos_dir) + list(FAST), name, schedule,
                          hooks=(_DeadRankHoldsItsGpu(path, rank=1, seconds=1.0),))
    RESULTS.append(result)
    check_invariants(result, reference)
    assert [(e["role"], e["rank"]) for e in result.events_of("spare_adopted")] == [("actor", 1)]
    rec = result.events_of("recovered")[0]
    assert (rec["steps_replayed"], rec["source"]) == (0, "snapshot"), rec
    builds = held_memory.builds(path)
    assert "refused 1" in builds, builds  # the spare's first build met the held GPU
    assert "built 1" in builds[builds.index("refused 1"):], builds  # and built once it came free
