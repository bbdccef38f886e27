"""Roles across nodes: throughput of an actor on 2 nodes against 1, and recovery from a lost node.

One ``ray.cluster_utils.Cluster`` on this machine (a CPU-less head and ``--nodes`` worker nodes,
each a raylet of its own), and in it, one after another:

1. **one node**: PPO (actor, critic, ref and rollout colocated) with ``actor.world_size=4`` and
   ``trainer.nnodes=1``: the 4 ranks in one placement group on one node.
2. **two nodes**: the same run with ``trainer.nnodes=2``: ranks 0-1 on one node, 2-3 on another,
   one placement group per node. This is also the fault-free reference of 3.
3. **rank kill**: run 2 again, and ``--delay`` s into step ``--fault-step`` (once the previous
   step's snapshot is complete) actor rank 3, on the second node, is SIGKILLed.
4. **node loss**: run 2 again, and ``--delay`` s into step ``--fault-step`` (once the previous
   step's snapshot is complete) the worker node hosting actor ranks 2-3 is removed (its raylet and
   processes killed at once). The raylets' health check runs every ``--health-check-ms`` (a node is
   declared dead after 3 missed checks; Ray's default is 5 x 3 s). Ray places that node's
   placement group again on the spare node; the ranks there restore the in-memory snapshot from
   the copies their ring peers on the surviving node hold.

Every ``recovery.*`` setting is the default (``snapshot_every=auto``, no timeout shortened).
Printed: tokens/s of runs 1 and 2 (prompt + response tokens over the summed step time, the first
``--warmup`` steps left out, pooled over ``--repeats`` pairs run alternately) and their ratio;
for runs 3 and 4, whether each recovered from snapshots without reading storage (no checkpoint
loaded), the steps replayed, whether its final weights and optimizer state are bit-identical to
run 2's (sha256 of the final checkpoint's files), and the MTTR from the fault to the failed step
done, split into detect (fault -> ``failure``), restart (-> last ``worker_restarted``), rejoin
(-> start of the snapshot load), restore (-> ``recovered``) and complete (-> the next step starts).

Every node shares this machine's 2 cores, loopback and ``/dev/shm``: the figures show the cost
of the layout (per-node placement groups, gradients averaged across nodes by gloo all-reduce
instead of the one-node shared-memory reduction), not of a real network.

    python bench/multinode.py                     # ~3 minutes on 2 busy cores
    python bench/multinode.py --repeats 2 --steps 8 --fault-step 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from resilient_rl.env import fail_fast_on_dead_actors
from resilient_rl.faults.harness import RunResult, run_training
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.faults.nodes import RemoveNodeOf, local_nodes
from resilient_rl.trainer.hooks import TrainerHook

PHASES = ("detect", "restart", "rejoin", "restore", "complete")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s")
    p.add_argument("--fault-step", type=int, default=6, help="step at whose start the node is removed")
    p.add_argument("--repeats", type=int, default=1, help="pairs of one-node / two-node runs")
    p.add_argument("--nodes", type=int, default=3, help="worker nodes of the cluster (>= 3: one spare)")
    p.add_argument("--health-check-ms", type=int, default=1000,
                   help="GCS health-check period of the raylets (Ray's default 3000 x 5 failures before a node "
                        "is dead; here x 3); 0: Ray's defaults")
    p.add_argument("--delay", type=float, default=0.5,
                   help="seconds into the fault step (and after the previous step's snapshot is complete) "
                        "that the node is removed")
    p.add_argument("--skip-loss", action="store_true", help="throughput only")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = p.parse_args(argv)
    if not (0 <= args.warmup < args.steps and 2 <= args.fault_step < args.steps and args.repeats >= 1
            and args.nodes >= 3):
        p.error("need 0 <= --warmup < --steps, 2 <= --fault-step < --steps, --repeats >= 1, --nodes >= 3")
    return args


def overrides(args, root: str, nnodes: int) -> list[str]:
    return [
        f"trainer.total_steps={args.steps}", "trainer.progress_bar=false", "trainer.placement=colocated",
        f"trainer.nnodes={nnodes}", "actor.world_size=4", "data.batch_size=16", "data.num_prompts=64",
        "actor.mini_batch_size=8", "critic.mini_batch_size=8", "ray.cpus_per_worker=0.05",
        # Only the final step is saved: the recovery has no checkpoint to fall back on but step 0.
        # Every recovery.* setting is the default.
        f"checkpoint.save_every={args.steps}",
        f"trainer.output_dir={root}/runs", f"checkpoint.root={root}/ckpt",
        "checkpoint.shared_filesystem=true",  # the simulated nodes share this machine's disk
        *args.overrides,
    ]


def tokens_per_s(result: RunResult, warmup: int) -> float:
    return pooled([r for r in result.history if r["step"] > warmup])


def pooled(rows: list[dict]) -> float:
    """Tokens over summed step time of ``rows`` (runs pooled: a slow spell of the shared machine
    weighs by its length, not by which run it hit)."""
    return sum(r["tokens"] for r in rows) / sum(r["timing/step_s"] for r in rows)


def step_times(result: RunResult, warmup: int) -> str:
    return " ".join(f"{r['timing/step_s']:.2f}" for r in result.history if r["step"] > warmup)


class StepStarts(TrainerHook):
    """Trainer hook: the wall-clock time each step starts (the last time, after a replay)."""

    def __init__(self):
        self.at: dict[int, float] = {}

    def on_step_start(self, trainer, step: int) -> None:
        self.at[step] = time.time()


def check(result: RunResult) -> RunResult:
    if result.error is not None:
        raise SystemExit(f"run {result.name} failed: {result.error!r}")
    return result


def loss_report(args, result: RunResult, reference: RunResult, t0: float, ranks: list, starts: StepStarts) -> dict:
    ev = result.events
    fail = next(e for e in ev if e["event"] == "failure" and e["time"] >= t0)
    rec = next(e for e in ev if e["event"] == "recovered" and e["time"] > fail["time"])
    restarts = [e["time"] for e in ev if e["event"] == "worker_restarted" and fail["time"] < e["time"] <= rec["time"]]
    t_up = max(restarts, default=fail["time"])
    snaps = [e for e in ev if e["event"] == "snapshot_restored" and fail["time"] < e["time"] <= rec["time"]]
    loads = [e for e in ev if e["event"] == "checkpoint_restored" and e["time"] > t0]
    t_load = snaps[-1]["time"] - snaps[-1]["duration_s"] if snaps else rec["time"]
    t_done = starts.at.get(args.fault_step + 1, float("nan"))
    split = {"detect": fail["time"] - t0, "restart": t_up - fail["time"], "rejoin": t_load - t_up,
             "restore": rec["time"] - t_load, "complete": t_done - rec["time"]}
    return {"split": split, "mttr": t_done - t0, "source": rec.get("source"), "replayed": rec["steps_replayed"],
            "sources": snaps[-1]["sources"] if snaps else {}, "storage_loads": len(loads),
            "identical": result.final_files == reference.final_files and bool(reference.final_files)
            and result.final_trainer_state == reference.final_trainer_state,
            "cause": fail.get("cause"), "ranks_lost": ranks}


def main(argv=None) -> int:
    args = parse_args(argv)
    fail_fast_on_dead_actors()
    ratios, one, two, one_rows, two_rows = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="rrl-bench-multinode-") as root, local_nodes(args.nodes, health_check_ms=args.health_check_ms or None) as cluster:
        reference = None
        for i in range(args.repeats):
            # Alternately first (one, two, two, one, ...): a trend in the machine's load, or the
            # cluster warming up, does not favour either.
            runs = {}
            for nnodes in ((1, 2) if i % 2 == 0 else (2, 1)):
                name = f"one-node-{i}" if nnodes == 1 else f"two-nodes-{i}"
                runs[nnodes] = check(run_training(overrides(args, f"{root}/{name}", nnodes), name))
            a, b = runs[1], runs[2]
            one.append(tokens_per_s(a, args.warmup))
            two.append(tokens_per_s(b, args.warmup))
            one_rows += [r for r in a.history if r["step"] > args.warmup]
            two_rows += [r for r in b.history if r["step"] > args.warmup]
            ratios.append(two[-1] / one[-1])
            reference = b
            print(f"pair {i + 1}: one node {one[-1]:.0f} tokens/s (step s {step_times(a, args.warmup)}), two nodes "
                  f"{two[-1]:.0f} tokens/s (step s {step_times(b, args.warmup)}), ratio {ratios[-1]:.3f}", flush=True)
        print(f"\ntokens/s, actor of 4 ranks (PPO, colocated), over {args.repeats} pair(s): one node "
              f"{pooled(one_rows):.0f}, two nodes (2 + 2) {pooled(two_rows):.0f}; two / one = "
              f"{pooled(two_rows) / pooled(one_rows):.3f}x (target >= 0.9x); median of the pairs' ratios "
              f"{statistics.median(ratios):.3f}x")
        if args.skip_loss:
            return 0
        # A SIGKILL of rank 3 (second node): the survivors on both nodes leave the broken
        # collective at once, Ray restarts the process in its bundle.
        schedule = FaultSchedule().after_snapshot(args.fault_step).kill("actor", 3, delay_s=args.delay)
        starts = StepStarts()
        killed = check(run_training(overrides(args, f"{root}/kill", 2), "rank-kill", schedule, hooks=(starts,)))
        fault = schedule.faults[0]
        if fault.fired_at is None:
            raise SystemExit("the rank was never killed")
        r = loss_report(args, killed, reference, fault.fired_at, [("actor", 3)], starts)
        ok_kill = report(f"SIGKILL of actor rank 3 (second node) at step {args.fault_step}", "kill", r)
        hook = RemoveNodeOf(cluster, rank=2, step=args.fault_step, delay_s=args.delay, after_snapshot=True)
        starts = StepStarts()
        lost = run_training(overrides(args, f"{root}/loss", 2), "node-loss", hooks=(hook, starts))
        check(lost)
        if hook.removed is None:
            raise SystemExit("the node was never removed")
        r = loss_report(args, lost, reference, hook.fired_at, hook.ranks, starts)
        ok = report(f"node loss at step {args.fault_step} (node of ranks {r['ranks_lost']} removed)", "removal", r)
        # The lost ranks' copies survive only on their ring peers' node: held there by the peer
        # process ("peer"), or as the object store's copy the peer fetched, which Ray makes the
        # primary copy when the owner's node is lost ("object_store").
        off_node = r["sources"].get("peer", 0) + r["sources"].get("object_store", 0)
        print(f"  lost ranks restored from copies off their node: {'yes' if off_node > 0 else 'NO'}")
        return 0 if ok and ok_kill and off_node > 0 else 1


def report(title: str, fault: str, r: dict) -> bool:
    """Print one recovery's figures; whether it replayed nothing, read no storage and ended bit-identical."""
    print(f"\n{title}; failure cause {r['cause']}:")
    print(f"  recovered from: {r['source']} (copies read per rank: {r['sources']}); "
          f"checkpoints loaded from storage: {r['storage_loads']}; steps replayed: {r['replayed']}")
    print(f"  final weights and optimizer state bit-identical to the fault-free two-node run: {r['identical']}")
    print(f"  MTTR ({fault} -> failed step done) {r['mttr']:.2f} s = "
          + " + ".join(f"{p} {r['split'][p]:.2f}" for p in PHASES))
    ok = r["source"] == "snapshot" and r["storage_loads"] == 0 and r["replayed"] == 0 and r["identical"]
    print(f"  zero-replay recovery: {'yes' if ok else 'NO'}")
    return ok


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
