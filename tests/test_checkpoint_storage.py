"""Storage: atomic writes, ranged reads and listings on local disk, memory:// and S3 (moto);
transient faults retried, permanent ones raised as StorageError naming the path."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import uuid

import pytest

from resilient_rl.checkpoint.storage import RetryPolicy, Storage, is_transient
from resilient_rl.errors import StorageError
from resilient_rl.faults.storage import FaultPlan, FaultyFileSystem, faulty_url

FAST = RetryPolicy(attempts=4, initial_s=0.001, max_s=0.01)




@pytest.fixture(params=["local", "file-url", "memory", "s3"])
def storage(request, tmp_path, moto):
    if request.param == "local":
        return Storage(str(tmp_path / "root"), retry=FAST)
    if request.param == "file-url":
        return Storage(f"file://{tmp_path}/root", retry=FAST)
    if request.param == "memory":
        return Storage(f"memory://store-{uuid.uuid4().hex}", retry=FAST)
    if isinstance(moto, str):
        pytest.skip(f"moto_server cannot start here: {moto}")
    return Storage(f"s3://store/{uuid.uuid4().hex}", moto.storage_options, retry=FAST)


def test_write_read_list_remove(storage):
    data = os.urandom(3000)
    rec = storage.write_bytes_atomic("a/b/blob.bin", data)
    assert (rec.size, rec.sha256) == (3000, hashlib.sha256(data).hexdigest())
    assert storage.read_bytes("a/b/blob.bin") == data
    assert storage.read_bytes("a/b/blob.bin", 100, 200) == data[100:200]
    out = bytearray(50)
    storage.read_into("a/b/blob.bin", 10, memoryview(out))
    assert bytes(out) == data[10:60]
    segs = [(0, memoryview(bytearray(5))), (5, memoryview(bytearray(7))), (2000, memoryview(bytearray(9)))]
    storage.read_segments("a/b/blob.bin", segs)
    assert [bytes(v) for _, v in segs] == [data[0:5], data[5:12], data[2000:2009]]
    storage.write_bytes_atomic("a/c.txt", b"x")
    assert storage.exists("a/b/blob.bin") and not storage.exists("a/nope")
    assert storage.ls("a") == ["b", "c.txt"]
    assert storage.ls("missing") == [] and storage.find("missing") == {}
    assert storage.find("a") == {"b/blob.bin": 3000, "c.txt": 1}
    assert storage.size("a/c.txt") == 1
    assert storage.try_read_bytes("a/none") is None
    # A full URL under the root works as a path too.
    assert storage.read_bytes(storage.url_for("a/c.txt")) == b"x"
    storage.rm("a", recursive=True)
    assert not storage.exists("a/c.txt")
    storage.rm("a", recursive=True)  # absent: fine


def test_streamed_write_hashes_on_the_way_and_failed_stream_keeps_old_file(storage):
    old = storage.write_bytes_atomic("f.bin", b"old contents")
    parts = [os.urandom(1 << 20), os.urandom(5), os.urandom(2 << 20)]
    rec = storage.write_stream("f.bin", lambda: iter(parts))
    assert rec.sha256 == hashlib.sha256(b"".join(parts)).hexdigest()
    assert storage.read_bytes("f.bin") == b"".join(parts)

    def broken():
        yield b"partial"
        raise ValueError("producer failed")

    storage.write_bytes_atomic("g.bin", b"old contents")
    with pytest.raises(StorageError, match=r"g\.bin.*producer failed"):
        storage.write_stream("g.bin", broken)
    assert storage.read_bytes("g.bin") == b"old contents"
    assert set(storage.find("")) == {"f.bin", "g.bin"}  # no temp file left behind
    assert old.size == 12


def test_missing_file_is_a_permanent_storage_error(storage):
    with pytest.raises(StorageError, match=r"nothere\.bin.*permanent.*FileNotFoundError"):
        storage.read_bytes("nothere.bin")


@pytest.mark.parametrize("exc, transient", [
    (ConnectionResetError(), True), (TimeoutError(), True), (OSError(errno.EIO, "io"), True),
    (OSError(errno.EAGAIN, "again"), True), (OSError(errno.EBUSY, "slow down"), True),
    (OSError(errno.ENOSPC, "full"), False), (PermissionError(errno.EACCES, "denied"), False),
    (FileNotFoundError(errno.ENOENT, "gone"), False), (ValueError("bad"), False),
    (StorageError("already classified"), False),
])
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


def test_transient_classification_of_client_library_errors():
    import aiohttp
    import botocore.exceptions as bce

    assert is_transient(bce.EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(bce.ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(aiohttp.ServerDisconnectedError())
    assert not is_transient(bce.NoCredentialsError())


@pytest.mark.parametrize("target", ["memory", "local"])
def test_transient_faults_are_retried(target, tmp_path):
    url = f"memory://faulty-{uuid.uuid4().hex}" if target == "memory" else str(tmp_path)
    fs = FaultyFileSystem(target_protocol="memory" if target == "memory" else "file",
                          plan=FaultPlan(transient_writes=2, transient_reads=2), name=uuid.uuid4().hex)
    storage = Storage(url, retry=FAST, fs=fs)
    data = [os.urandom(1000), os.urandom(2000)]
    rec = storage.write_stream("d/x.bin", lambda: iter(data))
    assert rec.sha256 == hashlib.sha256(b"".join(data)).hexdigest()
    assert storage.read_bytes("d/x.bin") == b"".join(data)
    assert fs.writes >= 3 and fs.reads == 3
    assert sum(e.startswith("transient write") for e in fs.injected) == 2
    assert sum(e.startswith("transient read") for e in fs.injected) == 2
    assert storage.find("d") == {"x.bin": 3000}  # the failed attempts left nothing behind


def test_exhausted_retries_raise_storage_error_naming_path_and_cause():
    fs = FaultyFileSystem(target_protocol="memory", plan=FaultPlan(transient_reads=10), name=uuid.uuid4().hex)
    storage = Storage(f"memory://exhaust-{uuid.uuid4().hex}", retry=FAST, fs=fs)
    storage.write_bytes_atomic("k.bin", b"abc")
    with pytest.raises(StorageError, match=r"k\.bin.*after 4 attempts.*injected read fault") as info:
        storage.read_bytes("k.bin")
    assert isinstance(info.value.__cause__, OSError) and fs.reads == 4


def test_enospc_is_permanent_and_not_retried():
    fs = FaultyFileSystem(target_protocol="memory", plan=FaultPlan(enospc_after_bytes=100), name=uuid.uuid4().hex)
    storage = Storage(f"memory://full-{uuid.uuid4().hex}", retry=FAST, fs=fs)
    storage.write_bytes_atomic("small", b"x" * 60)
    writes_before = fs.writes
    with pytest.raises(StorageError, match=r"big.*permanent.*No space left"):
        storage.write_bytes_atomic("big", b"y" * 60)
    assert fs.writes == writes_before + 1
    assert not storage.exists("big") and storage.read_bytes("small") == b"x" * 60


def test_faulty_filesystem_is_reachable_by_url_and_options(tmp_path):
    url, options = faulty_url(str(tmp_path), FaultPlan(transient_writes=1), name=uuid.uuid4().hex)
    assert url.startswith("faulty://")
    storage = Storage(url, options, retry=FAST)
    assert isinstance(storage.fs, FaultyFileSystem)
    storage.write_bytes_atomic("x/y.txt", b"hello")
    assert (tmp_path / "x" / "y.txt").read_bytes() == b"hello"
    [fault] = storage.fs.injected  # the first write (to a temp name) failed, the retry succeeded
    assert fault.startswith(f"transient write {tmp_path}/x/y.txt.tmp-")
    assert storage.find("x") == {"y.txt": 5}


def test_slow_operations_still_complete():
    fs = FaultyFileSystem(target_protocol="memory", plan=FaultPlan(slow_s=0.01), name=uuid.uuid4().hex)
    storage = Storage(f"memory://slow-{uuid.uuid4().hex}", retry=FAST, fs=fs)
    storage.write_bytes_atomic("s", b"data")
    assert storage.read_bytes("s") == b"data" and fs.injected == []


def test_a_held_path_waits_until_its_hold_file_is_removed(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    plan = FaultPlan(hold_paths="step_00000002/", hold_while=str(hold))
    storage = Storage(f"memory://hold-{uuid.uuid4().hex}", retry=FAST,
                      fs=FaultyFileSystem(target_protocol="memory", plan=plan, name=uuid.uuid4().hex))
    storage.write_bytes_atomic("step_00000004/a", b"free")  # other paths are not held
    held = threading.Thread(target=storage.write_bytes_atomic, args=("step_00000002/a", b"held"))
    held.start()
    held.join(0.5)
    assert held.is_alive() and not storage.exists("step_00000002/a")
    hold.unlink()
    held.join(30)
    assert not held.is_alive() and storage.read_bytes("step_00000002/a") == b"held"
    with pytest.raises(ValueError, match="hold_paths and hold_while"):
        FaultPlan(hold_paths="step_00000002/")


def test_local_write_is_replaced_atomically(tmp_path):
    storage = Storage(str(tmp_path))
    storage.write_bytes_atomic("p", b"1")
    inode = os.stat(tmp_path / "p").st_ino
    storage.write_bytes_atomic("p", b"2")
    assert (tmp_path / "p").read_bytes() == b"2"
    assert os.stat(tmp_path / "p").st_ino != inode  # a new file renamed over the old one
    assert os.listdir(tmp_path) == ["p"]


def test_retry_policy_validation():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="initial_s"):
        RetryPolicy(initial_s=3.0, max_s=1.0)
