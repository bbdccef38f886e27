"""Connecting to Ray: a local cluster by default, an existing one when ``ray.address`` is set.

What the workers print (warnings, tracebacks) is sent to the run's ``train.log`` instead of the
driver's terminal, where it would tear the progress bar (see :mod:`resilient_rl.runtime.worker_output`).
A worker's exception still reaches the controller with its traceback and is reported there.
"""

from __future__ import annotations

import logging

import ray

from resilient_rl import env
from resilient_rl.runtime.worker_output import capture_worker_output, release_worker_output

logger = logging.getLogger(__name__)


def connect(ray_cfg) -> bool:
    """Initialise Ray for this controller; returns whether this call initialised it.

    True when it started a local cluster or connected to the one at ``ray.address``; False when
    Ray was already initialised by the caller (a test's cluster, a notebook's), which stays as it
    is. Pass the result to :func:`disconnect`.
    """
    if ray.is_initialized():
        return False
    env.fail_fast_on_dead_actors()
    address = ray_cfg.address or env.ray_address()
    if address:
        ray.init(address=address, namespace=ray_cfg.namespace, log_to_driver=True)
        capture_worker_output()
        return True
    ray.init(**local_cluster_options(ray_cfg))
    capture_worker_output()
    return True


def local_cluster_options(ray_cfg, log_to_driver: bool = True) -> dict:
    """``ray.init`` arguments of a new local cluster with the ``ray`` section's resources.

    ``address="local"``: always a new cluster, never one a stale ``/tmp/ray/ray_current_cluster``
    file points at."""
    kwargs = dict(address="local", num_cpus=ray_cfg.num_cpus, include_dashboard=False, namespace=ray_cfg.namespace,
                  log_to_driver=log_to_driver, configure_logging=False)
    if ray_cfg.num_gpus is not None:
        kwargs["num_gpus"] = ray_cfg.num_gpus
    if ray_cfg.object_store_memory:
        kwargs["object_store_memory"] = ray_cfg.object_store_memory
    return kwargs


def alive_nodes() -> int:
    """Nodes of the Ray cluster this process is connected to that are alive (1 without Ray)."""
    if not ray.is_initialized():
        return 1
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def disconnect(owned: bool) -> None:
    """Undo :func:`connect`; ``owned`` is what it returned.

    When ``connect`` initialised Ray, shut the connection down (and with it the local cluster it
    started; a cluster at ``ray.address`` keeps running) and give the workers' output back to Ray.
    Otherwise leave Ray to whoever initialised it.
    """
    if not owned:
        return
    if ray.is_initialized():
        ray.shutdown()
    release_worker_output()


def on_every_node(fn, *args, wait_s: float | None = None) -> None:
    """Run ``fn(*args)`` once on every live Ray node, for work on a node's own files (its
    ``/dev/shm``): on this process's node here, in this process (no worker process to start, which
    costs seconds of CPU on a small machine), and on each other node as a task needing no CPU,
    pinned to it. Outside Ray (or through Ray Client, where this process is on no node) every node
    gets the task, or, with Ray not initialised, the call runs here only. ``wait_s``: wait that
    long for the tasks (None: not waited for). Raises what ``fn`` raises here, and Ray's errors."""
    if not ray.is_initialized():
        fn(*args)
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = None if ray.util.client.ray.is_connected() else ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
            for node in others]
    if here is not None:
        fn(*args)
    if refs and wait_s is not None:
        ray.get(refs, timeout=wait_s)
