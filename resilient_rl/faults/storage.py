"""A fault-injecting fsspec filesystem: transient errors, slow operations, a full disk.

:class:`FaultyFileSystem` wraps any fsspec filesystem (local, ``memory://``, ``s3://``) and,
following a :class:`FaultPlan`, makes its data operations misbehave:

- the first ``transient_writes`` write operations and the first ``transient_reads`` read
  operations (listings and metadata queries count as reads) fail with a transient ``OSError``
  (``EIO`` by default). A failing streamed write fails part-way, after some bytes went through,
  like a dropped connection;
- every data operation is delayed by ``slow_s`` seconds, every listing or metadata query by
  ``query_s`` seconds (an object store's round trip: a request costs tens of milliseconds);
- every data operation on a path containing one of the comma-separated ``hold_paths`` waits while
  the local file ``hold_while`` exists (up to ``HOLD_MAX_S``): a save kept in flight until the test
  removes that file, however long the rest of the run takes to get there (``slow_s`` only makes a
  race likely, a hold decides it);
- once ``enospc_after_bytes`` bytes have been written, writes fail with ``ENOSPC`` (permanent);
- every write to a path containing one of the comma-separated ``outage_paths`` (e.g.
  ``"step_00000004/,step_00000006/actor"``) fails with the transient error, however often it is
  retried: a storage outage longer than the retries, for those saves only (the lease and the
  other steps are untouched, in every process that opens the plan);
- every read or listing of a path containing one of the comma-separated ``outage_reads``
  (e.g. ``"/lease"``) fails with the transient error: the lease's storage flapping, when the plan
  is switched at run time.

It is never registered in production. :func:`register` (called by :func:`faulty_url` and the chaos
suite) registers it with fsspec as protocol ``faulty`` in this process and sets
``RRL_FAULT_INJECTION=1`` for the processes started afterwards (a local Ray cluster's workers
then register it on first use), so it can be configured by URL and storage options
(``faulty_url`` builds both)::

    url, options = faulty_url("s3://bucket/ckpt", FaultPlan(transient_writes=2), {"key": ...})
    manager = CheckpointManager(url, "run", storage_options=options)

Counters (``writes``, ``reads``, ``bytes_written``, and ``requests`` by kind: ``read``, ``write``,
``list``, ``info``) and the log of injected faults (``injected``) live on the instance, as do
``on_request``, called with the kind and path of every counted operation (a test that asserts which
files a command touched), and ``on_flush``: called with the path each time a written file is
flushed and closed (where a local write would fsync), so a test can change the world during
that slow step, e.g. have another controller take the run's lease over. fsspec caches instances by
their options: pass a distinct ``name`` (or ``skip_instance_cache=True``) for an independent fault
budget. The plan may be changed at run time (``fs.plan.enospc_after_bytes = fs.bytes_written``).
:func:`after_local_fsync` does what ``on_flush`` does for the local write path, which bypasses fsspec.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from resilient_rl import env
from resilient_rl.checkpoint.storage import OBJECT_STORE_PROTOCOLS

logger = logging.getLogger(__name__)

PROTOCOL = "faulty"
#: The longest a held operation waits for its ``hold_while`` file to go: a test that never
#: releases it fails on what the run did instead of hanging.
HOLD_MAX_S = 120.0


@dataclass
class FaultPlan:
    """What to inject. Counts are per filesystem instance."""

    transient_writes: int = 0
    transient_reads: int = 0
    transient_errno: int = errno.EIO
    slow_s: float = 0.0
    query_s: float = 0.0
    enospc_after_bytes: int | None = None
    outage_paths: str = ""
    outage_reads: str = ""
    hold_paths: str = ""
    hold_while: str = ""

    def __post_init__(self) -> None:
        self.outage_paths = self.outage_paths or ""  # an empty `key=` override reads as None
        self.outage_reads = self.outage_reads or ""
        self.hold_paths, self.hold_while = self.hold_paths or "", self.hold_while or ""
        if bool(self.hold_paths) != bool(self.hold_while):
            raise ValueError(f"FaultPlan hold_paths and hold_while go together, got {self}")
        if self.transient_writes < 0 or self.transient_reads < 0 or self.slow_s < 0 or self.query_s < 0:
            raise ValueError(f"FaultPlan counts and delays must be >= 0, got {self}")


def _matches(path: str, parts: str) -> bool:
    """Whether ``path`` contains one of the comma-separated ``parts``."""
    return any(part and part in path for part in parts.split(","))


class _FaultyWriteFile:
    """A writable file of the target fs that may fail part-way or run out of space."""

    def __init__(self, owner: "FaultyFileSystem", inner: Any, path: str, fail: OSError | None):
        self._owner = owner
        self._inner = inner
        self._path = path
        self._fail = fail
        self._written = 0
        self.closed = False

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self._fail is not None and self._written > 0:
            self._raise_pending()
        self._owner._charge_bytes(n, self._path)
        self._inner.write(data)
        self._written += n
        return n

    def _raise_pending(self) -> None:
        exc, self._fail = self._fail, None
        self.discard()
        raise exc  # type: ignore[misc]

    def close(self) -> None:
        if self.closed:
            return
        if self._fail is not None:
            self._raise_pending()
        self.closed = True
        self._inner.close()
        if self._owner.on_flush is not None:
            self._owner.on_flush(self._path)

    def discard(self) -> None:
        # Abort the target's upload when it can; otherwise just release it (a partial temp
        # file is removed by the caller).
        if self.closed:
            return
        self.closed = True
        try:
            self._inner.discard()
        except Exception:
            with contextlib.suppress(Exception):
                self._inner.close()

    def __enter__(self) -> "_FaultyWriteFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class FaultyFileSystem(AbstractFileSystem):
    """Delegates to a target filesystem and injects the faults of its :class:`FaultPlan`."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, target_protocol: str = "file", target_options: dict[str, Any] | None = None,
                 plan: FaultPlan | dict[str, Any] | None = None,
                 fs: AbstractFileSystem | None = None, name: str = "", **kwargs: Any):
        super().__init__(**kwargs)
        self.target = fs if fs is not None else fsspec.filesystem(
            target_protocol, **(target_options or {}))
        self.plan = plan if isinstance(plan, FaultPlan) else FaultPlan(**(plan or {}))
        self.name = name
        self.writes = 0
        self.reads = 0
        self.bytes_written = 0
        self.requests: collections.Counter[str] = collections.Counter()
        self.injected: list[str] = []
        self.on_request: Callable[[str, str], None] | None = None
        self.on_flush: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        protocols = self.target.protocol
        protocols = protocols if isinstance(protocols, (tuple, list)) else (protocols,)
        # Writes go through this wrapper (temp name + rename through it, or a single put), so
        # the faults apply to them; a local target's own fsync/replace path would bypass it.
        self.rrl_write_strategy = ("put" if OBJECT_STORE_PROTOCOLS.intersection(protocols)
                                   else "rename")

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]  # type: ignore[return-value]
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return path.rstrip("/") or "/"

    # ------------------------------------------------------------- injection
    def _transient(self, kind: str, path: str) -> OSError:
        code = self.plan.transient_errno
        self.injected.append(f"transient {kind} {path}")
        return OSError(code, f"{os.strerror(code)} (injected {kind} fault)", path)

    def _next_op(self, kind: str, path: str) -> OSError | None:
        """Count one data operation (slowed and held as planned); the fault it must raise, if any."""
        if self.plan.slow_s:
            time.sleep(self.plan.slow_s)
        if self.plan.hold_paths and _matches(path, self.plan.hold_paths):
            self._hold(path)
        return self._count(kind, path)

    def _count(self, kind: str, path: str) -> OSError | None:
        """Count one operation, a write or a read (any other ``kind``: a read of that kind, such
        as a listing); the fault it must raise, if any."""
        if self.on_request is not None:
            self.on_request(kind, path)
        with self._lock:
            self.requests[kind] += 1
            if kind == "write":
                self.writes += 1
                failing = self.writes <= self.plan.transient_writes or _matches(path, self.plan.outage_paths)
            else:
                self.reads += 1
                failing = self.reads <= self.plan.transient_reads or self._read_outage(path)
            return self._transient(kind, path) if failing else None

    def _hold(self, path: str) -> None:
        deadline = time.monotonic() + HOLD_MAX_S
        while os.path.exists(self.plan.hold_while) and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.path.exists(self.plan.hold_while):
            logger.warning("fault: %s held for %.0fs and let through: %s was never removed", path, HOLD_MAX_S,
                           self.plan.hold_while)

    def _charge_bytes(self, n: int, path: str) -> None:
        with self._lock:
            budget = self.plan.enospc_after_bytes
            if budget is not None and self.bytes_written + n > budget:
                self.injected.append(f"enospc {path}")
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            self.bytes_written += n

    # ------------------------------------------------------------- data operations
    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:  # type: ignore[override]
        if "r" in mode and "+" not in mode:
            fault = self._next_op("read", path)
            if fault is not None:
                raise fault
            return self.target.open(path, mode, **kwargs)
        fault = self._next_op("write", path)
        if fault is not None and "x" in mode:
            raise fault  # an exclusive create dropped before it reached the target created nothing
        return _FaultyWriteFile(self, self.target.open(path, mode, **kwargs), path, fault)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        fault = self._next_op("read", path)
        if fault is not None:
            raise fault
        return self.target.cat_file(path, start=start, end=end, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        fault = self._next_op("write", path)
        if fault is not None:
            raise fault
        self._charge_bytes(len(value), path)
        self.target.pipe_file(path, value, **kwargs)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:  # type: ignore[override]
        fault = self._next_op("write", path2)
        if fault is not None:
            raise fault
        self.target.mv(path1, path2, **kwargs)

    def _read_outage(self, path: str) -> bool:
        return _matches(path, self.plan.outage_reads)

    # ------------------------------------------------------------- metadata (reads, never held)
    def _query(self, kind: str, path: str) -> None:
        """Count a listing or metadata query as a read and raise its fault, if any: the
        ``transient_reads`` and ``outage_reads`` reach the run's listings (which step folders
        exist, what a step holds) as well as its reads. Delayed by ``query_s`` only: ``slow_s``
        and holds are for data."""
        if self.plan.query_s:
            time.sleep(self.plan.query_s)
        fault = self._count(kind, path)
        if fault is not None:
            raise fault

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._query("list", path)
        return self.target.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._query("info", path)
        return self.target.info(path, **kwargs)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._query("list", path)
        return self.target.find(path, *args, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._query("info", path)
        return self.target.exists(path, **kwargs)

    def size(self, path: str) -> int:
        self._query("info", path)
        return self.target.size(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.mkdir(path, create_parents=create_parents, **kwargs)

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        self.target.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self.target.rm_file(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)


@contextlib.contextmanager
def after_local_fsync(hook: Callable[[str], None]):
    """Within the block, every ``os.fsync`` of this process (the local write path's, before its
    rename) calls ``hook`` with the path of the synced file once the real fsync returned: the
    local counterpart of ``FaultyFileSystem.on_flush``, for a test that changes the world during
    that slow step. The real fsync still runs."""
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        path = ""
        with contextlib.suppress(OSError):
            path = os.readlink(f"/proc/self/fd/{fd}")
        hook(path)

    os.fsync = fsync
    try:
        yield
    finally:
        os.fsync = real


def register() -> None:
    """Let ``faulty://`` URLs open a :class:`FaultyFileSystem` here and in processes started later."""
    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
    os.environ[env.FAULT_INJECTION] = "1"


def faulty_url(url: str, plan: FaultPlan | None = None,
               storage_options: dict[str, Any] | None = None,
               name: str = "") -> tuple[str, dict[str, Any]]:
    """A ``faulty://`` URL and storage options that wrap ``url`` (opened with
    ``storage_options``) in a :class:`FaultyFileSystem` following ``plan`` (registers it)."""
    register()
    target, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocol = target.protocol if isinstance(target.protocol, str) else target.protocol[0]
    options = {"target_protocol": protocol, "target_options": dict(storage_options or {}),
               "plan": asdict(plan or FaultPlan()), "name": name}
    return f"{PROTOCOL}://{path}", options
