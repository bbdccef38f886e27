"""Which operators write tensors of a given size while a function runs: evidence, without a GPU,
of the memory traffic a change removes (e.g. copies of a weight)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["writes_of_size"]


def writes_of_size(fn: Callable[[], object], numel: int,
                   dtype: torch.dtype | None = None) -> dict[str, tuple[int, int]]:
    """For each operator that ``fn()`` dispatches and that returns a tensor of ``numel`` elements
    (views left out: they write nothing), of ``dtype`` if given: how many times, and how many bytes
    those outputs hold in all."""
    seen: dict[str, tuple[int, int]] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == numel and not func.is_view \
                    and dtype in (None, out.dtype):
                name = func.overloadpacket.__name__
                count, size = seen.get(name, (0, 0))
                seen[name] = (count + 1, size + out.numel() * out.element_size())
            return out

    with Count():
        fn()
    return seen
