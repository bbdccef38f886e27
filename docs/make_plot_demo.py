"""Make ``docs/plot-demo.png``: a short real run that loses an actor rank and a hung worker.

    PYTHONPATH=. python docs/make_plot_demo.py /tmp/rrl-demo
    resilient-rl plot /tmp/rrl-demo/runs/plot-demo --out docs/plot-demo.png

Trains 40 steps of the default PPO copy task on a local Ray cluster, checkpointing every 5 steps;
SIGKILLs actor rank 1 at step 13 (recovery restores step 10 and replays 2 steps) and SIGSTOPs
actor rank 0 mid-step 27 (found hung by the health probe, killed and restarted).
"""

from __future__ import annotations

import sys

import ray

from resilient_rl.faults.harness import run_training
from resilient_rl.faults.injectors import FaultSchedule


def main(base: str) -> int:
    overrides = [
        "trainer.total_steps=40", "trainer.progress_bar=false", "checkpoint.save_every=5", "checkpoint.keep_last=3",
        "recovery.call_timeout_s=6", "recovery.health_timeout_s=2", "recovery.restart_timeout_s=60",
        f"trainer.output_dir={base}/runs", f"checkpoint.root={base}/ckpt",
    ]
    schedule = FaultSchedule().at_step(13).kill("actor", 1).at_step(27).hang("actor", 0, delay_s=0.2)
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        result = run_training(overrides, "plot-demo", schedule)
    finally:
        ray.shutdown()
    if result.error is not None:
        print(f"run failed: {result.error}", file=sys.stderr)
        return 1
    print(f"run folder: {base}/runs/plot-demo ({len(result.history)} steps, "
          f"{len(result.events_of('recovered'))} recoveries)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rrl-demo"))
