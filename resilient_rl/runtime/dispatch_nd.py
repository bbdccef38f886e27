"""verl's n-dimensional dispatch: split a batch by a named mesh's data-parallel ranks.

Each worker registers, per mesh name, its data-parallel rank and whether its output is collected
(:meth:`Worker._register_dispatch_collect_info`, e.g. only tensor-parallel rank 0 of each
data-parallel group). ``make_nd_compute_dataproto_dispatch_fn(mesh_name)`` gives the dispatch
mode of a method that splits its DataProto (or TensorDict) arguments into ``dp_size`` chunks,
sends chunk ``dp_rank`` to every rank of that data-parallel rank, and concatenates the outputs of
the collecting ranks. The group asks its ranks for the mapping on the first call and keeps it.
"""

from __future__ import annotations

from functools import partial

from resilient_rl.errors import DispatchError
from resilient_rl.protocol import DataProto
from resilient_rl.protocol.future import DataProtoFuture, concat_tensordicts


def _chunk(name: str, value, chunks: int) -> list:
    from resilient_rl.protocol.utils import tensordict_class

    if isinstance(value, (DataProto, DataProtoFuture)):
        return value.chunk(chunks)
    if isinstance(value, tensordict_class()):
        n = value.batch_size[0]
        if n % chunks:
            raise DispatchError(f"TensorDict argument {name!r} of length {n} cannot be split into {chunks} chunks")
        size = n // chunks
        # Index row by row: jagged (nested) tensors do not support slicing along the batch dim.
        return [_stack_rows(value, range(i * size, (i + 1) * size)) for i in range(chunks)]
    raise DispatchError(f"nd-dispatched argument {name!r} must be a DataProto or TensorDict, "
                        f"got {type(value).__name__}")


def _stack_rows(td, rows):
    import torch

    out = {}
    for key, val in td.items():
        if getattr(val, "is_nested", False):
            parts = val.unbind(0)
            out[key] = torch.nested.as_nested_tensor([parts[r] for r in rows], layout=val.layout)
        else:
            out[key] = val[list(rows)]
    return type(td)(out, batch_size=[len(rows)])


def _concat(parts: list):
    import ray

    from resilient_rl.protocol.utils import tensordict_class

    if parts and all(isinstance(p, ray.ObjectRef) for p in parts):
        return DataProtoFuture.concat(parts)
    if parts and all(isinstance(p, DataProto) for p in parts):
        return DataProto.concat(parts)
    if parts and all(isinstance(p, tensordict_class()) for p in parts):
        return concat_tensordicts(parts)
    raise DispatchError(f"nd-collected outputs must all be DataProtos or all TensorDicts, got "
                        f"{sorted({type(p).__name__ for p in parts})}")


def dispatch_nd_compute(dp_rank_mapping: list[int], dp_size: int, worker_group, *args, **kwargs):
    """Per rank, the ``dp_rank_mapping[rank]``-th entry of every (already split) argument."""
    for name, value in [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if not isinstance(value, (list, tuple)) or len(value) != dp_size:
            raise DispatchError(f"nd-dispatched argument {name!r} must have one entry per data-parallel rank "
                                f"({dp_size})")
    ranks = range(worker_group.world_size)
    return (tuple([a[dp_rank_mapping[r]] for r in ranks] for a in args),
            {k: [v[dp_rank_mapping[r]] for r in ranks] for k, v in kwargs.items()})


def collect_nd_compute(collect_mask: list[bool], worker_group, output):
    """The outputs of the ranks whose ``collect_mask`` entry is true, in rank order."""
    if len(output) != worker_group.world_size:
        raise DispatchError(f"expected {worker_group.world_size} outputs, got {len(output)}")
    return [o for o, keep in zip(output, collect_mask) if keep]


def dispatch_nd_compute_dataproto(dp_rank_mapping: list[int], dp_size: int, worker_group, *args, **kwargs):
    """Split every DataProto/TensorDict argument into ``dp_size`` chunks, then dispatch them."""
    args = tuple(_chunk(f"args[{i}]", a, dp_size) for i, a in enumerate(args))
    kwargs = {k: _chunk(k, v, dp_size) for k, v in kwargs.items()}
    return dispatch_nd_compute(dp_rank_mapping, dp_size, worker_group, *args, **kwargs)


def collect_nd_compute_dataproto(collect_mask: list[bool], worker_group, output):
    """Concatenate the collecting ranks' outputs (a DataProtoFuture for a non-blocking call)."""
    return _concat(collect_nd_compute(collect_mask, worker_group, output))


def _mesh_info(worker_group, kind: str, mesh_name: str) -> list:
    cache = worker_group.__dict__.setdefault(f"_{kind}_info", {})
    if mesh_name not in cache:
        query = getattr(worker_group, f"_query_{kind}_info", None)
        if query is None:
            raise DispatchError(f"worker group {worker_group.name_prefix!r} cannot report mesh {mesh_name!r}: its "
                                "class does not subclass resilient_rl.Worker")
        info = query(mesh_name)
        if len(info) != worker_group.world_size:
            raise DispatchError(f"mesh {mesh_name!r}: {len(info)} ranks answered, world size {worker_group.world_size}")
        cache[mesh_name] = info
    return cache[mesh_name]


def dispatch_lazy_compute_data_proto(mesh_name: str, worker_group, *args, **kwargs):
    mapping = _mesh_info(worker_group, "dispatch", mesh_name)
    return dispatch_nd_compute_dataproto(mapping, max(mapping) + 1, worker_group, *args, **kwargs)


def collect_lazy_compute_data_proto(mesh_name: str, worker_group, output):
    return collect_nd_compute_dataproto(_mesh_info(worker_group, "collect", mesh_name), worker_group, output)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict:
    """The dispatch mode of a method split over mesh ``mesh_name``'s data-parallel ranks."""
    return {"dispatch_fn": partial(dispatch_lazy_compute_data_proto, mesh_name),
            "collect_fn": partial(collect_lazy_compute_data_proto, mesh_name)}
