"""The lease survives a storage hiccup, fences itself at expiry, and refuses claims it cannot read."""

from __future__ import annotations

import json
import threading

import pytest

from resilient_rl.checkpoint import Storage
from resilient_rl.checkpoint.leases.run_lease import RunLease, read_lease
from resilient_rl.errors import LeaseExpiredError, LeaseFormatError, LeaseLostError
from resilient_rl.faults.storage import FaultPlan, faulty_url
from resilient_rl.testing.checkpoint_store import FAST
from resilient_rl.testing.clock import FakeClock


def _faulty(tmp_path, name):
    url, options = faulty_url(str(tmp_path), FaultPlan(), name=name)
    storage = Storage(url, options, FAST)
    return storage, storage.fs.plan


def test_a_lease_read_failing_past_the_storage_retries_is_survived(tmp_path):
    storage, plan = _faulty(tmp_path, "flap-check")
    clock = FakeClock(1_800_000_000.0)
    slept = []

    def sleep(s):  # the outage ends after a few retries, well inside the lease
        slept.append(s)
        clock.now += s
        if len(slept) == 3:
            plan.outage_reads = ""

    lease = RunLease(storage, "run", ttl_s=60, renew_s=20, clock=clock, sleep=sleep)
    lease.acquire()
    plan.outage_reads = "/lease"
    assert lease.check().token == 1  # the old code raised StorageError here and the run exited 4
    assert len(slept) == 3
    lease.close()


def test_a_lease_unreadable_until_its_expiry_fences_its_holder(tmp_path):
    storage, plan = _faulty(tmp_path, "flap-expire")
    clock = FakeClock(1_800_000_000.0)

    def sleep(s):
        clock.now += max(s, 1.0)

    lease = RunLease(storage, "run", ttl_s=60, renew_s=20, clock=clock, sleep=sleep)
    acquired = lease.acquire()
    plan.outage_reads = "/lease"
    with pytest.raises(LeaseExpiredError, match="stops writing") as info:
        lease.check()
    assert isinstance(info.value, LeaseLostError)  # reported as a lost lease (exit 2), not a storage error
    # It gave up before the expiry, by the clock-skew margin: no successor can have started yet.
    assert clock.now <= acquired.expires_at - lease.skew_s + 1.0
    plan.outage_reads = ""
    lease.close()


def test_the_holder_stops_writing_at_expiry_without_reading_storage(tmp_path):
    clock = FakeClock(1_800_000_000.0)
    lease = RunLease(Storage(str(tmp_path)), "run", ttl_s=60, renew_s=20, clock=clock, skew_s=5)
    lease.acquire()
    clock.now += 54
    lease.raise_if_lost()  # still 6 s to go, more than the margin
    clock.now += 1.5
    with pytest.raises(LeaseExpiredError):
        lease.raise_if_lost()  # no renewal came: self-fenced 5 s before the expiry
    lease.renew()  # storage answers again and nobody took over: writes may go on
    lease.raise_if_lost()
    lease.close()


def test_the_renewal_thread_retries_soon_after_a_failure(tmp_path):
    storage, plan = _faulty(tmp_path, "flap-renew")
    lease = RunLease(storage, "run", ttl_s=8, renew_s=2)
    first = lease.acquire()
    plan.outage_reads = "/lease"
    lease.start_renewing()
    threading.Event().wait(2.3)  # one renewal failed
    plan.outage_reads = ""
    threading.Event().wait(1.0)  # retried after renew_s / 4, not after a whole renew_s
    assert read_lease(storage, "run").renewed_at > first.renewed_at
    lease.close()


@pytest.mark.parametrize("change, match", [
    ({"fencing": "strict"}, "unknown lease field.*'fencing'"),
    ({"format_version": 2}, "format_version 2.*upgrade resilient-rl"),
])
def test_a_lease_claim_this_version_cannot_read_is_an_error(tmp_path, change, match):
    lease = RunLease(Storage(str(tmp_path)), "run", ttl_s=60)
    lease.acquire()
    claim = tmp_path / "run" / "lease" / "token_00000001.json"
    claim.write_text(json.dumps({**json.loads(claim.read_text()), **change}))
    with pytest.raises(LeaseFormatError, match=match):
        read_lease(Storage(str(tmp_path)), "run")
    with pytest.raises(LeaseFormatError, match=match):
        RunLease(Storage(str(tmp_path)), "run", ttl_s=60).acquire()
    lease.close()


def test_an_expired_holder_names_its_successor_when_there_is_one(tmp_path):
    clock = FakeClock(1_800_000_000.0)
    old = RunLease(Storage(str(tmp_path)), "run", ttl_s=60, renew_s=20, clock=clock)
    old.acquire()
    clock.now += 61  # hung past its expiry; another controller took the run over
    new = RunLease(Storage(str(tmp_path)), "run", ttl_s=60, renew_s=20, clock=clock)
    new.acquire()
    with pytest.raises(LeaseLostError, match=f"was taken over by {new.holder}"):
        old.raise_if_lost()
    old.close()
    new.close()
