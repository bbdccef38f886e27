"""A worker's parts: the collaborators whose registered methods are calls of the worker.

A role worker is composed, not stacked from mixins: its snapshots, its checkpointer, its weight
sender are objects of their own classes, each holding its own state and handed what it reads (the
rank's state registry, its place). A part's ``@register``-ed methods are calls of the worker as
the controller sees them: a worker group binds them like the worker's own (``group.save_checkpoint(...)``,
``group.execute_rank_async(r, "take_snapshot")``) and sends each through the worker's one generic
endpoint, :meth:`~resilient_rl.runtime.worker.RankWorker.call_part`, naming the part and the method,
with the Ray options the method declares (``@ray.method(concurrency_group=..., num_returns=...)``)
given per call. verl's fused worker routes ``{role}_fwmn_{method}`` to a hosted worker the same way.

A worker class declares its parts by attribute name (``parts = {"snapshots": RankSnapshots}``); the
worker builds each as that attribute. Only a registered method of a declared part can be called
so: :func:`call` refuses any other name.
"""

from __future__ import annotations

import functools
from typing import Any

from resilient_rl.errors import DispatchError
from resilient_rl.runtime.dispatch import registered_methods


@functools.cache
def _registered(part_cls: type) -> frozenset[str]:
    """The registered method names of a part class (looked up once per class, not at every call)."""
    return frozenset(registered_methods(part_cls))


def declared(worker_cls: type) -> dict[str, type]:
    """``worker_cls``'s parts: attribute name -> class."""
    return dict(getattr(worker_cls, "parts", None) or {})


def part_methods(worker_cls: type) -> dict[str, tuple[str, dict]]:
    """method name -> (part attribute, its ``@register`` settings), for every registered method of
    ``worker_cls``'s parts. A name may be registered once per worker: a clash with the worker's own
    registered methods or another part's is a DispatchError."""
    own = registered_methods(worker_cls)
    found: dict[str, tuple[str, dict]] = {}
    for attr, part_cls in declared(worker_cls).items():
        for name, settings in registered_methods(part_cls).items():
            clash = f"{worker_cls.__name__}'s own" if name in own else (
                f"its {found[name][0]} part's" if name in found else None)
            if clash is not None:
                raise DispatchError(f"{worker_cls.__name__}: the {attr} part's {name} clashes with {clash}; rename it")
            found[name] = (attr, settings)
    return found


def ray_options(worker_cls: type, attr: str, name: str) -> dict[str, Any]:
    """The Ray options ``name`` of the part ``attr`` declares with ``@ray.method``: its thread
    (concurrency group) and number of returns, given per call to the generic endpoint."""
    method = getattr(declared(worker_cls)[attr], name)
    options = {}
    group = getattr(method, "__ray_concurrency_group__", None)
    if group is not None:
        options["concurrency_group"] = group
    returns = getattr(method, "__ray_num_returns__", None)
    if returns is not None:
        options["num_returns"] = returns
    return options


def routes(worker_cls: type, remote_prefix: str = "") -> dict[str, tuple[str, dict]]:
    """The group's remote name of each part method of ``worker_cls`` -> (the path
    :meth:`Worker.call_part` takes, the call's Ray options). A colocated role's (``remote_prefix``
    ``"{role}_"``) path starts with the role, which the process's colocated worker resolves."""
    role = remote_prefix[:-1] + "." if remote_prefix else ""
    return {remote_prefix + name: (f"{role}{attr}.{name}", ray_options(worker_cls, attr, name))
            for name, (attr, _) in part_methods(worker_cls).items()}


def call(worker: Any, path: str, args: tuple, kwargs: dict) -> Any:
    """Run the part method ``path`` (``"part.method"``) of ``worker``: a registered method of a
    part its class declares, else a DispatchError naming what is missing."""
    attr, _, name = path.partition(".")
    parts = declared(type(worker))
    if attr not in parts:
        raise DispatchError(f"{type(worker).__name__} has no part {attr!r}; parts: {sorted(parts)}")
    if name not in _registered(parts[attr]):
        raise DispatchError(f"{type(worker).__name__}'s {attr} part has no registered method {name!r}")
    part = getattr(worker, attr, None)
    if not isinstance(part, parts[attr]):
        raise DispatchError(f"{type(worker).__name__}.{attr} is {type(part).__name__}, not the declared "
                            f"{parts[attr].__name__} (built in the worker's __init__?)")
    return getattr(part, name)(*args, **kwargs)
