"""One run, one writer: the run lease, its expiry and takeover, and fencing of an old holder."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import pytest

from resilient_rl.checkpoint import CheckpointManager, Storage
from resilient_rl.checkpoint.leases.run_lease import Lease, RunLease, holder_alive, read_lease
from resilient_rl.errors import ConfigError, LeaseHeldError, LeaseLostError
from resilient_rl.faults.storage import FaultPlan, faulty_url
from resilient_rl.config.schema import load_config
from resilient_rl.testing.checkpoint_store import FAST, checkpoint_root, save_step
from resilient_rl.testing.clock import FakeClock
from resilient_rl.testing.wait import wait_until


def Clock() -> FakeClock:
    """A wall clock that moves only when told."""
    return FakeClock(1_800_000_000.0)


def _lease(root, options, clock, **kw) -> RunLease:
    return RunLease(Storage(root, options, FAST), "run", ttl_s=60, renew_s=20, clock=clock, **kw)


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_second_controller_is_refused_naming_the_holder(kind, tmp_path, moto):
    root, options = checkpoint_root(kind, tmp_path, moto)
    clock = Clock()
    first = _lease(root, options, clock)
    held = first.acquire()
    assert held.token == 1 and held.holder == first.holder and held.expires_at == clock.now + 60
    assert read_lease(Storage(root, options), "run") == held
    second = _lease(root, options, clock)
    clock.now += 59
    with pytest.raises(LeaseHeldError) as info:
        second.acquire()
    message = str(info.value)
    assert first.holder in message and "token 1" in message and "(in 1s)" in message
    assert "checkpoint.takeover=true" in message and "lease_ttl_s" in message
    assert second.lease is None and read_lease(Storage(root, options), "run").holder == first.holder
    first.close()


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_expired_lease_is_taken_over_and_the_old_holder_is_fenced(kind, tmp_path, moto):
    root, options = checkpoint_root(kind, tmp_path, moto)
    clock = Clock()
    old_lease, new_lease = _lease(root, options, clock), _lease(root, options, clock)
    old = CheckpointManager(root, "run", keep_last=5, storage_options=options, retry=FAST)
    old.lease = old_lease
    old_lease.acquire()
    save_step(old, 2)
    assert old.load_manifest(2).fencing_token == 1
    clock.now += 20
    old_lease.renew()  # renewed at t+20: expires at t+80
    clock.now += 59
    with pytest.raises(LeaseHeldError):
        new_lease.acquire()
    clock.now += 2  # the old controller hangs: no renewal for longer than the TTL
    taken = new_lease.acquire(floor=old.newest_fencing_token())
    assert taken.token == 2 and taken.previous["holder"] == old_lease.holder
    new = CheckpointManager(root, "run", keep_last=5, storage_options=options, retry=FAST)
    new.lease = new_lease
    save_step(new, 4)
    assert new.load_manifest(4).fencing_token == 2

    # The old controller wakes up: every write or deletion it tries stops, naming the new holder.
    files = save_step(old, 6, commit=False)
    with pytest.raises(LeaseLostError, match=new_lease.holder):
        old.commit(6, files, {"actor": 2})
    with pytest.raises(LeaseLostError, match="taken over"):
        old.begin_step(4)
    with pytest.raises(LeaseLostError):
        old.cleanup_uncommitted()
    with pytest.raises(LeaseLostError):
        old.set_aside_newer(2, "test")
    with pytest.raises(LeaseLostError):
        old_lease.renew()
    assert new.committed_steps() == [2, 4] and new.verify(4) == "ok" and new.latest_step() == 4
    assert not new.is_committed(6)
    old_lease.close()  # releases nothing: the lease is not its own any more
    assert read_lease(new.storage, "run").holder == new_lease.holder
    new_lease.check()
    new_lease.close()
    assert read_lease(new.storage, "run").released


def test_takeover_switch_takes_a_live_lease(tmp_path):
    clock = Clock()
    first = _lease(str(tmp_path), None, clock)
    first.acquire()
    forced = _lease(str(tmp_path), None, clock, takeover=True)
    assert forced.acquire().token == 2
    with pytest.raises(LeaseLostError, match=forced.holder):
        first.check()
    # takeover displaces the holder it found, never a third controller racing it
    third = _lease(str(tmp_path), None, clock)
    with pytest.raises(LeaseHeldError, match=forced.holder):
        third.acquire()


def test_released_lease_is_taken_at_once_with_the_next_token(tmp_path):
    clock = Clock()
    first = _lease(str(tmp_path), None, clock)
    first.acquire()
    first.close()
    again = _lease(str(tmp_path), None, clock)
    assert again.acquire().token == 2
    assert sorted(p.name for p in (tmp_path / "run" / "lease").iterdir()) == ["token_00000002.json"]


def test_lease_of_a_dead_local_process_is_taken_over_without_waiting(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = RunLease(Storage(str(tmp_path)), "run", ttl_s=60)
    if not me._ident["boot_id"]:
        pytest.skip("no /proc/sys/kernel/random/boot_id: processes of this machine cannot be told apart")
    now = time.time()
    dead = Lease(run="run", token=1, holder=f"{me._ident['host']}:{gone.pid}:0123456789ab", host=me._ident["host"],
                 pid=gone.pid, acquired_at=now, renewed_at=now, expires_at=now + 3600, ttl_s=3600,
                 boot_id=me._ident["boot_id"], pid_ns=me._ident["pid_ns"])
    me.storage.write_bytes_atomic("run/lease/token_00000001.json", dead.to_bytes())
    assert holder_alive(dead) is False
    assert me.acquire().token == 2 and me.lease.previous["holder"] == dead.holder
    # the same claim seen from "another machine" (another boot) is only ever waited for
    assert holder_alive(replace(dead, boot_id="another-boot")) is None
    me.close()


@pytest.mark.slow
def test_lease_of_a_killed_local_controller_is_taken_over_without_waiting(tmp_path):
    code = ("import os, sys; from resilient_rl.checkpoint import Storage; "
            "from resilient_rl.checkpoint.leases.run_lease import RunLease; "
            f"RunLease(Storage({str(tmp_path)!r}), 'run', ttl_s=3600).acquire(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    dead = read_lease(Storage(str(tmp_path)), "run")
    assert dead.live(time.time()) and dead.expires_at > time.time() + 3000
    mine = RunLease(Storage(str(tmp_path)), "run", ttl_s=60)
    assert mine.acquire().token == 2 and mine.lease.previous["holder"] == dead.holder
    mine.close()


def test_lease_that_could_not_be_released_in_this_process_is_not_waited_for(tmp_path):
    url, options = faulty_url(str(tmp_path), FaultPlan(), name=uuid.uuid4().hex)
    storage = Storage(url, options, FAST)
    first = RunLease(storage, "run", ttl_s=3600)
    first.acquire()
    storage.fs.plan.enospc_after_bytes = storage.fs.bytes_written  # the disk is full at shutdown
    first.close()  # logs the failed release, does not raise
    assert read_lease(storage, "run").live(time.time())
    storage.fs.plan.enospc_after_bytes = None
    second = RunLease(Storage(url, options, FAST), "run", ttl_s=60)
    assert second.acquire().token == 2
    second.close()


def test_renewal_thread_extends_the_lease_and_stops_on_close(tmp_path):
    lease = RunLease(Storage(str(tmp_path)), "run", ttl_s=30, renew_s=0.05)
    first = lease.acquire()
    lease.start_renewing()
    assert lease.renewing
    wait_until(lambda: read_lease(lease.storage, "run").renewed_at != first.renewed_at, 20, 0.02,
               "the renewal thread to renew the lease")
    assert read_lease(lease.storage, "run").expires_at > first.expires_at
    lease.close()
    assert not lease.renewing and lease.lease is None
    claim = json.loads((tmp_path / "run" / "lease" / "token_00000001.json").read_text())
    assert claim["released"] is True and claim["holder"] == first.holder


def test_renewal_thread_notices_a_takeover(tmp_path):
    clock = Clock()
    lease = RunLease(Storage(str(tmp_path)), "run", ttl_s=30, renew_s=0.05, clock=clock)
    lease.acquire()
    clock.now += 31
    other = RunLease(Storage(str(tmp_path)), "run", ttl_s=30, clock=clock)
    other.acquire()
    lease.start_renewing()
    wait_until(lambda: not lease.renewing, 20, 0.02, "the renewal thread to stop on the takeover")
    with pytest.raises(LeaseLostError, match=other.holder):
        lease.raise_if_lost()
    lease.close()
    other.close()


def test_token_floor_survives_a_removed_lease_folder(tmp_path):
    manager = CheckpointManager(str(tmp_path), "run", retry=FAST)
    lease = RunLease(manager.storage, "run", ttl_s=60)
    manager.lease = lease
    for _ in range(3):
        lease.acquire()
        lease.close()
    lease.acquire()
    save_step(manager, 1)
    lease.close()
    for p in (tmp_path / "run" / "lease").iterdir():
        p.unlink()
    again = RunLease(manager.storage, "run", ttl_s=60)
    assert again.acquire(floor=manager.newest_fencing_token()).token == 5
    again.close()


def test_lease_settings_are_validated(tmp_path):
    cfg = load_config(None, ["checkpoint.lease_ttl_s=30", "checkpoint.lease_renew_s=10", "checkpoint.takeover=true"])
    assert (cfg.checkpoint.lease_ttl_s, cfg.checkpoint.lease_renew_s, cfg.checkpoint.takeover) == (30.0, 10.0, True)
    with pytest.raises(ConfigError, match=r"checkpoint\.lease_renew_s=30.*< lease_ttl_s=30"):
        load_config(None, ["checkpoint.lease_ttl_s=30", "checkpoint.lease_renew_s=30"])
    with pytest.raises(ConfigError, match=r"checkpoint\.lease_ttl_s"):
        load_config(None, ["checkpoint.lease_ttl_s=0"])
    with pytest.raises(ConfigError, match="renew_s"):
        RunLease(Storage(str(tmp_path)), "run", ttl_s=10, renew_s=10)


def test_checkpoints_list_shows_the_lease_and_set_aside_timelines(tmp_path):
    from resilient_rl.checkpoint.inspect import CheckpointLocation, inspect_run

    manager = CheckpointManager(str(tmp_path), "run", keep_last=5, retry=FAST)
    manager.lease = RunLease(manager.storage, "run", ttl_s=60)
    manager.lease.acquire()
    for step in (1, 2, 3):
        save_step(manager, step)
    manager.set_aside_newer(1, "resumed from step 1")
    table = inspect_run(CheckpointLocation(str(tmp_path), "run"), deep=False).format_table()
    assert f"lease: held by {manager.lease.holder} (token 1) until" in table
    assert f"set aside: 1 abandoned timeline(s) under {tmp_path}/run/abandoned/" in table
    assert manager.load_manifest(1).fencing_token == 1
    manager.lease.close()
    table = inspect_run(CheckpointLocation(str(tmp_path), "run"), deep=False).format_table()
    assert "lease: released by" in table


def test_transient_errors_while_claiming_are_retried(tmp_path):
    url, options = faulty_url(str(tmp_path), FaultPlan(transient_writes=2, transient_reads=1), name=uuid.uuid4().hex)
    storage = Storage(url, options, FAST)
    lease = RunLease(storage, "run", ttl_s=60)
    assert lease.acquire().token == 1
    assert sum(e.startswith("transient write") for e in storage.fs.injected) == 2
    assert read_lease(Storage(str(tmp_path)), "run").holder == lease.holder
    assert [p.name for p in (tmp_path / "run" / "lease").iterdir()] == ["token_00000001.json"]
    lease.close()
