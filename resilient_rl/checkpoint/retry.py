"""Retrying storage calls: which errors are transient, and the bounded backoff loop.

Transient errors (connection drops, timeouts, ``EAGAIN``/``EIO``/``EBUSY``/``ETIMEDOUT``, S3
throttling surfaced by s3fs as ``EBUSY``, botocore/aiohttp connection errors) are retried with
exponential backoff and jitter (tenacity); everything else is permanent. Either way the caller
gets a :class:`~resilient_rl.errors.StorageError` naming the operation, the path and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from resilient_rl.errors import StorageError

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "EAGAIN", "EIO", "EBUSY", "ETIMEDOUT", "EINTR", "ECONNRESET", "ECONNABORTED",
        "ECONNREFUSED", "EPIPE", "ENETUNREACH", "ENETDOWN", "EHOSTUNREACH", "EREMOTEIO")
    if hasattr(errno, name))


@dataclass(frozen=True)
class RetryPolicy:
    """How transient storage errors are retried: ``attempts`` tries in all, backoff from
    ``initial_s`` doubling up to ``max_s`` (with jitter)."""

    attempts: int = 5
    initial_s: float = 0.05
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError(f"RetryPolicy needs 0 <= initial_s <= max_s, got "
                             f"initial_s={self.initial_s}, max_s={self.max_s}")


@functools.cache
def _optional_transient_types() -> tuple[type[BaseException], ...]:
    """The object-store clients' connection errors; looked up at the first error, not at import
    (aiohttp alone is a tenth of a second of every ``resilient-rl`` command's start)."""
    types: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        import botocore.exceptions as bce
        types += [bce.ConnectionError, bce.HTTPClientError]
    with contextlib.suppress(ImportError):
        import aiohttp
        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    return tuple(types)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying. Conservative: anything unknown is permanent."""
    if isinstance(exc, StorageError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, FileExistsError)):
        return False
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    extra = _optional_transient_types()
    return bool(extra) and isinstance(exc, extra)


def is_outage(exc: BaseException) -> bool:
    """Whether a StorageError is a storage outage (transient errors that outlasted the retries,
    which a later attempt may get through) rather than a permanent error (no space left, no
    permission): what :func:`call_with_retry` raised for a transient error that kept failing."""
    if not isinstance(exc, StorageError):
        return False
    return bool(getattr(exc, "outage", False)) or (exc.__cause__ is not None and is_transient(exc.__cause__))


def call_with_retry(policy: RetryPolicy, op: str, where: str, fn: Callable[[], T]) -> T:
    """Run ``fn``, retrying transient errors per ``policy``; any failure that remains is raised
    as StorageError("<op> failed for <where>: ...") chained to the original error."""
    def _before_sleep(state: Any) -> None:
        log.warning("%s %s: transient error %r (attempt %d/%d), retrying", op, where,
                    state.outcome.exception(), state.attempt_number, policy.attempts)

    retrying = Retrying(
        stop=stop_after_attempt(policy.attempts),
        wait=wait_exponential_jitter(initial=policy.initial_s, max=policy.max_s, jitter=policy.initial_s),
        retry=retry_if_exception(is_transient),
        before_sleep=_before_sleep,
        reraise=True,
    )
    try:
        return retrying(fn)
    except StorageError:
        raise
    except Exception as exc:
        attempts = retrying.statistics.get("attempt_number", 1)
        why = f"still failing after {attempts} attempts" if is_transient(exc) else "permanent error"
        raise StorageError(f"{op} failed for {where}: {why}: {type(exc).__name__}: {exc}",
                           outage=is_transient(exc)) from exc
