"""verl's DataProto contract, exercised as verl's own protocol tests do (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from resilient_rl import (DataProto, DataProtoConfig, deserialize_single_tensor, deserialize_tensordict,
                          fold_batch_dim, serialize_single_tensor, serialize_tensordict, unfold_batch_dim,
                          union_numpy_dict)
from resilient_rl.errors import DataProtoError


def make(n=6, meta=None):
    return DataProto.from_dict(tensors={"obs": torch.arange(n * 2).reshape(n, 2)},
                               non_tensors={"labels": [f"l{i}" for i in range(n)]}, meta_info=meta or {"k": 1})


def test_errors_are_assertion_errors_too():
    data = make(6)
    with pytest.raises(AssertionError):
        data.chunk(5)
    with pytest.raises(AssertionError):
        DataProto.from_dict(tensors={"a": torch.zeros(4, 3), "b": torch.zeros(4, 2)}, num_batch_dims=2)
    assert issubclass(DataProtoError, ValueError)


def test_from_dict_num_batch_dims_builds_that_batch_size_but_a_proto_keeps_one():
    with pytest.raises(DataProtoError, match="num_batch_dims must be 1 when non_tensors"):
        DataProto.from_dict(tensors={"a": torch.zeros(2, 3)}, non_tensors={"n": [1, 2]}, num_batch_dims=2)
    with pytest.raises(DataProtoError, match="one batch dimension"):
        DataProto.from_dict(tensors={"a": torch.zeros(2, 3)}, num_batch_dims=2)


def test_concat_merges_meta_info_and_per_worker_metrics():
    parts = [DataProto.from_dict(tensors={"x": torch.tensor([i])}, meta_info={"metrics": {"loss": float(i)}, "f": 1})
             for i in range(3)]
    parts[0].meta_info.pop("metrics")  # the first worker reporting nothing loses nobody's metrics
    parts[2].meta_info["only_last"] = "z"
    out = DataProto.concat(parts)
    assert out.meta_info == {"metrics": {"loss": [1.0, 2.0]}, "f": 1, "only_last": "z"}
    lists = [DataProto.from_dict(tensors={"x": torch.tensor([i])}, meta_info={"metrics": [{"a": i}, {"a": -i}]})
             for i in range(2)]
    assert DataProto.concat(lists).meta_info["metrics"] == {"a": [0, 0, 1, -1]}
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'f'"):
        DataProto.concat([parts[1], DataProto.from_dict(tensors={"x": torch.tensor([0])}, meta_info={"f": 2})])


def test_auto_padding_global_and_per_proto(monkeypatch):
    monkeypatch.setattr(type(DataProtoConfig), "_config", {})
    data = make(10)
    assert not data.is_padding_enabled()
    with pytest.raises(DataProtoError):
        data.chunk(4)
    padded = DataProto.from_dict(tensors={"a": torch.arange(10)}, auto_padding=True)
    assert [len(p) for p in padded.chunk(4)] == [3, 3, 3, 1]  # torch.chunk's sizes, as verl
    DataProtoConfig.auto_padding = True
    assert make(10).is_padding_enabled()
    with pytest.raises(DataProtoError, match="must be a bool"):
        DataProtoConfig.auto_padding = 1
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert make(3).is_padding_enabled()


def test_padding_repeats_last_or_first_row():
    data = make(3)
    data.padding(2)
    assert data.batch["obs"][:, 0].tolist() == [0, 2, 4, 4, 4]
    assert data.non_tensor_batch["labels"].tolist() == ["l0", "l1", "l2", "l2", "l2"]
    data = make(3)
    data.padding(1, padding_candidate="first")
    assert data.batch["obs"][:, 0].tolist() == [0, 2, 4, 0]


def test_fold_unfold_batch_dim_roundtrip():
    data = make(6).repeat(2)
    folded = fold_batch_dim(data, new_batch_size=6)
    assert folded.batch["obs"].shape == (6, 2, 2) and folded.non_tensor_batch["labels"].shape == (6, 2)
    back = unfold_batch_dim(folded, batch_dims=2)
    assert back.equals(data)


def test_sample_level_repeat_and_unfold_column_chunks():
    data = make(3)
    rep = data.sample_level_repeat(np.array([2, 0, 1]))
    assert rep.non_tensor_batch["labels"].tolist() == ["l0", "l0", "l2"]
    with pytest.raises(DataProtoError, match="3 rows"):
        data.sample_level_repeat([1, 2])
    cols = DataProto.from_dict(tensors={"w": torch.arange(12).reshape(3, 4), "o": torch.arange(3)},
                               non_tensors={"pairs": [["a", "b"], ["c", "d"], ["e", "f"]]})
    out = cols.unfold_column_chunks(2, split_keys=["w", "pairs"])
    assert out.batch["w"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert out.batch["o"].tolist() == [0, 0, 1, 1, 2, 2]
    assert out.non_tensor_batch["pairs"].tolist() == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"]]


def test_tensordict_roundtrip():
    data = make(4, meta={"name": "x"})
    td = data.to_tensordict()
    assert td["labels"] == ["l0", "l1", "l2", "l3"] and td["name"] == "x"
    back = DataProto.from_tensordict(td)
    assert back.equals(data)


def test_save_and_load_from_disk_without_pickle(tmp_path):
    data = DataProto.from_dict(tensors={"obs": torch.randn(3, 2), "bf": torch.ones(3, dtype=torch.bfloat16)},
                               non_tensors={"labels": ["a", "b", "c"], "nested": [[1], [2, 3], []],
                                            "ints": np.arange(3)},
                               meta_info={"info": "t", "t": (1, 2), "metrics": {"a": [1.0]}})
    path = tmp_path / "d.safetensors"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert loaded.equals(data)
    assert path.read_bytes()[:1] != b"\x80"  # not a pickle stream
    with pytest.raises(DataProtoError, match=r"non_tensor_batch\['obj'\].*object"):
        DataProto.from_dict(non_tensors={"obj": [object()]}).save_to_disk(tmp_path / "x")
    (tmp_path / "bad").write_bytes(b"not a file")
    with pytest.raises(DataProtoError, match="bad"):
        DataProto.load_from_disk(tmp_path / "bad")


def test_serialize_helpers_and_cyclic_union():
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    assert torch.equal(deserialize_single_tensor(serialize_single_tensor(t)), t)
    td = make(2).batch
    assert torch.equal(deserialize_tensordict(serialize_tensordict(td))["obs"], td["obs"])
    a, b = np.array([None], dtype=object), np.array([None], dtype=object)
    a[0], b[0] = a, b
    union_numpy_dict({"x": a}, {"x": b})  # structurally equal cycles: no RecursionError
    with pytest.raises(AssertionError, match="not the same object"):
        union_numpy_dict({"x": np.arange(3)}, {"x": np.arange(3) + 1})
