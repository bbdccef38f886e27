"""DataProto's serialization (resilient_rl.protocol): tensors sent out of band under pickle
protocol 5, bit-exact bfloat16, received buffers copied rather than written through, default
pickle and deepcopy, and the states a receiver refuses."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from resilient_rl.errors import DataProtoError
from resilient_rl.protocol import DataProto
from resilient_rl.testing.dataproto import ids, make, uids


# ----------------------------------------------------------------------------- serialization
def _pickle5(obj, as_bytes: bool = False):
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    sent = [bytes(b.raw()) for b in buffers] if as_bytes else buffers
    return stream, buffers, pickle.loads(stream, buffers=sent)


def test_pickle5_sends_tensors_out_of_band():
    n = 64
    data = DataProto.from_dict(tensors={"x": torch.randn(n, 256), "m": torch.ones(n, 256, dtype=torch.bool)},
                               non_tensors={"uid": np.array([str(i) for i in range(n)], dtype=object)},
                               meta_info={"step": 1})
    tensor_bytes = n * 256 * 4 + n * 256
    stream, buffers, restored = _pickle5(data)
    assert sum(b.raw().nbytes for b in buffers) == tensor_bytes
    assert len(stream) < tensor_bytes // 20
    assert restored.equals(data)
    assert restored.batch.batch_size == torch.Size([n]) and restored.batch.device is None


def test_pickle5_bfloat16_roundtrip_is_bit_exact():
    x = torch.tensor([[1.5, -0.0, float("inf")], [float("nan"), 3.0e38, 1e-40]], dtype=torch.bfloat16)
    data = DataProto.from_dict(tensors={"x": x, "y": torch.arange(2, dtype=torch.int16)}).to("cpu")
    _, buffers, restored = _pickle5(data, as_bytes=True)
    assert buffers
    out = restored.batch["x"]
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    assert restored.batch.device == torch.device("cpu") and restored.batch.batch_size == torch.Size([2])


def test_unpickled_tensors_own_writable_memory_and_views_send_only_their_rows():
    big = make(100)
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(big[10:12], protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) == 2 * 8 + 2 * 2 * 4  # ids int64 + obs 2 x float32
    received = [bytes(b.raw()) for b in buffers]  # read-only, like buffers from an object store
    snapshot = [bytes(bytearray(r)) for r in received]
    restored = pickle.loads(stream, buffers=received)
    restored.batch["obs"] += 1
    restored.batch["ids"] *= 0
    assert received == snapshot  # the received buffers were copied, never written through
    assert restored.batch["obs"].tolist() == [[21.0, 22.0], [23.0, 24.0]] and ids(restored) == [0, 0]
    assert restored.meta_info == {"temperature": 0.7} and uids(restored) == ["u10", "u11"]


def test_default_pickle_deepcopy_and_non_contiguous_tensors():
    data = DataProto.from_dict(tensors={"t": torch.arange(12.0).reshape(3, 4).t().contiguous().t()},
                               meta_info={"a": [1, 2]})
    assert not data.batch["t"].is_contiguous()
    for restored in (pickle.loads(pickle.dumps(data)), copy.deepcopy(data)):
        assert restored.equals(data)
    empty = pickle.loads(pickle.dumps(DataProto(meta_info={"only": "meta"})))
    assert empty.batch is None and empty.non_tensor_batch == {} and empty.meta_info == {"only": "meta"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
def test_cuda_batch_arriving_without_cuda_names_the_key():
    state = make(2).__getstate__()
    state["batch"]["tensors"] = [(k, dt, sh, torch.device("cuda", 0), raw) for k, dt, sh, _, raw
                                 in state["batch"]["tensors"]]
    with pytest.raises(DataProtoError, match="batch key 'ids' on cuda:0"):
        DataProto.__new__(DataProto).__setstate__(state)


def test_unknown_state_version_is_rejected():
    data = make(2)
    state = data.__getstate__()
    state["version"] = 99
    with pytest.raises(DataProtoError, match="version 99"):
        DataProto.__new__(DataProto).__setstate__(state)
