"""A node is lost and no node can take its ranks: the run stops at once, intact, and continues
when a node is back.

A ``ray.cluster_utils`` cluster of a CPU-less head and two worker nodes, no spare: the actor's
four ranks span both (two per node). Removing the node of ranks 2-3 leaves their placement
group nowhere to go. Recovery must see that (rather than wait ``recovery.restart_timeout_s`` per
attempt until the failure budget is spent), stop with NoCapacityError (exit 75) naming the lost
node, the ranks and the resources, and leave the run folder and the last committed checkpoint as
they were; once a node is added, the same run continues to its last step with every step once.
"""

from __future__ import annotations

import pytest

from suite import nodes_instead
from resilient_rl.cli import EXIT_NO_CAPACITY, exit_code
from resilient_rl.errors import NoCapacityError
from resilient_rl.faults.harness import run_training
from resilient_rl.faults.nodes import RemoveNodeOf

STEPS = 6


def overrides(tmp: str) -> list[str]:
    return [
        f"trainer.total_steps={STEPS}", "trainer.progress_bar=false", "trainer.placement=colocated",
        "trainer.nnodes=2", "actor.world_size=4", "data.batch_size=16", "data.num_prompts=64",
        "actor.mini_batch_size=8", "critic.mini_batch_size=8", "ray.cpus_per_worker=0.05",
        "checkpoint.save_every=2", f"trainer.output_dir={tmp}/runs", f"checkpoint.root={tmp}/ckpt",
        "checkpoint.shared_filesystem=true",  # the simulated nodes share this machine's disk
    ]


@pytest.fixture()
def two_nodes():
    with nodes_instead(2, "rrl-chaos-capacity") as cluster:
        yield cluster


def test_a_lost_node_with_no_capacity_stops_at_once_and_the_run_continues_when_a_node_is_back(two_nodes, tmp_path):
    hook = RemoveNodeOf(two_nodes, rank=2, step=4, in_call="update_actor")  # inside step 4, however busy
    lost = run_training(overrides(str(tmp_path)), "no-capacity", hooks=(hook,))
    assert hook.removed is not None
    assert isinstance(lost.error, NoCapacityError), repr(lost.error)
    assert exit_code(lost.error) == EXIT_NO_CAPACITY
    message = str(lost.error)
    assert hook.removed in message and "ranks [2, 3]" in message and "CPU=" in message, message
    aborted = lost.events_of("aborted")
    assert len(aborted) == 1 and lost.events_of("failure_during_recovery") == []
    seconds = aborted[0]["time"] - hook.fired_at
    print(f"node removed -> run stopped: {seconds:.1f} s (Ray declares the node dead after ~3 s here)")
    assert [r["step"] for r in lost.history] == [1, 2, 3]
    committed = [e["step"] for e in lost.events_of("checkpoint_committed")]
    assert committed and committed[-1] == 2

    two_nodes.add_node(num_cpus=8, object_store_memory=128 * 2**20)
    two_nodes.wait_for_nodes()
    resumed = run_training(overrides(str(tmp_path)), "no-capacity")
    assert resumed.error is None, resumed.error
    assert [r["step"] for r in resumed.history] == list(range(1, STEPS + 1))
