"""DataProto's batching (resilient_rl.protocol): chunk, split and concat, repeat and reorder,
the mini-batch iterator and its seeded shuffle, and padding to a divisor and back."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.errors import DataProtoError
from resilient_rl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from resilient_rl.testing.dataproto import ids, make, uids


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
