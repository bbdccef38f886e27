"""verl's ``Worker``: the project's :class:`~resilient_rl.runtime.worker.RankWorker` with verl's
surface, so that a verl worker ports by changing its imports.

It adds each worker's data-parallel rank per named mesh, for verl's n-dimensional dispatch
(:mod:`resilient_rl.runtime.dispatch_nd`), verl's function-running helpers and its identity
helpers. The mesh tables are created on first use, so a worker whose ``__init__`` does not call
``super().__init__()`` has them too. The project's own role workers build on ``RankWorker``.
"""

from __future__ import annotations

from resilient_rl.errors import DispatchError
from resilient_rl.runtime.dispatch import Dispatch, Execute, register
from resilient_rl.runtime.master_env import free_port
from resilient_rl.runtime.worker import RankWorker

#: The env:// contract a worker finds before its ``__init__`` runs (verl's ``Worker.env_keys``).
ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Worker(RankWorker):
    """Base class of a verl-style worker run by a :class:`~resilient_rl.RayWorkerGroup`: a
    :class:`~resilient_rl.runtime.worker.RankWorker` with verl's per-mesh dispatch rank and collect
    flag (verl's names and semantics) and verl's helpers."""

    @classmethod
    def env_keys(cls) -> list[str]:
        """The environment variables the group sets for every rank (verl)."""
        return list(ENV_KEYS)

    def get_fused_worker_by_name(self, worker_name: str):
        """The colocated role ``worker_name`` of this process (verl's fused workers), or None."""
        return (self.__dict__.get("fused_worker_dict") or {}).get(worker_name)

    def get_node_ip(self) -> str:
        return self.identity.node_ip

    def get_free_port(self) -> int:
        return free_port()

    # ------------------------------------------------------------------ meshes
    def _mesh_tables(self) -> tuple[dict[str, int], dict[str, bool]]:
        tables = self.__dict__.get("_rrl_mesh")
        if tables is None:
            tables = self.__dict__["_rrl_mesh"] = ({}, {})
        return tables

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Record this worker's data-parallel rank in mesh ``mesh_name`` and whether its output
        is collected (called by the worker itself, usually in ``__init__``)."""
        dispatch, collect = self._mesh_tables()
        if mesh_name in dispatch or mesh_name in collect:
            raise DispatchError(f"mesh_name {mesh_name} has been registered")
        dispatch[mesh_name], collect[mesh_name] = dp_rank, is_collect

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        dispatch, _ = self._mesh_tables()
        if mesh_name not in dispatch:
            raise DispatchError(f"{mesh_name} is not registered in {type(self).__name__}")
        return dispatch[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this worker's output is collected for mesh ``mesh_name``."""
        _, collect = self._mesh_tables()
        if mesh_name not in collect:
            raise DispatchError(f"{mesh_name} is not registered in {type(self).__name__}")
        return collect[mesh_name]

    def get_dispatch_collect(self) -> dict:
        """Every registered mesh: ``{"dispatch_dp_rank": {...}, "collect_dp_rank": {...}}``."""
        dispatch, collect = self._mesh_tables()
        return {"dispatch_dp_rank": dispatch, "collect_dp_rank": collect}

    def set_dispatch_collect(self, mesh_name: str, dispatch_dp_rank: dict[str, int],
                             collect_dp_rank: dict[str, bool]) -> None:
        """Take another worker's registration (``get_dispatch_collect``) under ``mesh_name``: a
        fused worker answers for the workers it hosts."""
        dispatch, collect = self._mesh_tables()
        if mesh_name in dispatch or mesh_name in collect:
            raise DispatchError(f"{mesh_name} is already registered, {sorted(dispatch)}")
        for dp_rank in dispatch_dp_rank.values():
            dispatch[mesh_name] = dp_rank
        for is_collect in collect_dp_rank.values():
            collect[mesh_name] = is_collect

    # ------------------------------------------------------------------ running a driver's function
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func, *args, **kwargs):
        """Run ``func(self, *args, **kwargs)`` on every rank, each with its chunk of the DataProtos."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func, *args, **kwargs):
        """Run ``func(*args, **kwargs)`` on rank zero."""
        return func(*args, **kwargs)
