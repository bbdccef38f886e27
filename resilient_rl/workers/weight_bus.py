"""Process-local hand-off of weights from a colocated actor to the rollout in the same process.

Colocated roles share a process, so the gathered full weights need not be copied through Ray:
the actor publishes them under a version number and the rollout takes exactly that version.
"""

from __future__ import annotations

import threading

import torch

from resilient_rl.errors import WorkerError

_LOCK = threading.Lock()
_SLOT: dict[str, object] = {"version": None, "state": None}


def publish(state: dict[str, torch.Tensor], version: int) -> None:
    """Leave ``state`` for the colocated rollout (replacing an older version)."""
    with _LOCK:
        _SLOT["version"], _SLOT["state"] = int(version), state


def take(version: int) -> dict[str, torch.Tensor]:
    """The published weights of ``version``; anything else is an error, never a silent stale load."""
    with _LOCK:
        if _SLOT["version"] != int(version):
            raise WorkerError(f"weight sync: this process holds version {_SLOT['version']}, asked for {version}",
                              role="rollout", cause="stale_weights")
        state = _SLOT["state"]
        _SLOT["version"], _SLOT["state"] = None, None
        return state  # type: ignore[return-value]
