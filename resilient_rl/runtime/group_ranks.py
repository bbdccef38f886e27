"""The processes that serve a worker group's ranks, and what the group knows of each.

A :class:`~resilient_rl.runtime.worker_group.RayWorkerGroup` keeps its ranks in one
:class:`RankTable`: the handle of the process serving each rank (a restarted process keeps its
handle; a warm spare that takes a rank replaces it), the rank's actor name, its identity (the
environment it was started with), where it last reported running, whether its process was still
running its start-up imports then (judged hung later while it does:
:mod:`resilient_rl.runtime.liveness`), and the process started in the rank's own placement-group
bundle. Health probes, warm spares and dispatch read and change the table through the group's
public ``ranks`` attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankTable:
    """A worker group's ranks (see the module docstring). Colocated role groups spawned from a
    group share its ``handles`` and ``names`` lists (changed in place, never rebound)."""

    #: The process serving each rank.
    handles: list = field(default_factory=list)
    #: Each rank's actor name.
    names: list[str] = field(default_factory=list)
    #: Each rank's RANK, WORLD_SIZE, ... (empty for a group attached to running workers or spawned).
    identities: list[dict[str, str]] = field(default_factory=list)
    #: Each rank's (node id, ``CUDA_VISIBLE_DEVICES``) as its process last reported them (a warm
    #: spare taking the rank takes these GPUs).
    placements: list[tuple[str | None, str | None]] = field(default_factory=list)
    #: The process started in each rank's bundle (Ray restarts it there, also after a node loss).
    bundle_handles: list = field(default_factory=list)
    #: Whether each rank's process was still warming up when it last answered (True until it has).
    warming: list[bool] = field(default_factory=list)

    @classmethod
    def of(cls, handles: list, names: list[str], identities: list[dict[str, str]] | None = None) -> RankTable:
        """A table of processes started (or found) for each rank, in their own bundles."""
        return cls(handles, names, list(identities or []), [(None, None)] * len(handles), list(handles),
                   [True] * len(handles))

    def sharing(self) -> RankTable:
        """A table of the same processes for a colocated role group (no identities or bundles of
        its own): handles, names and warm-up state are shared lists, changed in place."""
        return RankTable(self.handles, self.names, warming=self.warming)

    def is_warming(self, rank: int) -> bool:
        """Whether ``rank``'s process was starting up when last heard of (unknown: True)."""
        return self.warming[rank] if rank < len(self.warming) else True

    def serves_a_rank(self, handle) -> bool:
        """Whether process ``handle`` serves one of the ranks now."""
        return any(handle is h for h in self.handles)

    def is_bundle_process(self, handle) -> bool:
        """Whether ``handle`` is a process started in one of the ranks' bundles."""
        return any(handle is h for h in self.bundle_handles)

    def placement(self, rank: int) -> tuple[str | None, str | None]:
        """(node id, ``CUDA_VISIBLE_DEVICES``) of ``rank`` as its process last reported them."""
        return self.placements[rank] if rank < len(self.placements) else (None, None)

    def note_placements(self, infos: list) -> list:
        """Remember the node and GPUs of each rank whose process answered (``infos``: ping replies)
        as that rank; returns ``infos``."""
        for rank, info in enumerate(infos):
            self.note(rank, info)
        return infos

    def note(self, rank: int, info) -> None:
        """Remember what ``rank``'s process said of itself in a health reply (``info``), where it
        answered as that rank: its node and GPUs, and whether it is still warming up."""
        if getattr(info, "rank", None) != rank:
            return
        if rank < len(self.placements):
            self.placements[rank] = (info.node_id, getattr(info, "devices", None))
        if rank < len(self.warming):
            self.warming[rank] = bool(getattr(info, "warming", False))

    def serve(self, rank: int, handle, placement: tuple[str | None, str | None] = (None, None),
              warming: bool = True) -> object:
        """Make ``handle`` serve ``rank`` (in place: groups sharing the list see it); the process
        that served it before."""
        old = self.handles[rank]
        self.handles[rank] = handle
        if rank < len(self.warming):
            self.warming[rank] = warming
        if rank < len(self.placements):  # a spawned role group keeps no placements of its own
            self.placements[rank] = placement
        return old
