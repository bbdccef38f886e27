"""The parts of verl's ``DataProto`` surface beyond the core container: auto-padding, batch-dim
folding, TensorDict conversion, per-sample repeats, column unfolding and disk I/O.

:class:`DataProto` is a base class of :class:`~resilient_rl.protocol.DataProto`; it only
calls DataProto's own methods, so the core container stays in :mod:`resilient_rl.protocol`.
Behaviour follows verl 0.9; errors are :class:`~resilient_rl.errors.DataProtoError`, which is an
``AssertionError`` too, so code that catches verl's assertions keeps working.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from resilient_rl.errors import DataProtoError
from resilient_rl.protocol.container import DataProtoCore
from resilient_rl.protocol.utils import positive_int, tensordict_class

if TYPE_CHECKING:
    from tensordict import TensorDict


# dataloader_kwargs accepted by make_iterator for verl compatibility; only "shuffle" changes
# anything, the others do not affect which rows end up in which mini-batch.
_ITERATOR_KWARGS = frozenset({"shuffle", "drop_last", "num_workers", "pin_memory"})


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """``[bsz, ...]`` -> ``[new_bsz, bsz // new_bsz, ...]`` (the batch keeps one batch dim)."""
    new_batch_size = positive_int("new_batch_size", new_batch_size)
    if len(data) % new_batch_size:
        raise DataProtoError(f"cannot fold a DataProto of length {len(data)} into {new_batch_size} rows")
    batch = None
    if data.batch is not None:
        batch = data.batch.view(new_batch_size, -1)
        batch.auto_batch_size_(batch_dims=1)
    non_tensor = {k: np.reshape(v, (new_batch_size, -1, *v.shape[1:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Flatten the first ``batch_dims`` dims back into one batch dim (inverse of fold_batch_dim)."""
    batch_dims = positive_int("batch_dims", batch_dims)
    batch, rows = None, None
    if data.batch is not None:
        td = data.batch.clone(recurse=False)
        td.auto_batch_size_(batch_dims=batch_dims)
        batch = td.view(-1)
        rows = batch.batch_size[0]
    non_tensor = {}
    for key, val in data.non_tensor_batch.items():
        n = rows if rows is not None else int(np.prod(val.shape[:batch_dims]))
        non_tensor[key] = np.reshape(val, (n, *val.shape[batch_dims:]))
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


class DataProto(DataProtoCore):
    """A batch of tensors, non-tensor arrays and meta info sharing one leading dimension: the
    core container (:class:`~resilient_rl.protocol.container.DataProtoCore`) with the rest of
    verl's surface (see the module docstring)."""

    # ------------------------------------------------------------------ repeats and unfolding
    def sample_level_repeat(self, repeat_times) -> DataProto:
        """Repeat row i ``repeat_times[i]`` times (a list, tuple, 1-D tensor or 1-D array)."""
        if isinstance(repeat_times, (torch.Tensor, np.ndarray)):
            if repeat_times.ndim != 1:
                raise DataProtoError(f"repeat_times must be one-dimensional, got shape {tuple(repeat_times.shape)}")
            repeat_times = repeat_times.tolist()
        if not isinstance(repeat_times, (list, tuple)):
            raise DataProtoError("repeat_times must be a list, tuple, torch.Tensor or np.ndarray, "
                                 f"got {type(repeat_times).__name__}")
        if len(repeat_times) != len(self):
            raise DataProtoError(f"repeat_times has {len(repeat_times)} entries, DataProto has {len(self)} rows")
        times = torch.tensor(list(repeat_times), dtype=torch.long)
        batch = None
        if self.batch is not None:
            batch = tensordict_class()({k: v.repeat_interleave(times.to(v.device), dim=0)
                                        for k, v in self.batch.items()},
                                       batch_size=[int(times.sum())], device=self.batch.device)
        non_tensor = {k: np.repeat(v, times.numpy(), axis=0) for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Split dim 1 of each of ``split_keys`` into ``n_split`` parts laid out along the batch dim;
        every other key is repeated ``n_split`` times per row to match."""
        n_split = positive_int("n_split", n_split)
        split = set(split_keys or [])

        def unfold(key: str, value):
            if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == object:
                # A column of equal-length lists (from_dict keeps those one-dimensional): verl
                # holds it as a 2-D object array, so unfold it as one.
                widths = {len(cell) if isinstance(cell, (list, tuple, np.ndarray)) else -1 for cell in value}
                if len(widths) != 1 or -1 in widths:
                    raise DataProtoError(f"cannot split the cells of {key!r}: they are not sequences of one length")
                grid = np.empty((len(value), widths.pop()), dtype=object)
                for i, cell in enumerate(value):
                    grid[i, :] = list(cell)
                value = grid
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(f"cannot split dim 1 of {key!r} (shape {value.shape}) into {n_split} parts")
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            batch = tensordict_class()(
                {k: unfold(k, v) if k in split else torch.repeat_interleave(v, n_split, dim=0)
                 for k, v in self.batch.items()}, batch_size=[len(self) * n_split], device=self.batch.device)
        non_tensor = {k: unfold(k, v) if k in split else np.repeat(v, n_split, axis=0)
                      for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    # ------------------------------------------------------------------ TensorDict conversion
    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors as they are, non-tensor columns as ``NonTensorStack``s, meta_info
        entries as ``NonTensorData`` (verl's layout)."""
        from tensordict import NonTensorData, NonTensorStack

        tensors = {k: v for k, v in self.batch.items()} if self.batch is not None else {}
        common = set(tensors) & set(self.non_tensor_batch)
        if common:
            raise DataProtoError(f"batch and non_tensor_batch share keys {sorted(common)}")
        out = tensordict_class()(tensors, batch_size=[len(self)])
        for key, val in self.non_tensor_batch.items():
            out[key] = NonTensorStack.from_list([NonTensorData(item) for item in val])
        for key, val in self.meta_info.items():
            if key in out.keys():
                raise DataProtoError(f"meta_info key {key!r} clashes with a column of the same name")
            out[key] = NonTensorData(val)
        return out

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: dict[str, Any] | None = None,
                        num_batch_dims: int = 1) -> DataProto:
        """Inverse of :meth:`to_tensordict`: tensors to ``batch``, ``NonTensorStack`` columns to
        ``non_tensor_batch``, ``NonTensorData`` entries to ``meta_info``."""
        from tensordict import NonTensorData, NonTensorStack

        num_batch_dims = positive_int("num_batch_dims", num_batch_dims)
        meta = dict(meta_info or {})
        tensors, non_tensor, batch_size = {}, {}, None
        for key in tensor_dict.keys():
            val = tensor_dict.get(key)
            if isinstance(val, NonTensorStack):
                non_tensor[key] = np.array([item.data if isinstance(item, NonTensorData) else item
                                            for item in val], dtype=object)
            elif isinstance(val, NonTensorData):
                meta[key] = val.data
            elif isinstance(val, torch.Tensor):
                tensors[key] = val
                batch_size = batch_size if batch_size is not None else val.shape[:num_batch_dims]
            else:
                raise DataProtoError(f"tensordict entry {key!r} holds {type(val).__name__}; expected a tensor, "
                                     "NonTensorStack or NonTensorData")
        if non_tensor and num_batch_dims != 1:
            raise DataProtoError("num_batch_dims must be 1 when the tensordict holds non-tensor columns")
        batch = tensordict_class()(tensors, batch_size=batch_size) if tensors else None
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    # ------------------------------------------------------------------ mini-batches
    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict[str, Any] | None = None) -> Iterator[DataProto]:
        """Yield mini-batches of ``mini_batch_size`` rows for ``epochs`` passes.

        With a ``seed`` every epoch is a fresh permutation drawn from one ``torch.Generator`` seeded
        with it, so the same seed gives the same order. Without a seed rows come in order, unless
        ``dataloader_kwargs={"shuffle": True}`` asks for shuffling from torch's global generator.
        ``{"shuffle": False}`` turns shuffling off even with a seed.
        """
        mini_batch_size = positive_int("mini_batch_size", mini_batch_size)
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise DataProtoError(f"epochs must be a non-negative integer, got {epochs!r}")
        if len(self) % mini_batch_size:
            raise DataProtoError(f"DataProto length {len(self)} is not divisible by mini_batch_size "
                                 f"{mini_batch_size}")
        kwargs = dict(dataloader_kwargs or {})
        unknown = sorted(set(kwargs) - _ITERATOR_KWARGS)
        if unknown:
            raise DataProtoError(f"unsupported dataloader_kwargs {unknown}; supported: {sorted(_ITERATOR_KWARGS)}")
        shuffle = bool(kwargs.get("shuffle", seed is not None))
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        n = len(self)

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
                for start in range(0, n, mini_batch_size):
                    yield self.select_idxs(order[start:start + mini_batch_size])

        return batches()

    # ------------------------------------------------------------------ disk and reporting
    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Write to one safetensors file (no pickle; see :mod:`resilient_rl.protocol.io`)."""
        from resilient_rl.protocol.io import save_to_disk

        save_to_disk(self, filepath)

    @classmethod
    def load_from_disk(cls, filepath: str | os.PathLike) -> DataProto:
        """Read a file written by :meth:`save_to_disk`."""
        from resilient_rl.protocol.io import load_from_disk

        return load_from_disk(cls, filepath)

    def print_size(self, prefix: str = "") -> None:
        """Print the bytes held by the batch and the non-tensor columns (in GB, as verl)."""
        tensor_bytes = sum(v.element_size() * v.numel() for v in self.batch.values()) if self.batch is not None else 0
        numpy_bytes = sum(v.nbytes for v in self.non_tensor_batch.values())
        print(f"{prefix}size of tensordict: {tensor_bytes / 1024**3} GB, "
              f"size of non_tensor_batch: {numpy_bytes / 1024**3} GB")

    def get_data_info(self) -> str:
        """A readable listing of the keys, shapes and dtypes."""
        lines = ["batch"]
        for key, tensor in (self.batch.items() if self.batch is not None else []):
            lines.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
        lines.append("non_tensor_batch")
        lines += [f"  {k}: ndarray{v.shape} ({v.dtype})" for k, v in self.non_tensor_batch.items()]
        lines.append("meta_info")
        lines += [f"  {k}: {type(v).__name__}" for k, v in self.meta_info.items()]
        return "\n".join(lines)


# Its public home, where verl has it too: pickles (``save_to_disk``, Ray) name it there, as they
# did before the container was split out, so files saved by either version load in the other.
DataProto.__module__ = "resilient_rl.protocol"


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` to a multiple of ``size_divisor`` by repeating its rows from the start (cyclically
    when more padding than rows is needed). Returns ``(padded, pad_size)``; ``data`` itself is not changed."""
    size_divisor = positive_int("size_divisor", size_divisor)
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:  # includes the empty proto: nothing to pad, no rows to repeat
        return data, 0
    padding = data.select_idxs(torch.arange(pad_size) % n)
    return type(data).concat([data, padding]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows added by :func:`pad_dataproto_to_divisor`."""
    if isinstance(pad_size, bool) or not isinstance(pad_size, (int, np.integer)) or not 0 <= pad_size <= len(data):
        raise DataProtoError(f"pad_size must be an integer in [0, {len(data)}], got {pad_size!r}")
    return data if pad_size == 0 else data.slice(0, len(data) - int(pad_size))
