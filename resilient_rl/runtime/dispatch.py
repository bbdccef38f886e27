"""``@register``, ``Dispatch``, ``Execute`` and the built-in dispatch/collect functions.

A method of a :class:`~resilient_rl.runtime.worker.RankWorker` decorated with ``@register`` becomes a
method of every worker group built from that class. Its dispatch mode says how the controller's
arguments are split over the ranks (``dispatch_fn``) and how the per-rank results are merged
(``collect_fn``); its execute mode says which ranks run it. The names follow verl's so that a
verl worker ports by changing imports.
"""

from __future__ import annotations

import functools
import inspect
from enum import Enum
from typing import Any, Callable

from resilient_rl.runtime import leave_collective, progress
from resilient_rl.errors import DispatchError
from resilient_rl.protocol import DataProto, pad_dataproto_to_divisor
from resilient_rl.protocol.future import DataProtoFuture, materialize, materialize_async

#: Attribute under which ``@register`` stores a method's dispatch settings.
MAGIC_ATTR = "__rrl_register__"
#: Reserved keyword that carries the padding added by a DP_COMPUTE_PROTO dispatch to its collect step.
PAD_SIZE_KEY = "_rrl_pad_size"
#: ``meta_info`` key of a DataProto that turns automatic padding of uneven batches on or off.
AUTO_PADDING_KEY = "auto_padding"


class Dispatch(Enum):
    """How a group method's arguments are distributed over the ranks."""

    RANK_ZERO = "rank_zero"
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    DP_COMPUTE_METRIC = "dp_compute_metric"


class Execute(Enum):
    """Which ranks execute a group method."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


# ----------------------------------------------------------------------------- dispatch functions


def dispatch_one_to_all(worker_group, *args, **kwargs):
    """Send every argument unchanged to every rank."""
    n = worker_group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(worker_group, *args, **kwargs):
    """Pass the arguments through: the caller already gave one value per rank (or one for all)."""
    return args, kwargs


def collect_all_to_all(worker_group, output):
    """Return the per-rank outputs as a list."""
    return output


def dispatch_rank_zero(worker_group, *args, **kwargs):
    """Arguments go to rank zero only (used with ``Execute.RANK_ZERO``)."""
    return args, kwargs


def collect_rank_zero(worker_group, output):
    """The single output of rank zero."""
    return output[0] if isinstance(output, list) else output


def _check_per_rank(worker_group, name: str, value) -> None:
    n = worker_group.world_size
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) \
            else f"a {type(value).__name__}"
        raise DispatchError(f"DP_COMPUTE argument {name!r} must be a list with one entry per rank "
                            f"(world size {n}); got {got}")


def dispatch_dp_compute(worker_group, *args, **kwargs):
    """Every argument is already a list with one entry per rank."""
    for i, a in enumerate(args):
        _check_per_rank(worker_group, f"args[{i}]", a)
    for k, v in kwargs.items():
        _check_per_rank(worker_group, k, v)
    return args, kwargs


def collect_dp_compute(worker_group, output):
    """The per-rank outputs as a list, one per rank."""
    if len(output) != worker_group.world_size:
        raise DispatchError(f"expected {worker_group.world_size} outputs, got {len(output)}")
    return output


def _split_protos(worker_group, args, kwargs):
    """Chunk every DataProto argument into ``world_size`` parts, padding uneven batches if allowed."""
    n = worker_group.world_size
    lengths = {len(v) for v in list(args) + list(kwargs.values()) if isinstance(v, DataProto)}
    # A DataProtoFuture (another group's non-blocking result) is split by the ranks that fetch
    # it: its length is not known here, so it is never padded.
    if len(lengths) > 1:
        raise DispatchError(f"DataProto arguments of one call must have the same length; got {sorted(lengths)}")
    pad_size = 0

    def split(name, value):
        nonlocal pad_size
        if isinstance(value, DataProtoFuture):
            return value.chunk(n)
        if not isinstance(value, DataProto):
            raise DispatchError(f"DP_COMPUTE_PROTO argument {name!r} must be a DataProto, got {type(value).__name__}")
        if len(value) % n:
            # Unlike verl (which pads only where DataProtoConfig.auto_padding is on), an uneven
            # batch is padded unless meta_info["auto_padding"] is False.
            if not value.meta_info.get(AUTO_PADDING_KEY, True):
                raise DispatchError(f"DataProto argument {name!r} of length {len(value)} cannot be split into "
                                    f"{n} equal chunks and meta_info[{AUTO_PADDING_KEY!r}] is False")
            value, pad_size = pad_dataproto_to_divisor(value, n)
        return value.chunk(n)

    new_args = tuple(split(f"args[{i}]", a) for i, a in enumerate(args))
    new_kwargs = {k: split(k, v) for k, v in kwargs.items()}
    return new_args, new_kwargs, pad_size


def dispatch_dp_compute_data_proto(worker_group, *args, **kwargs):
    """Split DataProto arguments by data-parallel rank; uneven batches are padded (and unpadded on collect)."""
    new_args, new_kwargs, pad_size = _split_protos(worker_group, args, kwargs)
    if pad_size:
        new_kwargs[PAD_SIZE_KEY] = pad_size
    return new_args, new_kwargs


def dispatch_dp_compute_data_proto_with_func(worker_group, *args, **kwargs):
    """The first argument is a function sent to every rank; the DataProto arguments after it are split."""
    if not args or not callable(args[0]):
        raise DispatchError("DP_COMPUTE_PROTO_WITH_FUNC expects a function as its first argument")
    func, rest = args[0], args[1:]
    new_args, new_kwargs, pad_size = _split_protos(worker_group, rest, kwargs)
    if pad_size:
        new_kwargs[PAD_SIZE_KEY] = pad_size
    return ([func] * worker_group.world_size,) + new_args, new_kwargs


def _refs(output) -> bool:
    import ray

    return bool(output) and all(isinstance(o, ray.ObjectRef) for o in output)


def collect_dp_compute_data_proto(worker_group, output):
    """Concatenate the per-rank DataProto outputs in rank order (ObjectRefs of a non-blocking
    call become one :class:`DataProtoFuture`)."""
    output = collect_dp_compute(worker_group, output)
    if _refs(output):
        return DataProtoFuture.concat(output)
    for i, o in enumerate(output):
        if not isinstance(o, DataProto):
            raise DispatchError(f"rank {i} returned a {type(o).__name__}; DP_COMPUTE_PROTO methods must return a DataProto")
    return DataProto.concat(output)


_PREDEFINED: dict[Dispatch, dict[str, Callable]] = {
    Dispatch.RANK_ZERO: {"dispatch_fn": dispatch_rank_zero, "collect_fn": collect_rank_zero},
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {"dispatch_fn": dispatch_dp_compute_data_proto,
                                "collect_fn": collect_dp_compute_data_proto},
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: {"dispatch_fn": dispatch_dp_compute_data_proto_with_func,
                                          "collect_fn": collect_dp_compute_data_proto},
    Dispatch.DP_COMPUTE_METRIC: {"dispatch_fn": dispatch_dp_compute_data_proto, "collect_fn": collect_dp_compute},
}


class RegisteredDispatch:
    """A dispatch mode added by :func:`register_dispatch_mode`, reachable as ``Dispatch.<name>``."""

    def __init__(self, name: str) -> None:
        self.name = self.value = name

    def __repr__(self) -> str:
        return f"<Dispatch.{self.name}: registered>"

    def __reduce__(self):  # the same object in every process that registered it
        return (_registered, (self.name,))


def _registered(name: str) -> RegisteredDispatch:
    mode = getattr(Dispatch, name, None)
    return mode if isinstance(mode, RegisteredDispatch) else RegisteredDispatch(name)


def get_predefined_dispatch_fn(dispatch_mode) -> dict[str, Callable]:
    """The ``{"dispatch_fn", "collect_fn"}`` pair of a built-in (or registered) dispatch mode."""
    return _PREDEFINED[dispatch_mode]


def register_dispatch_mode(dispatch_mode_name: str, dispatch_fn: Callable, collect_fn: Callable):
    """Add a dispatch mode named ``dispatch_mode_name`` (then ``Dispatch.<name>``), as in verl."""
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise DispatchError(f"dispatch mode {dispatch_mode_name!r} needs callable dispatch_fn and collect_fn")
    if hasattr(Dispatch, dispatch_mode_name):
        raise DispatchError(f"dispatch_mode_name {dispatch_mode_name} already exists")
    mode = RegisteredDispatch(dispatch_mode_name)
    setattr(Dispatch, dispatch_mode_name, mode)
    _PREDEFINED[mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
    return mode


def update_dispatch_mode(dispatch_mode, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Replace the functions of an existing dispatch mode (built-in or registered), as in verl.
    Methods registered with it use the new functions from the next worker group built."""
    if dispatch_mode not in _PREDEFINED:
        raise DispatchError(f"dispatch_mode {dispatch_mode} not found")
    _PREDEFINED[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def resolve_dispatch(dispatch_mode) -> dict[str, Callable]:
    """Turn a ``Dispatch`` member or a custom ``{"dispatch_fn", "collect_fn"}`` dict into the pair of functions."""
    if isinstance(dispatch_mode, (Dispatch, RegisteredDispatch)):
        return _PREDEFINED[dispatch_mode]
    if isinstance(dispatch_mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(dispatch_mode)
        if missing or not all(callable(dispatch_mode[k]) for k in ("dispatch_fn", "collect_fn")):
            raise DispatchError("a custom dispatch mode must be a dict with callable 'dispatch_fn' and 'collect_fn'"
                                f"{'; missing ' + ', '.join(sorted(missing)) if missing else ''}")
        return dispatch_mode
    raise DispatchError(f"unknown dispatch mode {dispatch_mode!r}; use a Dispatch member or "
                        "{'dispatch_fn': f, 'collect_fn': g}")


def register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode: Execute = Execute.ALL, blocking: bool = True,
             materialize_futures: bool = True):
    """Mark a worker method as callable on a worker group with the given dispatch and execute modes.

    ``async def`` methods stay coroutines (Ray runs the actor's event loop). With
    ``materialize_futures`` (the default), :class:`DataProtoFuture` arguments are fetched in the
    worker before the method runs. ``blocking=False`` makes the group method return without
    waiting: a DataProtoFuture for DataProto-collecting modes, else the ObjectRefs.
    """
    resolve_dispatch(dispatch_mode)  # fail at import time, not at the first call
    if not isinstance(execute_mode, Execute):
        raise DispatchError(f"execute_mode must be an Execute member, got {execute_mode!r}")

    def decorator(func):
        def prepare(args, kwargs):
            kwargs.pop(PAD_SIZE_KEY, None)
            if materialize_futures:
                args = tuple(materialize(a) for a in args)
                kwargs = {k: materialize(v) for k, v in kwargs.items()}
            return args, kwargs

        @functools.wraps(func)
        def inner(*args, **kwargs):
            args, kwargs = prepare(args, kwargs)
            # Runs in the worker process: its health replies say which call it is in (liveness).
            progress.begin(name)
            try:
                return func(*args, **kwargs)
            except BaseException as exc:
                typed = _leave_if_collective(exc, name, args)
                if typed is None or typed is exc:
                    raise
                raise typed from exc
            finally:
                progress.end()

        @functools.wraps(func)
        async def async_inner(*args, **kwargs):
            kwargs.pop(PAD_SIZE_KEY, None)
            if materialize_futures:
                args = tuple([await materialize_async(a) for a in args])
                kwargs = {k: await materialize_async(v) for k, v in kwargs.items()}
            progress.begin(name)
            try:
                return await func(*args, **kwargs)
            except BaseException as exc:
                typed = _leave_if_collective(exc, name, args)
                if typed is None or typed is exc:
                    raise
                raise typed from exc
            finally:
                progress.end()

        name = func.__name__
        if inspect.iscoroutinefunction(func):
            inner = async_inner  # noqa: F811 -- a coroutine method stays one

        setattr(inner, MAGIC_ATTR, {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode,
                                    "blocking": blocking})
        return inner

    return decorator


def _leave_if_collective(exc: BaseException, call: str, args: tuple) -> BaseException | None:
    """A call that ends with a collective error leaves its group's collectives, so that peers
    still waiting on this rank raise at once too (:mod:`resilient_rl.runtime.leave_collective`).
    The error typed as a CollectiveError, or None where it is not a collective's."""
    typed = leave_collective.collective_error(exc, getattr(args[0], "rank", None) if args else None)
    if typed is not None:
        leave_collective.leave_collectives(f"{call} raised {type(exc).__name__}")
    return typed


def registered_methods(cls) -> dict[str, dict[str, Any]]:
    """Every ``@register``-ed method of ``cls`` (including inherited ones) with its settings."""
    found = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        attr = getattr(cls, name, None)
        settings = getattr(attr, MAGIC_ATTR, None)
        if settings is not None:
            found[name] = settings
    return found
