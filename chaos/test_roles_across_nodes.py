"""Roles across nodes, every recovery setting at its default: an actor whose ranks span two nodes
loses one of them and recovers from the snapshot copies its ring peers keep on the other node,
replaying nothing; a rank killed on the second node is back without waiting out a timeout.

A ``ray.cluster_utils`` cluster of a CPU-less head and three worker nodes (one spare) replaces the
suite's cluster for this module (as in ``test_node_loss.py``); the fault-free run is made in the
same cluster with the same config, since the suite's reference runs another layout.
"""

from __future__ import annotations

import pytest

from suite import STEPS, nodes_instead
from resilient_rl.faults.harness import check_invariants, leftovers, run_training
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.faults.nodes import RemoveNodeOf

pytestmark = pytest.mark.slow  # two runs of 4 ranks on three raylets: minutes on 2 busy cores


def overrides(tmp: str) -> list[str]:
    return [
        f"trainer.total_steps={STEPS}", "trainer.progress_bar=false", "trainer.placement=colocated",
        "trainer.nnodes=2", "actor.world_size=4", "data.batch_size=16", "data.num_prompts=64",
        "actor.mini_batch_size=8", "critic.mini_batch_size=8", "actor.ppo_epochs=2", "critic.ppo_epochs=2",
        "ray.cpus_per_worker=0.05", f"checkpoint.save_every={STEPS}", f"trainer.output_dir={tmp}/runs", f"checkpoint.root={tmp}/ckpt",
        "checkpoint.shared_filesystem=true",  # the simulated nodes share this machine's disk
    ]


@pytest.fixture(scope="module")
def nodes():
    with nodes_instead(3, "rrl-chaos-across") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(nodes, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("across"))
    result = run_training(overrides(root), "across-reference")
    assert result.error is None, result.error
    assert not result.events_of("worker_restarted"), "the fault-free run restarted nothing"
    return root, result


def test_a_rank_killed_on_the_second_node_is_back_with_nothing_replayed(nodes, reference):
    root, ref = reference
    schedule = FaultSchedule().after_snapshot(4).kill("actor", 3, in_call="update_actor")  # mid-step
    result = run_training(overrides(root), "across-kill", schedule)
    fault = schedule.faults[0]
    assert fault.fired_at is not None, "the rank was killed"
    check_invariants(result, ref)
    recovered = result.events_of("recovered")[-1]
    assert recovered["source"] == "snapshot" and recovered["steps_replayed"] == 0, recovered
    # The survivors left the broken collective at once (tests/test_leave_collective.py shows how);
    # the figure, for the record:
    print(f"kill -> recovered: {recovered['time'] - fault.fired_at:.2f} s, phases {recovered['phases']}")
    assert not leftovers(result)


def test_actor_across_nodes_loses_a_node_and_replays_nothing(nodes, reference):
    root, reference = reference
    # Inside step 4 (its actor update), with step 3's snapshot complete: however busy the machine.
    hook = RemoveNodeOf(nodes, rank=2, step=4, after_snapshot=True, in_call="update_actor")
    result = run_training(overrides(root), "across-node-loss", hooks=(hook,))
    assert hook.removed is not None, "the node was removed"
    assert [r for _, r in hook.ranks] == [2, 3], "ranks 2-3 were on the removed node, 0-1 elsewhere"
    check_invariants(result, reference)
    recovered = result.events_of("recovered")[-1]
    assert recovered["source"] == "snapshot" and recovered["steps_replayed"] == 0, recovered
    assert not [e for e in result.events_of("checkpoint_restored")], "nothing was read from storage"
    sources = result.events_of("snapshot_restored")[-1]["sources"]
    # Ranks 2-3 (actor and critic each) could only find copies off their lost node.
    assert sources.get("peer", 0) + sources.get("object_store", 0) >= 4, sources
    # The lost node's placement group went to the spare node: not the lost one, and not the
    # surviving ranks' node (its label selector keeps the role across two nodes). A survivor may
    # be restarted too (on its own node): gloo can abort a rank whose peer went on to its next
    # collective on the broken group.
    survivors = {nid for key, nid in hook.nodes_before.items() if key not in hook.ranks}
    assert len(survivors) == 1 and hook.removed not in survivors
    moved = {e["node"] for e in result.events_of("worker_restarted") if (e["group"], e["rank"]) in hook.ranks}
    assert len(moved) == 1 and not moved & ({hook.removed} | survivors), moved
    assert not leftovers(result)
