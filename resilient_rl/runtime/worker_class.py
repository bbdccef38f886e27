"""Worker classes as a worker group starts them: ranked remote classes, ``RayClassWithInitArgs``
and colocated classes.

A rank's process is an actor of a *ranked* subclass of the user's worker class, whose constructor
exports the rank's identity (``RANK``, ``WORLD_SIZE``, ...) before the worker's own ``__init__``
runs, and which can take another rank's identity later (a warm spare taking a dead rank's place,
with the rank's GPUs: :mod:`resilient_rl.runtime.devices`). A colocated class hosts several
roles in one process, each role's methods named ``{role}_{method}``.
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from typing import Any

import ray

from resilient_rl.runtime.devices import see_ray_gpus_only, take_devices
from resilient_rl.runtime.rank_host import RankHost
from resilient_rl.runtime.dispatch import MAGIC_ATTR, registered_methods
from resilient_rl.runtime.health import HEALTH_GROUPS
from resilient_rl.runtime import master_env
from resilient_rl.runtime.verl_worker import Worker
from resilient_rl.protocol.utils import tensordict_class
from resilient_rl.runtime.worker import RankWorker, _node_ip, export_identity, warm_in_background, warm_worker_imports
from resilient_rl.runtime.worker_logging import forward_package_logs
from resilient_rl.errors import DispatchError

logger = logging.getLogger(__name__)


def _actor_class(ray_cls) -> type:
    """The plain Python class behind a ``@ray.remote`` class (or the class itself)."""
    return getattr(ray_cls, "__ray_actor_class__", ray_cls)


# One ranked remote class per remote class, so that Ray exports each class definition once per job
# however many groups are built from it.
_RANKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ranked_remote_class(ray_cls):
    """A remote subclass of ``ray_cls``'s class whose constructor takes a rank's identity first.

    The identity is exported to the process environment before the worker's ``__init__`` runs, so
    the worker reads ``RANK``/``WORLD_SIZE`` as usual, also when Ray restarts the actor (it replays
    the constructor with the same arguments). The options of the user's ``@ray.remote(...)``
    (concurrency groups among them, which ``.options()`` cannot set) carry over. The subclass gets
    its own qualified name: Ray keys class definitions by module and qualified name, and the plain
    class may be started as an actor too.
    """
    ranked = _RANKED.get(ray_cls)
    if ranked is None:
        user_cls = _actor_class(ray_cls)

        class Ranked(user_cls):  # type: ignore[valid-type, misc]
            def __init__(self, identity: dict[str, str], *args, **kwargs) -> None:
                see_ray_gpus_only()  # before anything can start CUDA in the process
                forward_package_logs()  # the rank's INFO records reach the driver's train.log
                self._rrl_init_args = (args, kwargs)
                self._rrl_become(identity)
                # The first batch's import (tensordict, and with it torch's compiler stack) runs
                # in the background from the start, so that it overlaps the controller's
                # rendezvous and no call of the worker holds the interpreter through it.
                warm_in_background(tensordict_class, "warm-imports")
                super().__init__(*args, **kwargs)
                warm_worker_imports(self)

            def _rrl_become(self, identity: dict[str, str]) -> None:
                # The env:// contract (MASTER_ADDR/PORT among it) is in place before the
                # worker's __init__, which need not call Worker.__init__ itself.
                export_identity(master_env.resolve(identity, _node_ip()))
                self.__dict__.pop("_rrl_identity", None)  # read again at first use
                # A spare's constructor ran once under a spare's identity: what it registered
                # per mesh is registered again by the constructor run for the rank.
                self.__dict__.pop("_rrl_mesh", None)

            def adopt_identity(self, identity: dict[str, str], devices: str | None = None,
                               node_id: str | None = None):
                """Become the rank ``identity`` names (a warm spare taking a dead rank's place):
                take the rank's GPUs (``devices``, its ``CUDA_VISIBLE_DEVICES`` on node
                ``node_id``; :func:`~resilient_rl.runtime.devices.take_devices` raises
                DevicesUnavailable, changing nothing, where this process cannot), export the
                identity and run the worker's constructor again under it. A spare never served a
                rank before (it is a fresh process), so nothing of an earlier rank is left.
                Logs how long each part took (a recovery's hand-over waits for all of them)."""
                start = time.perf_counter()
                take_devices(devices, node_id, self.identity.node_id, int(identity.get("LOCAL_RANK", 0)))
                took = time.perf_counter()
                args, kwargs = self._rrl_init_args
                self._rrl_become(identity)
                user_cls.__init__(self, *args, **kwargs)
                built = time.perf_counter()
                info = self.ping()
                done = time.perf_counter()
                logger.info("rank %s: a warm spare took its place in %.2f s (the rank's devices %.2f s, the worker's "
                            "constructor %.2f s, its first health reply %.2f s)", identity.get("RANK"),
                            done - start, took - start, built - took, done - built)
                return info

        Ranked.__name__ = user_cls.__name__
        Ranked.__qualname__ = f"Ranked({user_cls.__qualname__})"
        Ranked.__module__ = user_cls.__module__
        Ranked.__doc__ = user_cls.__doc__
        defaults = dict(getattr(ray_cls, "_default_options", None) or {})
        ranked = ray.remote(**defaults)(Ranked) if defaults else ray.remote(Ranked)
        _RANKED[ray_cls] = ranked
    return ranked


def task_event_options(ray_cls) -> dict[str, Any]:
    """The Ray option a worker group adds for ``ray_cls``'s actors: no Ray task events, unless the
    class's own ``@ray.remote(enable_task_events=...)`` says (it carries over to its ranks).

    The controller calls its ranks many times a step (the dispatched methods, health polls,
    snapshots, a spare's pings), and Ray's GCS keeps a record of every call, up to
    ``RAY_task_events_max_num_task_in_gcs`` (100,000 by default, some 300 MB of GCS memory over a
    long run), that nothing reads: the run's own events and metrics say what happened. Set per
    actor, it quiets every call on the actor's handles, whoever makes it, and its creation task's
    record with them; the GCS's actor table still holds the actor (``ray list actors``). A user who
    wants the records back (to debug in Ray's dashboard) asks for them on the class or in the
    group's ``actor_options``.
    """
    if "enable_task_events" in (getattr(ray_cls, "_default_options", None) or {}):
        return {}
    return {"enable_task_events": False}


class RayClassWithInitArgs:
    """A ``@ray.remote`` worker class with the arguments of its constructor."""

    def __init__(self, cls, *args, **kwargs) -> None:
        if not issubclass(_actor_class(cls), RankWorker):
            raise DispatchError(f"{_actor_class(cls).__name__} must subclass resilient_rl.Worker")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self._options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Extra Ray actor options (merged over the worker group's)."""
        self._options.update(options)

    def __call__(self, options: dict[str, Any], identity: dict[str, str] | None = None):
        """Start one actor with ``options``; ``identity`` (RANK, WORLD_SIZE, ...) is exported in its
        process before the worker is constructed."""
        if identity is None:
            return self.cls.options(**{**options, **self._options}).remote(*self.args, **self.kwargs)
        ranked = _ranked_remote_class(self.cls)
        return ranked.options(**{**options, **self._options}).remote(identity, *self.args, **self.kwargs)


def _forwarder(role: str, name: str, settings: dict, role_cls: type):
    """The colocated class's ``{role}_{name}``: calls ``name`` on the process's ``role`` worker."""
    target = getattr(role_cls, name)
    if inspect.iscoroutinefunction(target):
        async def method(self, *args, **kwargs):
            return await getattr(self.worker_dict[role], name)(*args, **kwargs)
    else:
        def method(self, *args, **kwargs):
            return getattr(self.worker_dict[role], name)(*args, **kwargs)
    setattr(method, MAGIC_ATTR, settings)
    method.__name__ = f"{role}_{name}"
    # The role method's Ray options (a thread of its own, several return values) are the forwarder's.
    for option in ("__ray_concurrency_group__", "__ray_num_returns__"):
        value = getattr(target, option, None)
        if value is not None:
            setattr(method, option, value)
    return method


def _colocated_base(class_dict: dict[str, RayClassWithInitArgs]) -> type:
    """A Worker class building every role of ``class_dict`` in its constructor, with forwarders."""
    role_classes = {role: _actor_class(c.cls) for role, c in class_dict.items()}
    init_args = {role: (c.args, c.kwargs) for role, c in class_dict.items()}

    class Colocated(Worker):
        _rrl_role_classes = role_classes
        raw_cls_dict = role_classes  # verl's name
        is_fused_worker = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.worker_dict = {role: cls(*init_args[role][0], **init_args[role][1])
                                for role, cls in role_classes.items()}
            host = RankHost()  # the roles find each other through it (snapshots, engine collection)
            for role, worker in self.worker_dict.items():
                host.add(role, worker)
            # verl's fused-worker view: each role by name, and every role knows the others.
            self.fused_worker_dict = self.worker_dict
            for role, worker in self.worker_dict.items():
                setattr(self, role, worker)
                worker.fused_worker_dict = self.worker_dict

        def warm_imports(self) -> None:
            """Every hosted role's (:meth:`~resilient_rl.runtime.worker.RankWorker.warm_imports`)."""
            for worker in self.worker_dict.values():
                getattr(worker, "warm_imports", lambda: None)()

        def call_part(self, path: str, *args, **kwargs):
            """A part method of a hosted role (``"{role}.{part}.{method}"``), else of this worker."""
            role, _, rest = path.partition(".")
            if role in self.worker_dict:
                return self.worker_dict[role].call_part(rest, *args, **kwargs)
            return RankWorker.call_part(self, path, *args, **kwargs)

        def _fuw_execute(self, method_name: str, *args, **kwargs):
            """Call ``{role}_fwmn_{method}`` (verl's fused-worker call convention)."""
            role, _, name = method_name.partition("_fwmn_")
            if role not in self.worker_dict:
                raise DispatchError(f"calling {role}'s {name}, but {role} is not a colocated role")
            return getattr(self.worker_dict[role], name)(*args, **kwargs)

    for role, cls in role_classes.items():
        for name, settings in registered_methods(cls).items():
            setattr(Colocated, f"{role}_{name}", _forwarder(role, name, settings, cls))
    return Colocated


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """A worker class hosting every role of ``class_dict`` in one process; methods are named ``{role}_{method}``."""
    base = _colocated_base(class_dict)

    class WorkerDict(base):
        answers_during_calls = True

        @ray.method(concurrency_group="health")
        def health(self):
            return self.ping()

        @ray.method(concurrency_group="health")
        def call_off_rendezvous(self, generation: int) -> None:
            Worker.call_off_rendezvous(self, generation)

        @ray.method(concurrency_group="health")
        def leave_collectives(self, reason: str = "") -> int:
            return Worker.leave_collectives(self, reason)

    WorkerDict.__name__ = "WorkerDict_" + "_".join(class_dict)
    WorkerDict.__qualname__ = WorkerDict.__name__
    return RayClassWithInitArgs(ray.remote(concurrency_groups=HEALTH_GROUPS)(WorkerDict))


def create_colocated_worker_raw_cls(class_dict: dict[str, RayClassWithInitArgs]) -> type:
    """verl's fused-worker base class: a plain (not yet ``@ray.remote``) Worker class hosting every
    role of ``class_dict``, each reachable as ``self.<role>``. A subclass adds its own registered
    methods (calling across roles) and is decorated with ``@ray.remote``; its group's
    :meth:`~resilient_rl.RayWorkerGroup.fuse` then gives one group per role (``wg.<role>.method``)."""
    cls = _colocated_base(class_dict)
    cls.__name__ = cls.__qualname__ = "FusedWorker_" + "_".join(class_dict)
    return cls


def create_colocated_worker_cls_fused(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """verl's fused colocated class, ready to start: ``spawn`` or ``fuse`` its group for the roles."""
    cls_with_init = create_colocated_worker_cls(class_dict)
    cls_with_init.fused_worker_used = True
    return cls_with_init
