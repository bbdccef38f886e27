"""How a role's ranks are laid out over nodes, and whether a cluster can host that layout.

A role of ``world_size`` ranks on ``nnodes`` nodes runs ``world_size // nnodes`` ranks on each
(verl's ``trainer.nnodes`` x ``trainer.n_gpus_per_node``): its resource pool is
``process_on_nodes=[n, n, ...]``, one placement group per node, and ranks are numbered node by node
(ranks ``0..n-1`` on the first node, ``n..2n-1`` on the second, ...), which is what HSDP's
``(replicate, shard)`` mesh and the snapshot ring by node rely on.

Everything here is plain arithmetic over the config and the alive nodes' resources (as
``ray.nodes()`` reports them), so that a bad shape is refused, naming the keys, before any actor
of the run starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilient_rl.config.section import ConfigFieldError
from resilient_rl.errors import ConfigError, ResourceError


@dataclass(frozen=True)
class RoleLayout:
    """The ranks of one process group over nodes: ``process_on_nodes[i]`` ranks on node i."""

    name: str  # the process group ("main" when the roles are colocated, else the role)
    process_on_nodes: tuple[int, ...]

    @property
    def nnodes(self) -> int:
        return len(self.process_on_nodes)

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def node_of(self, rank: int) -> int:
        """The index of the node (in ``process_on_nodes``) hosting ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        for node, first in enumerate(self.first_ranks()):
            if rank < first + self.process_on_nodes[node]:
                return node
        raise AssertionError("unreachable")

    def first_ranks(self) -> list[int]:
        out, total = [], 0
        for n in self.process_on_nodes:
            out.append(total)
            total += n
        return out


def role_layout(name: str, world_size: int, nnodes: int, n_gpus_per_node: int | None = None,
                world_size_key: str | None = None, nnodes_key: str = "trainer.nnodes") -> RoleLayout:
    """The layout of ``world_size`` ranks of process group ``name`` on ``nnodes`` nodes.

    Raises :class:`ConfigError` naming the keys when the ranks do not divide evenly over the nodes
    or a node would run more ranks than ``trainer.n_gpus_per_node``."""
    world_size_key = world_size_key or f"{name}.world_size"
    if nnodes < 1:
        raise ConfigError(f"{nnodes_key}={nnodes}: must be >= 1")
    if world_size % nnodes:
        # Split roles left on trainer.nnodes are told where their own node count goes.
        own = (f"; or give {name} a node count of its own: trainer.role_nnodes.{name}"
               if nnodes_key == "trainer.nnodes" and name != "main" else "")
        raise ConfigError(f"{world_size_key}={world_size} is not divisible by {nnodes_key}={nnodes}: every node "
                          f"of a role runs the same number of ranks{own}")
    per_node = world_size // nnodes
    if n_gpus_per_node is not None and per_node > n_gpus_per_node:
        raise ConfigError(f"{world_size_key}={world_size} on {nnodes_key}={nnodes} puts {per_node} ranks on a node, "
                          f"more than trainer.n_gpus_per_node={n_gpus_per_node}")
    return RoleLayout(name, (per_node,) * nnodes)


def check_cluster_fits(layouts: list[RoleLayout], nodes: list[dict], use_gpu: bool, cpus_per_rank: float) -> None:
    """Refuse, naming the keys, layouts that the alive nodes can never host: a layout of k nodes
    needs k distinct nodes each with room for one node's ranks (a GPU each on GPU, else
    ``cpus_per_rank`` CPU each). ``nodes`` is ``ray.nodes()``; dead nodes are ignored.

    Only what can never fit is refused; resources held by other jobs are the placement timeout's
    business."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if use_gpu and not any(r.get("GPU", 0) for r in alive):
        # Only trainer.device=cuda asks for GPUs of a cluster that has none (auto would not). It is
        # checked here, against the cluster, not where the config is read: the controller may run
        # on a node without a GPU (a Ray head), and so does a warm spare before it takes a GPU.
        raise ConfigFieldError("trainer.device", "cuda", "no alive node of the Ray cluster has a GPU "
                               "(use 'auto' or 'cpu')")
    for layout in layouts:
        if layout.nnodes == 1 and not use_gpu:
            continue  # the resource pool's own total check covers one node of CPU bundles
        per_node = max(layout.process_on_nodes)
        if use_gpu:
            most = max((r.get("GPU", 0) for r in alive), default=0)
            if per_node > most:
                raise ResourceError(f"process group {layout.name!r} runs {per_node} GPU ranks on each node "
                                    f"(trainer.n_gpus_per_node / {layout.name}.world_size over trainer.nnodes) "
                                    f"but the largest node has {most:g} GPU(s)")
            able = sum(1 for r in alive if r.get("GPU", 0) >= per_node)
        else:
            able = sum(1 for r in alive if r.get("CPU", 0) + 1e-9 >= per_node * cpus_per_rank)
        if able < layout.nnodes:
            raise ResourceError(f"process group {layout.name!r} spans trainer.nnodes={layout.nnodes} nodes of "
                                f"{per_node} ranks but only {able} alive node(s) of the cluster can host "
                                f"{per_node} of its ranks ({'GPU' if use_gpu else 'CPU'}); lower trainer.nnodes "
                                f"or add nodes")


def config_layouts(cfg) -> dict[str, RoleLayout]:
    """Process group -> its layout, from a validated root config: colocated, one group ("main")
    of ``actor.world_size`` ranks on ``trainer.nnodes`` nodes; split, one per role, each on
    ``trainer.role_nnodes[role]`` nodes where set, else ``trainer.nnodes``."""
    t = cfg.trainer
    if t.placement == "colocated":
        return {"main": role_layout("main", cfg.actor.world_size, t.nnodes, t.n_gpus_per_node,
                                    world_size_key="actor.world_size")}
    roles = ["actor", "rollout", "ref"] + (["critic"] if cfg.critic.enabled else [])
    out = {}
    for role in roles:
        nnodes_key = f"trainer.role_nnodes.{role}" if role in t.role_nnodes else "trainer.nnodes"
        out[role] = role_layout(role, getattr(cfg, role).world_size, t.role_nnodes.get(role, t.nnodes),
                                t.n_gpus_per_node, nnodes_key=nnodes_key)
    return out


def network_runtime_env(interface: str) -> dict | None:
    """The Ray ``runtime_env`` that makes every worker's gloo and NCCL use ``interface``
    (``trainer.network_interface``) between nodes; None where the libraries choose."""
    if not interface:
        return None
    return {"env_vars": {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}}
