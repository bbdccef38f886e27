"""Reading the calls that have ended, never waiting for the others.

The controller keeps calls in flight that it reads only when they are done: health calls
(liveness, device reports, warm spares' pings) and the calls a failed wait left behind. Each is
read once it ends, its error caught: Ray logs an error result that is freed unread as
"Unhandled error", with its trace, on the driver's console.
"""

from __future__ import annotations

from typing import Any

import ray


def read_ended(refs) -> tuple[list[tuple[Any, Any, Exception | None]], list]:
    """The calls among ``refs`` that have ended, each as ``(ref, value, error)`` with the error it
    raised (died, failed) or None, and the refs still running. Never waits."""
    refs = list(refs)
    if not refs:
        return [], []
    ready, running = ray.wait(refs, num_returns=len(refs), timeout=0)
    ended: list[tuple[Any, Any, Exception | None]] = []
    for ref in ready:
        try:
            ended.append((ref, ray.get(ref, timeout=0), None))
        except Exception as exc:  # noqa: BLE001 -- the caller decides what a failed call means
            ended.append((ref, None, exc))
    return ended, running
