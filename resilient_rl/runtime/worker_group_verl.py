"""verl's worker-group surface beyond dispatching calls: its constructor options, attaching to
detached workers (``from_detached``) and fused colocated groups (``fuse``).

:class:`VerlGroupMixin` is a base of :class:`~resilient_rl.runtime.worker_group.RayWorkerGroup`.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from resilient_rl.errors import DispatchError

logger = logging.getLogger("resilient_rl.runtime.worker_group")

#: The environment variables the group sets for every rank itself: worker_env may not override them.
RESERVED_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RAY_LOCAL_RANK",
                          "RAY_LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RRL_WORKER_GROUP",
                          "RRL_MASTER_KEY", "RRL_MASTER_PUBLISH"})

#: verl constructor options accepted where their value changes nothing here: {name: allowed values}.
_NEUTRAL_OPTIONS: dict[str, tuple] = {
    # Ranks are always packed node by node, bundle by bundle (verl's bin_pack=True).
    "bin_pack": (True,),
    # Devices follow the pool's use_gpu; a name is only checked against the machine.
    "device_name": (None, "cuda", "cpu", "npu"),
    # There is no register center to wait for: ranks start in parallel.
    "ray_wait_register_center_timeout": None,
    # Profiling hooks are not implemented: only their "off" values are accepted.
    "profile_steps": (None,),
    "worker_nsight_options": (None,),
}


def check_verl_options(options: dict[str, Any]) -> None:
    """Refuse options this worker group does not know, or whose value it cannot honour."""
    unknown = sorted(set(options) - set(_NEUTRAL_OPTIONS))
    if unknown:
        raise TypeError(f"RayWorkerGroup got unknown keyword argument(s) {unknown}; verl options accepted: "
                        f"{sorted(_NEUTRAL_OPTIONS)} plus worker_env, worker_names, worker_handles")
    for name, value in options.items():
        allowed = _NEUTRAL_OPTIONS[name]
        if allowed is not None and value not in allowed:
            raise DispatchError(f"RayWorkerGroup({name}={value!r}) is not supported; accepted: {list(allowed)}")


class VerlGroupMixin:
    """verl's group helpers that are not about dispatching a call."""

    @staticmethod
    def _checked_worker_env(worker_env: dict[str, str] | None) -> dict[str, str]:
        env = dict(worker_env or {})
        clash = sorted(set(env) & RESERVED_ENV)
        if clash:
            raise DispatchError(f"worker_env may not set {clash}: the worker group sets them for every rank")
        bad = sorted(k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str))
        if bad:
            raise DispatchError(f"worker_env keys and values must be strings; check {bad}")
        return env

    def _attach(self, worker_names: list[str] | None, worker_handles: list | None) -> None:
        """Drive existing actors (by handle, or looked up by name) as this group's ranks."""
        if worker_handles is None:
            handles = []
            for name in worker_names or []:
                try:
                    handles.append(ray.get_actor(name))
                except ValueError as exc:
                    raise DispatchError(f"no worker named {name!r} to attach to: {exc}") from None
            worker_handles = handles
        if worker_names is None:
            worker_names = [f"{self.name_prefix}_{i}" for i in range(len(worker_handles))]
        if len(worker_names) != len(worker_handles):
            raise DispatchError(f"{len(worker_names)} worker_names for {len(worker_handles)} worker_handles")
        self._workers, self._worker_names = list(worker_handles), list(worker_names)
        self._bundle_workers = list(self._workers)
        self._placements = [(None, None)] * len(self._workers)

    @classmethod
    def from_detached(cls, name_prefix: str | None = None, worker_names: list[str] | None = None,
                      worker_handles: list | None = None, ray_cls_with_init=None, **kwargs):
        """A group driving workers that already run (a detached group started by another driver,
        found by its actor names, or handles), with the registered methods of ``ray_cls_with_init``."""
        if worker_names is None and worker_handles is None:
            raise DispatchError("from_detached needs worker_names or worker_handles")
        return cls(resource_pool=None, ray_cls_with_init=ray_cls_with_init, name_prefix=name_prefix,
                   worker_names=worker_names, worker_handles=worker_handles, **kwargs)

    def fuse(self, prefix_set) -> None:
        """Make each colocated role's group an attribute of this group (``wg.actor.add(...)``),
        beside the methods of the fused class itself (verl)."""
        if self.wg_dict is None:
            self.wg_dict = self.spawn(prefix_set)
        for role, group in self.wg_dict.items():
            if hasattr(type(self), role):
                raise DispatchError(f"colocated role {role!r} clashes with a RayWorkerGroup attribute; rename it")
            setattr(self, role, group)
