"""The worker pool: what the controller asks of the processes that run the roles, by caller.

Each caller sees only its part of a pool:

- :class:`StepRoles`: what one PPO/GRPO step needs (the role calls, in flight together, and the
  weight sync); also rebuilding the models, which a roll-back to the start needs;
- :class:`RecoveryPool`: what recovery needs (probe, kill, hand ranks to spares, wait for restarts,
  rejoin, rebuild), on top of the step's part;
- :class:`StatefulTargets`: what checkpoints and snapshots need (the worker groups whose state
  they save and load);
- :class:`TelemetrySource`: what telemetry reads (processes, roles, device reports).

:class:`WorkerPool` is all of them: :class:`~resilient_rl.runtime.pool.ray_roles.RayRoles` (Ray worker
groups, one process per rank) implements it. :class:`~resilient_rl.trainer.local_roles.LocalRoles`
(every engine in the controller's process) implements the step's part and telemetry's, which is
all it does: it has no processes to recover and saves no checkpoint. The recovery protocol is
unit-tested against a fake pool (:mod:`resilient_rl.testing.fake_pool`).

Processes are named by :data:`ProcessKey`: (process group, rank), where a process group is one set
of worker processes (colocated roles share one; in the split placement each role has its own).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

from resilient_rl.errors import RRLError
from resilient_rl.protocol import DataProto

#: (process group, rank): one worker process.
ProcessKey = tuple[str, int]
#: (role, rank): one role's rank; colocated roles of one rank share a process.
RoleKey = tuple[str, int]
#: Roles whose state lives in checkpoints (ref is rebuilt from its source, rollout gets the actor's weights).
STATEFUL_ROLES = ("actor", "critic")
#: The step's calls on the roles' data, and the role each runs on.
STEP_CALLS = {"compute_ref_log_prob": "ref", "compute_log_prob": "actor", "compute_values": "critic",
              "update_critic": "critic", "update_actor": "actor"}


def step_role(method: str) -> str:
    """The role that runs the step call ``method`` (see :data:`STEP_CALLS`)."""
    try:
        return STEP_CALLS[method]
    except KeyError:
        raise RRLError(f"{method!r} is not a step call (known: {', '.join(STEP_CALLS)})") from None


#: Roles in the order a process shared by several is reported under.
ROLE_ORDER = ("actor", "critic", "rollout", "ref")


def role_order(role: str) -> int:
    """Sort key of a role in :data:`ROLE_ORDER` (roles it does not name come last)."""
    return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)


class StepRoles(Protocol):
    """The roles as one step drives them (see :mod:`resilient_rl.trainer.step`)."""

    critic_enabled: bool

    def generate(self, prompts: DataProto) -> DataProto: ...
    def compute_ref_log_prob(self, data: DataProto) -> DataProto: ...
    def compute_log_prob(self, data: DataProto) -> DataProto: ...
    def compute_values(self, data: DataProto) -> DataProto: ...
    def update_critic(self, data: DataProto) -> list[dict]: ...
    def update_actor(self, data: DataProto) -> list[dict]: ...
    def sync_weights(self, version: int) -> dict[str, float]:
        """Give the rollout the actor's weights as ``version``; returns transfer statistics."""
    def concurrently(self, calls: list[tuple[str, DataProto]]) -> Iterator[Any]:
        """Put independent step calls (``(method, data)``, methods of :data:`STEP_CALLS`) in
        flight together and yield their results in order, each as its own call would return it:
        calls to one process run back to back there without a round trip to the controller in
        between, calls to different processes run side by side."""
    def init_models(self, groups: list[str] | None = None, empty: bool = False) -> None:
        """(Re)build the models of the roles living in ``groups`` (every role when None) on the
        current process groups. ``empty``: the stateful roles' models are allocated, not
        initialised (a restore of their whole state follows). The rollout may be built empty
        either way: a weight sync must follow before the next generation."""
    def shutdown(self) -> None:
        """Stop every process of the pool."""


class TelemetrySource(Protocol):
    """What telemetry reads of the processes that run the roles."""

    def process_groups(self) -> list[str]:
        """The names of the distinct process groups."""
    def workers(self) -> dict[ProcessKey, Any]:
        """Every process's last ping reply (``WorkerInfo``: pid, node, GPU), from :meth:`refresh_workers`."""
    def roles_of(self, group: str) -> tuple[str, ...]:
        """The roles whose ranks live in the processes of ``group``, the one the group is reported
        under first (the first of :data:`ROLE_ORDER`)."""
    def role_processes(self) -> dict[RoleKey, tuple[int, str | None]]:
        """(role, rank) -> (pid, node id) of every role's rank."""
    def poll_device_reports(self, poller) -> bool:
        """Refresh ``poller``'s reports (a :class:`~resilient_rl.runtime.device_poller.DeviceReportPoller`)
        without waiting; whether any changed."""


class RecoveryPool(StepRoles, Protocol):
    """The processes as recovery repairs them (see :mod:`resilient_rl.recovery`)."""

    #: The process-group generation, bumped by every :meth:`rendezvous`.
    generation: int
    #: The process groups one collective spans, each with the calls its ranks are inside it in:
    #: the weight channel joins the actor's group and the rollout's in the split placement
    #: (``send_weights``, ``receive_weights``); empty where every collective stays in one group.
    #: A rank inside such a call when the other group loses a rank is cut off: NCCL within a
    #: node never learns that a peer died, and waits out ``recovery.collective_timeout_s``.
    shared_calls: dict[str, frozenset[str]]
    #: Called before each recovery state, after the probe and between the tries of a wait for
    #: ranks (:meth:`wait_alive`); raises to end the recovery (the controller sets it: a
    #: preemption signal ends it).
    interrupt: Callable[[], None]

    def process_groups(self) -> list[str]:
        """The names of the distinct process groups."""
    def workers(self) -> dict[ProcessKey, Any]:
        """Every process's last ping reply (``WorkerInfo``: pid, node, GPU), from :meth:`refresh_workers`."""
    def roles_of(self, group: str) -> tuple[str, ...]:
        """The roles whose ranks live in the processes of ``group``, the one the group is reported
        under first (the first of :data:`ROLE_ORDER`)."""
    def refresh_workers(self) -> None:
        """Ping every process again and remember the replies."""
    def probe(self, group: str, timeout_s: float, during_call: bool = False) -> dict[int, Any]:
        """rank -> health reply, an exception (died, restarting) or None (no answer in time).

        With ``during_call`` only groups whose health calls do not queue behind a running call
        are probed (others return ``{}``)."""
    def kill(self, key: ProcessKey) -> None:
        """SIGKILL the process (stopped or hung) so that it is restarted."""
    def adopt_spares(self, keys: list[ProcessKey]) -> list[ProcessKey]:
        """Hand each dead process of ``keys`` to a ready warm spare (``recovery.spares``) instead
        of waiting for its restart; the keys handed over (none without spares)."""
    def leave_collectives(self, keys: list[ProcessKey], reason: str) -> None:
        """Tell each process of ``keys`` (inside a call) to leave its process groups'
        collectives, so that the call ends now with a collective error; not waited for."""
    def wait_alive(self, group: str, timeout_s: float) -> list[Any]:
        """Wait until every rank of ``group`` answers (restarted where it died); their replies."""
    def locate(self, name: str | None) -> tuple[str | None, str | None]:
        """(process group, role) of the worker group an error names (``WorkerError.role``)."""
    def rendezvous(self, groups: list[str] | None = None) -> None:
        """Join the process groups named in ``groups`` (every one when None) with a new
        generation (also after a failure); the others keep theirs."""


class StatefulTargets(Protocol):
    """The worker groups whose state checkpoints and snapshots save and load."""

    def checkpoint_groups(self) -> list[tuple[str, Any]]:
        """(role, worker group) of every role whose state a checkpoint saves and loads."""
    def role_processes(self) -> dict[RoleKey, tuple[int, str | None]]:
        """(role, rank) -> (pid, node id) of every role's rank."""


class WorkerPool(RecoveryPool, TelemetrySource, StatefulTargets, Protocol):
    """Every part: the roles' processes as the controller drives them on Ray."""

    #: Whether the pool's stateful roles save and load sharded checkpoints (and so the run needs
    #: a lease, and recovery restores from storage).
    writes_checkpoints: bool
