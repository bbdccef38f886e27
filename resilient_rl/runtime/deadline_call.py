"""Reads from Ray's control plane with a deadline.

Some reads from Ray's GCS take no timeout (``ray.nodes()``, an actor's record): once the control
plane is gone (a preemption with no warning signals Ray's processes too; a head node is lost)
they block until Ray ends the process, 60 s later with exit code 1, and the main thread runs no
signal handler meanwhile. :func:`within` runs such a read on a thread of its own and waits for it
in Python, where handlers run: past its deadline the caller gets ``otherwise``. While a read of
the same name is still blocked, the next ones get ``otherwise`` at once, so no threads pile up
behind a control plane that is gone.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_blocked: set[str] = set()  # names of reads still running past their deadline
_lock = threading.Lock()


def within(name: str, read: Callable[[], T], timeout_s: float, otherwise: T) -> T:
    """``read()``, or ``otherwise`` when it has not returned within ``timeout_s`` (or a read named
    ``name`` is still blocked past its own deadline). Raises what ``read`` raises."""
    with _lock:
        if name in _blocked:
            return otherwise
    done = threading.Event()
    result: list = []

    def run() -> None:
        try:
            result.append((True, read()))
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            result.append((False, exc))
        finally:
            with _lock:
                done.set()
                _blocked.discard(name)

    threading.Thread(target=run, name=f"rrl-read-{name}", daemon=True).start()
    if not done.wait(timeout_s):
        with _lock:
            if not done.is_set():
                _blocked.add(name)
                return otherwise
    ok, value = result[0]
    if not ok:
        raise value
    return value
