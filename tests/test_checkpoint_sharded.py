"""Sharded save/load: state flattening, safetensors files, resharding of FSDP2 state across
world sizes (2 -> 1, 2, 4 ranks), local disk / memory:// / S3 (moto), corruption detection,
no unpickling on load, and the background writer."""

from __future__ import annotations

import os
import pickle
import tempfile
import uuid

import pytest
import torch

from resilient_rl.checkpoint import (
    AsyncShardWriter, CheckpointManager, FileRecord, Storage, flatten_state, gather_full_state,
    load_shard_into, stage, unflatten_state, write_shard,
)
from resilient_rl.errors import CheckpointCorruptError, CheckpointError, CheckpointTimeoutError, StorageError
from resilient_rl.faults.storage import FaultPlan, FaultyFileSystem




@pytest.fixture()
def s3(moto):
    if isinstance(moto, str):
        pytest.skip(f"moto_server cannot start here: {moto}")
    return moto


@pytest.fixture(params=["local", "memory", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return Storage(str(tmp_path))
    if request.param == "memory":
        return Storage(f"memory://ckpt-{uuid.uuid4().hex}")
    server = request.getfixturevalue("s3")
    return Storage(f"s3://ckpt/{uuid.uuid4().hex}", server.storage_options)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"layers.0.weight": torch.randn(5, 3, generator=g), "layers.0.bias": torch.randn(5, generator=g),
                  "emb": torch.randn(7, 2, generator=g).to(torch.bfloat16)},
        "optim": {"state": {"layers.0.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["layers.0.weight"]}]},
        "counters": {"mask": torch.tensor([True, False, True]), "ids": torch.arange(4, dtype=torch.int64)},
        "step": 12,
    }


def _zeros_like(state):
    tensors, extras = flatten_state(state)
    return unflatten_state({k: torch.zeros_like(t) for k, t in tensors.items()}, extras)


def _assert_state_equal(a, b):
    ta, ea = flatten_state(a)
    tb, eb = flatten_state(b)
    assert ea == eb
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


# --------------------------------------------------------------------------- flattening
def test_flatten_round_trip_keeps_structure_and_types():
    state = {"a/b": {"~x": torch.ones(2)}, 3: ["s", 1, 2.5, None, True], "t": (1, (2, 3), torch.zeros(1)),
             "empty": {}, "nested": [{"k": torch.arange(3)}], "py_rng": (3, tuple(range(5)), None)}
    tensors, extras = flatten_state(state)
    assert set(tensors) == {"a~1b/~0x", "t/2", "nested/0/k"}
    back = unflatten_state(tensors, extras)
    assert back[3] == ["s", 1, 2.5, None, True]
    assert back["t"][1] == (2, 3) and isinstance(back["t"], tuple)
    assert back["py_rng"] == (3, (0, 1, 2, 3, 4), None)
    assert back["empty"] == {} and list(back) == list(state)
    assert torch.equal(back["a/b"]["~x"], torch.ones(2))


def test_flatten_refuses_arbitrary_objects_naming_the_key():
    import numpy as np

    with pytest.raises(CheckpointError, match="optim/extra"):
        flatten_state({"optim": {"extra": np.zeros(3)}})
    with pytest.raises(CheckpointError, match="obj"):
        flatten_state({"obj": object()})


# --------------------------------------------------------------------------- single-process round trips
def test_round_trip_on_every_backend(storage):
    state = _state()
    records = write_shard(stage(state, 0, world_size=1), storage, "run/actor", 0)
    assert [r.path for r in records] == ["shard_00000.safetensors", "shard_00000.json"]
    loaded = load_shard_into(_zeros_like(state), storage, "run/actor", records)
    _assert_state_equal(loaded, state)
    full = gather_full_state(storage, "run/actor", records, prefix="model")
    assert set(full) == {"layers.0.weight", "layers.0.bias", "emb"}
    assert torch.equal(full["emb"], state["model"]["emb"])


def test_files_are_standard_safetensors(tmp_path):
    from safetensors import safe_open

    state = _state()
    write_shard(stage(state, 0, world_size=1), Storage(str(tmp_path)), "actor", 0)
    with safe_open(str(tmp_path / "actor" / "shard_00000.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model/emb"), state["model"]["emb"])
        assert torch.equal(f.get_tensor("counters/mask"), state["counters"]["mask"])
        assert f.get_slice("model/layers.0.weight")[1:3].shape == (2, 3)


def test_plain_tensors_are_written_by_rank_zero_and_rank_local_by_every_rank(tmp_path):
    st = Storage(str(tmp_path))
    records = []
    for rank in range(2):
        state = {"w": torch.full((3,), 7.0), "rng": {"torch": torch.full((4,), rank, dtype=torch.uint8),
                                                       "seed": 100 + rank}}
        staged = stage(state, rank, world_size=2, rank_local=("rng",))
        assert ("w" in staged.tensors) == (rank == 0)
        records += write_shard(staged, st, "actor", rank)
    for rank in range(3):  # rank 2 of a larger world reads rank 0's (2 % 2) rank-local part
        template = {"w": torch.zeros(3), "rng": {"torch": torch.zeros(4, dtype=torch.uint8), "seed": 0}}
        out = load_shard_into(template, st, "actor", records, rank=rank)
        assert torch.equal(out["w"], torch.full((3,), 7.0))
        assert out["rng"]["seed"] == 100 + rank % 2
        assert torch.equal(out["rng"]["torch"], torch.full((4,), rank % 2, dtype=torch.uint8))


def test_missing_key_shape_mismatch_and_unexpected_key(tmp_path):
    st = Storage(str(tmp_path))
    records = write_shard(stage({"a": torch.ones(4, 2)}, 0, world_size=1), st, "actor", 0)
    with pytest.raises(CheckpointCorruptError, match=r"actor.*'b'"):
        load_shard_into({"a": torch.zeros(4, 2), "b": torch.zeros(1)}, st, "actor", records)
    with pytest.raises(CheckpointCorruptError, match=r"actor.*'a'.*shape \[4, 2\]"):
        load_shard_into({"a": torch.zeros(4, 3)}, st, "actor", records)
    with pytest.raises(CheckpointError, match="'a'"):
        load_shard_into({}, st, "actor", records)
    assert torch.equal(load_shard_into({}, st, "actor", records, strict=False)["a"], torch.ones(4, 2))


def test_flipped_byte_is_caught_when_loading(tmp_path):
    st = Storage(str(tmp_path))
    state = {"a": torch.arange(64, dtype=torch.float32)}
    records = write_shard(stage(state, 0, world_size=1), st, "actor", 0)
    path = tmp_path / "actor" / "shard_00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"actor.*shard_00000\.safetensors.*sha256"):
        load_shard_into({"a": torch.zeros(64)}, st, "actor", records)
    # Without verification the damage goes unnoticed: the check above is what caught it.
    out = load_shard_into({"a": torch.zeros(64)}, st, "actor", records, verify=False)
    assert not torch.equal(out["a"], state["a"])
    short = [FileRecord(r.path, r.size + 1, r.sha256) for r in records]
    with pytest.raises(CheckpointCorruptError, match="size"):
        load_shard_into({"a": torch.zeros(64)}, st, "actor", short)


def _forbid(*_a, **_k):
    raise AssertionError("a checkpoint load must not unpickle")


def _patch_unpickling(monkeypatch):
    monkeypatch.setattr(pickle, "load", _forbid)
    monkeypatch.setattr(pickle, "loads", _forbid)
    monkeypatch.setattr(pickle, "Unpickler", _forbid)
    monkeypatch.setattr(torch, "load", _forbid)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    st = Storage(str(tmp_path))
    state = _state()
    manager = CheckpointManager(str(tmp_path), "run")
    records = write_shard(stage(state, 0, world_size=1), st, manager.role_dir(1, "actor"), 0)
    manager.commit(1, {"actor": records}, {"actor": 1})
    _patch_unpickling(monkeypatch)
    step = manager.find_latest_valid()
    loaded = load_shard_into(_zeros_like(state), st, manager.role_dir(step, "actor"), manager.role_files(step, "actor"))
    _assert_state_equal(loaded, state)
    assert set(gather_full_state(st, manager.role_dir(step, "actor")))


# --------------------------------------------------------------------------- background writer
def test_staging_copies_so_live_updates_do_not_leak(tmp_path):
    live = {"w": torch.zeros(1000), "b": torch.ones(3)}
    with AsyncShardWriter() as writer:
        staged = stage(live, 0, world_size=1)
        live["w"].add_(5.0)  # the next training step mutates in place
        live["b"].zero_()
        records = writer.submit(staged, Storage(str(tmp_path)), "actor", 0).result(timeout=60)
    out = load_shard_into({"w": torch.empty(1000), "b": torch.empty(3)}, Storage(str(tmp_path)), "actor", records)
    assert torch.equal(out["w"], torch.zeros(1000)) and torch.equal(out["b"], torch.ones(3))


def test_stage_and_submit_saves_each_state_exactly_while_reusing_buffers(tmp_path):
    st = Storage(str(tmp_path))
    live = {"w": torch.zeros(4096), "n": 0}
    futures = []
    with AsyncShardWriter() as writer:
        for i in range(3):
            live["w"].fill_(float(i))
            live["n"] = i
            futures.append(writer.stage_and_submit(live, st, f"s{i}", 0))
            live["w"].fill_(-1.0)  # training moves on while the save is written
        records = [f.result(timeout=60) for f in futures]
    for i, recs in enumerate(records):
        out = load_shard_into({"w": torch.empty(4096), "n": 0}, st, f"s{i}", recs)
        assert torch.equal(out["w"], torch.full((4096,), float(i))) and out["n"] == i


def test_whole_step_manifest_list_selects_the_role_folder(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run")
    st = Storage(str(tmp_path))
    files = {role: write_shard(stage({"w": torch.full((3,), float(k))}, 0, world_size=1), st,
                               manager.role_dir(4, role), 0) for k, role in enumerate(("actor", "critic"))}
    manager.write_trainer_state(4, {"step": 4})
    manager.commit(4, files, {"actor": 1, "critic": 1})
    step_files = list(manager.load_manifest(4).files)
    out = load_shard_into({"w": torch.zeros(3)}, st, manager.role_dir(4, "critic"), step_files)
    assert torch.equal(out["w"], torch.ones(3))


def test_async_writer_one_in_flight_and_errors_through_future():
    fs = FaultyFileSystem(target_protocol="memory", plan=FaultPlan(slow_s=0.05), name=uuid.uuid4().hex)
    slow = Storage(f"/async-{uuid.uuid4().hex}", fs=fs)
    with AsyncShardWriter() as writer:
        first = writer.submit(stage({"a": torch.ones(8)}, 0, world_size=1), slow, "s1", 0)
        second = writer.submit(stage({"a": torch.ones(8)}, 0, world_size=1), slow, "s2", 0)
        assert first.done()  # submitting waited for the previous save
        with pytest.raises(CheckpointTimeoutError):
            writer.wait(timeout=0)  # still writing (every operation takes 50 ms)
        assert [r.path for r in writer.wait(timeout=60)] == ["shard_00000.safetensors", "shard_00000.json"]
        assert second.done()
        fs.plan.enospc_after_bytes = fs.bytes_written
        failing = writer.submit(stage({"a": torch.ones(8)}, 0, world_size=1), slow, "s3", 0)
        with pytest.raises(StorageError, match="No space left"):
            failing.result(timeout=60)
        with pytest.raises(StorageError):
            writer.wait(timeout=60)
    with pytest.raises(CheckpointError, match="closed"):
        writer.submit(stage({"a": torch.ones(1)}, 0, world_size=1), slow, "s4", 0)


# --------------------------------------------------------------------------- FSDP2 resharding
def _build(mesh, seed):
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # Dims 5 and 3: uneven over 2 ranks, and an empty shard on the 4th of 4 ranks.
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, generator=g)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _full(model, opt):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, opt, options=options)


def _sharded(model, opt, step):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "rng": {"torch": torch.get_rng_state()}, "step": step}


def _fsdp_worker(rank, world, init_file, root, s3_url, s3_options):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    meshes = {n: DeviceMesh("cpu", list(range(n))) for n in (1, 2, 4)}
    local = Storage(root)
    remote = Storage(s3_url, s3_options) if s3_url else None
    manager = CheckpointManager(root, "run")
    probe = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))

    # Save with 2 ranks (to local disk, and to S3 when available).
    saved_rng = None
    if rank < 2:
        model, opt = _build(meshes[2], seed=0)
        _train_step(model, opt, seed=1)
        state = _sharded(model, opt, step=1)
        saved_rng = state["rng"]["torch"].clone()
        staged = stage(state, rank, world_size=2, rank_local=("rng",))
        records = write_shard(staged, local, manager.role_dir(1, "actor"), rank)
        if remote is not None:
            assert write_shard(staged, remote, "step_1/actor", rank) == records
        ref_model, ref_optim = _full(model, opt)
        with torch.no_grad():
            ref_loss = model(probe).pow(2).mean()
    gathered = [None] * world
    dist.all_gather_object(gathered, records if rank < 2 else None)
    if rank == 0:
        manager.commit(1, {"actor": gathered[0] + gathered[1]}, {"actor": 2})
    dist.barrier()

    for n, source in ((4, local), (2, remote or local), (1, local)):
        if rank < n:
            model, opt = _build(meshes[n], seed=100 + n)  # different weights: the load must overwrite them
            template = _sharded(model, opt, step=0)
            files = manager.role_files(1, "actor")
            path = manager.role_dir(1, "actor") if source is local else "step_1/actor"
            forbidden = (pickle.load, pickle.loads, pickle.Unpickler, torch.load)
            pickle.load = pickle.loads = pickle.Unpickler = torch.load = _forbid
            try:
                loaded = load_shard_into(template, source, path, files)
            finally:
                pickle.load, pickle.loads, pickle.Unpickler, torch.load = forbidden
            assert loaded["step"] == 1
            if rank < 2:
                assert torch.equal(loaded["rng"]["torch"], saved_rng)
            set_model_state_dict(model, loaded["model"])
            set_optimizer_state_dict(model, opt, loaded["optim"])
            full_model, full_optim = _full(model, opt)
            if rank == 0:
                assert full_model.keys() == ref_model.keys()
                for k in ref_model:
                    assert torch.equal(full_model[k], ref_model[k]), (n, k)
                assert full_optim["param_groups"] == ref_optim["param_groups"]
                for fqn, ref_st in ref_optim["state"].items():
                    for k, v in ref_st.items():
                        assert torch.equal(full_optim["state"][fqn][k], v), (n, fqn, k)
                if n == 1:
                    consolidated = gather_full_state(local, manager.role_dir(1, "actor"), files, prefix="model")
                    assert all(torch.equal(consolidated[k], ref_model[k]) for k in ref_model)
            with torch.no_grad():
                loss = model(probe).pow(2).mean()
            if rank == 0:
                assert torch.equal(loss, ref_loss), (n, loss, ref_loss)
            _train_step(model, opt, seed=3)  # training continues from the restored state
            stepped, _ = _full(model, opt)
            if rank == 0:
                assert all(torch.isfinite(v).all() and not torch.equal(v, ref_model[k]) for k, v in stepped.items())
        dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_state_saved_with_2_ranks_loads_into_1_2_and_4(tmp_path, moto):
    import torch.multiprocessing as mp

    s3_url, s3_options = None, None
    if not isinstance(moto, str):
        s3_url, s3_options = f"s3://ckpt/{uuid.uuid4().hex}", moto.storage_options
    init_file = os.path.join(tempfile.mkdtemp(), "pg-init")
    mp.spawn(_fsdp_worker, args=(4, init_file, str(tmp_path / "ckpt"), s3_url, s3_options), nprocs=4, join=True)
    assert CheckpointManager(str(tmp_path / "ckpt"), "run").verify(1) == "ok"

