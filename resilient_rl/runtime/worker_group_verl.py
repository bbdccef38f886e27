"""verl's worker-group constructor surface: its options, ``worker_env``, and the ranks of a group
attached to detached workers (``RayWorkerGroup.from_detached``)."""

from __future__ import annotations

from typing import Any

import ray

from resilient_rl.errors import DispatchError
from resilient_rl.runtime.group_ranks import RankTable

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


def checked_worker_env(worker_env: dict[str, str] | None) -> dict[str, str]:
    """verl's ``worker_env``: extra environment variables of every rank, refused where they would
    override a rank's identity or are not strings."""
    env = dict(worker_env or {})
    clash = sorted(set(env) & RESERVED_ENV)
    if clash:
        raise DispatchError(f"worker_env may not set {clash}: the worker group sets them for every rank")
    bad = sorted(k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str))
    if bad:
        raise DispatchError(f"worker_env keys and values must be strings; check {bad}")
    return env


def attached_ranks(name_prefix: str, worker_names: list[str] | None, worker_handles: list | None) -> RankTable:
    """The ranks of a group that drives existing actors (verl's ``from_detached``): by handle, or
    looked up by name."""
    if worker_handles is None:
        handles = []
        for name in worker_names or []:
            try:
                handles.append(ray.get_actor(name))
            except ValueError as exc:
                raise DispatchError(f"no worker named {name!r} to attach to: {exc}") from None
        worker_handles = handles
    if worker_names is None:
        worker_names = [f"{name_prefix}_{i}" for i in range(len(worker_handles))]
    if len(worker_names) != len(worker_handles):
        raise DispatchError(f"{len(worker_names)} worker_names for {len(worker_handles)} worker_handles")
    return RankTable.of(list(worker_handles), list(worker_names))
