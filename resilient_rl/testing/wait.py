"""Waiting for a condition: the one polling helper of the tests and the chaos suite.

``wait_until(predicate, timeout_s)`` calls ``predicate`` until it returns something truthy and
returns that, so a test can wait for a value and use it. Past the deadline it raises
:class:`WaitTimeout` (an ``AssertionError``, so pytest reports it as a failed check) naming what
was awaited and the last result or error, instead of letting a test go on with a false premise.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The awaited condition did not hold within the timeout."""


def wait_until(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.2,
               message: str | Callable[[], str] = "", ignore: tuple[type[BaseException], ...] = ()) -> T:
    """``predicate()``'s first truthy result, polled every ``interval_s`` for up to ``timeout_s``.

    ``predicate`` is called once more at the deadline, so a condition that became true while the
    helper slept is not missed. Exceptions of the types in ``ignore`` (e.g. ``OSError`` while a
    server starts) count as "not yet"; any other exception propagates at once. ``message`` says
    what is awaited; a function is called at the timeout, to report the state then (e.g. the
    exit code of a process that should have made progress).

    Raises:
        WaitTimeout: the condition did not hold in time; the message names ``message`` (what was
            awaited) and the last result or ignored error.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        expired = time.monotonic() >= deadline
        try:
            result = predicate()
        except ignore as exc:
            last = exc
        else:
            if result:
                return result
            last = result
        if expired:
            what = (message() if callable(message) else message) or getattr(predicate, "__name__", "the condition")
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what} (last: {last!r})")
        time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
