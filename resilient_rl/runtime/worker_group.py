"""``RayWorkerGroup``: the ranks of a worker class, driven as one object by the controller.

A worker group starts one Ray actor per bundle of a :class:`RayResourcePool`, all at once, and
binds every ``@register``-ed method of the worker class onto itself: calling ``wg.method(x)``
dispatches ``x`` over the ranks, runs the method on them and collects the results.

Every wait on the workers watches the ranks' liveness (a rank that stops answering its health call
or stops advancing for ``hang_timeout_s`` is hung, see :mod:`resilient_rl.runtime.liveness`)
under a generous ceiling (``call_timeout_s``), and errors crossing the Ray
boundary are classified into :class:`WorkerDiedError`, :class:`WorkerTimeoutError`,
:class:`CollectiveError` or :class:`WorkerError`, each naming the group and the rank.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from resilient_rl.runtime.health import HEALTH_GROUPS, answers_during_calls, classify_error  # noqa: F401
from resilient_rl.runtime import master_env, parts
from resilient_rl.runtime.dispatch import Dispatch, Execute, PAD_SIZE_KEY, registered_methods, resolve_dispatch
from resilient_rl.runtime.group_call import GroupCall
from resilient_rl.runtime.group_ranks import RankTable
from resilient_rl.runtime.group_wait import AbandonedCalls, Waited, wait_calls
from resilient_rl.runtime.worker_group_verl import attached_ranks, check_verl_options, checked_worker_env
from resilient_rl.runtime.liveness import LivenessWatch
from resilient_rl.runtime.resource_pool import RayResourcePool
from resilient_rl.runtime.worker_class import (RayClassWithInitArgs, _actor_class,  # noqa: F401
                                                 create_colocated_worker_cls, task_event_options)
from resilient_rl.errors import DispatchError

logger = logging.getLogger(__name__)

#: Dispatch modes that hand out one entry per rank (rank-zero execution takes entry 0).
_PER_RANK_MODES = (Dispatch.ONE_TO_ALL, Dispatch.DP_COMPUTE, Dispatch.DP_COMPUTE_PROTO,
                   Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, Dispatch.DP_COMPUTE_METRIC)


#: Group helpers a worker's registered method of the same name replaces on that group (the group's
#: own code calls the other name: ``wait_refs``).
_USER_MAY_SHADOW = frozenset({"get"})


class RayWorkerGroup:
    """One Ray actor per bundle of ``resource_pool``, driven as one object by the controller.

    Its ranks' processes are ``ranks`` (:class:`~resilient_rl.runtime.group_ranks.RankTable`);
    probing and killing them is :mod:`resilient_rl.runtime.health`'s, warm spares taking their
    places :mod:`resilient_rl.runtime.worker_group_spares`'.

    verl's keyword arguments are accepted: ``worker_env`` (extra environment variables of every
    rank; the rank's own identity keys may not be overridden), ``worker_names``/``worker_handles``
    (see :meth:`from_detached`), and ``bin_pack``, ``device_name``, ``ray_wait_register_center_timeout``,
    ``profile_steps``, ``worker_nsight_options`` where their value changes nothing here (see
    :func:`~resilient_rl.runtime.worker_group_verl.check_verl_options`); any other is a TypeError.
    """

    def __init__(self, resource_pool: RayResourcePool | None = None,
                 ray_cls_with_init: RayClassWithInitArgs | None = None, name_prefix: str | None = None, *,
                 max_restarts: int = 0, max_task_retries: int = 0, runtime_env: dict | None = None,
                 call_timeout_s: float | None = 3600.0, actor_options: dict | None = None, detached: bool = False,
                 hang_timeout_s: float | None = 300.0, health_timeout_s: float = 2.0, warmup_timeout_s: float = 60.0,
                 worker_env: dict[str, str] | None = None, worker_names: list[str] | None = None,
                 worker_handles: list | None = None, **verl_options) -> None:
        check_verl_options(verl_options)
        self.ranks = RankTable()
        #: What every process of the group asks of Ray, wherever it is placed (warm spares too).
        self.actor_options: dict[str, Any] = {}
        self.resource_pool = resource_pool
        self.ray_cls_with_init = ray_cls_with_init
        self.call_timeout_s = call_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.health_timeout_s = health_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self._watch: LivenessWatch | None = None
        #: Calls of the group nobody waits for any more (a wait failed fast), read once they end.
        self.abandoned = AbandonedCalls()
        self.name_prefix = name_prefix or (resource_pool.next_group_prefix() if resource_pool else "rrl")
        self.max_restarts = max_restarts
        self.max_task_retries = max_task_retries
        self._remote_prefix = ""
        #: remote name of each part method -> (its call_part path, Ray options): runtime/parts.py
        self._part_routes: dict[str, tuple[str, dict]] = {}
        self._dispatch_info: dict[str, list] = {}  # verl's nd dispatch: rank -> dp rank, per mesh
        self._collect_info: dict[str, list] = {}
        self.wg_dict: dict[str, RayWorkerGroup] | None = None
        self._master_key = f"{self.name_prefix}:{uuid.uuid4().hex[:12]}"
        if worker_names is not None or worker_handles is not None:
            self.ranks = attached_ranks(self.name_prefix, worker_names, worker_handles)  # from_detached
            if ray_cls_with_init is not None:
                _bind_worker_methods(self, _actor_class(ray_cls_with_init.cls))
            return
        if resource_pool is None or ray_cls_with_init is None:
            return  # an empty shell filled by spawn()
        self._start(resource_pool, ray_cls_with_init, runtime_env or {}, actor_options or {}, detached,
                    checked_worker_env(worker_env))
        _bind_worker_methods(self, _actor_class(ray_cls_with_init.cls))

    # ------------------------------------------------------------------ construction
    def _start(self, pool: RayResourcePool, cls_with_init: RayClassWithInitArgs, runtime_env: dict,
               actor_options: dict, detached: bool, worker_env: dict[str, str]) -> None:
        slots = pool.bundle_slots()
        world_size = len(slots)
        self.actor_options = {"num_cpus": pool.cpus_per_bundle / pool.max_colocate_count,
                              "max_restarts": self.max_restarts, "max_task_retries": self.max_task_retries,
                              **task_event_options(cls_with_init.cls), **actor_options}
        if runtime_env:  # the user's, shared by every rank; the rank's identity does not go here
            self.actor_options["runtime_env"] = runtime_env
        if pool.use_gpu:
            self.actor_options["num_gpus"] = 1 / pool.max_colocate_count
        if detached:
            self.actor_options["lifetime"] = "detached"
        handles, names, identities = [], [], []
        for rank, (pg, bundle_idx, local_rank, local_world_size) in enumerate(slots):
            # verl's env:// contract; rank 0 publishes MASTER_ADDR/PORT for the others (master_env).
            identity = {**worker_env, "RANK": str(rank), "WORLD_SIZE": str(world_size),
                        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
                        "RAY_LOCAL_RANK": str(local_rank), "RAY_LOCAL_WORLD_SIZE": str(local_world_size),
                        "RRL_WORKER_GROUP": self.name_prefix, master_env.KEY: self._master_key}
            if rank == 0:
                identity[master_env.PUBLISH] = "1"
            name = f"{self.name_prefix}_{rank}"
            options = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_idx), "name": name, **self.actor_options}
            identities.append(identity)
            handles.append(cls_with_init(options, identity))
            names.append(name)
        self.ranks = RankTable.of(handles, names, identities)
        # Constructors run in parallel; wait for all of them (a failing constructor names its rank).
        self.ranks.note_placements(self.wait_refs([w.ping.remote() for w in handles],
                                                  timeout_s=max(self.call_timeout_s or 0, 300.0), liveness=False))

    def submit(self, method_name: str, *args, **kwargs) -> GroupCall:
        """Dispatch a registered method's call to the ranks without waiting: its :class:`GroupCall`,
        whose ``result()`` is what ``group.method_name(*args, **kwargs)`` returns."""
        method = getattr(self, method_name, None)
        settings = getattr(method, "settings", None)
        if settings is None:
            raise DispatchError(f"worker group {self.name_prefix!r} has no registered method {method_name!r}")
        return self._submit(self._remote_prefix + method_name, settings, *args, **kwargs)

    def _submit(self, remote_name: str, settings: dict, *args, **kwargs) -> GroupCall:
        fns = resolve_dispatch(settings["dispatch_mode"])
        collect = fns["collect_fn"]
        args, kwargs = fns["dispatch_fn"](self, *args, **kwargs)
        pad_size = kwargs.pop(PAD_SIZE_KEY, 0)
        if settings["execute_mode"] is Execute.RANK_ZERO:
            # Like verl: rank zero's single result is what the collect function sees. These
            # built-in modes hand out one entry per rank; rank-zero execution takes entry 0.
            if settings["dispatch_mode"] in _PER_RANK_MODES:
                args, kwargs = tuple(a[0] for a in args), {k: v[0] for k, v in kwargs.items()}
            return GroupCall(self, [self._call(0, remote_name, *args, **kwargs)], collect, rank_zero=True)
        return GroupCall(self, self.execute_all_async(remote_name, *args, **kwargs), collect, pad_size)

    # ------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        return len(self.ranks.handles)

    @property
    def workers(self) -> list:
        return self.ranks.handles

    @property
    def worker_names(self) -> list[str]:
        return self.ranks.names

    # ------------------------------------------------------------------ execution
    def _call(self, rank: int, method_name: str, *args, **kwargs):
        route = self._part_routes.get(method_name)
        if route is not None:  # a part's method, through the worker's generic endpoint
            path, options = route
            method = self.ranks.handles[rank].call_part
            return (method.options(**options) if options else method).remote(path, *args, **kwargs)
        try:
            method = getattr(self.ranks.handles[rank], method_name)
        except AttributeError:
            raise DispatchError(f"worker group {self.name_prefix!r} has no method {method_name!r}") from None
        return method.remote(*args, **kwargs)

    def execute_all_async(self, method_name: str, *args, **kwargs) -> list:
        """Call ``method_name`` on every rank; if every argument is a list of length world_size, rank i gets item i."""
        n = self.world_size
        values = list(args) + list(kwargs.values())
        if values and all(isinstance(v, (list, tuple)) and len(v) == n for v in values):
            return [self._call(i, method_name, *(a[i] for a in args), **{k: v[i] for k, v in kwargs.items()})
                    for i in range(n)]
        return [self._call(i, method_name, *args, **kwargs) for i in range(n)]

    def execute_rank_async(self, rank: int, method_name: str, *args, **kwargs):
        """Call the registered method ``method_name`` on one rank (for a colocated role, its
        process's ``{role}_{method}``); its ObjectRef, unwaited."""
        return self._call(rank, self._remote_prefix + method_name, *args, **kwargs)

    def execute_all_sync(self, method_name: str, *args, **kwargs) -> list:
        return self.wait_refs(self.execute_all_async(method_name, *args, **kwargs))

    execute_all = execute_all_async

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return self._call(0, method_name, *args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args, **kwargs):
        return self.wait_refs([self.execute_rank_zero_async(method_name, *args, **kwargs)])[0]

    execute_rank_zero = execute_rank_zero_async

    def wait_refs(self, refs: list, timeout_s: float | None = None, liveness: bool = True) -> list:
        """Results of ``refs`` (one per rank, in rank order), failing fast on the first error.

        While results are pending, the ranks still running are watched for liveness (when the
        group has ``hang_timeout_s`` and a health concurrency group): WorkerTimeoutError with cause
        "hang" names a rank that stopped answering or stopped advancing. ``timeout_s`` (default
        ``call_timeout_s``) is only a ceiling on the whole wait: WorkerTimeoutError with cause
        "timeout" names the ranks still running when it passes. The calls a failed wait leaves
        running go to :attr:`abandoned`, read once they end (:mod:`resilient_rl.runtime.group_wait`).
        """
        return wait_calls([self.waited(refs, liveness)], self.call_timeout_s if timeout_s is None else timeout_s)[0]

    #: The name callers used before ``wait_refs``; a worker's registered ``get`` replaces it on its group.
    get = wait_refs

    def waited(self, refs: list, liveness: bool = True) -> Waited:
        """``refs`` (one per rank) as one call of a wait (:func:`~resilient_rl.runtime.group_wait.wait_calls`:
        this group's alone, or several groups' at once), its ranks watched for liveness, the refs a
        failed wait leaves unread abandoned to the group."""
        self.abandoned.read()
        return Waited(refs, self.name_prefix, self._liveness_watch(len(refs)) if liveness else None, self.abandoned)

    def _liveness_watch(self, n_refs: int) -> LivenessWatch | None:
        """The group's health poller, or None where liveness cannot be watched (no hang timeout, no
        health concurrency group: a health call would queue behind the call it should watch)."""
        if self.hang_timeout_s is None or n_refs > self.world_size or not answers_during_calls(self):
            return None
        if self._watch is None or self._watch.workers is not self.ranks.handles:
            self._watch = LivenessWatch(self.ranks.handles, self.hang_timeout_s, self.health_timeout_s,
                                        poll_interval_s=min(1.0, self.hang_timeout_s / 3),
                                        warmup_timeout_s=self.warmup_timeout_s, table=self.ranks)
        self._watch.fresh()
        return self._watch

    def forget_liveness(self) -> None:
        """Drop the health calls in flight and what they told (a rank's process was replaced)."""
        self._watch = None

    def ping(self, timeout_s: float | None = None) -> list:
        """Health of every rank (WorkerInfo), within a deadline."""
        return self.ranks.note_placements(self.wait_refs([w.ping.remote() for w in self.ranks.handles],
                                                         timeout_s=timeout_s, liveness=False))

    def init_process_group(self, generation: int, backend: str | None = None, timeout_s: float = 60.0,
                           collective_timeout_s: float | None = None) -> int:
        """Rendezvous every rank into a torch.distributed group of ``generation`` hosted on rank 0's node.

        ``timeout_s`` bounds the rendezvous; ``collective_timeout_s`` (default: the same) bounds
        every collective of the new group."""
        addr, port = self.wait_refs([self.ranks.handles[0].get_master_addr_port.remote()], timeout_s=timeout_s)[0]
        pg_timeout = collective_timeout_s or timeout_s
        refs = [w.rendezvous.remote(generation, addr, port, backend, pg_timeout) for w in self.ranks.handles]
        try:
            self.wait_refs(refs, timeout_s=timeout_s + 5.0)
        except BaseException:
            self.call_off_rendezvous(generation)
            raise
        return generation

    def call_off_rendezvous(self, generation: int) -> None:
        """Tell every rank to stop waiting in the rendezvous of ``generation`` (a rank failed in
        it), so that the next generation's does not queue behind it. Not waited for; only
        classes with a health thread can hear it during the call."""
        if not answers_during_calls(self):
            return
        for w in self.ranks.handles:
            try:
                w.call_off_rendezvous.remote(generation)
            except Exception:  # noqa: BLE001 -- a dead handle: nothing waits there
                pass

    # ------------------------------------------------------------------ colocated roles
    def spawn(self, prefix_set) -> dict[str, "RayWorkerGroup"]:
        """One worker group per role of a colocated class, all sharing this group's actors."""
        role_classes: dict[str, type] = getattr(_actor_class(self.ray_cls_with_init.cls), "_rrl_role_classes", {})
        groups = {}
        for prefix in prefix_set:
            if prefix not in role_classes:
                raise DispatchError(f"no colocated role {prefix!r}; roles: {sorted(role_classes)}")
            g = RayWorkerGroup(None, None, name_prefix=f"{self.name_prefix}:{prefix}", call_timeout_s=self.call_timeout_s,
                               hang_timeout_s=self.hang_timeout_s, health_timeout_s=self.health_timeout_s,
                               warmup_timeout_s=self.warmup_timeout_s)
            g.ranks = self.ranks.sharing()  # the same processes
            g.resource_pool, g.ray_cls_with_init = self.resource_pool, self.ray_cls_with_init
            _bind_worker_methods(g, role_classes[prefix], remote_prefix=f"{prefix}_")
            groups[prefix] = g
        return groups

    def fuse(self, prefix_set) -> None:
        """Make each colocated role's group an attribute of this group (``wg.actor.add(...)``),
        beside the methods of the fused class itself (verl)."""
        if self.wg_dict is None:
            self.wg_dict = self.spawn(prefix_set)
        for role, group in self.wg_dict.items():
            if hasattr(type(self), role):
                raise DispatchError(f"colocated role {role!r} clashes with a RayWorkerGroup attribute; rename it")
            setattr(self, role, group)

    @classmethod
    def from_detached(cls, name_prefix: str | None = None, worker_names: list[str] | None = None,
                      worker_handles: list | None = None, ray_cls_with_init=None, **kwargs) -> RayWorkerGroup:
        """A group driving workers that already run (a detached group started by another driver,
        found by its actor names, or handles), with the registered methods of ``ray_cls_with_init``."""
        if worker_names is None and worker_handles is None:
            raise DispatchError("from_detached needs worker_names or worker_handles")
        return cls(resource_pool=None, ray_cls_with_init=ray_cls_with_init, name_prefix=name_prefix,
                   worker_names=worker_names, worker_handles=worker_handles, **kwargs)

    # ------------------------------------------------------------------ teardown
    def shutdown(self, release_pool: bool = True) -> None:
        """Kill the group's actors (no restart) and release the pool's placement groups."""
        for w in self.ranks.handles:
            try:
                ray.kill(w, no_restart=True)
            except Exception as exc:  # already dead
                logger.debug("ray.kill failed: %s", exc)
        self.ranks = RankTable()
        master_env.forget(self._master_key)
        if release_pool and self.resource_pool is not None:
            self.resource_pool.release()


def _bind_worker_methods(group: RayWorkerGroup, user_cls: type, remote_prefix: str = "") -> None:
    """Make every ``@register``-ed method of ``user_cls`` a method of ``group`` that dispatches
    over its ranks (for a colocated role, the process's ``{role}_{method}``), and so every
    registered method of its parts (:mod:`resilient_rl.runtime.parts`)."""
    group._remote_prefix = remote_prefix
    methods = registered_methods(user_cls)
    hosted = {"": user_cls, **{f"{role}_": c for role, c in getattr(user_cls, "_rrl_role_classes", {}).items()}}
    for prefix, cls in hosted.items():  # the class's own parts, and a colocated class's roles' parts
        group._part_routes.update(parts.routes(cls, prefix + remote_prefix))
        methods.update({prefix + name: settings for name, (_, settings) in parts.part_methods(cls).items()})
    for name, settings in methods.items():
        if hasattr(RayWorkerGroup, name) and name not in _USER_MAY_SHADOW:
            raise DispatchError(f"registered method {user_cls.__name__}.{name} clashes with a RayWorkerGroup "
                                "attribute; rename it")
        setattr(group, name, _group_method(group, remote_prefix + name, settings))


def _group_method(group: RayWorkerGroup, remote_name: str, settings: dict) -> Callable:
    blocking: bool = settings["blocking"]

    def group_method(*args, **kwargs):
        call = group._submit(remote_name, settings, *args, **kwargs)
        if not blocking:  # like verl: the collect function of the ObjectRefs (a DataProtoFuture
            return call.future()  # for DataProto modes), rank zero's ref for rank-zero execution
        return call.result()

    group_method.__name__ = remote_name
    group_method.settings = settings
    return group_method
