"""``DataProtoFuture``: the result of a non-blocking group call, not fetched to the controller.

A registered method declared with ``blocking=False`` returns one of these instead of waiting: it
holds the ranks' ObjectRefs and how to merge them (``collect_fn``). Passed as an argument to
another group's method, each destination rank fetches and merges the parts itself and keeps its
own chunk (``dispatch_fn``), so the data goes from worker to worker without passing through the
controller. ``get()`` fetches and merges on the caller instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from resilient_rl.errors import DataProtoError
from resilient_rl.protocol.container import DataProtoCore


def _concat_parts(parts: list) -> Any:
    # A DataProto is a DataProtoCore (its base here): concat through the parts' own class.
    if parts and all(isinstance(p, DataProtoCore) for p in parts) and len({type(p) for p in parts}) == 1:
        return type(parts[0]).concat(parts)
    from resilient_rl.protocol.utils import tensordict_class

    if parts and all(isinstance(p, tensordict_class()) for p in parts):
        return concat_tensordicts(parts)
    raise DataProtoError("a DataProtoFuture's parts must all be DataProtos or all TensorDicts, got "
                         f"{sorted({type(p).__name__ for p in parts})}")


def concat_tensordicts(parts: list):
    """TensorDicts joined along the batch dim; jagged (nested) tensors are joined row by row."""
    import torch

    out = {}
    for key in parts[0].keys():
        vals = [p[key] for p in parts]
        if getattr(vals[0], "is_nested", False):
            out[key] = torch.nested.as_nested_tensor([t for v in vals for t in v.unbind(0)], layout=vals[0].layout)
        else:
            out[key] = torch.cat(vals, dim=0)
    return type(parts[0])(out, batch_size=[sum(p.batch_size[0] for p in parts)])


def _chunk_part(data, i: int, chunks: int):
    return data.chunk(chunks=chunks)[i]


@dataclass
class DataProtoFuture:
    """ObjectRefs of a call's per-rank results, with how to merge them and which part to keep."""

    collect_fn: Callable
    futures: list
    dispatch_fn: Callable | None = None

    @staticmethod
    def concat(data: list) -> DataProtoFuture:
        """A future of the concatenation of ``data`` (ObjectRefs of DataProtos)."""
        return DataProtoFuture(collect_fn=_concat_parts, futures=list(data))

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures, the i-th of which resolves to chunk i of the merged result."""
        return [DataProtoFuture(collect_fn=self.collect_fn, futures=self.futures,
                                dispatch_fn=partial(_chunk_part, i=i, chunks=chunks)) for i in range(chunks)]

    def get(self, timeout: float | None = None):
        """Fetch every part, merge them and keep this future's chunk."""
        import ray

        output = self.collect_fn(ray.get(self.futures, timeout=timeout))
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output

    async def get_async(self):
        """:meth:`get` for an ``async def`` method: awaits the parts, so the actor's event loop
        keeps running the calls that produce them (an async actor may start a later call first)."""
        import asyncio

        output = self.collect_fn(list(await asyncio.gather(*self.futures)))
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output


def materialize(value):
    """``value``, or what it resolves to when it is a DataProtoFuture (run on the worker side)."""
    return value.get() if isinstance(value, DataProtoFuture) else value


async def materialize_async(value):
    """:func:`materialize` without blocking the event loop (``async def`` methods)."""
    return await value.get_async() if isinstance(value, DataProtoFuture) else value
