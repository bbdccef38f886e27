"""The role workers one process hosts: how colocated roles find each other.

Colocated roles (actor, critic, ref and rollout of one rank in one process) act together: one
snapshot take copies every stateful role of the process, a peer's copy is kept once per process,
an engine is collected once no role of the process holds one. Each role worker therefore has a
:class:`RankHost` naming the process's roles: the colocated worker class
(:mod:`resilient_rl.runtime.worker_class`) builds one for the roles it hosts; a worker alone in
its process gets one of its own on first use (:func:`host_of`). Nothing is registered in module
state: two hosts in one process (tests) do not see each other.
"""

from __future__ import annotations

import weakref
from typing import Any


class RankHost:
    """The role workers of one process, by role (held weakly: a host keeps no worker alive)."""

    def __init__(self) -> None:
        self._roles: dict[str, weakref.ref] = {}

    def add(self, role: str, worker: Any) -> None:
        """Host ``worker`` as ``role`` and make this its host."""
        self._roles[role] = weakref.ref(worker)
        worker._rank_host = self

    def role(self, role: str) -> Any:
        """The worker of ``role`` in this process, or None."""
        ref = self._roles.get(role)
        return ref() if ref is not None else None

    def workers(self) -> list[Any]:
        """Every role worker of this process."""
        return [w for w in (ref() for ref in list(self._roles.values())) if w is not None]

    def parts(self, attr: str) -> dict[str, Any]:
        """role -> that role's part ``attr`` (:mod:`resilient_rl.runtime.parts`), for every role
        of this process that has one."""
        out = {}
        for role, ref in list(self._roles.items()):
            part = getattr(ref(), attr, None)
            if part is not None:
                out[role] = part
        return out


def host_of(worker: Any) -> RankHost:
    """``worker``'s host: the one that hosts it with its colocated roles, else one of its own."""
    host = getattr(worker, "_rank_host", None)
    if host is None:
        host = RankHost()
        host.add(getattr(worker, "role", "worker"), worker)
    return host
