"""Roles across nodes: the placement math, refused shapes and the FSDP mesh (no Ray cluster)."""

from __future__ import annotations

import pytest

from resilient_rl.config.schema import load_config
from resilient_rl.config.section import ConfigFieldError
from resilient_rl.config.node_layout import (RoleLayout, check_cluster_fits, config_layouts, network_runtime_env,
                                             role_layout)
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


def test_network_interface_reaches_gloo_and_nccl():
    cfg = load_config(overrides=["trainer.network_interface=ib0"])
    assert network_runtime_env(cfg.trainer.network_interface) == {
        "env_vars": {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}}
    assert network_runtime_env(load_config().trainer.network_interface) is None


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
    # trainer.device=cuda on a cluster without any GPU is refused naming the key, before any actor starts.
    with pytest.raises(ConfigFieldError, match=r"trainer\.device='cuda': no alive node of the Ray cluster has a GPU"):
        check_cluster_fits([RoleLayout("main", (2,))], [node(), node(gpu=8, alive=False)], use_gpu=True,
                           cpus_per_rank=0.1)
    # One node of CPU ranks is the resource pool's own check (the totals).
    check_cluster_fits([RoleLayout("main", (4,))], [node(cpu=0.1)], use_gpu=False, cpus_per_rank=0.1)


def test_hybrid_sharding_mesh_has_one_row_per_node():
    assert mesh_shape("full", 8, 4) == (8,)
    assert mesh_shape("hybrid", 8, 4) == (2, 4)
    assert mesh_shape("hybrid", 4, 4) == (4,)  # one node: nothing to replicate over
    with pytest.raises(ConfigError, match="trainer.sharding=hybrid"):
        mesh_shape("hybrid", 6, 4)


class FakePlacement:
    """Stands in for Ray's placement-group API: places each group on the first node that its
    label selector allows (as Ray's scheduler must) and records what it was asked."""

    def __init__(self, nodes):
        self.nodes, self.created, self.removed = nodes, [], []

    def placement_group(self, bundles, strategy, name, lifetime=None, bundle_label_selector=None):
        banned = set()
        for sel in bundle_label_selector or []:
            value = sel["ray.io/node-id"]
            assert value.startswith("!in(") and value.endswith(")")
            banned |= set(value[4:-1].split(","))
        node = next(n for n in self.nodes if n not in banned)
        pg = type("PG", (), {"node": node, "n": len(bundles), "ready": lambda self: self})()
        self.created.append((name, strategy, bundle_label_selector, node))
        return pg

    def table(self, pg):
        return {"state": "CREATED", "bundles_to_node_id": {i: pg.node for i in range(pg.n)}}


def test_pool_of_several_nodes_places_each_group_off_the_others_nodes(monkeypatch):
    import resilient_rl.runtime.resource_pool as rp

    fake = FakePlacement(["n1", "n2", "n3"])
    monkeypatch.setattr(rp, "placement_group", fake.placement_group)
    monkeypatch.setattr(rp, "placement_group_table", fake.table)
    monkeypatch.setattr(rp.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(rp.ray, "cluster_resources", lambda: {"CPU": 24})
    pool = rp.RayResourcePool([2, 2, 2], name_prefix="p", use_gpu=False, cpus_per_bundle=0.1, distinct_nodes=True)
    pgs = pool.get_placement_groups()
    assert [pg.node for pg in pgs] == ["n1", "n2", "n3"]
    assert [c[2] for c in fake.created] == [None, [{"ray.io/node-id": "!in(n1)"}] * 2,
                                            [{"ray.io/node-id": "!in(n1,n2)"}] * 2]
    assert all(c[1] == "STRICT_PACK" for c in fake.created)
    assert pool.nodes() == [["n1", "n1"], ["n2", "n2"], ["n3", "n3"]]
    # verl's default (several groups free to share a node, e.g. merged pools) is unchanged.
    fake.created.clear()
    rp.RayResourcePool([1, 1], name_prefix="q", use_gpu=False).get_placement_groups()
    assert [c[2] for c in fake.created] == [None, None]


@pytest.mark.parametrize("old_ray, why", [
    ("ignores", r"it placed group 1 on node\(s\) \['n1'\] that its label selector excludes"),
    ("lacks", r"its placement groups take no label selector"),
])
def test_a_ray_that_cannot_keep_groups_on_distinct_nodes_is_refused_leaving_no_group(monkeypatch, old_ray, why):
    """Ray took placement-group label selectors in one release and honoured them in a later one:
    before, the keyword is unknown; between, it is accepted and the groups may share a node, which
    HSDP's mesh by node and the snapshot ring by node would silently get wrong."""
    import resilient_rl.runtime.resource_pool as rp

    fake = FakePlacement(["n1", "n2"])

    def placement_group(bundles, strategy, name, lifetime=None, **selector):
        if old_ray == "lacks" and selector:
            raise TypeError("placement_group() got an unexpected keyword argument 'bundle_label_selector'")
        return fake.placement_group(bundles, strategy, name, lifetime)  # the selector unread

    monkeypatch.setattr(rp, "placement_group", placement_group)
    monkeypatch.setattr(rp, "placement_group_table", fake.table)
    monkeypatch.setattr(rp, "remove_placement_group", fake.removed.append)
    monkeypatch.setattr(rp.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(rp.ray, "cluster_resources", lambda: {"CPU": 24})
    pool = rp.RayResourcePool([2, 2], name_prefix="p", use_gpu=False, cpus_per_bundle=0.1, distinct_nodes=True)
    with pytest.raises(ResourceError, match=r"pool 'p' needs its 2 placement groups on distinct nodes, which Ray "
                                            r"[\d.]+\S* cannot do: " + why):
        pool.get_placement_groups()
    assert len(fake.removed) == len(fake.created) == (2 if old_ray == "ignores" else 0), \
        "every group created is removed again"


def test_the_readmes_split_example_validates_as_written():
    """README "Roles across nodes": the split example's command line loads, every role fits, and
    without its critic entry the refusal says where the critic's node count goes."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Roles across nodes\n", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["resilient-rl", "train"]
    cfg = load_config(overrides=argv[2:])
    assert {k: v.process_on_nodes for k, v in config_layouts(cfg).items()} == {
        "actor": (8, 8), "rollout": (1,), "ref": (1,), "critic": (1,)}
    without_critic = [a.replace(", critic: 1", "") for a in argv[2:]]
    with pytest.raises(ConfigError, match=r"critic\.world_size=1 .*trainer\.role_nnodes\.critic"):
        load_config(overrides=without_critic)
