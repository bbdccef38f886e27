"""Recovery time: in-place recovery against a full restart of the job and against Ray Train, in one run.

The measurements (``--parts``), each in its own Ray cluster (``ray.init`` ... ``ray.shutdown``) and temp dir:

1. **in-place**: a :class:`FaultSchedule` SIGKILLs actor rank ``--rank`` (default 1) once it is
   inside ``--in-call`` (default ``update_actor``, where a step spends most of its time) of step
   ``--fault-step``, or ``--delay`` seconds into that step; the trainer recovers by itself. Time
   from the kill to the completion of the failed step (the first step completed after recovery, once
   the lost steps are replayed), split from the run's events into detect (kill -> ``failure``),
   restart (-> last ``worker_restarted``: every rank answers), rejoin (rendezvous + model re-init,
   -> start of the checkpoint load), restore (checkpoint load + weight sync, -> ``recovered``) and
   replay (-> the failed step's metrics row).
2. **full restart**: the same run is "killed" ``--delay`` seconds into the same step by
   shutting the trainer and Ray down, then a new ``ray.init`` and a new trainer with
   ``checkpoint.resume=auto`` carry on. Split into teardown (trainer + Ray shutdown, which a real
   crash would replace by the scheduler noticing it), ray start, worker start (trainer, actors,
   rendezvous, models), restore and replay.
3. **Ray Train v2** (skip with ``--skip-ray-train``): ``TorchTrainer`` with 2 CPU workers training
   a small MLP with DDP on gloo, a checkpoint reported every step, ``FailureConfig(max_failures=2)``.
   Worker rank 1 is SIGKILLed ``--delay`` s after its ``--rt-kill-after``-th step; time to the
   next completed step, split into detect (kill -> the controller's ``after_exception`` callback),
   restart (-> every new worker entered the training function), restore and first step.
4. **fast in-place** against **old in-place**, both with ``checkpoint.save_every=20``: the same
   SIGKILL with warm spares and in-memory snapshots on (``recovery.spares=1``,
   ``recovery.snapshot_every=1``), and with both off (the recovery path of before). The fault is
   fired once the spares are ready (a run's steady state). Printed with the same split; "restart"
   is then the hand-over to a spare. **default**: the same with every recovery setting at its
   default (``recovery.spares=auto``, ``recovery.snapshot_every=auto``).
5. **hang**: a SIGSTOP of actor rank ``--rank`` with ``recovery.hang_timeout_s=--hang-timeout``; the time
   from the SIGSTOP to the ``failure`` event against that deadline (it must be within deadline + 1 s;
   a stopped rank is found sooner, when its health call goes unanswered for ``health_timeout_s``).

Step completion times come from polling ``metrics.jsonl`` (10 ms); step starts from a hook that
writes ``bench_step_start`` events. Each in-place and hang repeat also prints the controller's own
split (``ctl_*``: the ``recovered`` event's phases, as exported in ``rrl_recovery_phase_seconds``). Printed: one row per repeat and the median, then the ratios
in-place / Ray Train and in-place / full restart.

    python bench/recovery.py                       # all parts, once (3-6 minutes on 2 busy cores)
    python bench/recovery.py --repeats 3
    python bench/recovery.py --skip-ray-train model.num_layers=4    # any config override
    python bench/recovery.py --parts old,fast --rank 0 actor.world_size=1 ...   # one GPU
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ray

from resilient_rl.events import read_events
from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.config.schema import load_config
from resilient_rl.trainer.ppo import PPOTrainer

from recovery_instruments import (JobKill, MetricsWatcher, StepClock, first, ray_session,  # this script's folder
                                  run_trainer, start_cluster)
from recovery_raytrain import measure_ray_train

PARTS = ("inplace", "full", "raytrain", "old", "fast", "default", "hang")
INPLACE = ("detect", "restart", "rejoin", "restore", "replay")
FULL = ("teardown", "ray_start", "worker_start", "restore", "replay")
RAYTRAIN = ("detect", "restart", "restore", "first_step")


def add_fault_args(p: argparse.ArgumentParser, delay: float) -> None:
    """Where the fault of an in-place run lands: ``--fault-step``, ``--rank``, ``--in-call``, ``--delay``."""
    p.add_argument("--fault-step", type=int, default=4, help="step during which the fault lands (default: 4)")
    p.add_argument("--rank", type=int, default=1, help="actor rank killed or stopped (default: 1)")
    p.add_argument("--in-call", default="update_actor",
                   help="the rank is killed (stopped) once inside this call of the fault step, whatever "
                        "a step takes on the machine (default: update_actor; '' for --delay s into the step)")
    p.add_argument("--delay", type=float, default=delay, help=f"seconds into that step (default: {delay})")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="measurements of each part (default: 1)")
    p.add_argument("--skip-ray-train", action="store_true", help="do not measure Ray Train")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to measure (default: all of {','.join(PARTS)})")
    # About half of a step of this config on a 2-core machine, so that the kill lands inside the
    # step (in its updates, where a step spends most of its time) on both sides.
    add_fault_args(p, delay=0.15)
    p.add_argument("--hang-timeout", type=float, default=5.0, help="recovery.hang_timeout_s of the hang run (default: 5)")
    p.add_argument("--rt-kill-after", type=int, default=5, help="Ray Train: kill after this step (default: 5)")
    p.add_argument("--rt-pause", type=float, default=0.2, help="Ray Train: extra seconds per step (default: 0.2)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.num_layers=4")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    if args.skip_ray_train:
        args.parts = [x for x in args.parts if x != "raytrain"]
    if not set(args.parts) <= set(PARTS) or not args.parts:
        p.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}")
    if args.repeats < 1 or args.fault_step < 2 or args.delay < 0 or args.hang_timeout <= 0 or args.rt_kill_after < 1 \
            or args.rank < 0:
        p.error("need --repeats >= 1, --fault-step >= 2, --delay >= 0, --hang-timeout > 0, --rt-kill-after >= 1, "
                "--rank >= 0")
    return args


def build_config(args, root: str, extra=()):
    return load_config(None, [
        "trainer.progress_bar=false", "data.batch_size=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
        "data.num_prompts=64", f"trainer.total_steps={args.fault_step}", "checkpoint.save_every=2",
        "checkpoint.resume=auto", f"trainer.output_dir={root}/runs", f"checkpoint.root={root}/ckpt",
        "trainer.run_name=bench", "recovery.call_timeout_s=8", "recovery.collective_timeout_s=30",
        # The baselines recover from storage in a new process (snapshots and spares default to
        # auto); the fast and default parts turn them on.
        "recovery.snapshot_every=0", "recovery.spares=0", *args.overrides, *extra])


# ---------------------------------------------------------------------------- parts
def _when(args) -> dict:
    """When in the fault step the trainer's fault fires: inside ``--in-call``, else ``--delay`` in."""
    return {"in_call": args.in_call} if args.in_call else {"delay_s": args.delay}


def measure_inplace(args, root: str) -> dict:
    cfg = build_config(args, root)
    sched = FaultSchedule().at_step(args.fault_step).kill("actor", args.rank, **_when(args))
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.run_name
    watcher = MetricsWatcher(run_dir / "metrics.jsonl")

    clock = StepClock()
    try:
        ray_session(cfg, lambda: run_trainer(cfg, [sched, clock]))
    finally:
        watcher.stop()
    ev = read_events(run_dir)
    t_kill = sched.faults[0].fired_at
    fail = first(ev, "failure")  # the run's only fault
    restarts = [e["time"] for e in ev if e["event"] == "worker_restarted" and e["time"] > fail["time"]]
    t_up = max(restarts) if restarts else fail["time"]
    rec = first(ev, "recovered", fail["time"])
    restored = [e for e in ev if e["event"] in ("checkpoint_restored", "snapshot_restored")
                and fail["time"] < e["time"] <= rec["time"]]
    t_load = restored[0]["time"] - restored[0]["duration_s"] if restored else rec["time"]
    t_done = watcher.completed(args.fault_step, rec["time"])
    spawned = [clock.spawned[e["pid"]] for e in ev if e["event"] == "worker_restarted" and e["time"] > fail["time"]
               and e["pid"] in clock.spawned]
    return {"spawn": (max(spawned) if spawned else float("nan")) - t_kill, "ready": t_up - max(spawned, default=t_up),
            "detect": fail["time"] - t_kill, "restart": t_up - fail["time"], "rejoin": t_load - t_up,
            "restore": rec["time"] - t_load, "replay": t_done - rec["time"], "total": t_done - t_kill,
            "replayed": rec["steps_replayed"], "from_step": rec["restored_step"],
            "cause": fail["cause"], "recovery_duration_s": rec["duration_s"], **controller_phases(rec)}


def controller_phases(rec: dict) -> dict:
    """The controller's own phase split (the ``recovered`` event's, what rrl_recovery_phase_seconds
    exports), as ``ctl_<phase>``, printed next to the split measured here from the outside."""
    return {f"ctl_{phase}": float(seconds) for phase, seconds in (rec.get("phases") or {}).items()}


FAST = ("recovery.spares=1", "recovery.snapshot_every=1")


def _save_every_20(args, extra=()) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, "checkpoint.save_every=20", *extra]})


def measure_old_inplace(args, root: str) -> dict:
    return measure_inplace(_save_every_20(args), root)


def measure_fast_inplace(args, root: str) -> dict:
    return measure_inplace(_save_every_20(args, FAST), root)


def measure_default_inplace(args, root: str) -> dict:
    """The same SIGKILL with every recovery setting at its default (spares and snapshots ``auto``)."""
    return measure_inplace(_save_every_20(args, ("recovery.snapshot_every=auto", "recovery.spares=auto")), root)


def measure_full_restart(args, root: str) -> dict:
    cfg = build_config(args, root)
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.run_name
    marks: list[float] = []
    kill = JobKill(args.fault_step, args.delay)
    trainer = None
    start_cluster(cfg)
    try:
        trainer = PPOTrainer(cfg, hooks=[kill, StepClock()])
        trainer.fit()
        raise RuntimeError(f"the job was not killed at step {args.fault_step}")
    except JobKill.Killed:
        pass
    finally:  # the kill: the controller's state and the whole cluster are gone
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
    t_kill, t_down = kill.fired_at, time.time()
    watcher = MetricsWatcher(run_dir / "metrics.jsonl")
    t0 = time.time()
    try:
        ray_session(cfg, lambda: run_trainer(cfg, [StepClock()]), on_started=lambda: marks.append(time.time()))
    finally:
        watcher.stop()
    t_ray = marks[0]
    ev = read_events(run_dir)
    restored = first(ev, "checkpoint_restored", t0)
    t_load = restored["time"] - restored["duration_s"]
    t_resumed = first(ev, "bench_step_start", restored["time"])["time"]
    t_done = watcher.completed(args.fault_step, t_resumed)
    return {"teardown": t_down - t_kill, "ray_start": t_ray - t0, "worker_start": t_load - t_ray,
            "restore": t_resumed - t_load, "replay": t_done - t_resumed, "total": t_done - t_kill,
            "no_teardown": t_done - t0,
            "from_step": restored["step"], "replayed": args.fault_step - 1 - restored["step"]}


def measure_hang(args, root: str) -> dict:
    cfg = build_config(args, root, [f"recovery.hang_timeout_s={args.hang_timeout}"])
    sched = FaultSchedule().at_step(args.fault_step).hang("actor", args.rank, **_when(args))
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.run_name
    ray_session(cfg, lambda: run_trainer(cfg, [sched]))
    ev = read_events(run_dir)
    t_stop = sched.faults[0].fired_at
    fail = first(ev, "failure")
    rec = first(ev, "recovered", fail["time"])
    return {"detect": fail["time"] - t_stop, "deadline": args.hang_timeout, "cause": fail["cause"],
            "within": fail["time"] - t_stop <= args.hang_timeout + 1.0, "recovery_duration_s": rec["duration_s"],
            "killed": any(e["event"] == "kill_unresponsive" for e in ev), **controller_phases(rec)}


# ---------------------------------------------------------------------------- report
def in_tmp(fn, args, prefix: str) -> dict:
    """Run one measurement in a temp dir of its own (removed after), and show its figures at once."""
    root = tempfile.mkdtemp(prefix=f"rrl-bench-recovery-{prefix}-")
    try:
        out = fn(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("   ", " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()), flush=True)
    return out


def median_row(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k, v in rows[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def table(title: str, cols: tuple[str, ...], rows: list[dict], extra: tuple[str, ...] = ()) -> dict:
    print(f"\n{title} (seconds)")
    head = (*cols, "total", *extra)
    print(f"{'':<8}" + "".join(f"{c:>13}" for c in head))
    for i, r in enumerate(rows):
        print(f"{'#' + str(i + 1):<8}" + "".join(f"{r[c]:>13.2f}" for c in head))
    med = median_row(rows)
    if len(rows) > 1:
        print(f"{'median':<8}" + "".join(f"{med[c]:>13.2f}" for c in head))
    return med


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    t0 = time.time()
    parts = {"inplace": ("in-place", measure_inplace), "full": ("full restart", measure_full_restart),
             "raytrain": ("Ray Train v2", lambda args, root: measure_ray_train(
                 args, root, lambda run: ray_session(build_config(args, root), run))),
             "old": ("old in-place (save_every=20)", measure_old_inplace),
             "fast": ("fast in-place (save_every=20, spares, snapshots)", measure_fast_inplace),
             "default": ("in-place with default recovery settings (save_every=20)", measure_default_inplace),
             "hang": ("hang", measure_hang)}
    res: dict[str, list[dict]] = {name: [] for name in PARTS}
    for i in range(args.repeats):
        for name in args.parts:
            title, fn = parts[name]
            print(f"[repeat {i + 1}/{args.repeats}] {title} ...", flush=True)
            res[name].append(in_tmp(fn, args, name))

    cfg = build_config(args, "unused")
    when = f"inside {args.in_call}" if args.in_call else f"{args.delay:g} s into"
    print(f"\nfault: SIGKILL of actor rank {args.rank}, {when} step {args.fault_step} (full restart and Ray "
          f"Train: {args.delay:g} s in); checkpoint every "
          f"{cfg.checkpoint.save_every} steps (old/fast: 20); measured in {time.time() - t0:.0f} s")
    med: dict[str, dict] = {}
    if res["inplace"]:
        med["inplace"] = table("in-place recovery: kill -> failed step completed", INPLACE, res["inplace"],
                               ("replayed", "from_step"))
        for i, r in enumerate(res["inplace"]):
            print(f"  #{i + 1}: failure cause {r['cause']}; recovered.duration_s {r['recovery_duration_s']:.2f}; "
                  f"restart: the new process was created {r['spawn']:.2f} s after the kill (< 0: a pre-started "
                  f"idle worker) and answered {r['ready']:.2f} s after its creation")
    if res["full"]:
        med["full"] = table("full restart from checkpoint: kill -> failed step completed", FULL, res["full"],
                            ("no_teardown", "replayed", "from_step"))
    if res["raytrain"]:
        med["raytrain"] = table(f"Ray Train v2 (2 workers, DDP gloo, checkpoint every step, +{args.rt_pause:g} "
                                "s/step): kill -> next step completed", RAYTRAIN, res["raytrain"],
                                ("replayed", "from_step"))
    for name, title in (("old", "old in-place (spares and snapshots off), checkpoint.save_every=20"),
                        ("fast", "fast in-place (spares=1, snapshot_every=1), checkpoint.save_every=20"),
                        ("default", "in-place with default recovery settings (spares and snapshots auto), "
                                    "checkpoint.save_every=20")):
        if res[name]:
            med[name] = table(f"{title}: kill -> failed step completed", INPLACE, res[name], ("replayed", "from_step"))
    ratios = []
    for a, b, label, target in (("inplace", "raytrain", "in-place / Ray Train", 0.3),
                                ("inplace", "full", "in-place / full restart", 0.5),
                                ("fast", "old", "fast in-place / old in-place", 0.3),
                                ("fast", "raytrain", "fast in-place / Ray Train", 0.15)):
        if a in med and b in med:
            ratios.append((label, med[a]["total"] / med[b]["total"], target))
    if "inplace" in med and "full" in med:
        ratios.append(("in-place / full restart without teardown", med["inplace"]["total"] / med["full"]["no_teardown"],
                       0.5))
    if "fast" in med:
        print(f"\nsteps replayed beyond the failed one, fast in-place: {med['fast']['replayed']:g} (target 0)")
    if ratios:
        print("\nratios (medians):")
    for name, value, target in ratios:
        print(f"  {name:<44}{value:6.2f}x   target <= {target}x  {'ok' if value <= target else 'MISSED'}")
    if res["hang"]:
        print(f"\nSIGSTOP of actor rank {args.rank} with recovery.hang_timeout_s={args.hang_timeout:g}: "
              "failure event - SIGSTOP, against deadline + 1 s")
    for i, h in enumerate(res["hang"]):
        print(f"  #{i + 1}: detected in {h['detect']:.2f} s (deadline {h['deadline']:g} s, cause {h['cause']}, "
              f"unresponsive rank killed: {h['killed']}) -> {'ok' if h['within'] else 'LATE'}; "
              f"recovery took {h['recovery_duration_s']:.2f} s more")


if __name__ == "__main__":
    main()
