"""Unit tests for resilient_rl.protocol (DataProto and its helpers): construction, indexing,
select/pop/rename and union. Chunking, concatenation, iteration and padding are tested in
test_protocol_batching.py, pickling in test_protocol_serialization.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from resilient_rl.errors import DataProtoError
from resilient_rl.protocol import DataProto, DataProtoItem, union_numpy_dict, union_tensor_dict, values_equal
from resilient_rl.testing.dataproto import ids, make, uids


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


# ----------------------------------------------------------------------------- device / repr
def test_to_and_repr():
    data = make(2)
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")
    text = repr(data)
    assert "len=2" in text and "'obs'" in text and "'uid'" in text and "temperature" in text

