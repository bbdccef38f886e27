"""One run, one writer: a renewed lease on the run with a fencing token.

Two controllers must never write the same run: the second would delete the folder the first is
writing and un-commit its steps. A controller therefore holds a *lease* on ``{root}/{run}``
before it writes anything, renews it while it runs, and releases it when it stops.

Layout: one small JSON *claim* per holder, ``{run}/lease/token_{N:08d}.json``. The claim with the
highest token is the lease; its token is the *fencing token* recorded in every manifest the holder
commits. A claim names its holder (``host:pid:uuid``), when it was acquired and renewed, and when it
expires (wall clock: the TTL must exceed the clock skew between hosts).

- **Acquire**: read the highest claim. If it is live (not released, not expired) and held by
  another controller, refuse with :class:`~resilient_rl.errors.LeaseHeldError` naming the holder
  and its expiry, unless ``takeover`` is set, or the holder is a process of this machine that no
  longer exists (a killed controller does not make its successor wait for the TTL). Otherwise
  *create* the claim of the next token exclusively and check that no higher claim appeared.
- **Renew** (a daemon thread, every ``renew_s``): rewrite our own claim with a later expiry, after
  checking that no higher claim exists; a higher one means the run was taken over: the lease is
  marked lost and the next write raises :class:`~resilient_rl.errors.LeaseLostError`.
- **Check** (before every commit and every deletion of the run's files): a higher claim exists ->
  ``LeaseLostError``; nothing is written or deleted.
- **Release** (clean shutdown): mark our claim released, keeping its token so tokens only grow.

Why claims per token and not one object rewritten in place: fsspec has no portable
compare-and-swap, but exclusive creation exists almost everywhere (a hard link of a complete temp
file locally, a conditional put ``If-None-Match: *`` on S3, ``O_EXCL``-like ``"xb"`` elsewhere).
Two controllers taking over the same expired lease race for the *same* name; exactly one creates
it. Renewals never overwrite someone else's claim. The residual windows: (1) on a backend without
exclusive creation, acquire falls back to exists-then-write and read-back, and two simultaneous
takers can both believe they won until the next check (the loser stops at its first check); (2) a
check and the write it guards are not one atomic step: the check runs as the last step before the
write is published (after its fsync, see ``before_publish`` in ``checkpoint/storage.py``), yet a
takeover landing in the instant between them lets one last write of the old holder through (a
commit of a step the new holder does not read unless it is newer than its own timeline, see
``CheckpointManager.timeline_steps``), and a write of the old holder that fails on the new holder's
clean-up is reported as the lost lease, not as a storage error; (3) workers of an old holder that is
stopped mid-save may keep writing shard files until their process ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from resilient_rl.checkpoint.leases.claims import Lease, _fmt_time, _process_identity, claim_name
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.log_route import FILE_ONLY
from resilient_rl.errors import (ConfigError, LeaseError, LeaseExpiredError, LeaseFormatError, LeaseHeldError,
                                 LeaseLostError, StorageError)

log = logging.getLogger(__name__)

LEASE_DIR = "lease"
_CLAIM_RE = re.compile(r"^token_(\d{8,})\.json$")
_ATTEMPTS = 8

# uuids of the leases this process holds open: a claim of this very process whose uuid is not
# here belongs to a lease object that was closed (or never released because storage failed).
_OPEN: set[str] = set()
_OPEN_LOCK = threading.Lock()


def _claims(storage: Storage, run: str, lease_dir: str = LEASE_DIR) -> list[int]:
    """Tokens of the run's claims, ascending."""
    names = storage.ls(Storage.join(run, lease_dir))
    return sorted(int(m.group(1)) for m in map(_CLAIM_RE.match, names) if m)


def _read_claim(storage: Storage, run: str, token: int, lease_dir: str = LEASE_DIR) -> Lease | None:
    """The claim of ``token``; None when it is gone or unreadable (a creator that died mid-write)."""
    rel = Storage.join(run, lease_dir, claim_name(token))
    data = storage.try_read_bytes(rel)
    if data is None:
        return None
    try:
        return Lease.from_bytes(data, storage.url_for(rel))
    except LeaseFormatError:
        raise
    except LeaseError as exc:
        log.warning("ignoring an unreadable lease claim: %s", exc)
        return None


def read_lease(storage: Storage, run: str, lease_dir: str = LEASE_DIR) -> Lease | None:
    """The run's current lease (its highest readable claim, live or not), or None when the run
    was never leased. For status displays: this takes nothing and writes nothing."""
    for token in reversed(_claims(storage, run, lease_dir)):
        lease = _read_claim(storage, run, token, lease_dir)
        if lease is not None:
            return lease
    return None


def holder_alive(lease: Lease) -> bool | None:
    """Whether the holder's process still exists: True/False when it ran on this machine (same
    host, boot and pid namespace), None when that cannot be told from here."""
    me = _process_identity()
    if (lease.host, lease.boot_id, lease.pid_ns) != (me["host"], me["boot_id"], me["pid_ns"]) or not lease.boot_id:
        return None
    if lease.pid == me["pid"]:
        with _OPEN_LOCK:
            return lease.uid in _OPEN
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLease:
    """This controller's lease on ``{storage}/{run}``: acquire, renew (thread), check, release.

    ``clock`` (wall-clock seconds) and ``alive`` (see :func:`holder_alive`) are injectable so
    expiry and takeover can be tested without waiting."""

    def __init__(self, storage: Storage, run: str, ttl_s: float = 60.0, renew_s: float | None = None,
                 takeover: bool = False, clock: Callable[[], float] = time.time,
                 alive: Callable[[Lease], bool | None] = holder_alive, lease_dir: str = LEASE_DIR,
                 skew_s: float | None = None, sleep: Callable[[float], None] = time.sleep):
        if not ttl_s > 0:
            raise ConfigError(f"lease ttl_s must be > 0, got {ttl_s}")
        renew_s = ttl_s / 3 if renew_s is None else renew_s
        if not 0 < renew_s < ttl_s:
            raise ConfigError(f"lease renew_s must be > 0 and < ttl_s={ttl_s}, got {renew_s}")
        self.storage = storage
        self.run = run
        self.lease_dir = lease_dir  # the folder of the claims under ``run``
        # Clock-skew margin: this holder counts its lease as over this much before its expiry,
        # so it stops writing before another host's clock lets a successor in.
        self.skew_s = min(5.0, float(ttl_s) / 10) if skew_s is None else float(skew_s)
        self.sleep = sleep
        self.ttl_s = float(ttl_s)
        self.renew_s = float(renew_s)
        self.takeover = takeover
        self.clock = clock
        self.alive = alive
        ident = _process_identity()
        self.uid = uuid.uuid4().hex[:12]
        self.holder = f"{ident['host']}:{ident['pid']}:{self.uid}"
        self._ident = ident
        self.lease: Lease | None = None
        self.lost: LeaseLostError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RunLease({self.storage.url_for(self.run)!r}, holder={self.holder!r}, token={self.token})"

    @property
    def token(self) -> int | None:
        return self.lease.token if self.lease is not None else None

    @property
    def run_url(self) -> str:
        return self.storage.url_for(self.run)

    def _rel(self, token: int) -> str:
        return Storage.join(self.run, self.lease_dir, claim_name(token))

    # ------------------------------------------------------------------ acquire
    def _refuse(self, current: Lease, now: float) -> LeaseHeldError:
        return LeaseHeldError(
            f"run {self.run!r} ({self.run_url}) is held by {current.describe(now)}: another controller is "
            "writing it. Wait for it to finish or stop it; a hung controller loses the run when its lease "
            "expires (checkpoint.lease_ttl_s after its last renewal), and running again after that takes "
            "it over. To take it over now (only if that controller is certainly stuck or gone), pass "
            "checkpoint.takeover=true")

    def acquire(self, floor: int = 0) -> Lease:
        """Take the lease (token = 1 + the highest claim or ``floor``); raise LeaseHeldError
        when another controller holds it."""
        if self.lease is not None:
            return self.lease
        superseded: str | None = None  # the one holder `takeover` may displace: the first one seen
        for _ in range(_ATTEMPTS):
            now = self.clock()
            tokens = _claims(self.storage, self.run, self.lease_dir)
            current = read_lease(self.storage, self.run, self.lease_dir)
            if current is not None and current.live(now) and current.holder != self.holder:
                alive = self.alive(current)
                if alive is False:
                    log.warning("lease of run %s: holder %s is a process of this machine that no longer "
                                "exists; taking the run over", self.run_url, current.holder)
                elif self.takeover and superseded in (None, current.holder):
                    superseded = current.holder
                    log.warning("lease of run %s: taking over from %s (checkpoint.takeover=true)",
                                self.run_url, current.describe(now))
                else:
                    raise self._refuse(current, now)
            token = max(tokens[-1] if tokens else 0, floor) + 1
            previous = None if current is None else {
                "holder": current.holder, "token": current.token, "expires_at": current.expires_at,
                "released": current.released}
            mine = Lease(run=self.run, token=token, holder=self.holder, host=self._ident["host"],
                         pid=self._ident["pid"], acquired_at=now, renewed_at=now, expires_at=now + self.ttl_s,
                         ttl_s=self.ttl_s, boot_id=self._ident["boot_id"], pid_ns=self._ident["pid_ns"],
                         previous=previous)
            with _OPEN_LOCK:
                _OPEN.add(self.uid)
            created = self.storage.create_exclusive(self._rel(token), mine.to_bytes())
            back = _read_claim(self.storage, self.run, token, self.lease_dir)
            if not created and (back is None or back.holder != self.holder):
                continue  # someone else took this token first: decide again on what is there now
            if back is None or back.holder != self.holder or _claims(self.storage, self.run, self.lease_dir)[-1] != token:
                continue  # a fallback-backend race or a higher claim appeared: decide again
            self.lease = back
            self._collect(token)
            if current is not None and not current.released:
                log.warning("lease of run %s: took over from %s", self.run_url, current.describe(now))
            log.info("lease of run %s acquired: %s", self.run_url, back.describe(now), extra=FILE_ONLY)
            return back
        with _OPEN_LOCK:
            _OPEN.discard(self.uid)
        raise LeaseError(f"could not acquire the lease of run {self.run!r} ({self.run_url}) in "
                         f"{_ATTEMPTS} attempts: other controllers keep claiming it")

    def _collect(self, token: int) -> None:
        """Delete the claims below ours (the new claim records the one it replaced)."""
        for old in _claims(self.storage, self.run, self.lease_dir):
            if old < token:
                with contextlib.suppress(StorageError):
                    self.storage.rm(self._rel(old))

    # ------------------------------------------------------------------ check / renew
    def _lost(self, highest: int) -> LeaseLostError:
        other = _read_claim(self.storage, self.run, highest, self.lease_dir)
        who = other.describe(self.clock()) if other is not None else f"token {highest}"
        return LeaseLostError(
            f"run {self.run!r} ({self.run_url}) was taken over by {who}; this controller ({self.holder}, "
            f"token {self.token}) stops without writing or deleting anything of the run")

    def _expired(self, cause: Exception | None = None) -> LeaseExpiredError:
        why = f" (reading it failed: {cause})" if cause is not None else ""
        return LeaseExpiredError(
            f"run {self.run!r} ({self.run_url}): the lease of this controller ({self.holder}, token "
            f"{self.lease.token}) was last renewed at {_fmt_time(self.lease.renewed_at)} and expires at "
            f"{_fmt_time(self.lease.expires_at)} (less a {self.skew_s:g}s clock-skew margin){why}; another "
            "controller may take the run over now, so this one stops writing")

    def _fence_expired(self) -> None:
        """Self-fencing: past our expiry (less the skew margin) nothing more is written. The
        error names the successor when one took the run over (one read, in this rare case)."""
        if self.clock() < self.lease.expires_at - self.skew_s:
            return
        try:
            tokens = _claims(self.storage, self.run, self.lease_dir)
        except StorageError:
            tokens = []
        if tokens and tokens[-1] > self.lease.token:
            self.lost = self._lost(tokens[-1])
            raise self.lost
        raise self._expired()

    def _tokens_within_margin(self) -> list[int]:
        """The run's claims; a read that fails is retried while the lease is surely still ours
        (until its expiry less the skew margin), so one slow or failed read does not end a run."""
        delay = 0.1
        while True:
            try:
                return _claims(self.storage, self.run, self.lease_dir)
            except StorageError as exc:
                left = self.lease.expires_at - self.skew_s - self.clock()
                if left <= 0:
                    raise self._expired(exc) from exc
                log.warning("lease of run %s: reading it failed (%s); retrying (the lease holds for %.0fs more)",
                            self.run_url, exc, left)
                self.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)

    def check(self, _renewing: bool = False) -> Lease:
        """Raise LeaseLostError unless our claim is still the highest (read from storage now),
        and LeaseExpiredError once it expired without a renewal (self-fencing)."""
        if self.lease is None:
            raise LeaseError(f"run {self.run!r}: writing without holding its lease (call acquire first)")
        if self.lost is not None:
            raise self.lost
        # The renewal reads once (it runs again soon); a writer waits out a storage hiccup.
        tokens = _claims(self.storage, self.run, self.lease_dir) if _renewing else self._tokens_within_margin()
        if not tokens or tokens[-1] != self.lease.token:
            if tokens and tokens[-1] > self.lease.token:
                self.lost = self._lost(tokens[-1])
            else:
                self.lost = LeaseLostError(
                    f"run {self.run!r} ({self.run_url}): the lease claim of this controller ({self.holder}, "
                    f"token {self.lease.token}) is gone; stopping without writing")
            raise self.lost
        if not _renewing:
            self._fence_expired()
        return self.lease

    def raise_if_lost(self) -> None:
        """Raise the LeaseLostError the renewal thread found, if any, or LeaseExpiredError when the
        lease is past its expiry less the skew margin (no storage access)."""
        if self.lost is not None:
            raise self.lost
        if self.lease is not None:
            self._fence_expired()

    def renew(self) -> Lease:
        """Push our expiry to ``now + ttl_s``; raises LeaseLostError when taken over."""
        with self._lock:
            self.check(_renewing=True)
            now = self.clock()
            renewed = replace(self.lease, renewed_at=now, expires_at=now + self.ttl_s)
            self.storage.write_bytes_atomic(self._rel(renewed.token), renewed.to_bytes())
            self.lease = renewed
            return renewed

    def _renew_loop(self) -> None:
        wait = self.renew_s
        while not self._stop.wait(wait):
            try:
                self.renew()
                wait = self.renew_s
            except LeaseLostError as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # storage trouble: retry sooner; the lease may expire meanwhile
                wait = min(self.renew_s, max(0.05, self.renew_s / 4))
                log.warning("lease of run %s: renewal failed (%s); retrying in %.1fs", self.run_url, exc, wait)

    def start_renewing(self) -> None:
        """Renew every ``renew_s`` seconds in a daemon thread until :meth:`close`."""
        if self.lease is None:
            raise LeaseError("start_renewing before acquire")
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.run}", daemon=True)
            self._thread.start()

    @property
    def renewing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ release
    def close(self) -> None:
        """Stop renewing and release the lease (mark our claim released, if it is still ours).
        Never raises: a controller shutting down must not fail on its lease."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self.lease is not None and self.lost is None:
                with self._lock:
                    self.check()
                    now = self.clock()
                    done = replace(self.lease, renewed_at=now, expires_at=now, released=True)
                    self.storage.write_bytes_atomic(self._rel(done.token), done.to_bytes())
                    log.info("lease of run %s released (token %d)", self.run_url, done.token, extra=FILE_ONLY)
        except Exception as exc:
            log.warning("lease of run %s: release failed (%s); it expires at %s", self.run_url, exc,
                        _fmt_time(self.lease.expires_at) if self.lease else "-")
        finally:
            with _OPEN_LOCK:
                _OPEN.discard(self.uid)
            self.lease = None
