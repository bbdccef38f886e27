"""In-memory snapshots: recovery from a peer's copy against in-place recovery from storage, and their cost.

Measured in one run, each part in its own Ray cluster (helpers of ``bench/recovery.py``):

1. **in-place, storage** (the baseline): SIGKILL of actor rank ``--rank`` once it is inside
   ``--in-call`` of step ``--fault-step`` (or ``--delay`` s into that step) with
   ``checkpoint.save_every=2`` and no snapshots.
2. **in-place, snapshots**: the same fault with ``checkpoint.save_every=20`` and
   ``recovery.snapshot_every=1``. Printed: steps replayed, restored step and source, and the time
   from the kill to the failed step's completion (MTTR) as a ratio to the baseline's.
3. **cost**: fault-free runs of ``--steps`` steps with ``checkpoint.save_every=20`` in which
   snapshots are switched on and off every ``--block`` steps (a first block with them on warms
   up and is not counted), so that both sides share the machine's load of the same seconds
   (this machine is shared: separate runs minutes apart differ by more than the cost). A step's
   time runs from its start to the next step's start, so it holds the controller's work after the
   step (starting the snapshot) and the workers' copy queued before the next step's calls; the
   first step of each block is left out (it carries the previous block's last snapshot, or
   not). Printed: the median step time on each side and its ratio, the same for the CPU time the
   run's processes (controller, GCS, raylet, workers) spend per step, the median of the
   ``--repeats`` runs' ratios, and the bytes of one snapshot copy per rank with the host memory
   each rank spends on snapshots (its own copies, in node memory unless
   ``recovery.snapshot_node_dir=""``, and the neighbours' it holds).

    python bench/snapshots.py                     # about 2 minutes on 2 busy cores
    python bench/snapshots.py --steps 85 model.num_layers=4
    python bench/snapshots.py --cost-only --repeats 3   # the cost part only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import recovery as rb  # noqa: E402  (bench/recovery.py)

from resilient_rl.trainer.ppo import PPOTrainer  # noqa: E402
from resilient_rl.trainer.hooks import TrainerHook  # noqa: E402

SNAPSHOTS = ("checkpoint.save_every=20", "recovery.snapshot_every=1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rb.add_fault_args(p, delay=0.3)
    p.add_argument("--steps", type=int, default=65, help="steps of each cost run (default: 65)")
    p.add_argument("--block", type=int, default=5, help="steps between switching snapshots on and off (default: 5)")
    p.add_argument("--cost-only", action="store_true", help="measure only the cost (skip the two fault runs)")
    p.add_argument("--repeats", type=int, default=1, help="cost runs; the ratio printed is the median of theirs")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    if args.block < 2 or args.steps < 5 * args.block or args.repeats < 1 or args.fault_step < 2 or args.rank < 0:
        p.error("need --block >= 2, --steps >= 5 * --block (a warm-up block and two of each side), --repeats >= 1, "
                "--fault-step >= 2 and --rank >= 0")
    return args


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


class Blocks(TrainerHook):
    """Trainer hook: switches snapshots on and off every ``block`` steps (on for the first block,
    the warm-up) and notes each step's start time, and the run's CPU seconds at the start of the
    first two steps of each block (what the measured steps of a block spent lies between the
    second step of one block and the first of the next)."""

    def __init__(self, block: int, clock=time.perf_counter):
        self.block, self.clock = block, clock
        self.starts: dict[int, float] = {}
        self.cpu: dict[int, float] = {}

    def on(self, step: int) -> bool:
        """Whether step ``step`` (from 1) is snapshotted."""
        return ((step - 1) // self.block) % 2 == 0

    def on_step_start(self, trainer, step: int) -> None:
        if (step - 1) % self.block < 2:
            self.cpu[step] = cpu_seconds()
        trainer.snapshots.every = 1 if self.on(step) else 0
        self.starts[step] = self.clock()

    def sides(self) -> dict[bool, dict[str, float]]:
        """Median step time and CPU seconds per step with snapshots on (True) and off (False),
        over every block after the first that the run finished, less each block's first step."""
        times: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        first = 1 + self.block
        while first + self.block in self.starts:
            steps = range(first + 1, first + self.block)
            side = self.on(first)
            times[side] += [self.starts[s + 1] - self.starts[s] for s in steps]
            cpu[side].append((self.cpu[first + self.block] - self.cpu[first + 1]) / len(steps))
            first += self.block
        return {side: {"step_s": statistics.median(times[side]), "cpu_s": statistics.median(cpu[side])}
                for side in (True, False)}


def measure_cost(args, root: str) -> dict:
    cfg = rb.build_config(with_overrides(args, ["checkpoint.save_every=20", "recovery.snapshot_every=1",
                                                f"trainer.total_steps={args.steps}"]), root)
    out: dict = {}

    def run():
        blocks = Blocks(args.block)
        trainer = PPOTrainer(cfg, hooks=[blocks])
        try:
            trainer.fit()
            sides = blocks.sides()
            out.update(off_s=sides[False]["step_s"], on_s=sides[True]["step_s"],
                       off_cpu=sides[False]["cpu_s"], on_cpu=sides[True]["cpu_s"])
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
    print(f"cost, snapshots every step / off, switched every {args.block} steps:", flush=True)
    runs = [rb.in_tmp(measure_cost, args, "cost") for _ in range(args.repeats)]
    print()
    if not args.cost_only:
        print(f"steps replayed: storage {base['replayed']} (from step {base['from_step']}), "
              f"snapshots {snap['replayed']} (from step {snap['from_step']})")
        print(f"MTTR (kill -> failed step done): storage {base['total']:.2f}s, snapshots {snap['total']:.2f}s, "
              f"ratio snapshots/storage {snap['total'] / base['total']:.2f}")
    for r in runs if len(runs) > 1 else ():
        print(f"  run: step off {r['off_s']:.3f}s, every step {r['on_s']:.3f}s, ratio {r['on_s'] / r['off_s']:.3f}; "
              f"CPU per step off {r['off_cpu']:.3f}s, every step {r['on_cpu']:.3f}s, "
              f"ratio {r['on_cpu'] / r['off_cpu']:.3f}")
    med = {k: statistics.median(r[k] for r in runs) for k in ("off_s", "on_s", "off_cpu", "on_cpu")}
    ratio = statistics.median(r["on_s"] / r["off_s"] for r in runs)
    print(f"step time: off {med['off_s']:.3f}s, every step {med['on_s']:.3f}s, ratio {ratio:.3f}   "
          f"target <= 1.05  {'ok' if ratio <= 1.05 else 'MISSED'}")
    print(f"CPU time per step (the run's processes): off {med['off_cpu']:.3f}s, every step {med['on_cpu']:.3f}s, "
          f"ratio {statistics.median(r['on_cpu'] / r['off_cpu'] for r in runs):.3f}")
    on = runs[-1]
    for role, sizes in on.get("copy_bytes", {}).items():
        for rank, nbytes in enumerate(sizes):
            host = on["host_bytes"][role][rank]
            print(f"snapshot {role} rank {rank}: {nbytes / 2**20:.2f} MiB per copy; host memory own "
                  f"{host['own_bytes'] / 2**20:.2f} MiB + held {host['held_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
