"""The chaos suite's run: its config, its Ray cluster and the fault-free run scenarios are
compared with (``conftest.py`` holds the fixtures and the summary built on them).

Every scenario trains the same small config (split placement, so every role has its own
processes: actor 2 ranks, critic, ref and rollout 1 each) under a fault schedule and checks the
invariants of :mod:`resilient_rl.faults.harness` against the reference computed once.

Scenarios import from here (``from suite import ...``), never from ``conftest``: ``tests/`` has a
``conftest`` too, and which of the two that name finds depends on the order of pytest's arguments.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil

import pytest

from resilient_rl.config.schema import load_config
from resilient_rl.faults.harness import collect_run, run_training
from resilient_rl.faults.nodes import local_nodes
from resilient_rl.faults.storage import FaultPlan, faulty_url
from resilient_rl.trainer.hooks import TrainerHook

STEPS = 6
#: ``RRL_CHAOS_RECOVERY=fast`` runs every scenario (and the reference) with warm spares and a
#: snapshot after every step; by default snapshots are ``auto`` (every step where node memory
#: holds them) and spares off. Scenarios about the storage path itself keep snapshots off.
FAST_RECOVERY = ("recovery.spares=1", "recovery.snapshot_every=1")
#: What a scenario that tests restoring from storage adds: no snapshot (one would be preferred)
#: and no spares (a fault waits for them to be ready, which would move it off the save it targets).
STORAGE_ONLY = ("recovery.snapshot_every=0", "recovery.spares=0")


def recovery_mode() -> tuple[str, ...]:
    mode = os.environ.get("RRL_CHAOS_RECOVERY", "")
    if mode not in ("", "default", "fast"):
        raise pytest.UsageError(f"RRL_CHAOS_RECOVERY={mode!r}: use 'fast' (spares and snapshots) or leave it unset")
    return FAST_RECOVERY if mode == "fast" else ()


def check_restore_point(recovered: dict, *checkpoint_steps: int) -> None:
    """A recovery restored one of ``checkpoint_steps`` from storage or a snapshot (the newest
    complete one, which no storage step pins down): always one with fast recovery, and by default
    (``recovery.snapshot_every=auto``) unless node memory could not hold one."""
    if recovery_mode():
        assert recovered["source"] == "snapshot", recovered
    else:
        assert recovered["source"] == "snapshot" or recovered["restored_step"] in checkpoint_steps, recovered


def chaos_overrides(tmp: str) -> list[str]:
    return [
        f"trainer.total_steps={STEPS}", "trainer.progress_bar=false", "trainer.placement=split",
        "data.batch_size=16", "data.num_prompts=64", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
        "actor.ppo_epochs=2", "critic.ppo_epochs=2", "actor.world_size=2", "critic.world_size=1",
        "rollout.world_size=1", "ref.world_size=1", "ray.cpus_per_worker=0.05",
        "checkpoint.save_every=2", "checkpoint.keep_last=3",
        "recovery.call_timeout_s=6", "recovery.health_timeout_s=2", "recovery.collective_timeout_s=30",
        "recovery.restart_timeout_s=60", "recovery.max_restarts=4", "recovery.max_failures=6",
        f"trainer.output_dir={tmp}/runs", f"checkpoint.root={tmp}/ckpt", *recovery_mode(),
    ]


#: The runs under faults of the test running now in this process (moved into its report, then
#: gathered in ``SUMMARY`` for the session's summary).
RESULTS: list = []


def storage_overrides(chaos_dir: str, name: str, plan: FaultPlan) -> list[str]:
    """Overrides that put the run's checkpoints on ``faulty://`` storage failing by ``plan``
    (a folder of its own under ``chaos_dir``, named ``name``)."""
    url, options = faulty_url(f"{chaos_dir}/ckpt-{name}", plan, name=name)
    flat = [f"checkpoint.root={url}", f"checkpoint.storage_options.target_protocol={options['target_protocol']}",
            f"checkpoint.storage_options.name={options['name']}"]
    return flat + [f"checkpoint.storage_options.plan.{k}={'null' if v is None else v}"
                   for k, v in options["plan"].items()]


class _ReleaseOnRecovery(TrainerHook):
    """Removes a hold file once a recovery has begun (the save in flight abandoned by then)."""

    def __init__(self, hold: str):
        self.hold = hold

    def on_recovery_state(self, trainer, state) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.hold)


def held_save(chaos_dir: str, name: str, step: int) -> tuple[list[str], TrainerHook]:
    """Overrides whose storage holds the workers' shards of step ``step``'s save until a recovery
    begins, and the hook that lets them through then (pass it to ``chaos_run(..., hooks=(hook,))``):
    the save is in flight when the scenario's fault lands, however long the run takes to get there
    (a slowed save only makes that likely), and the save of that step after the recovery is not
    held. The controller's own files of the step are not held: it writes some before the save has
    started, and a held controller would never reach the fault."""
    hold = os.path.join(chaos_dir, f"{name}.hold")
    open(hold, "w").close()
    plan = FaultPlan(hold_paths=f"step_{step:08d}/actor/,step_{step:08d}/critic/", hold_while=hold)
    return storage_overrides(chaos_dir, name, plan), _ReleaseOnRecovery(hold)


def ensure_ray():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=32, include_dashboard=False, namespace="rrl-chaos",
                 object_store_memory=256 * 1024**2, log_to_driver=False, configure_logging=False)
    return ray


@contextlib.contextmanager
def nodes_instead(workers: int, namespace: str):
    """A ``ray.cluster_utils`` cluster of a CPU-less head and ``workers`` worker nodes (health
    checks every second), connected in place of the suite's cluster; ``chaos_ray`` starts the
    suite's again on next use."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with local_nodes(workers, health_check_ms=1000, namespace=namespace) as cluster:
        yield cluster


def fault_free_run(chaos_dir: str, name: str, *extra: str, shared: str | None = None):
    """The fault-free run ``name`` (``extra``: its overrides), in ``chaos_dir``.

    ``shared``: a folder every worker of the session sees (``pytest -n``). The run is then trained
    once per session: the first worker to ask trains it there, under a lock, and each worker copies
    its checkpoints and run folder into its own ``chaos_dir`` (scenarios copy them and resume from
    them) and reads the run from there."""
    if shared is None:
        ensure_ray()
        result = run_training(chaos_overrides(chaos_dir) + list(extra), name)
        assert result.error is None, result.error
    else:
        os.makedirs(shared, exist_ok=True)
        trained = os.path.join(shared, name, "trained")
        with open(os.path.join(shared, f"{name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an error
            if not os.path.exists(trained):
                fault_free_run(os.path.join(shared, name), name, *extra)
                open(trained, "w").close()
        for folder in ("ckpt", "runs"):
            shutil.copytree(os.path.join(shared, name, folder, name), os.path.join(chaos_dir, folder, name))
        cfg = load_config(None, chaos_overrides(chaos_dir) + list(extra) + [f"trainer.run_name={name}"])
        result = collect_run(cfg)
    assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))
    assert result.final_files, "the reference run committed no checkpoint"
    return result


#: The trained roles sharded with FSDP2 (on CPU they default to replicas, ``ddp``).
FSDP = ("actor.strategy=fsdp", "critic.strategy=fsdp")
