"""What this machine says about a process id: its state (running, stopped, a zombie), or gone.

The one place the controller (is a rank's process gone?), the telemetry (which workers are
down?) and the fault harness (did the process it killed die?) ask it. Only processes of this
machine can be seen: a caller that knows the process's node checks it first.
"""

from __future__ import annotations

import psutil

__all__ = ["process_alive", "process_state"]


def process_state(pid: int) -> str | None:
    """psutil's status of ``pid`` (``running``, ``sleeping``, ``stopped``, ``zombie``, ...), None
    when there is no such process, ``unknown`` when it exists but may not be inspected."""
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:  # e.g. access denied: it exists
        return "unknown"


def process_alive(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has, its parent has not reaped it yet)."""
    return process_state(pid) not in (None, psutil.STATUS_ZOMBIE)
