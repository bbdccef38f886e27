"""Unit tests for resilient_rl.protocol (DataProto and its helpers)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from resilient_rl.errors import DataProtoError
from resilient_rl.protocol import (
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
    union_numpy_dict,
    union_tensor_dict,
    values_equal,
)


def make(n: int = 6, meta: dict | None = None) -> DataProto:
    """Rows are identifiable: row i has ids == i, obs == [2i, 2i+1], uid == f"u{i}"."""
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n), "obs": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info={"temperature": 0.7} if meta is None else meta,
    )


def ids(data: DataProto) -> list[int]:
    return data.batch["ids"].tolist()


def uids(data: DataProto) -> list[str]:
    return data.non_tensor_batch["uid"].tolist()


# ------------------------------------------------------------------------------ construction
def test_from_dict_builds_consistent_proto():
    data = DataProto.from_dict(tensors={"x": torch.zeros(3, 4)}, non_tensors={"msgs": [[1, 2], [3, 4], [5, 6]]},
                               meta_info={"k": 1})
    assert len(data) == 3
    assert data.batch.batch_size == torch.Size([3])
    msgs = data.non_tensor_batch["msgs"]
    # a list of equal-length lists must stay one cell per row, not become a 2-D array
    assert msgs.shape == (3,) and msgs.dtype == object and msgs[1] == [3, 4]
    assert data.meta_info == {"k": 1}


def test_from_dict_rejects_mismatched_tensor_lengths():
    with pytest.raises(DataProtoError, match=r"'b' has length 2 but 'a' has 3"):
        DataProto.from_dict(tensors={"a": torch.zeros(3), "b": torch.zeros(2)})


def test_from_dict_rejects_scalar_tensor_and_bad_non_tensor():
    with pytest.raises(DataProtoError, match="'s'"):
        DataProto.from_dict(tensors={"s": torch.tensor(1.0)})
    with pytest.raises(DataProtoError, match="'n'.*int"):
        DataProto.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"n": 5})


def test_non_tensor_length_mismatch_names_key():
    with pytest.raises(DataProtoError, match=r"'uid' has length 2, expected 3"):
        DataProto.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    with pytest.raises(DataProtoError, match=r"'b' has length 4, expected 3"):
        DataProto(non_tensor_batch={"a": np.zeros(3), "b": np.zeros(4)})


def test_constructor_checks_types_and_batch_dims():
    with pytest.raises(DataProtoError, match="one batch dimension"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(DataProtoError, match="'x'.*numpy array"):
        DataProto(batch=TensorDict({"a": torch.zeros(2)}, batch_size=[2]), non_tensor_batch={"x": [1, 2]})
    with pytest.raises(DataProtoError, match="TensorDict"):
        DataProto(batch={"a": torch.zeros(2)})
    td = TensorDict({"a": torch.zeros(2)}, batch_size=[2])
    td["name"] = "not a tensor"
    with pytest.raises(DataProtoError, match="'name'"):
        DataProto(batch=td)


def test_from_single_dict_splits_tensors_and_arrays():
    data = DataProto.from_single_dict({"a": torch.ones(2), "b": np.array(["x", "y"], dtype=object)},
                                      meta_info={"m": 3})
    assert list(data.batch.keys()) == ["a"]
    assert list(data.non_tensor_batch) == ["b"]
    assert data.meta_info == {"m": 3}
    with pytest.raises(DataProtoError, match="'c'.*list"):
        DataProto.from_single_dict({"a": torch.ones(2), "c": [1, 2]})


def test_lengths_of_partial_protos():
    assert len(DataProto()) == 0
    assert len(DataProto(meta_info={"a": 1})) == 0
    assert len(DataProto(non_tensor_batch={"a": np.arange(5)})) == 5
    only_tensors = DataProto.from_dict(tensors={"a": torch.zeros(4)})
    assert len(only_tensors) == 4 and only_tensors.non_tensor_batch == {}


# ---------------------------------------------------------------------------------- indexing
def test_int_index_returns_item():
    data = make()
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].item() == 2 and item.batch["obs"].tolist() == [4.0, 5.0]
    assert item.non_tensor_batch == {"uid": "u2"}
    assert item.meta_info == {"temperature": 0.7}
    assert data[-1].batch["ids"].item() == 5
    assert data[np.int64(1)].non_tensor_batch["uid"] == "u1"
    with pytest.raises(IndexError, match="6"):
        data[6]
    assert [it.non_tensor_batch["uid"] for it in data] == uids(data)


def test_slice_and_index_arrays_return_protos():
    data = make()
    for index, expected in [(slice(1, 4), [1, 2, 3]), (slice(None, None, 2), [0, 2, 4]), ([5, 0, 5], [5, 0, 5]),
                            (np.array([3, 1]), [3, 1]), (torch.tensor([4, 2]), [4, 2]),
                            (np.array([True, False, False, False, False, True]), [0, 5]),
                            (torch.tensor([False, True, False, False, False, False]), [1]), ([], [])]:
        part = data[index]
        assert isinstance(part, DataProto)
        assert ids(part) == expected
        assert uids(part) == [f"u{i}" for i in expected]
        assert part.meta_info == data.meta_info and part.meta_info is not data.meta_info


def test_bad_indices_raise():
    data = make()
    with pytest.raises(DataProtoError, match="mask has length 2"):
        data[np.array([True, False])]
    with pytest.raises(DataProtoError, match="integers or booleans"):
        data[torch.tensor([0.0, 1.0])]
    with pytest.raises(TypeError, match="str"):
        data["ids"]


# ------------------------------------------------------------------------------ select / pop
def test_select_subsets_and_shares_tensors():
    data = make(meta={"a": 1, "b": 2})
    sub = data.select(batch_keys=["obs"], non_tensor_batch_keys=[], meta_info_keys=["b"])
    assert list(sub.batch.keys()) == ["obs"]
    assert sub.non_tensor_batch == {}
    assert sub.meta_info == {"b": 2}
    sub.batch["obs"][0, 0] = -1.0  # shared storage without deepcopy, as in verl
    assert data.batch["obs"][0, 0].item() == -1.0
    sub.batch["new"] = torch.zeros(6)  # but the containers are separate
    assert "new" not in data.batch.keys()


def test_select_deepcopy_is_independent():
    data = make()
    sub = data.select(deepcopy=True)
    assert sub.equals(data)
    sub.batch["obs"][0, 0] = -1.0
    sub.non_tensor_batch["uid"][0] = "changed"
    assert data.batch["obs"][0, 0].item() == 0.0 and data.non_tensor_batch["uid"][0] == "u0"


@pytest.mark.parametrize("kwargs,kind,key", [({"batch_keys": ["nope"]}, "batch", "nope"),
                                             ({"non_tensor_batch_keys": ["zz"]}, "non_tensor_batch", "zz"),
                                             ({"meta_info_keys": ["mm"]}, "meta_info", "mm")])
def test_select_and_pop_missing_keys_name_them(kwargs, kind, key):
    data = make()
    with pytest.raises(DataProtoError, match=rf"{kind} has no key\(s\) \['{key}'\]"):
        data.select(**kwargs)
    with pytest.raises(DataProtoError, match=key):
        data.pop(batch_keys=["ids"], **kwargs) if "batch_keys" not in kwargs else data.pop(**kwargs)
    assert set(data.batch.keys()) == {"ids", "obs"}  # a failed pop removes nothing


def test_pop_removes_and_returns():
    data = make(meta={"a": 1, "b": 2})
    popped = data.pop(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert list(popped.batch.keys()) == ["obs"] and len(popped) == 6
    assert uids(popped) == [f"u{i}" for i in range(6)]
    assert popped.meta_info == {"a": 1}
    assert list(data.batch.keys()) == ["ids"] and data.non_tensor_batch == {} and data.meta_info == {"b": 2}
    assert len(data) == 6


def test_rename():
    data = make()
    assert data.rename("obs", "observation") is data
    data.rename(["observation", "uid"], ["o", "u"])
    assert set(data.batch.keys()) == {"ids", "o"} and list(data.non_tensor_batch) == ["u"]
    with pytest.raises(DataProtoError, match="'missing'"):
        data.rename("missing", "x")
    with pytest.raises(DataProtoError, match="'ids' already exists"):
        data.rename("o", "ids")
    with pytest.raises(DataProtoError, match="as many new keys"):
        data.rename(["o", "ids"], ["a"])


# ------------------------------------------------------------------------------------ union
def test_union_merges_keys_and_accepts_equal_values():
    a = make(meta={"m": 1})
    b = DataProto.from_dict(tensors={"ids": torch.arange(6), "adv": torch.ones(6)},
                            non_tensors={"uid": np.array([f"u{i}" for i in range(6)], dtype=object),
                                         "score": np.array([float("nan")] * 6)},
                            meta_info={"m": 1, "n": 2})
    out = a.union(b)
    assert out is a
    assert set(a.batch.keys()) == {"ids", "obs", "adv"}
    assert set(a.non_tensor_batch) == {"uid", "score"}  # NaN == NaN for union purposes
    assert a.meta_info == {"m": 1, "n": 2}


def test_union_meta_only_side():
    data = make()
    data.union(DataProto(meta_info={"step": 3}))
    assert data.meta_info == {"temperature": 0.7, "step": 3} and len(data) == 6
    empty = DataProto().union(make(2))
    assert ids(empty) == [0, 1] and uids(empty) == ["u0", "u1"]


@pytest.mark.parametrize("other,pattern", [
    (lambda: DataProto.from_dict(tensors={"ids": torch.arange(6) + 1}), "batch key 'ids'"),
    (lambda: DataProto.from_dict(tensors={"ids": torch.arange(6, dtype=torch.int32)}), "batch key 'ids'"),
    (lambda: DataProto(non_tensor_batch={"uid": np.array(["x"] * 6, dtype=object)}), "non-tensor key 'uid'"),
    (lambda: DataProto(meta_info={"temperature": 1.0}), "meta_info key 'temperature'"),
    (lambda: make(4), "lengths 6 and 4"),
])
def test_union_conflicts_raise_and_leave_self_unchanged(other, pattern):
    data = make()
    before = data.select(deepcopy=True)
    with pytest.raises(DataProtoError, match=pattern):
        data.union(other())
    assert data.equals(before)


def test_union_helpers():
    td = union_tensor_dict(TensorDict({"a": torch.ones(2)}, batch_size=[2]),
                           TensorDict({"a": torch.ones(2), "b": torch.zeros(2)}, batch_size=[2]))
    assert set(td.keys()) == {"a", "b"}
    with pytest.raises(DataProtoError, match="batch sizes"):
        union_tensor_dict(TensorDict({}, batch_size=[2]), TensorDict({}, batch_size=[3]))
    assert union_numpy_dict({"a": np.arange(2)}, {"b": np.arange(2)}).keys() == {"a", "b"}
    with pytest.raises(DataProtoError, match="'a'"):
        union_numpy_dict({"a": np.arange(2)}, {"a": np.arange(2) + 1})
    assert not values_equal(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert values_equal(np.array([{"x": [1.0, float("nan")]}], dtype=object),
                        np.array([{"x": [1.0, float("nan")]}], dtype=object))


# ------------------------------------------------------------------- chunk / split / concat
def test_chunk_even_and_uneven():
    parts = make(6).chunk(3)
    assert [ids(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [uids(p) for p in parts][2] == ["u4", "u5"]
    assert all(p.meta_info == {"temperature": 0.7} for p in parts)
    with pytest.raises(DataProtoError, match="length 7 into 4 equal chunks"):
        make(7).chunk(4)
    with pytest.raises(DataProtoError, match="chunks must be a positive integer"):
        make(6).chunk(0)


def test_split():
    parts = make(7).split(3)
    assert [ids(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert make(0).split(2) == []
    with pytest.raises(DataProtoError, match="split_size"):
        make(2).split(-1)


def test_concat_roundtrips_chunks_and_merges_meta_as_verl():
    data = make(6)
    parts = data.chunk(3)
    parts[1].meta_info["other"] = True  # a key of one part only is kept (verl merges meta_info)
    joined = DataProto.concat(parts)
    assert joined.equals(data, check_meta_info=False)
    assert joined.meta_info == {**data.meta_info, "other": True}
    assert joined.meta_info is not data.meta_info
    parts[2].meta_info["other"] = False
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'other'"):
        DataProto.concat(parts)


def test_concat_errors():
    with pytest.raises(DataProtoError, match="empty list"):
        DataProto.concat([])
    with pytest.raises(DataProtoError, match="part 1 has batch keys"):
        DataProto.concat([make(2), make(2).select(batch_keys=["ids"])])
    with pytest.raises(DataProtoError, match="part 1 has non-tensor keys"):
        DataProto.concat([make(2), make(2).select(non_tensor_batch_keys=[])])
    with pytest.raises(DataProtoError, match="batch key 'x'"):
        DataProto.concat([DataProto.from_dict({"x": torch.zeros(2, 3)}), DataProto.from_dict({"x": torch.zeros(2, 4)})])


# --------------------------------------------------------------------------- repeat / reorder
def test_repeat_interleave_and_tile():
    data = make(3)
    inter = data.repeat(2, interleave=True)
    assert ids(inter) == [0, 0, 1, 1, 2, 2]
    assert uids(inter) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert inter.batch["obs"][:, 0].tolist() == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0]
    tiled = data.repeat(2, interleave=False)
    assert ids(tiled) == [0, 1, 2, 0, 1, 2]
    assert uids(tiled) == ["u0", "u1", "u2", "u0", "u1", "u2"]
    assert tiled.batch["obs"].tolist() == data.batch["obs"].tolist() * 2
    assert tiled.meta_info == data.meta_info
    with pytest.raises(DataProtoError, match="repeat_times"):
        data.repeat(0)


def test_reorder_in_place():
    data = make(4)
    assert data.reorder(torch.tensor([2, 0, 3, 1])) is None
    assert ids(data) == [2, 0, 3, 1] and uids(data) == ["u2", "u0", "u3", "u1"]
    data.reorder([1, 3, 0, 2])
    assert ids(data) == [0, 1, 2, 3]
    with pytest.raises(DataProtoError, match="permutation of range\\(4\\)"):
        data.reorder(torch.tensor([0, 0, 1, 2]))
    with pytest.raises(DataProtoError, match="permutation"):
        data.reorder([0, 1])


# ------------------------------------------------------------------------------ make_iterator
def _epoch_orders(data: DataProto, **kwargs) -> list[list[int]]:
    return [ids(mb) for mb in data.make_iterator(**kwargs)]


def test_iterator_without_seed_is_in_order():
    batches = list(make(6).make_iterator(mini_batch_size=2, epochs=2))
    assert [ids(b) for b in batches] == [[0, 1], [2, 3], [4, 5]] * 2
    assert all(b.meta_info == {"temperature": 0.7} for b in batches)
    assert all(uids(b) == [f"u{i}" for i in ids(b)] for b in batches)


def test_iterator_seeded_shuffle_is_deterministic():
    data = make(8)
    first = _epoch_orders(data, mini_batch_size=2, epochs=3, seed=7)
    assert first == _epoch_orders(data, mini_batch_size=2, epochs=3, seed=7)
    assert first != _epoch_orders(data, mini_batch_size=2, epochs=3, seed=8)
    epochs = [sum(first[i:i + 4], []) for i in range(0, 12, 4)]
    assert all(sorted(e) == list(range(8)) for e in epochs)  # every epoch visits every row once
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # epochs are reshuffled
    assert epochs[0] != list(range(8))
    for mb in data.make_iterator(mini_batch_size=4, epochs=1, seed=7):  # rows stay aligned
        assert uids(mb) == [f"u{i}" for i in ids(mb)]
        assert mb.batch["obs"][:, 0].tolist() == [2.0 * i for i in ids(mb)]


def test_iterator_shuffle_flag_and_errors():
    data = make(4)
    assert _epoch_orders(data, mini_batch_size=2, epochs=1, seed=3, dataloader_kwargs={"shuffle": False}) == \
        [[0, 1], [2, 3]]
    with pytest.raises(DataProtoError, match="length 4 is not divisible by mini_batch_size 3"):
        data.make_iterator(mini_batch_size=3, epochs=1)
    with pytest.raises(DataProtoError, match="sampler"):
        data.make_iterator(mini_batch_size=2, epochs=1, dataloader_kwargs={"sampler": None})
    with pytest.raises(DataProtoError, match="epochs"):
        data.make_iterator(mini_batch_size=2, epochs=-1)
    assert list(data.make_iterator(mini_batch_size=2, epochs=0)) == []


# ----------------------------------------------------------------------------- device / repr
def test_to_and_repr():
    data = make(2)
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")
    text = repr(data)
    assert "len=2" in text and "'obs'" in text and "'uid'" in text and "temperature" in text


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


# ------------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("n,divisor,expected_pad", [(7, 4, 1), (5, 4, 3), (3, 8, 5), (1, 3, 2), (8, 4, 0)])
def test_pad_chunk_concat_unpad_roundtrip(n, divisor, expected_pad):
    data = make(n)
    padded, pad = pad_dataproto_to_divisor(data, divisor)
    assert pad == expected_pad and len(padded) == n + pad
    assert ids(padded)[n:] == [i % n for i in range(pad)]  # rows repeated from the start, cyclically
    assert uids(padded)[n:] == [f"u{i % n}" for i in range(pad)]
    assert padded.meta_info == data.meta_info
    parts = padded.chunk(divisor)
    assert len({len(p) for p in parts}) == 1
    restored = unpad_dataproto(DataProto.concat(parts), pad)
    assert restored.equals(data)
    assert len(data) == n  # the input is not modified


def test_padding_edge_cases():
    data = make(4)
    padded, pad = pad_dataproto_to_divisor(data, 2)
    assert padded is data and pad == 0
    assert unpad_dataproto(data, 0) is data
    empty = make(0)
    assert pad_dataproto_to_divisor(empty, 3) == (empty, 0)
    with pytest.raises(DataProtoError, match=r"pad_size must be an integer in \[0, 4\]"):
        unpad_dataproto(data, 5)
    with pytest.raises(DataProtoError, match="size_divisor"):
        pad_dataproto_to_divisor(data, 0)
