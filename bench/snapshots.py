"""In-memory snapshots: recovery from a peer's copy against in-place recovery from storage, and their cost.

Measured in one run, each part in its own Ray cluster (helpers of ``bench/recovery.py``):

1. **in-place, storage** (the baseline): SIGKILL of actor rank 1 ``--delay`` s into step
   ``--fault-step`` with ``checkpoint.save_every=2`` and no snapshots.
2. **in-place, snapshots**: the same fault with ``checkpoint.save_every=20`` and
   ``recovery.snapshot_every=1``. Printed: steps replayed, restored step and source, and the time
   from the kill to the failed step's completion (MTTR) as a ratio to the baseline's.
3. **cost**: fault-free runs of ``--steps`` steps with ``checkpoint.save_every=20``, snapshots off
   and every step (``--repeats`` alternated pairs); the median step time (the first step
   excluded) as a ratio (the median of the pairs' ratios), the same for the CPU time the run's
   processes (controller, GCS, raylet, workers) spend per step (a busy machine changes wall
   times far more than it changes this), and the bytes of one
   snapshot copy per rank with the host memory each rank spends on snapshots (its own copies and
   the neighbour's it holds; the object store keeps one more copy per kept snapshot).

    python bench/snapshots.py                     # about 2 minutes on 2 busy cores
    python bench/snapshots.py --steps 12 model.num_layers=4
    python bench/snapshots.py --cost-only --steps 12 --repeats 3   # the cost part only
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import recovery as rb  # noqa: E402  (bench/recovery.py)

from resilient_rl.trainer.ppo import PPOTrainer  # noqa: E402

SNAPSHOTS = ("checkpoint.save_every=20", "recovery.snapshot_every=1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fault-step", type=int, default=4, help="step during which actor rank 1 is killed")
    p.add_argument("--delay", type=float, default=0.3, help="seconds into that step")
    p.add_argument("--steps", type=int, default=10, help="steps of each fault-free cost run")
    p.add_argument("--cost-only", action="store_true", help="measure only the cost (skip the two fault runs)")
    p.add_argument("--repeats", type=int, default=1,
                   help="pairs of cost runs (off, every step), alternated; the ratio is the median of the pairs'")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def with_overrides(args, extra) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *extra]})


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and every process under it (the Ray cluster it
    started: GCS, raylet, workers), so far."""
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # exited meanwhile
            pass
    return total


class CpuClock:
    """Trainer hook: the CPU seconds of the whole run at the start of step 2 (after the first step,
    which also warms up) and at the start of each later step; the last reading is taken after the
    run."""

    def __init__(self):
        self.readings: list[float] = []

    def on_step_start(self, trainer, step: int) -> None:
        if step >= 2:
            self.readings.append(cpu_seconds())


def measure_cost(args, root: str, snapshot_every: int) -> dict:
    cfg = rb.build_config(with_overrides(args, ["checkpoint.save_every=20", f"recovery.snapshot_every={snapshot_every}",
                                                f"trainer.total_steps={args.steps}"]), root)
    out: dict = {}

    def run():
        clock = CpuClock()
        trainer = PPOTrainer(cfg, hooks=[clock])
        try:
            rows = trainer.fit()
            clock.readings.append(cpu_seconds())
            out["step_s"] = statistics.median(r["timing/step_s"] for r in rows[1:])
            out["cpu_s"] = (clock.readings[-1] - clock.readings[0]) / max(1, len(clock.readings) - 1)
            if trainer.snapshots is not None:
                out["copy_bytes"] = trainer.snapshots.memory()
                out["host_bytes"] = {role: g.snapshot_memory() for role, g in trainer.roles.checkpoint_groups()}
        finally:
            trainer.shutdown()

    rb.ray_session(cfg, run)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.cost_only:
        print("in-place recovery from storage (save_every=2):", flush=True)
        base = rb.in_tmp(rb.measure_inplace, args, "storage")
        print("in-place recovery from snapshots (save_every=20, snapshot_every=1):", flush=True)
        snap = rb.in_tmp(rb.measure_inplace, with_overrides(args, SNAPSHOTS), "snapshot")
    print("cost, snapshots off / every step:", flush=True)
    pairs = []
    for _ in range(max(1, args.repeats)):  # alternated: a change in the machine's load hits both
        off = rb.in_tmp(lambda a, root: measure_cost(a, root, 0), args, "cost-off")
        on = rb.in_tmp(lambda a, root: measure_cost(a, root, 1), args, "cost-on")
        pairs.append((off["step_s"], on["step_s"], off["cpu_s"], on["cpu_s"]))
    print()
    if not args.cost_only:
        print(f"steps replayed: storage {base['replayed']} (from step {base['from_step']}), "
              f"snapshots {snap['replayed']} (from step {snap['from_step']})")
        print(f"MTTR (kill -> failed step done): storage {base['total']:.2f}s, snapshots {snap['total']:.2f}s, "
              f"ratio snapshots/storage {snap['total'] / base['total']:.2f}")
    for off_s, on_s, off_cpu, on_cpu in pairs if len(pairs) > 1 else ():
        print(f"  pair: step off {off_s:.3f}s, every step {on_s:.3f}s, ratio {on_s / off_s:.3f}; "
              f"CPU per step off {off_cpu:.3f}s, every step {on_cpu:.3f}s, ratio {on_cpu / off_cpu:.3f}")
    med = [statistics.median(p[i] for p in pairs) for i in range(4)]
    print(f"step time: off {med[0]:.3f}s, every step {med[1]:.3f}s, "
          f"ratio {statistics.median(p[1] / p[0] for p in pairs):.3f}")
    print(f"CPU time per step (the run's processes, less sensitive to other load on the machine): off "
          f"{med[2]:.3f}s, every step {med[3]:.3f}s, ratio {statistics.median(p[3] / p[2] for p in pairs):.3f}")
    for role, sizes in on.get("copy_bytes", {}).items():
        for rank, nbytes in enumerate(sizes):
            host = on["host_bytes"][role][rank]
            print(f"snapshot {role} rank {rank}: {nbytes / 2**20:.2f} MiB per copy; host memory own "
                  f"{host['own_bytes'] / 2**20:.2f} MiB + held {host['held_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
