"""The core of :class:`~resilient_rl.protocol.DataProto`: three parts sharing one leading dimension,
and the operations on rows every proto has (see :mod:`resilient_rl.protocol`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from resilient_rl.errors import DataProtoError
from resilient_rl.protocol.utils import (DataProtoConfig, as_object_array, batch_from_wire, batch_to_wire,
                                         merge_meta_info, positive_int, tensordict_class, union_dict, union_numpy_dict,
                                         union_tensor_dict, values_equal)

if TYPE_CHECKING:  # imported on first use at run time, see tensordict_class
    from tensordict import TensorDict

__all__ = ["DataProtoCore", "DataProtoItem"]

_STATE_VERSION = 1

Index = int | np.integer | slice | Sequence[int] | np.ndarray | torch.Tensor


@dataclass(eq=False)
class DataProtoItem:
    """One row of a :class:`DataProto` (what ``data[i]`` returns, as in verl)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class DataProtoCore:
    """A batch of tensors, non-tensor arrays and meta info sharing one leading dimension: the
    container every proto is (:class:`~resilient_rl.protocol.DataProto` adds the rest of verl's surface)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ----------------------------------------------------------------- construction and checks
    def check_consistency(self) -> None:
        """Raise DataProtoError unless every tensor and non-tensor has the same leading length."""
        if self.batch is not None:
            if not isinstance(self.batch, tensordict_class()):
                raise DataProtoError(f"batch must be a TensorDict or None, got {type(self.batch).__name__}")
            if self.batch.batch_dims != 1:
                raise DataProtoError(f"batch must have exactly one batch dimension, got batch_size "
                                     f"{tuple(self.batch.batch_size)}")
            for key, val in self.batch.items():
                if not isinstance(val, torch.Tensor):
                    raise DataProtoError(f"batch key {key!r} holds {type(val).__name__}; only tensors belong "
                                         "in batch, put other values in non_tensor_batch")
        if not isinstance(self.non_tensor_batch, dict):
            raise DataProtoError(f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        if not isinstance(self.meta_info, dict):
            raise DataProtoError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        expected = len(self) if self.batch is not None else None
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray) or val.ndim == 0:
                raise DataProtoError(f"non-tensor {key!r} must be a numpy array with a batch dimension, "
                                     f"got {type(val).__name__}")
            if expected is None:
                expected = val.shape[0]
            elif val.shape[0] != expected:
                raise DataProtoError(f"non-tensor {key!r} has length {val.shape[0]}, expected {expected}")

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None, non_tensors: dict[str, Any] | None = None,
                  meta_info: dict[str, Any] | None = None, num_batch_dims: int = 1,
                  auto_padding: bool = False) -> DataProtoCore:
        """Build from a dict of tensors (same leading ``num_batch_dims`` dims) and a dict of numpy
        arrays or lists. ``auto_padding`` lets ``chunk`` split this proto unevenly (verl)."""
        num_batch_dims = positive_int("num_batch_dims", num_batch_dims)
        if non_tensors and num_batch_dims != 1:
            raise DataProtoError("num_batch_dims must be 1 when non_tensors are given")
        tensors = dict(tensors or {})
        size: tuple | None = None
        first_key = None
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < num_batch_dims:
                raise DataProtoError(f"tensor {key!r} must be a torch.Tensor with {num_batch_dims} batch dimension(s)")
            if size is None:
                size, first_key = tuple(tensor.shape[:num_batch_dims]), key
            elif tuple(tensor.shape[:num_batch_dims]) != size:
                got, want = (tensor.shape[0], size[0]) if num_batch_dims == 1 else (tensor.shape[:num_batch_dims], size)
                raise DataProtoError(f"tensor {key!r} has length {got} but {first_key!r} has {want}")
        batch = tensordict_class()(tensors, batch_size=list(size)) if tensors else None
        non_tensor_batch = {k: as_object_array(k, v) for k, v in (non_tensors or {}).items()}
        meta = dict(meta_info or {})
        if auto_padding:
            meta[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta)

    @classmethod
    def from_single_dict(cls, data: dict[str, torch.Tensor | np.ndarray],
                         meta_info: dict[str, Any] | None = None, auto_padding: bool = False) -> DataProtoCore:
        """Build from one dict, sending tensors to ``batch`` and numpy arrays to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, val in data.items():
            if isinstance(val, torch.Tensor):
                tensors[key] = val
            elif isinstance(val, np.ndarray):
                non_tensors[key] = val
            else:
                raise DataProtoError(f"value of {key!r} must be a torch.Tensor or a numpy array, "
                                     f"got {type(val).__name__}")
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    def _new(self, batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray],
             meta_info: dict[str, Any] | None = None) -> DataProtoCore:
        # Results get their own meta_info dict so that editing one proto never edits another.
        meta = dict(self.meta_info) if meta_info is None else meta_info
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta)

    # ------------------------------------------------------------------ auto-padding
    def is_padding_enabled(self) -> bool:
        """Whether ``chunk`` may split this proto unevenly (its own flag or DataProtoConfig's)."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first (``"first"``) or last row, in place."""
        if padding_size == 0:
            return
        positive_int("padding_size", padding_size)
        if len(self) == 0:
            raise DataProtoError("cannot pad an empty DataProto: there is no row to repeat")
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        padded = type(self).concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    # ----------------------------------------------------------------------- size and indexing
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for val in self.non_tensor_batch.values():
            return int(val.shape[0])
        return 0

    def __getitem__(self, item: Index) -> DataProtoCore | DataProtoItem:
        """``int`` gives a :class:`DataProtoItem`; a slice, index list/array/tensor or mask a DataProto."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"index {item} is out of range for a DataProto of length {n}")
            return DataProtoItem(batch=self.batch[int(item)] if self.batch is not None else None,
                                 non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                                 meta_info=self.meta_info)
        raise TypeError(f"DataProto indices must be int, slice, list, numpy array or tensor, "
                        f"not {type(item).__name__}")

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProtoCore:
        """Rows ``start:end:step`` as a new DataProto (tensors are views, as with tensor slicing)."""
        s = slice(start, end, step)
        batch = self.batch[s] if self.batch is not None else None
        return self._new(batch, {k: v[s] for k, v in self.non_tensor_batch.items()})

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> DataProtoCore:
        """Rows at integer positions (or where a boolean mask of length ``len(self)`` is true)."""
        idx = torch.as_tensor(np.asarray(idxs) if isinstance(idxs, (list, tuple)) else idxs).cpu()
        if idx.numel() == 0:
            idx = idx.to(torch.long)
        if idx.dim() != 1:
            raise DataProtoError(f"indices must be one-dimensional, got shape {tuple(idx.shape)}")
        if idx.dtype == torch.bool:
            if idx.shape[0] != len(self):
                raise DataProtoError(f"boolean mask has length {idx.shape[0]}, DataProto has {len(self)}")
        elif idx.is_floating_point() or idx.is_complex():
            raise DataProtoError(f"indices must be integers or booleans, got {idx.dtype}")
        else:
            idx = idx.to(torch.long)
        idx_np = idx.numpy()
        batch = None
        if self.batch is not None:
            rows = int(idx.sum()) if idx.dtype == torch.bool else idx.shape[0]
            batch = tensordict_class()({k: v[idx.to(v.device)] for k, v in self.batch.items()},
                               batch_size=[rows], device=self.batch.device)
        return self._new(batch, {k: v[idx_np] for k, v in self.non_tensor_batch.items()})

    # ------------------------------------------------------------------------- keys
    def _check_keys(self, batch_keys: Sequence[str] | None, non_tensor_batch_keys: Sequence[str] | None,
                    meta_info_keys: Sequence[str] | None) -> None:
        have = set(self.batch.keys()) if self.batch is not None else set()
        for kind, keys, present in (("batch", batch_keys, have),
                                    ("non_tensor_batch", non_tensor_batch_keys, self.non_tensor_batch),
                                    ("meta_info", meta_info_keys, self.meta_info)):
            missing = [k for k in (keys or []) if k not in present]
            if missing:
                raise DataProtoError(f"{kind} has no key(s) {missing}; available: {sorted(present)}")

    def select(self, batch_keys: Sequence[str] | None = None, non_tensor_batch_keys: Sequence[str] | None = None,
               meta_info_keys: Sequence[str] | None = None, deepcopy: bool = False) -> DataProtoCore:
        """A DataProto with only the given keys (None keeps all of that kind); tensors are shared
        unless ``deepcopy`` is set."""
        self._check_keys(batch_keys, non_tensor_batch_keys, meta_info_keys)
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        non_tensor = {k: v for k, v in self.non_tensor_batch.items()
                      if non_tensor_batch_keys is None or k in non_tensor_batch_keys}
        meta = {k: v for k, v in self.meta_info.items() if meta_info_keys is None or k in meta_info_keys}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        elif batch is not None and batch is self.batch:
            batch = batch.select(*batch.keys())  # a new container, so adding keys there leaves self alone
        return self._new(batch, non_tensor, meta)

    def pop(self, batch_keys: Sequence[str] | None = None, non_tensor_batch_keys: Sequence[str] | None = None,
            meta_info_keys: Sequence[str] | None = None) -> DataProtoCore:
        """Remove the given keys from this proto and return them as a new DataProto."""
        self._check_keys(batch_keys, non_tensor_batch_keys, meta_info_keys)
        batch = None
        if batch_keys:
            assert self.batch is not None  # _check_keys guarantees it
            batch = tensordict_class()({k: self.batch.pop(k) for k in batch_keys}, batch_size=self.batch.batch_size,
                               device=self.batch.device)
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys or []}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys or []}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str] | None = None,
               new_keys: str | Sequence[str] | None = None) -> DataProtoCore:
        """Rename batch (or non-tensor) keys in place and return self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise DataProtoError(f"rename needs as many new keys as old keys, got {old} -> {new}")
        batch_keys = set(self.batch.keys()) if self.batch is not None else set()
        for o, n in zip(old, new):
            if n in batch_keys or n in self.non_tensor_batch:
                raise DataProtoError(f"cannot rename {o!r} to {n!r}: {n!r} already exists")
            if o in batch_keys:
                assert self.batch is not None
                self.batch.rename_key_(o, n)
                batch_keys = set(self.batch.keys())
            elif o in self.non_tensor_batch:
                self.non_tensor_batch[n] = self.non_tensor_batch.pop(o)
            else:
                raise DataProtoError(f"cannot rename {o!r}: no such batch or non-tensor key")
        return self

    def union(self, other: DataProtoCore) -> DataProtoCore:
        """Merge ``other``'s keys into self (in place, returns self).

        Lengths must match, unless one side carries no rows at all (only meta_info). A key present
        on both sides must hold equal values.
        """
        self_rows = self.batch is not None or bool(self.non_tensor_batch)
        other_rows = other.batch is not None or bool(other.non_tensor_batch)
        if self_rows and other_rows and len(self) != len(other):
            raise DataProtoError(f"cannot union DataProtos of lengths {len(self)} and {len(other)}")
        batch = self.batch
        if other.batch is not None:
            batch = union_tensor_dict(batch.select(*batch.keys()), other.batch) if batch is not None \
                else other.batch.select(*other.batch.keys())
        non_tensor = union_numpy_dict(dict(self.non_tensor_batch), other.non_tensor_batch)
        meta = union_dict(dict(self.meta_info), other.meta_info, "meta_info")
        # Everything was checked on copies above, so a conflict leaves self untouched.
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor, meta
        self.check_consistency()
        return self

    # ----------------------------------------------------------------- splitting and joining
    def chunk(self, chunks: int) -> list[DataProtoCore]:
        """Split into ``chunks`` equal parts; uneven lengths are an error (pad first if needed)
        unless auto-padding is enabled, where parts have ``torch.chunk``'s sizes, as in verl."""
        chunks = positive_int("chunks", chunks)
        if len(self) % chunks:
            if not self.is_padding_enabled():
                raise DataProtoError(f"cannot split a DataProto of length {len(self)} into {chunks} equal chunks; "
                                     "pad it with pad_dataproto_to_divisor first")
            size = -(-len(self) // chunks)
            return [self.slice(i, i + size) for i in range(0, len(self), size)]
        size = len(self) // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProtoCore]:
        """Split into parts of ``split_size`` rows; the last one may be shorter."""
        split_size = positive_int("split_size", split_size)
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProtoCore]) -> DataProtoCore:
        """Concatenate along dim 0; all parts must have the same keys. meta_info is merged as verl
        does (see :func:`~resilient_rl.protocol.verl.merge_meta_info`): per-worker ``metrics``
        become one dict of lists, other keys must agree."""
        if not data:
            raise DataProtoError("cannot concat an empty list of DataProtos")
        first = data[0]
        batch_keys = list(first.batch.keys()) if first.batch is not None else None
        for i, d in enumerate(data):
            keys = list(d.batch.keys()) if d.batch is not None else None
            if (keys is None) != (batch_keys is None) or set(keys or []) != set(batch_keys or []):
                raise DataProtoError(f"cannot concat: part {i} has batch keys {keys}, part 0 has {batch_keys}")
            if d.non_tensor_batch.keys() != first.non_tensor_batch.keys():
                raise DataProtoError(f"cannot concat: part {i} has non-tensor keys {sorted(d.non_tensor_batch)}, "
                                     f"part 0 has {sorted(first.non_tensor_batch)}")
        batch = None
        if batch_keys is not None:
            tensors = {}
            for key in batch_keys:
                try:
                    tensors[key] = torch.cat([d.batch[key] for d in data], dim=0)  # type: ignore[index]
                except RuntimeError as exc:
                    raise DataProtoError(f"cannot concat batch key {key!r}: {exc}") from exc
            batch = tensordict_class()(tensors, batch_size=[sum(len(d) for d in data)], device=first.batch.device)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data], axis=0)
                      for k in first.non_tensor_batch}
        return type(first)(batch=batch, non_tensor_batch=non_tensor,
                           meta_info=merge_meta_info([d.meta_info for d in data]))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProtoCore:
        """Repeat every row: ``interleave`` gives a,a,b,b; otherwise the whole batch is tiled a,b,a,b."""
        times = positive_int("repeat_times", repeat_times)
        batch = None
        if self.batch is not None:
            rep = (lambda t: t.repeat_interleave(times, dim=0)) if interleave \
                else (lambda t: t.repeat(times, *([1] * (t.dim() - 1))))
            batch = tensordict_class()({k: rep(v) for k, v in self.batch.items()}, batch_size=[len(self) * times],
                               device=self.batch.device)
        non_tensor = {k: np.repeat(v, times, axis=0) if interleave else np.tile(v, (times,) + (1,) * (v.ndim - 1))
                      for k, v in self.non_tensor_batch.items()}
        return self._new(batch, non_tensor)

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Permute the rows in place: row ``i`` becomes old row ``indices[i]``."""
        idx = torch.as_tensor(np.asarray(indices) if isinstance(indices, (list, tuple)) else indices).cpu()
        if idx.dim() != 1 or idx.dtype == torch.bool or idx.is_floating_point() or \
                not torch.equal(torch.sort(idx.to(torch.long)).values, torch.arange(len(self))):
            raise DataProtoError(f"reorder needs a permutation of range({len(self)}), "
                                 f"got {idx.numel()} indices starting {idx.flatten()[:8].tolist()}")
        reordered = self.select_idxs(idx)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    # ----------------------------------------------------------------------- device, repr, pickle
    def to(self, device: str | torch.device) -> DataProtoCore:
        """Move the tensors to ``device`` (in place) and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def __repr__(self) -> str:
        tensors = {k: f"{tuple(v.shape)} {v.dtype}" for k, v in self.batch.items()} if self.batch is not None else None
        non_tensors = {k: f"{v.shape} {v.dtype}" for k, v in self.non_tensor_batch.items()}
        device = self.batch.device if self.batch is not None else None
        return (f"{type(self).__name__}(len={len(self)}, batch={tensors}, device={device}, "
                f"non_tensor_batch={non_tensors}, meta_info_keys={sorted(map(str, self.meta_info))})")

    def __getstate__(self) -> dict[str, Any]:
        """Tensors travel as raw uint8 numpy arrays, which pickle 5 (and Ray) send out-of-band."""
        return {"version": _STATE_VERSION, "batch": batch_to_wire(self.batch),
                "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise DataProtoError(f"cannot unpickle DataProto state version {state.get('version')!r}, "
                                 f"this build reads version {_STATE_VERSION}")
        self.batch = batch_from_wire(state["batch"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def equals(self, other: DataProtoCore, check_meta_info: bool = True) -> bool:
        """Same keys, dtypes, shapes and values (NaN equal to NaN); meta_info too unless told not to."""
        if not isinstance(other, DataProtoCore) or len(self) != len(other):
            return False
        if (self.batch is None) != (other.batch is None):
            return False
        if self.batch is not None and (set(self.batch.keys()) != set(other.batch.keys()) or not all(
                values_equal(v, other.batch[k]) for k, v in self.batch.items())):
            return False
        if not values_equal(self.non_tensor_batch, other.non_tensor_batch):
            return False
        return not check_meta_info or values_equal(self.meta_info, other.meta_info)
