"""The worker pool on Ray: worker groups for actor, critic, ref and rollout, in either placement.

The role classes come from the caller (:meth:`RayRoles.running`): this package starts, probes,
kills and rejoins processes of any worker class, and the trainer names the classes it runs.

- ``colocated``: actor, rollout, ref and (PPO) critic share one process per device: one resource
  pool, ``actor.world_size`` worker processes in all, every role on every device. The actor writes
  its weights straight into the rollout's parameters on the device (:mod:`resilient_rl.workers.weight_sync`).
- ``split``: every role has its own resource pool and processes (the critic's world size may
  differ from the actor's); actor rank 0 broadcasts the weights to the rollout ranks over a weight
  channel (a process group of their own; NCCL on GPU) or, on CPU by default, sends them through
  Ray's object store (``rollout.weight_transfer``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Callable

import ray

from resilient_rl.runtime import health, worker_group_spares as group_spares
from resilient_rl.runtime.health import answers_during_calls, process_gone, replaced
from resilient_rl.runtime.group_call import GroupCall, results_in_order, results_together
from resilient_rl.runtime.worker import WorkerInfo
from resilient_rl.runtime.pool.groups import start_spares, worker_group
from resilient_rl.runtime.pool.unplaced import yield_to_unplaced
from resilient_rl.runtime.spares import SparePool
from resilient_rl.runtime.worker_group import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls
from resilient_rl.config.node_layout import check_cluster_fits, config_layouts
from resilient_rl.errors import WorkerError
from resilient_rl.protocol import DataProto
from resilient_rl.config.schema import config_to_dict
from resilient_rl.runtime.pool import STATEFUL_ROLES, role_order, step_role

logger = logging.getLogger(__name__)


class RayRoles:
    """Starts the worker groups of a run, joins their process groups and builds their models.

    Implements :class:`~resilient_rl.runtime.pool.WorkerPool`; a process group is named by its
    worker group's ``name_prefix``. A pool class runs the role classes it was made with
    (:meth:`running`).
    """

    writes_checkpoints = True
    #: Role -> worker class (actor, rollout, ref, critic), set by :meth:`running`.
    role_classes: Mapping[str, type] = MappingProxyType({})
    #: Logs the trained roles' memory plans (rank 0's lines) once at start, set by :meth:`running`.
    announce_plans: Callable[[logging.Logger, list], Any] = staticmethod(lambda logger, lines: None)

    @classmethod
    def running(cls, role_classes: Mapping[str, type],
                announce_plans: Callable[[logging.Logger, list], Any]) -> type[RayRoles]:
        """This pool as a class that runs ``role_classes`` and logs memory plans with ``announce_plans``."""
        missing = {"actor", "rollout", "ref", "critic"} - set(role_classes)
        if missing:
            raise ValueError(f"RayRoles.running: no worker class for {sorted(missing)}")
        return type(cls.__name__, (cls,), {"role_classes": MappingProxyType(dict(role_classes)),
                                           "announce_plans": staticmethod(announce_plans),
                                           "__module__": cls.__module__})

    def __init__(self, cfg, tokenizer, instance: str | None = None):
        self.cfg = cfg
        self.colocated = cfg.trainer.placement == "colocated"
        self.critic_enabled = cfg.critic.enabled
        self.instance = instance or uuid.uuid4().hex[:6]
        self.use_gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto"
                                                        and ray.cluster_resources().get("GPU", 0) > 0)
        self.backend = "nccl" if self.use_gpu else "gloo"
        transfer = cfg.rollout.weight_transfer
        self.weight_channel = not self.colocated and (transfer == "channel" or (transfer == "auto" and self.use_gpu))
        #: The layout the actor sends its weights in (with HSDP its shard group, not its world),
        #: asked of it at the first sync over each weight channel.
        self.weights_layout: int | None = None
        #: The process groups the weight channel spans, with their calls inside it (RecoveryPool.shared_calls).
        self.shared_calls: dict[str, frozenset[str]] = {}
        #: Called while recovering (:class:`~resilient_rl.runtime.pool.RecoveryPool`); raises to stop.
        self.interrupt: Callable[[], None] = lambda: None
        self.generation = 0
        init = dict(config=config_to_dict(cfg), vocab_size=tokenizer.vocab_size,
                    eos_token_id=list(tokenizer.eos_token_ids), pad_token_id=tokenizer.pad_token_id)
        self.torch_groups: list[RayWorkerGroup] = []  # groups that own a torch.distributed group
        self.spares: dict[str, SparePool] = {}  # process group -> its warm spares (recovery.spares)
        self.groups: dict[str, RayWorkerGroup] = {}  # role -> its worker group
        #: Process group name -> the worker group that owns its processes (a colocated role's group
        #: shares its parent's), and the name each role's processes go by; fixed once started.
        self.processes: dict[str, RayWorkerGroup] = {}
        self.process_of: dict[str, str] = {}
        #: Process group name -> its roles, the one it is reported under first (ROLE_ORDER).
        self.process_roles: dict[str, tuple[str, ...]] = {}
        # Each process group's ranks over nodes; a layout the cluster can never host is refused
        # here, before any actor of the run starts.
        self.layouts = config_layouts(cfg)
        check_cluster_fits(list(self.layouts.values()), ray.nodes(), self.use_gpu, cfg.ray.cpus_per_worker)
        try:
            roles = ("actor", "rollout", "ref") + (("critic",) if self.critic_enabled else ())
            if set(roles) - set(self.role_classes):
                raise TypeError("RayRoles runs the role classes of a pool made by RayRoles.running(...)")
            classes = {role: self.role_classes[role] for role in roles}
            if self.colocated:
                cls = create_colocated_worker_cls({role: RayClassWithInitArgs(c, **init) for role, c in classes.items()})
                main = worker_group(cfg, self.layouts["main"], "main", cls, self.instance, self.use_gpu)
                self.torch_groups.append(main)
                self.groups.update(main.spawn(prefix_set=tuple(classes)))
            else:
                for role, c in classes.items():
                    self.groups[role] = worker_group(cfg, self.layouts[role], role, RayClassWithInitArgs(c, **init),
                                                     self.instance, self.use_gpu)
                # The rollout is unsharded: it needs no process group.
                self.torch_groups += [g for role, g in self.groups.items() if role != "rollout"]
            self._name_processes()
            if self.weight_channel:
                self.shared_calls.update({self.process_of["actor"]: frozenset({"send_weights"}),
                                          self.process_of["rollout"]: frozenset({"receive_weights"})})
            self.worker_info: dict[tuple[str, int], WorkerInfo] = {}
            self.refresh_workers()
            self.rendezvous()
            self.init_models()
            # Said once, at start: how micro_batch_tokens=auto was resolved (every rank plans the same device).
            self.announce_plans(logger, [self.groups[role].memory_plan_line()[0]
                                         for role in ("actor", "critic") if role in self.groups])
            self.sync_weights(0)  # the rollout, built empty, gets the actor's initial weights
            # Started last: they warm up while the first step runs.
            self.spares = start_spares(self.cfg.recovery, self.groups, list(self.processes.values()))
        except BaseException:
            self.shutdown()
            raise

    def _name_processes(self) -> None:
        """Fill :attr:`processes`, :attr:`process_of` and :attr:`process_roles` from the groups started."""
        for g in list(self.torch_groups) + list(self.groups.values()):
            if not any(p.workers is g.workers for p in self.processes.values()):
                self.processes[g.name_prefix] = g
        self.process_of = {role: next(name for name, p in self.processes.items() if p.workers is g.workers)
                           for role, g in self.groups.items()}
        self.process_roles = {name: tuple(sorted((r for r, n in self.process_of.items() if n == name),
                                                 key=role_order)) for name in self.processes}

    # ------------------------------------------------------------------ lifecycle
    def refresh_workers(self) -> None:
        """Remember every rank's ping reply in ``worker_info``, keyed by (group, rank): its pid and
        node (to tell restarted actors and to kill hung ones) and its GPU (for telemetry)."""
        self.worker_info = {(name, rank): info for name, g in self.processes.items()
                            for rank, info in enumerate(g.ping())}
        for pool in self.spares.values():  # every rank answers: spares released for them start again
            pool.refill()

    @property
    def known_workers(self) -> dict[tuple[str, int], tuple[int, str]]:
        """(group, rank) -> (pid, node id) of every rank, as of the last :meth:`refresh_workers`."""
        return {key: (info.pid, info.node_id) for key, info in self.worker_info.items()}

    def workers(self) -> dict[tuple[str, int], WorkerInfo]:
        """Every rank's ping reply of the last :meth:`refresh_workers`, with whether its process is
        starting up as last heard (its group's health replies since: the ping at start finds most
        processes starting up, and recovery gives such a process ``warmup_timeout_s`` to answer)."""
        return {key: replace(info, warming=self.processes[key[0]].ranks.is_warming(key[1]))
                for key, info in self.worker_info.items()}

    def process_groups(self) -> list[str]:
        return list(self.processes)

    def probe(self, group: str, timeout_s: float, during_call: bool = False) -> dict[int, object]:
        g = self.processes[group]
        if during_call and not answers_during_calls(g):  # its probe would queue behind the call itself
            return {}
        known = dict(self.worker_info)

        def gone(rank: int) -> bool:
            # The process known for the rank exited, and Ray has not started its successor yet
            # (whose answer is then waited for, not taken as a death).
            info = known.get((group, rank))
            return info is not None and process_gone(info.pid, info.node_id) and not replaced(g.workers[rank], info.pid)

        return health.probe(g, timeout_s=timeout_s, gone=gone)

    def kill(self, key: tuple[str, int]) -> None:
        info = self.worker_info[key]
        health.kill_rank(self.processes[key[0]], key[1], info.pid, info.node_id)

    def leave_collectives(self, keys, reason: str) -> None:
        for name in sorted({key[0] for key in keys}):
            g = self.processes[name]
            if answers_during_calls(g):  # others would hear it only once the blocked call ends
                health.leave_collectives(g, [rank for group, rank in keys if group == name], reason)

    def adopt_spares(self, keys) -> list[tuple[str, int]]:
        """Hand each dead rank of ``keys`` to a ready warm spare of its group; the ranks handed over.

        A group whose placement groups wait to be placed again (a node was lost) takes spares
        only when every dead rank of it gets one: a rank left to wait needs the whole placement
        group placed, and a spare holding another rank outside it would only take resources from it."""
        adopted = []
        for name in sorted({key[0] for key in keys} & set(self.spares)):
            dead = sum(1 for key in keys if key[0] == name)
            if dead > len(self.spares[name].ready()) and self.processes[name].resource_pool.unplaced():
                logger.warning("%s lost %d rank(s) with a placement group that waits to be placed again, and "
                               "has fewer warm spares ready: they wait for the placement group", name, dead)
                keys = [key for key in keys if key[0] != name]
        for key in keys:
            info = self.spares[key[0]].adopt(key[1]) if key[0] in self.spares else None
            if info is not None:
                self.worker_info[key] = info  # its pid from now on (a later probe must not find it gone)
                adopted.append(key)
        if adopted:  # health calls in flight to the replaced processes must not be judged
            for g in list(self.torch_groups) + list(self.groups.values()):
                g.forget_liveness()
        return adopted

    def spares_ready(self) -> bool:
        """Whether every warm spare of the pool is ready now (true without spares)."""
        return all(len(pool.ready()) == len(pool) for pool in self.spares.values())

    def wait_alive(self, group: str, timeout_s: float) -> list[WorkerInfo]:
        """Wait for every rank of ``group`` to answer; between tries, end the wait when asked to
        stop (:attr:`interrupt`) and give way to ranks whose node was lost (:mod:`.unplaced`)."""
        g = self.processes[group]

        def between_tries() -> None:
            self.interrupt()
            yield_to_unplaced(list(self.processes.values()), self.spares, self.worker_info, self.process_roles)

        return group_spares.reidentify(g, health.wait_alive(g, timeout_s, while_waiting=between_tries))

    def locate(self, name: str | None) -> tuple[str | None, str | None]:
        """(process group, role) of the worker group ``name``; a colocated role's group is
        ``<parent>:<role>``; a process group's own name gives its first role."""
        for role, g in self.groups.items():
            if g.name_prefix == name:
                return self.process_of[role], role
        if name in self.processes:
            return name, self.process_roles[name][0]
        return None, None

    def roles_of(self, group: str) -> tuple[str, ...]:
        return self.process_roles[group]

    def role_processes(self) -> dict[tuple[str, int], tuple[int, str | None]]:
        known = self.known_workers
        return {(role, rank): known[(self.process_of[role], rank)]
                for role, g in self.groups.items() for rank in range(g.world_size)}

    def poll_device_reports(self, poller) -> bool:
        return poller.poll(list(self.processes.values()))

    def checkpoint_groups(self) -> list[tuple[str, RayWorkerGroup]]:
        return [(r, self.groups[r]) for r in STATEFUL_ROLES if r in self.groups]

    def rendezvous(self, groups: list[str] | None = None) -> None:
        """Join the process groups named in ``groups`` (every one when None) with a new generation
        (also after a failure); the weight channel too when actor or rollout is among them."""
        self.generation += 1
        rc = self.cfg.recovery
        for g in self.torch_groups:
            if groups is not None and g.name_prefix not in groups:
                continue
            g.init_process_group(self.generation, backend=self.backend, timeout_s=rc.rendezvous_timeout_s,
                                 collective_timeout_s=rc.collective_timeout_s)
        if self.weight_channel and (groups is None or {self.process_of[r] for r in ("actor", "rollout")} & set(groups)):
            actor, rollout = self.groups["actor"], self.groups["rollout"]
            addr, port = actor.get([actor.workers[0].get_master_addr_port.remote()], timeout_s=rc.rendezvous_timeout_s)[0]
            args = (self.generation, addr, port, rollout.world_size + 1, self.backend, rc.collective_timeout_s)
            wait_s = rc.rendezvous_timeout_s + 5.0
            calls = [GroupCall(g, g.execute_all_async("join_weight_channel", *args), timeout_s=wait_s)
                     for g in (actor, rollout)]
            try:
                results_together(calls)  # a peer dead on either side ends the wait at once
            except BaseException:  # the ranks still waiting for a failed peer give up at once
                for g in (actor, rollout):
                    g.call_off_rendezvous(self.generation)
                raise
            self.weights_layout = None  # asked again of the actor at the next sync

    def init_models(self, groups: list[str] | None = None, empty: bool = False) -> None:
        roles = [role for role in ("actor", "ref", "rollout", "critic") if role in self.groups
                 and (groups is None or self.process_of[role] in groups)]
        # Every old engine of a process is dropped before the cycle collector runs, once per process.
        last = {self.process_of[role]: role for role in roles}
        for role in roles:
            self.groups[role].drop_engine(last[self.process_of[role]] == role)
        for role in roles:
            # The rollout is always built empty: a weight sync follows every (re)build.
            self.groups[role].init_model(True if role == "rollout" else empty)

    def shutdown(self) -> None:
        """Kill every actor of the run and remove its placement groups."""
        for spares in self.spares.values():
            spares.shutdown()
        self.spares = {}
        seen = set()
        for g in list(self.torch_groups) + list(self.groups.values()):
            if id(g.workers) in seen:
                continue
            seen.add(id(g.workers))
            g.shutdown()
        self.torch_groups, self.groups, self.processes = [], {}, {}

    # ------------------------------------------------------------------ one step
    def generate(self, prompts: DataProto) -> DataProto:
        return self.groups["rollout"].generate_sequences(prompts)

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        return self.groups["ref"].compute_ref_log_prob(data)

    def compute_log_prob(self, data: DataProto) -> DataProto:
        return self.groups["actor"].compute_log_prob(data)

    def compute_values(self, data: DataProto) -> DataProto:
        return self.groups["critic"].compute_values(data)

    def update_critic(self, data: DataProto) -> list[dict]:
        return self.groups["critic"].update_critic(data)

    def update_actor(self, data: DataProto) -> list[dict]:
        return self.groups["actor"].update_actor(data)

    def concurrently(self, calls: list[tuple[str, DataProto]]):
        """Every call dispatched now (its data serialized as it is at this point), results collected
        in order when iterated."""
        return results_in_order([self.groups[step_role(method)].submit(method, data) for method, data in calls])

    def sync_weights(self, version: int) -> dict[str, float]:
        """Give the rollout the actor's weights as ``version``; returns the bytes moved and, where the
        workers time it, the seconds they spent (the slowest rank)."""
        actor, rollout = self.groups["actor"], self.groups["rollout"]
        stats: list = []
        if self.colocated:
            # One process per rank runs both, in order: the check is queued behind the write.
            calls = (actor.submit("export_weights", version, True), rollout.submit("update_weights", None, version))
            stats, versions = results_in_order(calls)
        elif self.weight_channel:
            if self.weights_layout is None:
                self.weights_layout = actor.get(actor.execute_all_async("weights_layout"))[0]
            stats, versions = results_together((  # a rank dead on either side ends the wait at once
                GroupCall(actor, actor.execute_all_async("send_weights", version)),
                GroupCall(rollout, rollout.execute_all_async("receive_weights", version, self.weights_layout))))
        else:
            states = actor.export_weights(version, False)
            versions = rollout.update_weights(ray.put(states[0]), version)
        if set(versions) != {version}:
            raise WorkerError(f"weight sync: rollout ranks report versions {versions}, expected {version}",
                              role="rollout", cause="stale_weights")
        if not stats:
            return {}
        return {"perf/weight_sync_bytes": float(stats[0][0]),
                "perf/weight_sync_worker_s": max(float(s[1]) for s in stats)}

