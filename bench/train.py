"""Training throughput: the Ray trainer (FSDP worker groups) against the single-process loop, in one run.

Both trainers are built from the same config (same model, batch, seeds and data order) and live
side by side in this process: the Ray one drives worker groups (``actor.world_size`` FSDP ranks,
``--placement`` colocated or split), the baseline runs the same engines here through
:class:`~resilient_rl.trainer.local_roles.LocalRoles`. After ``--warmup`` steps each, ``--steps``
measured steps of each are run in alternating blocks of ``--block`` steps (the first trainer of a
round alternates too), so drift in the load of a shared machine hits both alike.

Printed per trainer: tokens per second (prompt + response tokens of a step over its wall time),
the ratio Ray / single process, the mean step time, and each phase's share of the step time
(``other`` is the step time not inside any phase: prompt building, rewards, bookkeeping). Then the
weight sync as the workers time it (median ``perf/weight_sync_worker_s``) against a plain copy of the same
bytes into a preallocated tensor in this process (the floor for moving them), from cold CPU caches
as the sync finds the weights after an update (the warm copy is printed too), and the cost of an
empty Ray round trip to the workers, times the round trips a step waits for (calls in flight
together are waited for as one): a floor on what the Ray trainer pays for remote calls before any
data moves.

    python bench/train.py                          # colocated, 30 steps each (a few minutes)
    python bench/train.py --placement split
    python bench/train.py --steps 6 --warmup 1     # quick look
    python bench/train.py data.batch_size=16 model.num_layers=4   # any config override
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch

from resilient_rl.runtime.cluster import connect, disconnect
from resilient_rl.config.schema import load_config
from resilient_rl.trainer.local_roles import LocalRoles
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.telemetry import PHASES

RAY, LOCAL = "ray", "local"
#: Bytes copied to evict the CPU caches before a cold copy (larger than the last-level cache).
EVICT_BYTES = 256 * 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placement", choices=("colocated", "split"), default="colocated",
                   help="placement of the Ray trainer's roles (default: colocated)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per trainer (default: 30)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per trainer first (default: 3)")
    p.add_argument("--block", type=int, default=5, help="steps per trainer before switching (default: 5)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per step (default: the config's)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of this process, which runs the single-process loop; the Ray "
                        "workers use 1 each (default: 1)")
    p.add_argument("--probe-calls", type=int, default=50,
                   help="empty round trips timed to estimate the Ray per-call cost (0: skip; default: 50)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.num_layers=4")
    args = p.parse_args(argv)
    for name in ("steps", "block"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.threads < 1 or args.probe_calls < 0:
        p.error("--warmup and --probe-calls must be >= 0 and --threads >= 1")
    if args.batch_size is not None and args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return args


def build_config(args: argparse.Namespace, output_dir: str):
    # Checkpoints (the default schedule, part of what the Ray trainer pays) go to the temporary
    # directory too: a run left in ./checkpoints would otherwise be resumed, or its lease refused.
    overrides = [f"trainer.output_dir={output_dir}", f"checkpoint.root={output_dir}/checkpoints",
                 "trainer.progress_bar=false",
                 f"trainer.placement={args.placement}",
                 # The LR schedule depends on the run length: make it the same for both trainers.
                 f"trainer.total_steps={args.warmup + args.steps}"]
    if args.batch_size is not None:
        overrides.append(f"data.batch_size={args.batch_size}")
        # A small batch would fail validation against the default mini-batch sizes: shrink them to
        # the batch (one mini-batch per epoch) unless the command line sets them.
        base = load_config(None, list(args.overrides))
        sequences = args.batch_size * base.rollout.n
        for role in ("actor", "critic"):
            if getattr(base, role).mini_batch_size > sequences and \
                    not any(o.startswith(f"{role}.mini_batch_size=") for o in args.overrides):
                overrides.append(f"{role}.mini_batch_size={sequences}")
    return load_config(None, overrides + list(args.overrides))


def run_block(trainer: PPOTrainer, n: int, rows: list[dict] | None) -> None:
    for _ in range(n):
        row = trainer.train_step()
        if rows is not None:
            rows.append(row)


def summarize(rows: list[dict]) -> dict:
    """Tokens/s, mean step time, each phase's share of the summed step time, and the weight sync's
    bytes and median worker seconds (None where the backend does not report them)."""
    total = sum(r["timing/step_s"] for r in rows)
    phases = {p: sum(r.get(f"timing/{p}_s", 0.0) for r in rows) for p in PHASES}
    phases["other"] = total - sum(phases.values())
    synced = [r for r in rows if "perf/weight_sync_worker_s" in r]
    return {
        "weight_sync_bytes": synced[-1]["perf/weight_sync_bytes"] if synced else None,
        # The median, as for the plain copy it is compared with: a mean of 0.1 ms syncs moves by a
        # third with one preemption of the worker.
        "weight_sync_worker_s": statistics.median(r["perf/weight_sync_worker_s"] for r in synced) if synced else None,
        "tokens_per_s": sum(r["tokens"] for r in rows) / total,
        "step_s": total / len(rows),
        "median_step_s": statistics.median(r["timing/step_s"] for r in rows),
        "tokens_per_step": sum(r["tokens"] for r in rows) / len(rows),
        "phase_s": {p: v / len(rows) for p, v in phases.items()},
        "share": {p: 100.0 * v / total for p, v in phases.items()},
    }


def plain_copy_s(nbytes: int, device: str | torch.device = "cpu", repeats: int = 50, cold: bool = False) -> float:
    """Median seconds of one copy of ``nbytes`` bytes into a preallocated tensor on ``device``.

    The destination is allocated once, as the rollout's parameters are: a fresh ``empty_like`` per
    copy would time page faults on CPU rather than the copy. ``cold`` (CPU): before each copy, a
    copy of ``EVICT_BYTES`` pushes source and destination out of the CPU caches, as a step's
    update does before the weight sync reads the weights; a small model otherwise copies from
    cache at several times the speed the sync can reach.
    """
    device = torch.device(device)
    src = torch.ones(int(nbytes), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    evict = torch.ones(EVICT_BYTES, dtype=torch.uint8) if cold and device.type == "cpu" else None
    evict_dst = torch.empty_like(evict) if evict is not None else None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for _ in range(repeats + 1):  # the first copy warms caches and is not counted
        if evict is not None:
            evict_dst.copy_(evict)
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def weight_sync_line(results: dict[str, dict], copy_s: float | None, warm_s: float | None = None) -> str:
    """``weight sync / plain copy: ...`` for each result that reports its weight sync."""
    cells = []
    for name, r in results.items():
        if r["weight_sync_worker_s"] is None or not copy_s:
            cells.append(f"{name} n/a")
        else:
            cells.append(f"{name} {r['weight_sync_worker_s'] / copy_s:.1f}x "
                         f"({1e3 * r['weight_sync_worker_s']:.2f} ms)")
    nbytes = next((r["weight_sync_bytes"] for r in results.values() if r["weight_sync_bytes"]), None)
    base = f"plain copy of {nbytes / 2**20:.1f} MiB {1e3 * copy_s:.3f} ms" if nbytes and copy_s else "no bytes reported"
    if nbytes and copy_s and warm_s:
        base += f" from cold caches ({1e3 * warm_s:.3f} ms from warm ones)"
    return f"weight sync / plain copy: {', '.join(cells)}; {base}"


def probe_ray_call(trainer: PPOTrainer, n: int) -> float:
    """Mean seconds of one empty call to every rank of the actor group (dispatch, schedule, reply)."""
    group = trainer.roles.groups["actor"]
    group.ping()
    t0 = time.perf_counter()
    for _ in range(n):
        group.ping()
    return (time.perf_counter() - t0) / n


def group_calls_per_step(cfg, roles) -> tuple[int, int]:
    """(worker-group calls, round trips waited for) of one Ray trainer step (see trainer/step.py and
    runtime/pool/ray_roles.py): calls in flight together are waited for as one round trip."""
    need_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
    critic = 2 if cfg.critic.enabled else 0  # compute_values, update_critic
    # generate, old log-probs, update_actor, export_weights + update_weights
    calls = 5 + (1 if need_ref else 0) + critic
    # generate; the forward passes; the updates; the weight sync (two waits through the object store)
    return calls, 3 + (1 if roles.colocated or roles.weight_channel else 2)


def report(args, cfg, results: dict[str, dict], ray_call_s: float | None, wall_s: float,
           copy_s: float | None = None, warm_s: float | None = None, roles=None) -> None:
    ray, local = results[RAY], results[LOCAL]
    name = f"ray {args.placement} ({cfg.actor.world_size} ranks)"
    print()
    print(f"model: {cfg.model.kind} hidden={cfg.model.hidden_size} layers={cfg.model.num_layers}; "
          f"batch {cfg.data.batch_size} prompts x n={cfg.rollout.n}, {cfg.rollout.max_new_tokens} new tokens; "
          f"ppo_epochs={cfg.actor.ppo_epochs} mini_batch={cfg.actor.mini_batch_size}; critic "
          f"{'on (world ' + str(cfg.critic.world_size) + ')' if cfg.critic.enabled else 'off'}")
    print(f"{args.steps} measured steps each after {args.warmup} warm-up, interleaved in blocks of {args.block}; "
          f"local threads={args.threads}; measured in {wall_s:.0f} s")
    print()
    w = max(len(name), 16)
    print(f"{'':<18}{name:>{w}}{'single process':>{w}}")
    print(f"{'tokens/s':<18}{ray['tokens_per_s']:>{w}.0f}{local['tokens_per_s']:>{w}.0f}")
    print(f"{'tokens/step':<18}{ray['tokens_per_step']:>{w}.0f}{local['tokens_per_step']:>{w}.0f}")
    print(f"{'mean step (ms)':<18}{1e3 * ray['step_s']:>{w}.1f}{1e3 * local['step_s']:>{w}.1f}")
    print(f"{'median step (ms)':<18}{1e3 * ray['median_step_s']:>{w}.1f}{1e3 * local['median_step_s']:>{w}.1f}")
    print("phase share of step time, % (mean ms):")
    for p in (*PHASES, "other"):
        cells = [f"{r['share'][p]:5.1f}% ({1e3 * r['phase_s'][p]:7.1f})" for r in (ray, local)]
        print(f"  {p:<16}{cells[0]:>{w}}{cells[1]:>{w}}")
    print()
    print(f"tokens/s ratio ray / single process: {ray['tokens_per_s'] / local['tokens_per_s']:.2f}x")
    print(weight_sync_line({"ray": ray, "single process": local}, copy_s, warm_s))
    if ray_call_s is not None and roles is not None:
        calls, waits = group_calls_per_step(cfg, roles)
        floor = waits * ray_call_s
        print(f"empty Ray round trip to the {cfg.actor.world_size} actor ranks: {1e3 * ray_call_s:.2f} ms; "
              f"{calls} group calls per step in {waits} round trips = {1e3 * floor:.1f} ms "
              f"({100 * floor / ray['step_s']:.1f}% of the Ray step)")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rrl-bench-train-") as tmp:
        cfg = build_config(args, tmp)
        owned = connect(cfg.ray)
        trainers: dict[str, PPOTrainer] = {}
        try:
            trainers[RAY] = PPOTrainer(cfg)
            trainers[LOCAL] = PPOTrainer(build_config(args, tmp + "/local"), roles_factory=LocalRoles)
            for t in trainers.values():
                t.start_roles()
                run_block(t, args.warmup, None)
            rows: dict[str, list[dict]] = {RAY: [], LOCAL: []}
            order = [RAY, LOCAL]
            t0 = time.perf_counter()
            while len(rows[RAY]) < args.steps or len(rows[LOCAL]) < args.steps:
                for key in order:
                    run_block(trainers[key], min(args.block, args.steps - len(rows[key])), rows[key])
                order.reverse()
            wall = time.perf_counter() - t0
            ray_call_s = probe_ray_call(trainers[RAY], args.probe_calls) if args.probe_calls else None
            results = {k: summarize(v) for k, v in rows.items()}
            nbytes = next((r["weight_sync_bytes"] for r in results.values() if r["weight_sync_bytes"]), None)
            copy_s = plain_copy_s(int(nbytes), cold=True) if nbytes else None
            warm_s = plain_copy_s(int(nbytes)) if nbytes else None
            report(args, cfg, results, ray_call_s, wall, copy_s, warm_s, trainers[RAY].roles)
        finally:
            for t in trainers.values():
                t.shutdown()
            disconnect(owned)


if __name__ == "__main__":
    main()
