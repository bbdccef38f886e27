"""DataProto: the batch container passed between the controller and the workers.

A :class:`DataProto` holds three things:

- ``batch``: a :class:`tensordict.TensorDict` of tensors sharing one leading batch dimension
  (``None`` when the proto carries no tensors);
- ``non_tensor_batch``: a dict of numpy arrays (``dtype=object`` allowed) of that same length;
- ``meta_info``: a plain dict of per-batch values (temperatures, flags, metrics).

The surface follows verl's ``verl.protocol.DataProto`` so that ported workers keep working: the
core container is :mod:`.container`'s :class:`~resilient_rl.protocol.container.DataProtoCore`, and
:mod:`.verl` builds the rest of verl's surface on it as :class:`DataProto`.
Differences are deliberate: every inconsistency raises :class:`~resilient_rl.errors.DataProtoError`
naming the key or the sizes at fault, ``chunk`` never pads on its own (use
:func:`pad_dataproto_to_divisor`), and pickling sends tensors as contiguous numpy buffers so that
Ray (pickle protocol 5) moves them out-of-band instead of copying them into the pickle stream.
"""

from __future__ import annotations

from resilient_rl.protocol.container import DataProtoItem
from resilient_rl.protocol.future import DataProtoFuture
from resilient_rl.protocol.io import (deserialize_single_tensor, deserialize_tensordict, serialize_single_tensor,
                                      serialize_tensordict)
# The helpers live in protocol.utils; the public ones are re-exported here, where verl has them.
from resilient_rl.protocol.utils import DataProtoConfig, union_numpy_dict, union_tensor_dict, values_equal
from resilient_rl.protocol.verl import DataProto, fold_batch_dim, pad_dataproto_to_divisor, unfold_batch_dim, unpad_dataproto

__all__ = ["DataProto", "DataProtoItem", "DataProtoConfig", "DataProtoFuture", "pad_dataproto_to_divisor",
           "unpad_dataproto", "union_tensor_dict", "union_numpy_dict", "values_equal", "fold_batch_dim",
           "unfold_batch_dim", "serialize_single_tensor", "deserialize_single_tensor", "serialize_tensordict",
           "deserialize_tensordict"]
