"""The run-time config sections: the fit loop, checkpointing, recovery, telemetry and Ray.

These say how a run is driven and kept alive rather than what is trained; the model, optimiser,
role and data sections live in :mod:`resilient_rl.config.sections` and
:mod:`resilient_rl.config.data_sections`, the shared validation machinery (:class:`Section`,
``require``, ``choice``) in :mod:`resilient_rl.config.section`. The root config in
:mod:`resilient_rl.config.schema` re-exports every section.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from resilient_rl.config.section import choice, require, Section


#: Longest ``trainer.run_name``: it names folders (255 bytes at most on common file systems) with
#: room for the prefixes and suffixes added to it (Ray actor and placement-group names, leases).
MAX_RUN_NAME = 128


@dataclass
class TrainerConfig(Section):
    """The fit loop: length, seeds, where results go, device and placement of the roles."""

    #: Steps of the run (a resume continues to this step).
    total_steps: int = 250
    #: verl's ``trainer.total_epochs``: when set, the run is this many passes over the prompts,
    #: ``total_epochs * (prompts // data.batch_size)`` steps (an epoch's last incomplete batch is
    #: dropped, as verl's loader drops it), and ``total_steps`` is set to that when the trainer
    #: has read the data. Null: ``total_steps`` says how long the run is.
    total_epochs: Optional[int] = None
    #: Seed of model initialization, sampling and every worker's RNG.
    seed: int = 1
    #: The run's name: its folder ``output_dir/run_name`` and its checkpoints
    #: ``checkpoint.root/run_name`` (letters, digits, ``.``, ``_``, ``-``; at most 128 characters).
    run_name: str = "ppo-copy"
    #: Where run folders go (metrics, events, logs, config, controller record).
    output_dir: str = "runs"
    #: ``cpu``, ``cuda`` or ``auto`` (CUDA when the Ray cluster has a GPU). ``cuda`` on a cluster
    #: without one is refused before any worker starts; the controller itself may run on a node
    #: without a GPU.
    device: str = "auto"
    #: ``colocated``: all roles share each rank's process and device; ``split``: each role has
    #: processes of its own.
    placement: str = "colocated"
    #: Nodes of each role (verl's name): a role's ranks run ``world_size // nnodes`` on each of
    #: ``nnodes`` nodes, numbered node by node (resilient_rl.config.node_layout).
    nnodes: int = 1
    #: GPUs of a node: a role may put at most this many ranks on one; null: no limit.
    n_gpus_per_node: Optional[int] = None
    #: Split placement: nodes of a role other than ``nnodes`` (``{rollout: 1, critic: 1}``: a role with fewer
    #: ranks than ``nnodes`` needs its own count).
    role_nnodes: Dict[str, int] = field(default_factory=dict)
    #: FSDP2 over a role's ranks: "full" shards over all of them; "hybrid" (HSDP) shards within a
    #: node and replicates across nodes (a (replicate, shard) device mesh).
    sharding: str = "full"
    #: Network interface the process groups use between nodes (GLOO_SOCKET_IFNAME and
    #: NCCL_SOCKET_IFNAME of every worker); "" lets gloo and NCCL choose.
    network_interface: str = ""
    #: Steps between summary lines on the console.
    log_every: int = 10
    #: Show a progress bar on the console.
    progress_bar: bool = True
    #: Experiment trackers (verl: trainer.logger): console, jsonl, tensorboard, wandb, mlflow.
    loggers: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    #: Project name for the ``wandb`` and ``mlflow`` trackers.
    project_name: str = "resilient-rl"
    #: What a step that meets NaN/Inf (loss, grad norm, reward, KL) does: skip the poisoned update,
    #: roll back to the newest known-good checkpoint, or raise. See recovery/nonfinite.py.
    nonfinite: str = "skip"
    #: Steps with non-finite values tolerated in a row (after a rollback: until a known-good commit).
    max_nonfinite: int = 3
    #: Deterministic GPU kernels (cuBLAS workspace, torch.use_deterministic_algorithms, cuDNN):
    #: a replayed or re-run step gives the same bits on a GPU too, at some cost in speed.
    #: CPU runs are bit-identical either way. See workers/determinism.py.
    deterministic: bool = False
    #: SIGTERM or SIGUSR1 (a preemption): the run stops after the step in progress and has this
    #: long to commit its last completed step before it exits (143). Size it from a save's duration
    #: (the checkpoint_committed events' duration_s) plus one step; see trainer/preemption.py.
    preempt_grace_s: float = 120.0
    #: Validate (score the held-out prompts of ``data.val_path`` or ``data.val_num_prompts``)
    #: after every ``test_freq``-th step and after the last one; 0 (or verl's -1): never.
    test_freq: int = 0
    #: Validate once before the first step (a ``step: 0`` row in the metric history).
    val_before_train: bool = False

    def validate(self) -> None:
        require(self.test_freq >= 0, "test_freq", self.test_freq, "must be >= 0 (0: no validation)")
        require(self.preempt_grace_s > 0, "preempt_grace_s", self.preempt_grace_s, "must be > 0 seconds")
        require(self.total_steps >= 1, "total_steps", self.total_steps, "must be >= 1")
        require(self.total_epochs is None or self.total_epochs >= 1, "total_epochs", self.total_epochs,
                "must be >= 1 or null (trainer.total_steps sets the length)")
        choice("nonfinite", self.nonfinite, ("skip", "rollback", "raise"))
        require(self.max_nonfinite >= 0, "max_nonfinite", self.max_nonfinite, "must be >= 0")
        require(self.seed >= 0, "seed", self.seed, "must be >= 0")
        # The run name becomes a directory in checkpoint URLs and a metrics label, and part of Ray
        # actor names and lease files: a file name has at most 255 bytes, so keep well below it.
        require(len(self.run_name) <= MAX_RUN_NAME, "run_name", self.run_name if len(self.run_name) <= 80
                else f"{self.run_name[:40]}...({len(self.run_name)} characters)",
                f"must be at most {MAX_RUN_NAME} characters (it names directories and Ray actors)")
        require(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.run_name) is not None, "run_name",
                 self.run_name, "must be letters, digits, '.', '_' or '-' (it names directories)")
        choice("device", self.device, ("auto", "cpu", "cuda"))
        choice("placement", self.placement, ("colocated", "split"))
        require(self.nnodes >= 1, "nnodes", self.nnodes, "must be >= 1")
        require(self.n_gpus_per_node is None or self.n_gpus_per_node >= 1, "n_gpus_per_node", self.n_gpus_per_node,
                "must be >= 1 or null (not checked)")
        for role, n in self.role_nnodes.items():
            choice("role_nnodes", role, ("actor", "rollout", "ref", "critic"))
            require(isinstance(n, int) and n >= 1, f"role_nnodes.{role}", n, "must be an int >= 1")
        require(not self.role_nnodes or self.placement == "split", "role_nnodes", self.role_nnodes,
                "applies to trainer.placement=split only (colocated roles share the actor's nodes)")
        choice("sharding", self.sharding, ("full", "hybrid"))
        require(re.fullmatch(r"[A-Za-z0-9_.:@-]*", self.network_interface) is not None, "network_interface",
                self.network_interface, "must be an interface name (e.g. eth0, ib0) or empty")
        require(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        for name in self.loggers:
            choice("loggers", name, ("console", "jsonl", "tensorboard", "wandb", "mlflow"))
        require(bool(self.project_name), "project_name", self.project_name, "must be non-empty")


@dataclass
class CheckpointConfig(Section):
    """Where and how often checkpoints are written, how many are kept, what to resume from."""

    #: Where checkpoints go: a path or an fsspec URL (``s3://``, ``gs://``, ...).
    root: str = "checkpoints"
    #: Steps between checkpoints, and the run's last step (0: no checkpoints).
    save_every: int = 20
    #: Committed checkpoints kept (older ones are deleted; the newest known-good is always kept), and
    #: timelines set aside in ``abandoned/`` by a run continued from an earlier step or started over
    #: (older ones are deleted after a commit, never one set aside since the newest commit).
    keep_last: int = 2
    #: Also keep every checkpoint whose step is a multiple of this (0: none).
    keep_every: int = 0
    #: Write checkpoints in the background (the step waits only for the copy to host memory).
    async_save: bool = True
    #: What a start loads: ``auto`` (the newest checkpoint that verifies, or a newer snapshot a
    #: preempted controller left), ``off`` (start over, setting the old steps aside) or
    #: ``path:<checkpoint URL>``.
    resume: str = "auto"
    #: fsspec options of ``root`` (credentials, endpoint); secrets are redacted in saved configs and
    #: logs.
    storage_options: Optional[Dict[str, Any]] = None
    #: A controller's lease on its run expires this long after its last renewal.
    lease_ttl_s: float = 60.0
    #: Seconds between lease renewals (less than ``lease_ttl_s``).
    lease_renew_s: float = 20.0
    #: Take the run over from a controller that still holds its lease (this start only).
    takeover: bool = False
    #: A due save waits this long for the previous one to finish writing, then is skipped.
    save_timeout_s: float = 600.0
    #: Checkpoints skipped in a row (storage outage) before the run stops.
    max_skipped: int = 3
    #: A local ``root`` (a path, file://) is a different folder on every node: on a cluster of more
    #: than one node it is refused at start unless declared shared (NFS, a ReadWriteMany PVC, Lustre).
    shared_filesystem: bool = False

    def validate(self) -> None:
        require(self.save_timeout_s > 0, "save_timeout_s", self.save_timeout_s,
                 "must be > 0 seconds (how long a due save waits for the previous one to finish writing)")
        require(self.max_skipped >= 0, "max_skipped", self.max_skipped,
                 "must be >= 0 (checkpoints skipped in a row before the run stops; 0 = stop at the first)")
        require(bool(self.root), "root", self.root, "must be a non-empty path or fsspec URL")
        require(self.save_every >= 0, "save_every", self.save_every, "must be >= 0 (0 = off)")
        require(self.keep_last >= 1, "keep_last", self.keep_last, "must be >= 1")
        require(self.keep_every >= 0, "keep_every", self.keep_every, "must be >= 0 (0 = off)")
        if self.resume in ("False", "false"):  # YAML reads `resume=off` (and `false`) as a boolean
            self.resume = "off"
        require(self.resume in ("auto", "off") or (self.resume.startswith("path:") and len(self.resume) > 5),
                 "resume", self.resume, "allowed values are 'auto', 'off' or 'path:<checkpoint URL>'")
        require(self.lease_ttl_s > 0, "lease_ttl_s", self.lease_ttl_s, "must be > 0 seconds")
        require(0 < self.lease_renew_s < self.lease_ttl_s, "lease_renew_s", self.lease_renew_s,
                 f"must be > 0 and < lease_ttl_s={self.lease_ttl_s} (renew well before the lease expires)")


@dataclass
class RecoveryConfig(Section):
    """Failure budget, liveness and the deadline of every blocking call.

    A rank is hung when it stops answering its health call for ``health_timeout_s`` (a stopped
    process; ``warmup_timeout_s`` while the process still runs its start-up imports) or, inside
    a call, stops advancing for ``hang_timeout_s`` (longer than the slowest single mini-batch,
    token block or checkpoint chunk); a long call that keeps advancing is healthy.
    ``call_timeout_s`` is only a generous ceiling on one whole worker call. The wait for a
    background checkpoint write has its own ``checkpoint.save_timeout_s`` and the telemetry
    exporter's calls ``telemetry.call_timeout_s``.

    ``snapshot_every``: every that many steps each stateful rank copies its state to host memory,
    kept in its node's memory, by a ring peer on another node, else in the object store
    (:mod:`resilient_rl.workers.snapshots.keeper`);
    a recovery restores the newest complete snapshot instead of the older storage checkpoint.
    0 turns snapshots off. ``auto`` (the default) snapshots every step where each node's tmpfs,
    RAM and cgroup limit hold the copies with headroom, less often or not at all where they do not,
    and logs one line saying which and why (:mod:`resilient_rl.workers.snapshots.sizing`). ``snapshot_node_dir``: a node-shared memory directory (a tmpfs) where
    each rank keeps its snapshots, so that they outlive its process on that node
    (:mod:`resilient_rl.workers.snapshots.node_memory`); "" keeps them in the process and in Ray's object
    store instead (also where the directory cannot hold them). ``snapshot_hand_over_s``: how long
    the node memory of a controller that is gone without ending the run (killed, or preempted with
    no warning) is kept for the run's next controller, which continues from it
    (:mod:`resilient_rl.workers.snapshots.carry`), counted from when the controller was last seen
    alive (within a minute); other runs on the node sweep it after that, and sooner where their own
    snapshots need the room (:mod:`resilient_rl.workers.snapshots.node_sweep`); 0: not kept.

    ``spares``: warm spare processes per worker group (:mod:`resilient_rl.runtime.spares`),
    started ahead of need on free resources; a dead rank is handed to one at once instead of
    waiting for Ray to start a new process. ``auto`` (the default) keeps one per node of each
    group where host memory allows (a spare holds no accelerator), only one (for the group with
    the most ranks) where the ranks already take every core, and logs one line saying so
    (:mod:`resilient_rl.runtime.spare_sizing`); 0 turns spares off."""

    #: Recover from worker failures in place; false: a failure stops the run.
    enabled: bool = True
    #: Restarts of each worker process within ``failure_window_s`` before the run gives up (Ray
    #: restarts a dead process whenever it dies; this budget decides).
    max_restarts: int = 3
    #: Ray retries of a worker call whose process died (0: the controller recovers instead).
    max_task_retries: int = 0
    #: Failures within ``failure_window_s`` before the run gives up.
    max_failures: int = 5
    #: The window of that failure budget.
    failure_window_s: float = 3600.0
    #: Wait before recovering again from a failure in a row (no step completed since the last):
    #: this long after the second, doubling after each further one, up to a minute (0: none).
    backoff_s: float = 1.0
    #: Ceiling on one worker call (a hang is found sooner, by ``hang_timeout_s``).
    call_timeout_s: float = 3600.0
    #: Process-group set-up deadline, at start and at each rejoin.
    rendezvous_timeout_s: float = 60.0
    #: Process-group timeout of every collective.
    collective_timeout_s: float = 60.0
    #: How long recovery waits for a dead rank's new process (and that process's model build for
    #: the GPU memory the dead one still held).
    restart_timeout_s: float = 120.0
    #: How long a placement group may take to be placed at start.
    placement_timeout_s: float = 60.0
    #: A rank whose health call goes unanswered this long is hung.
    health_timeout_s: float = 2.0
    #: The same for a process still running its start-up imports (they hold the interpreter for
    #: seconds on a loaded host).
    warmup_timeout_s: float = 60.0
    #: A rank inside a call that does not advance for this long is hung.
    hang_timeout_s: float = 300.0
    #: Steps between in-memory snapshots (0: none; ``auto``: every step where node memory holds
    #: them).
    snapshot_every: Union[int, str] = "auto"
    #: Node-shared memory directory (a tmpfs) where snapshots outlive their processes; empty: in the
    #: processes and Ray's object store.
    snapshot_node_dir: str = "/dev/shm"
    #: How long node memory left by a controller that is gone is kept for the run's next
    #: controller (0: not kept).
    snapshot_hand_over_s: float = 600.0
    #: Warm spare processes per worker group; ``auto``: sized to the node's memory and cores; 0:
    #: none.
    spares: Union[int, str] = "auto"

    def validate(self) -> None:
        for name in ("max_restarts", "max_task_retries", "max_failures"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        require(self.spares == "auto" or (isinstance(self.spares, int) and self.spares >= 0), "spares", self.spares,
                "must be 'auto' (sized to the node's memory and cores) or a number >= 0")
        require(self.snapshot_every == "auto" or (isinstance(self.snapshot_every, int) and self.snapshot_every >= 0),
                "snapshot_every", self.snapshot_every,
                "must be 'auto' (sized to what node memory holds) or a number of steps >= 0 (0 = off)")
        for f in dataclasses.fields(self):
            if f.name.endswith("_s") and f.name not in ("snapshot_hand_over_s", "backoff_s"):
                require(getattr(self, f.name) > 0, f.name, getattr(self, f.name), "must be > 0 seconds")
        require(self.backoff_s >= 0, "backoff_s", self.backoff_s,
                "must be >= 0 seconds (0: a failure in a row is recovered from at once)")
        require(self.snapshot_hand_over_s >= 0, "snapshot_hand_over_s", self.snapshot_hand_over_s,
                "must be >= 0 seconds (0: node memory a gone controller left is not kept)")
        require(not self.snapshot_node_dir or self.snapshot_node_dir.startswith("/"), "snapshot_node_dir",
                self.snapshot_node_dir, "must be an absolute path, or empty to keep snapshots in the processes")
        require(self.warmup_timeout_s >= self.health_timeout_s, "warmup_timeout_s", self.warmup_timeout_s,
                f"must be at least recovery.health_timeout_s ({self.health_timeout_s:g})")
        # A stopped rank must be named before its peers, which stall waiting for it in a collective.
        require(self.hang_timeout_s > self.health_timeout_s, "hang_timeout_s", self.hang_timeout_s,
                 f"must be greater than recovery.health_timeout_s ({self.health_timeout_s:g})")


@dataclass
class TelemetryConfig(Section):
    """The Prometheus exporter and the GPU sampler.

    ``call_timeout_s`` bounds each call the controller makes to start, poll or stop a node's
    device exporter (a Ray actor): telemetry must never hold training up for long."""

    #: Serve Prometheus metrics from the controller and sample the GPUs.
    enabled: bool = True
    #: Address the metrics server listens on (loopback by default).
    bind_address: str = "127.0.0.1"
    #: Port of the controller's metrics server (0: any free port, named in the targets file).
    port: int = 0
    #: Port of each other node's device exporter (0: any free port).
    worker_port_base: int = 0
    #: Prometheus file_sd targets file; null: ``prometheus_targets.json`` in the run folder.
    file_sd_path: Optional[str] = None
    #: Seconds between GPU (NVML) or process samples.
    gpu_sample_interval_s: float = 5.0
    #: Deadline of each call to a node's device exporter.
    call_timeout_s: float = 30.0

    def validate(self) -> None:
        require(bool(self.bind_address), "bind_address", self.bind_address, "must be a non-empty address")
        require(self.call_timeout_s > 0, "call_timeout_s", self.call_timeout_s, "must be > 0 seconds")
        for name in ("port", "worker_port_base"):
            require(0 <= getattr(self, name) <= 65535, name, getattr(self, name), "must be in [0, 65535] (0 = any)")
        require(self.gpu_sample_interval_s > 0, "gpu_sample_interval_s", self.gpu_sample_interval_s, "must be > 0")


@dataclass
class RayConfig(Section):
    """The Ray cluster: join one (``address``) or start a local one with these resources."""

    #: A Ray cluster to join (``auto`` or ``host:port``, ``ray://`` allowed); null: ``RAY_ADDRESS``
    #: if set, else start a local cluster.
    address: Optional[str] = None
    #: Logical CPUs of a local cluster.
    num_cpus: int = 16
    #: GPUs of a local cluster; null: the visible ones.
    num_gpus: Optional[int] = None
    #: Logical CPUs each worker process asks for.
    cpus_per_worker: float = 0.1
    #: Ray namespace of the run's named actors.
    namespace: str = "resilient-rl"
    #: Bytes of a local cluster's object store; null: Ray's default.
    object_store_memory: Optional[int] = None
    #: Joining a cluster at ``address``: how long its GCS port may take to accept a connection, and
    #: about how long Ray then tries to reach the GCS through it.
    connect_timeout_s: float = 3.0

    def validate(self) -> None:
        require(self.address is None or self.address == "auto"
                 or re.fullmatch(r"(ray://)?[^\s:/]+:\d+", self.address) is not None, "address", self.address,
                 "must be null (start a local cluster), 'auto' or 'host:port'")
        require(self.num_cpus >= 1, "num_cpus", self.num_cpus, "must be >= 1")
        require(self.num_gpus is None or self.num_gpus >= 0, "num_gpus", self.num_gpus, "must be >= 0 or null")
        require(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "must be > 0")
        require(bool(self.namespace), "namespace", self.namespace, "must be non-empty")
        require(self.object_store_memory is None or self.object_store_memory > 0, "object_store_memory",
                 self.object_store_memory, "must be > 0 bytes or null")
        require(self.connect_timeout_s > 0, "connect_timeout_s", self.connect_timeout_s, "must be > 0 seconds")
