"""Unit tests of the dispatch/collect functions and @register (no Ray)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from resilient_rl import (DataProto, Dispatch, Execute, collect_all_to_all, collect_dp_compute,
                          collect_dp_compute_data_proto, collect_rank_zero, dispatch_all_to_all, dispatch_dp_compute,
                          dispatch_dp_compute_data_proto, dispatch_dp_compute_data_proto_with_func,
                          dispatch_one_to_all, dispatch_rank_zero, get_predefined_dispatch_fn, register)
from resilient_rl.runtime.dispatch import PAD_SIZE_KEY, registered_methods, resolve_dispatch
from resilient_rl.errors import DispatchError
from resilient_rl.protocol import unpad_dataproto

WG = SimpleNamespace(world_size=4)


def proto(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n).float().unsqueeze(1)},
                               {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)}, {"temp": 1.0})


def test_one_to_all_replicates_every_argument():
    args, kwargs = dispatch_one_to_all(WG, 1, "a", k=[1, 2])
    assert args == ([1, 1, 1, 1], ["a"] * 4)
    assert kwargs == {"k": [[1, 2]] * 4}


def test_all_to_all_and_rank_zero_pass_through():
    assert dispatch_all_to_all(WG, 1, k=2) == ((1,), {"k": 2})
    assert collect_all_to_all(WG, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert dispatch_rank_zero(WG, 5) == ((5,), {})
    assert collect_rank_zero(WG, [7]) == 7


def test_dp_compute_requires_one_entry_per_rank():
    args, kwargs = dispatch_dp_compute(WG, [1, 2, 3, 4], k=[5, 6, 7, 8])
    assert args == ([1, 2, 3, 4],) and kwargs == {"k": [5, 6, 7, 8]}
    with pytest.raises(DispatchError, match=r"'args\[0\]'.*world size 4.*length 3"):
        dispatch_dp_compute(WG, [1, 2, 3])
    with pytest.raises(DispatchError, match="'k'.*int"):
        dispatch_dp_compute(WG, k=3)
    assert collect_dp_compute(WG, [1, 2, 3, 4]) == [1, 2, 3, 4]
    with pytest.raises(DispatchError, match="expected 4 outputs"):
        collect_dp_compute(WG, [1])


def test_dp_compute_proto_splits_evenly_without_padding():
    (chunks,), kwargs = dispatch_dp_compute_data_proto(WG, proto(8))
    assert PAD_SIZE_KEY not in kwargs
    assert [len(c) for c in chunks] == [2, 2, 2, 2]
    assert chunks[3].batch["x"].flatten().tolist() == [6.0, 7.0]
    merged = collect_dp_compute_data_proto(WG, chunks)
    assert merged.equals(proto(8))


def test_dp_compute_proto_pads_uneven_and_unpads_on_collect():
    (chunks,), kwargs = dispatch_dp_compute_data_proto(WG, proto(6))
    pad = kwargs[PAD_SIZE_KEY]
    assert pad == 2 and [len(c) for c in chunks] == [2, 2, 2, 2]
    merged = unpad_dataproto(collect_dp_compute_data_proto(WG, chunks), pad)
    assert merged.equals(proto(6))


def test_dp_compute_proto_padding_off_is_an_error():
    data = proto(7)
    data.meta_info["auto_padding"] = False
    with pytest.raises(DispatchError, match="length 7 cannot be split into 4"):
        dispatch_dp_compute_data_proto(WG, data)


def test_dp_compute_proto_rejects_mismatched_lengths_and_non_protos():
    with pytest.raises(DispatchError, match="same length"):
        dispatch_dp_compute_data_proto(WG, proto(4), proto(8))
    with pytest.raises(DispatchError, match="must be a DataProto"):
        dispatch_dp_compute_data_proto(WG, [1, 2, 3, 4])
    with pytest.raises(DispatchError, match="rank 1 returned a int"):
        collect_dp_compute_data_proto(WG, [proto(1), 3, proto(1), proto(1)])


def test_dp_compute_proto_with_func_replicates_the_function():
    def f(x):
        return x

    (funcs, chunks), kwargs = dispatch_dp_compute_data_proto_with_func(WG, f, proto(4))
    assert funcs == [f] * 4 and [len(c) for c in chunks] == [1, 1, 1, 1]
    with pytest.raises(DispatchError, match="function as its first argument"):
        dispatch_dp_compute_data_proto_with_func(WG, proto(4))


def test_predefined_and_custom_modes_resolve():
    assert get_predefined_dispatch_fn(Dispatch.DP_COMPUTE_METRIC)["collect_fn"] is collect_dp_compute
    custom = {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_rank_zero}
    assert resolve_dispatch(custom) is custom
    with pytest.raises(DispatchError, match="missing collect_fn"):
        resolve_dispatch({"dispatch_fn": dispatch_one_to_all})
    with pytest.raises(DispatchError, match="unknown dispatch mode"):
        resolve_dispatch("fast")


def test_register_records_settings_and_hides_pad_key():
    class C:
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.ALL, blocking=False)
        def work(self, data):
            return data

        def plain(self):
            return 1

    found = registered_methods(C)
    assert set(found) == {"work"}
    assert found["work"] == {"dispatch_mode": Dispatch.DP_COMPUTE_PROTO, "execute_mode": Execute.ALL,
                             "blocking": False}
    assert C().work(3, **{PAD_SIZE_KEY: 2}) == 3
    with pytest.raises(DispatchError, match="execute_mode"):
        register(execute_mode="all")


def test_a_collective_failure_is_typed_where_the_call_ends(monkeypatch):
    """A worker call that ends with torch's distributed error (or a backend's transport error)
    raises a CollectiveError naming its rank, and leaves its group's collectives; any other error
    is the method's own and passes unchanged."""
    from resilient_rl.errors import CollectiveError
    from resilient_rl.runtime import leave_collective

    left = []
    monkeypatch.setattr(leave_collective, "leave_collectives", lambda reason="": left.append(reason) or 0)

    class Rank:
        rank = 3

        @register()
        def fail(self, exc):
            raise exc

    with pytest.raises(CollectiveError, match="rank 3: collective failed: DistBackendError") as info:
        Rank().fail(torch.distributed.DistBackendError("peer 1 gone"))
    assert info.value.rank == 3 and info.value.cause == "collective"
    assert isinstance(info.value.__cause__, torch.distributed.DistBackendError)
    with pytest.raises(CollectiveError):
        Rank().fail(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"))
    assert left == ["fail raised DistBackendError", "fail raised RuntimeError"]
    with pytest.raises(ValueError, match="a bug"):  # the method's own error: not a peer's failure
        Rank().fail(ValueError("a bug"))
    assert len(left) == 2
