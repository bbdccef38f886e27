"""The ``RankWorker`` base class: identity of a rank and the lifecycle of its process group.

A worker learns its rank and world size from the environment its worker group sets for it
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), as in verl. The group hands these to the actor's
constructor, which exports them (:func:`export_identity`) before the worker's own ``__init__`` runs,
rather than through a per-actor Ray ``runtime_env``: that would start every actor through Ray's
setup-worker process and bar it from reusing the node's idle worker processes, which costs seconds.

Its ``torch.distributed`` group is not created in ``__init__``: the controller calls
:meth:`RankWorker.rendezvous` on every rank with a generation number, a master address and a port. A
later rendezvous with a new generation (after a peer died and was restarted) destroys the broken
group first and joins the new one.

Several workers may live in one process (colocated roles). The process group is a property of
the process, so it is tracked at module level and a rendezvous for a generation the process has
already joined is a no-op.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
import torch.distributed as dist

from resilient_rl import env
from resilient_rl.runtime import leave_collective, progress, rendezvous
from resilient_rl.runtime.parts import call as run_part_method
from resilient_rl.runtime.leave_collective import uses_nccl  # noqa: F401 -- part of this module's surface
from resilient_rl.runtime.master_env import free_port
from resilient_rl.runtime.dispatch import Dispatch, Execute, register
from resilient_rl.errors import CollectiveError
from resilient_rl.runtime.devices import (cuda_driver_initialized, device_report, note_driver_initialised,
                                          taken_device_index, visible_devices)

logger = logging.getLogger(__name__)

_PG_LOCK = threading.Lock()
# "cuda_device": the CUDA index the rendezvous made current (CUDA's current device is per thread,
# and health calls run on another thread than the one that set it).
_PG_STATE: dict = {"generation": None, "cuda_device": None}

_WARMING: list[threading.Thread] = []  # see warm_in_background
_GC_HOLD = {"lock": threading.Lock(), "holders": 0}


def warm_in_background(fn, name: str) -> None:
    """Run ``fn`` (imports that later calls need) in a thread of its own, so that a new process
    answers its first ping at once; :meth:`RankWorker.warmed_up` waits for every such thread.

    The garbage collector is off while any warm-up runs: an import of torch's compiler stack
    triggers full collections over some 300,000 objects, each holding the interpreter lock
    throughout, which made a loaded host's health calls wait seconds (and judged the rank hung).
    With it off the import is about a quarter faster and the lock's longest holds (99th
    percentile) drop from ~100 ms to ~20 ms (measured on a 2-core host)."""
    thread = threading.Thread(target=_without_gc, args=(fn, name), name=name, daemon=True)
    thread.start()
    # A process that takes over one rank after another warms up again each time: keep only the
    # threads still running.
    _WARMING[:] = [t for t in _WARMING if t.is_alive()] + [thread]


def warm_worker_imports(worker) -> None:
    """Run ``worker.warm_imports()`` (:meth:`RankWorker.warm_imports`) in the background, after the
    warm-ups already running (one import at a time: two threads importing the same modules only
    wait for each other). A failure is logged, never raised: the call that needs the import
    raises it again, with its own context."""
    earlier = [t for t in _WARMING if t.is_alive()]

    def imports() -> None:
        for thread in earlier:
            thread.join()
        try:
            worker.warm_imports()
        except Exception as exc:  # noqa: BLE001 -- only a head start; the real import reports it
            logger.debug("warm-up imports of %s failed: %s: %s", type(worker).__name__, type(exc).__name__, exc)

    if callable(getattr(worker, "warm_imports", None)):
        warm_in_background(imports, "warm-worker-imports")


def _without_gc(fn, name: str) -> None:
    with _GC_HOLD["lock"]:
        _GC_HOLD["holders"] += 1
        gc.disable()
    try:
        before = cuda_driver_initialized()
        fn()
        note_driver_initialised(f"the start-up work {name!r}", before)
    finally:
        with _GC_HOLD["lock"]:
            _GC_HOLD["holders"] -= 1
            if not _GC_HOLD["holders"]:
                gc.enable()


def wait_warm_up() -> None:
    """Return once this process's background warm-ups are done (a call that imports the same
    modules then imports none of them concurrently)."""
    for thread in list(_WARMING):
        thread.join()


def warming() -> bool:
    """Whether this process's background warm-up is still running."""
    return any(t.is_alive() for t in _WARMING)


@dataclass
class WorkerInfo:
    """What the controller learns from a cheap health call.

    ``gpu_uuids`` names the GPU(s) the process computes on (empty on CPU); the torch counters
    are its caching allocator's allocated and reserved bytes there (None on CPU). ``call``,
    ``progress_age_s`` and ``advances`` are the process's progress
    (:mod:`resilient_rl.runtime.progress`): the registered call it is in (None when idle), the
    seconds since it last advanced, and how many times it has advanced. ``devices`` is the
    process's ``CUDA_VISIBLE_DEVICES`` (None when unset): the GPUs Ray gave it, which a warm spare
    takes over when the rank dies (:mod:`resilient_rl.runtime.devices`). ``warming``: the
    process's start-up imports are still running (:func:`warm_in_background`); until they end,
    its health calls may wait on them, and it is judged hung only after
    ``recovery.warmup_timeout_s``. ``left``: the process left its collectives
    (:func:`~resilient_rl.runtime.leave_collective.has_left`) and has not joined them again, so
    its group must rejoin before its next collective."""

    rank: int
    world_size: int
    generation: int | None
    pid: int
    node_id: str
    gpu_uuids: tuple[str, ...] = ()
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None
    call: str | None = None
    progress_age_s: float | None = None
    advances: int = 0
    devices: str | None = None
    warming: bool = False
    left: bool = False


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests): loopback is where the peers are
        return "127.0.0.1"


def _node_id() -> str:
    try:
        import ray

        if not ray.is_initialized():  # outside Ray: asking the runtime context would start a cluster
            return "local"
        return ray.get_runtime_context().get_node_id() or "local"
    except Exception:
        return "local"


def export_identity(identity: dict[str, str]) -> None:
    """Put a rank's identity (``RANK``, ``WORLD_SIZE``, ...) into this process's environment.

    Called by the worker group in the actor's constructor before the worker's ``__init__``, so that
    the worker (through :mod:`resilient_rl.env`) and any library it starts see them as usual.
    """
    os.environ.update(identity)


def default_backend() -> str:
    """nccl on CUDA machines, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def cuda_device_index(local_rank: int) -> int:
    """The CUDA device a rank computes on: one per local rank among its devices (those visible,
    or those a warm spare took after its driver was initialised: :func:`taken_device_index`)."""
    taken = taken_device_index(local_rank)
    return taken if taken is not None else local_rank % torch.cuda.device_count()


def compute_cuda_device() -> int | None:
    """The CUDA index this process computes on: the one its rendezvous selected, else CUDA's
    current device once CUDA is initialised (a worker that built its model before joining a
    group), else None (on CPU, or nothing on the GPU yet)."""
    index = _PG_STATE["cuda_device"]
    if index is None:
        # A spare that took a rank's GPU: CUDA's current device is per thread, and the thread of
        # a health reply never selected it.
        index = taken_device_index(int(env.get("LOCAL_RANK", "0")))
    # is_initialized first: is_available would initialise the CUDA driver in a process (a warm
    # spare) that must still be free to choose its devices.
    if index is None and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
    return index


@dataclass(frozen=True)
class RankIdentity:
    """Who a worker process is: what its group exported (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
    and where it runs."""

    rank: int
    world_size: int
    local_rank: int
    node_id: str
    node_ip: str

    @classmethod
    def from_env(cls) -> "RankIdentity":
        return cls(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")),
                   _node_id(), _node_ip())


class RankWorker:
    """Base class of every worker run by a :class:`~resilient_rl.RayWorkerGroup`: a rank's
    identity, its process group, its health calls, and its parts' calls. verl's
    :class:`~resilient_rl.runtime.verl_worker.Worker` adds verl's surface to it.

    A subclass need not call ``super().__init__()``: the group exports the rank's identity before
    the subclass's ``__init__`` runs, and :attr:`identity` reads it at first use.

    The health protocol: the group probes every rank with :meth:`health`. A class that declares
    ``@ray.remote(concurrency_groups=HEALTH_GROUPS)`` and puts ``health``,
    ``call_off_rendezvous`` and ``leave_collectives`` in the "health" group sets
    :attr:`answers_during_calls`: its ranks answer while a call runs (or is blocked in a
    collective), so only a stopped rank looks hung. Other classes answer after the running call."""

    #: Whether :meth:`health` (and the other health-group calls) answer while a call runs.
    answers_during_calls: bool = False
    #: The worker's parts (:mod:`resilient_rl.runtime.parts`): attribute name -> class; their
    #: registered methods are calls of the worker, sent through :meth:`call_part`.
    parts: Mapping[str, type] = MappingProxyType({})

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        """``cuda_visible_devices`` is accepted for verl compatibility and not used: Ray assigns a
        worker its devices."""

    def warm_imports(self) -> None:
        """Imports this worker's first calls will need, run in a background thread once its
        constructor has returned (:func:`warm_worker_imports`): a process restarted for a rank
        does them while the controller waits for the others, and a warm spare is ready only once
        they are done. None here; a subclass names its own."""

    @property
    def identity(self) -> RankIdentity:
        """This rank's identity, read from the environment at first use after the group exported
        it (a warm spare taking a rank drops it, :mod:`resilient_rl.runtime.worker_class`)."""
        identity = self.__dict__.get("_rrl_identity")
        if identity is None:
            identity = self.__dict__["_rrl_identity"] = RankIdentity.from_env()
        return identity

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def generation(self) -> int | None:
        """Generation of the process group this process has joined (None before the first rendezvous)."""
        return _PG_STATE["generation"]

    def call_part(self, path: str, *args, **kwargs):
        """Run the registered method ``path`` (``"part.method"``) of one of this worker's parts:
        the endpoint a worker group sends a part's calls to (:mod:`resilient_rl.runtime.parts`)."""
        return run_part_method(self, path, args, kwargs)

    def get_master_addr_port(self) -> tuple[str, int]:
        """Address and a free port of this node, for rank 0 to host a rendezvous. (verl returns
        the ``MASTER_ADDR``/``MASTER_PORT`` the rank started with; those are in the environment.)"""
        return self.identity.node_ip, free_port()

    get_available_master_addr_port = get_master_addr_port

    # ------------------------------------------------------------------ health
    def warmed_up(self) -> WorkerInfo:
        """The ping reply, once the process's background warm-up (:func:`warm_in_background`) is
        done. A warm spare counts as ready only then: a rank taking over before that waits for
        the import lock inside its first calls (about 0.25 s in the rendezvous here)."""
        wait_warm_up()
        return self.ping()

    def health(self) -> WorkerInfo:
        """The health probe's answer (:meth:`ping`'s); see the class's health protocol."""
        return self.ping()

    def ping(self) -> WorkerInfo:
        """Cheap health call: answers from the actor's process without touching the process group.

        It also says which GPU the process computes on and how much memory torch holds there
        (see :mod:`resilient_rl.telemetry.gpu_owners`); it never initialises CUDA."""
        report = device_report(compute_cuda_device())
        done = progress.snapshot()
        return WorkerInfo(self.rank, self.world_size, _PG_STATE["generation"], os.getpid(), self.identity.node_id,
                          report.gpu_uuids, report.torch_allocated_bytes,
                          report.torch_reserved_bytes, call=done.call, progress_age_s=done.age_s,
                          advances=done.advances, devices=visible_devices(), warming=warming(),
                          left=leave_collective.has_left())

    def inject_slowdown(self, seconds_per_advance: float, advances: int) -> None:
        """Fault injection (chaos suite): the next ``advances`` progress points of this process each
        sleep ``seconds_per_advance`` first, so its calls get slow while staying live."""
        progress.slow_down(seconds_per_advance, advances)

    # ------------------------------------------------------------------ process group
    def rendezvous(self, generation: int, master_addr: str, master_port: int, backend: str | None = None,
                   timeout_s: float = 60.0) -> int:
        """Join the process group of ``generation``, destroying an older (possibly broken) one first.

        Returns the generation joined. Every collective of the new group has ``timeout_s`` as its
        timeout, so a dead or hung peer ends a collective with an error instead of a silent hang.
        """
        with _PG_LOCK:
            if _PG_STATE["generation"] == generation and dist.is_initialized():
                return generation
            if dist.is_initialized():
                if _PG_STATE["generation"] is None:  # the worker's own, through env://
                    logger.warning("rank %d: replacing the process group the worker created itself with the "
                                   "controller's generation %d", self.rank, generation)
                destroy_process_group()
            backend = backend or default_backend()
            if backend == "nccl" and torch.cuda.is_available():
                _PG_STATE["cuda_device"] = cuda_device_index(self.identity.local_rank)
                torch.cuda.set_device(_PG_STATE["cuda_device"])
                leave_collective.survive_nccl_errors()
                # CPU-side collectives (checkpoint metadata, object gathers) ride on gloo next to nccl.
                backend = "cpu:gloo,cuda:nccl"
            # Every rank is in the store before torch builds the group: a rendezvous whose peer
            # died is called off there, instead of blocking in torch until the timeout.
            store = rendezvous.join_store(generation, master_addr, master_port, self.rank, self.world_size,
                                          timeout_s)
            # The old group is gone, also where leaving aborted it (an NCCL abort de-initialises
            # torch's default group, so nothing above destroyed it): the new one is not left.
            leave_collective.forget(leave_collective.PROCESS_GROUP)
            with leave_collective.recording():  # so that a broken collective can be left at once
                dist.init_process_group(
                    backend=backend,
                    store=store,
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
            _PG_STATE["generation"] = generation
            # The env:// contract follows the group: code that reads MASTER_ADDR/PORT later (a
            # library starting its own group) finds this generation's master.
            export_identity({"MASTER_ADDR": str(master_addr), "MASTER_PORT": str(master_port)})
            logger.info("rank %d joined generation %d (%s, world size %d)", self.rank, generation, backend,
                        self.world_size)
            return generation

    def call_off_rendezvous(self, generation: int) -> None:
        """Call off this process's rendezvous of ``generation``: a rank waiting there for a peer
        that will not come gives up at once (classes with a health thread answer this from it,
        while the rendezvous call itself is running)."""
        rendezvous.call_off(generation)

    def leave_collectives(self, reason: str = "") -> int:
        """End the collective this process is blocked in, and its peers' waits on it: a peer of
        its group died (see :mod:`resilient_rl.runtime.leave_collective`). Classes with a health
        thread answer this from it while the blocked call runs. The connections shut down."""
        return leave_collective.leave_collectives(reason)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.ALL)
    def all_reduce_check(self, value: float) -> float:
        """Sum ``value * (rank + 1)`` over the group: a cheap end-to-end check of the process group."""
        t = torch.tensor([value * (self.rank + 1)], dtype=torch.float64)
        try:
            dist.all_reduce(t)
        except Exception as exc:  # classify at the boundary: a peer died or timed out
            raise CollectiveError(f"all_reduce failed on rank {self.rank}: {exc}", rank=self.rank,
                                  cause="collective") from exc
        return float(t.item())


def destroy_process_group() -> None:
    """Tear down this process's group; a broken group must not prevent joining a new one."""
    try:
        # destroy on a wedged NCCL communicator can block; abort does not.
        if not leave_collective.abort_nccl():
            dist.destroy_process_group()
    except Exception as exc:  # the group may already be half gone
        logger.warning("destroying the old process group raised %s; continuing", exc)
    leave_collective.forget(leave_collective.PROCESS_GROUP)
    _PG_STATE["generation"] = None
