"""One lease claim: its JSON format and who wrote it (see :mod:`resilient_rl.checkpoint.leases.run_lease`).

A claim this version cannot fully read (a newer ``format_version``, a field it does not know) is a
:class:`~resilient_rl.errors.LeaseFormatError`, never silently ignored: acting on half of a claim
could let two controllers write one run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from resilient_rl.errors import LeaseError, LeaseFormatError

FORMAT_VERSION = 1


def claim_name(token: int) -> str:
    return f"token_{token:08d}.json"


def _read_text(path: str) -> str:
    with contextlib.suppress(OSError):
        with open(path) as f:
            return f.read().strip()
    return ""


def _process_identity() -> dict[str, Any]:
    """Who this process is, precisely enough to tell later whether it still exists."""
    ns = ""
    with contextlib.suppress(OSError):
        ns = os.readlink("/proc/self/ns/pid")
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": ns}


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass(frozen=True)
class Lease:
    """One claim on a run: who holds it, with which fencing token, until when."""

    run: str
    token: int
    holder: str
    host: str
    pid: int
    acquired_at: float
    renewed_at: float
    expires_at: float
    ttl_s: float
    released: bool = False
    boot_id: str = ""
    pid_ns: str = ""
    previous: dict[str, Any] | None = None

    def live(self, now: float) -> bool:
        """Held: not released and not expired at ``now``."""
        return not self.released and now < self.expires_at

    @property
    def uid(self) -> str:
        return self.holder.rsplit(":", 1)[-1]

    def describe(self, now: float | None = None) -> str:
        """``host:pid:uuid (token N) until T (in Xs)`` for messages."""
        now = time.time() if now is None else now
        if self.released:
            return f"{self.holder} (token {self.token}, released at {_fmt_time(self.renewed_at)})"
        left = self.expires_at - now
        when = f"in {left:.0f}s" if left >= 0 else f"expired {-left:.0f}s ago"
        return f"{self.holder} (token {self.token}) until {_fmt_time(self.expires_at)} ({when})"

    def to_bytes(self) -> bytes:
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self)}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Lease":
        try:
            obj = json.loads(data)
            version = obj.pop("format_version", FORMAT_VERSION)
            if version != FORMAT_VERSION:
                raise LeaseFormatError(f"{where}: lease claim of format_version {version!r}; this version of "
                                       f"resilient-rl reads {FORMAT_VERSION}: upgrade resilient-rl on every "
                                       "controller of the run")
            unknown = sorted(set(obj) - {f.name for f in fields(cls)})
            if unknown:  # a claim we do not fully understand must not be acted on as if we did
                raise LeaseFormatError(f"{where}: unknown lease field(s) {', '.join(map(repr, unknown))}; "
                                       "written by another version of resilient-rl?")
            lease = cls(**obj)
            float(lease.expires_at), int(lease.token)
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
            raise LeaseError(f"{where}: not a lease claim ({exc})") from exc
        return lease
