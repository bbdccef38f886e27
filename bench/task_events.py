"""Ray task events of a training run: what the GCS keeps per step, the worker groups' actors
recording them (Ray's default, the baseline) against not recording them (the trainer's default),
in one run on one local cluster.

Each trainer (the built-in tiny task, a tiny batch) is started and runs ``--warmup`` steps; then
the task events the GCS holds are read (once every process's report has arrived), ``--steps``
steps run, and they are read again. Printed per trainer: the task events added per step, their
serialized bytes per step (a floor on what the GCS holds for them), the tasks they belong to, and
how many steps fill Ray's store of task events (``RAY_task_events_max_num_task_in_gcs``, 100,000
by default); then the ratio of the trainer's events to the baseline's. Counts, not times: the
health polls of the liveness watch (one a second per rank while a call runs) make them vary a
little with the machine's speed.

    python bench/task_events.py                     # 10 steps each (about a minute)
    python bench/task_events.py --steps 30 trainer.placement=split rollout.world_size=2
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from unittest import mock

import ray

from resilient_rl.config.schema import load_config
from resilient_rl.runtime import worker_group
from resilient_rl.runtime.cluster import local_cluster_options
from resilient_rl.testing import task_events
from resilient_rl.trainer.ppo import PPOTrainer

#: Ray's default cap on the task attempts its GCS keeps events of.
GCS_CAP = 100_000
TINY = ["data.batch_size=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8", "data.num_prompts=64",
        "ray.cpus_per_worker=0.05", "trainer.progress_bar=false"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="measured steps per trainer (default: 10)")
    p.add_argument("--warmup", type=int, default=1, help="steps per trainer before the first read (default: 1)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rollout.n=2")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def measure(cfg, steps: int, warmup: int) -> task_events.TaskEvents:
    """The task events ``steps`` steps (after ``warmup`` ones) added to what the GCS holds."""
    trainer = PPOTrainer(cfg)
    try:
        trainer.start_roles()
        for _ in range(warmup):
            trainer.train_step()
        before = task_events.settled()
        for _ in range(steps):
            trainer.train_step()
        return task_events.settled().minus(before)
    finally:
        trainer.shutdown()


def describe(name: str, added: task_events.TaskEvents, steps: int) -> float:
    per_step = added.stored / steps
    fill = f"fill Ray's store of {GCS_CAP:,} in {GCS_CAP / per_step:,.0f} steps" if per_step else "never fill it"
    print(f"{name}: {per_step:.1f} task events per step ({added.bytes / steps / 1024:.1f} KiB serialized); {fill}")
    for task, n in added.by_name.most_common():
        print(f"    {n / steps:6.2f}/step  {task}")
    return per_step


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as out:
        def cfg(name: str):
            return load_config(None, TINY + [f"trainer.output_dir={out}", f"checkpoint.root={out}/ckpt",
                                             f"trainer.run_name={name}",
                                             f"trainer.total_steps={args.warmup + args.steps}", *args.overrides])

        ours = cfg("quiet")
        ray.init(**local_cluster_options(ours.ray, log_to_driver=False))
        try:
            # The baseline: the groups' actors keep Ray's default and record every call.
            with mock.patch.object(worker_group, "task_event_options", lambda cls: {}):
                recorded = measure(cfg("recorded"), args.steps, args.warmup)
            quiet = measure(ours, args.steps, args.warmup)
        finally:
            ray.shutdown()
    print(f"{args.steps} steps each after {args.warmup} warm-up")
    base = describe("baseline (worker groups record Ray task events)", recorded, args.steps)
    now = describe("trainer (worker groups record none)", quiet, args.steps)
    print(f"task events per step, trainer / baseline: {now / base:.3f}" if base else "the baseline recorded none")


if __name__ == "__main__":
    main()
