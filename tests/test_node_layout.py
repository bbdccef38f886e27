"""Roles across nodes: the placement math, refused shapes and the FSDP mesh (no Ray cluster)."""

from __future__ import annotations

import pytest

from resilient_rl.config.schema import load_config
from resilient_rl.controller.node_layout import RoleLayout, check_cluster_fits, config_layouts, role_layout
from resilient_rl.errors import ConfigError, ResourceError
from resilient_rl.workers.fsdp import mesh_shape


def node(cpu=8.0, gpu=0.0, alive=True):
    return {"Alive": alive, "Resources": {"CPU": cpu, "GPU": gpu}}


def test_role_layout_puts_the_same_number_of_ranks_on_each_node():
    layout = role_layout("actor", 8, 2)
    assert layout.process_on_nodes == (4, 4) and layout.nnodes == 2 and layout.world_size == 8
    assert [layout.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert role_layout("actor", 4, 1).process_on_nodes == (4,)


@pytest.mark.parametrize("overrides,names", [
    (["actor.world_size=4", "trainer.nnodes=3"], ("actor.world_size=4", "trainer.nnodes=3")),
    (["actor.world_size=4", "trainer.nnodes=2", "trainer.n_gpus_per_node=1"],
     ("actor.world_size=4", "trainer.n_gpus_per_node=1")),
    # Split: the rollout's single rank cannot span two nodes unless its own node count says so.
    (["trainer.placement=split", "actor.world_size=4", "trainer.nnodes=2", "critic.world_size=2"],
     ("rollout.world_size=1", "trainer.nnodes=2")),
    (["trainer.placement=split", "actor.world_size=4", "trainer.nnodes=2", "critic.world_size=2",
      "trainer.role_nnodes={rollout: 1, ref: 2}"], ("ref.world_size=1", "trainer.role_nnodes.ref=2")),
])
def test_bad_shapes_are_refused_at_config_time_naming_the_keys(overrides, names):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    for name in names:
        assert name in str(err.value)


def test_config_layouts_colocated_and_split():
    cfg = load_config(overrides=["actor.world_size=4", "trainer.nnodes=2"])
    assert config_layouts(cfg) == {"main": RoleLayout("main", (2, 2))}
    cfg = load_config(overrides=["trainer.placement=split", "actor.world_size=4", "trainer.nnodes=2",
                                 "critic.world_size=2", "trainer.role_nnodes={rollout: 1, ref: 1}"])
    assert {k: v.process_on_nodes for k, v in config_layouts(cfg).items()} == {
        "actor": (2, 2), "rollout": (1,), "ref": (1,), "critic": (1, 1)}


def test_config_keys_are_checked():
    for bad in ("trainer.nnodes=0", "trainer.sharding=ring", "trainer.network_interface='eth0; rm'",
                "trainer.role_nnodes={rollout: 1}", "trainer.n_gpus_per_node=0"):
        with pytest.raises(ConfigError, match="trainer"):
            load_config(overrides=[bad])


def test_cluster_that_can_never_host_the_layout_is_refused():
    two_by_two = [RoleLayout("main", (2, 2))]
    check_cluster_fits(two_by_two, [node(), node(), node(0)], use_gpu=False, cpus_per_rank=0.1)
    with pytest.raises(ResourceError, match="trainer.nnodes=2.*only 1 alive node"):
        check_cluster_fits(two_by_two, [node(), node(alive=False), node(0)], use_gpu=False, cpus_per_rank=0.1)
    with pytest.raises(ResourceError, match="largest node has 1 GPU"):
        check_cluster_fits(two_by_two, [node(gpu=1), node(gpu=1)], use_gpu=True, cpus_per_rank=0.1)
    with pytest.raises(ResourceError, match="only 1 alive node"):
        check_cluster_fits(two_by_two, [node(gpu=8), node(gpu=1)], use_gpu=True, cpus_per_rank=0.1)
    check_cluster_fits(two_by_two, [node(gpu=2), node(gpu=8)], use_gpu=True, cpus_per_rank=0.1)
    # One node of CPU ranks is the resource pool's own check (the totals).
    check_cluster_fits([RoleLayout("main", (4,))], [node(cpu=0.1)], use_gpu=False, cpus_per_rank=0.1)


def test_hybrid_sharding_mesh_has_one_row_per_node():
    assert mesh_shape("full", 8, 4) == (8,)
    assert mesh_shape("hybrid", 8, 4) == (2, 4)
    assert mesh_shape("hybrid", 4, 4) == (4,)  # one node: nothing to replicate over
    with pytest.raises(ConfigError, match="trainer.sharding=hybrid"):
        mesh_shape("hybrid", 6, 4)
