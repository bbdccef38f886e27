"""The Ray trainer on real GPUs: phase shares, tokens/s, NVML utilization, MFU and weight-sync cost.

Runs ``--warmup`` then ``--steps`` measured steps of the Ray trainer (by default the GRPO "add"
config, colocated, on one GPU) and prints:

- tokens per second and each phase's share of the step time, with the FLOP/s each phase achieved;
- GPU utilization per device, read from NVML in a background thread every ``--sample-interval``
  seconds during the measured steps (mean and max, and the most memory used);
- model FLOPs utilization (MFU): the step's model FLOPs (below) over step time x peak dense bf16
  FLOP/s of the device (a table by device name, or ``--peak-tflops``) x GPUs used;
- the weight sync (``perf/weight_sync_worker_s`` of the metrics rows, and the controller's
  ``weight_sync`` phase) against a plain device copy of the same bytes timed in this process
  (``perf/weight_sync_bytes`` bytes into a preallocated tensor, median of ``--copy-repeats``), and
  its share of the step. The worker time is host time around the sync: with one rank on CUDA the
  copies are asynchronous and may still run when it is taken, so the controller's phase (one Ray
  round trip more) is printed too;
- with ``checkpoint.save_every`` set, the stall of the first checkpoint save against later ones.

Model FLOPs of one step (N = parameters used in matrix products: every weight except embedding
tables, so a tied LM head counts once; T = prompt + response tokens of the step, from the
attention mask; attention-score FLOPs and padding are left out, so this is a lower bound)::

    gen            2·N·T_gen                  each prompt's prefill once (its rollout.n samples share it)
                                              + one decode per generated token (KV cache)
    ref            2·N·T                      when the KL term needs the reference policy
    old_log_prob   2·N·T
    values         2·N·T                      PPO critic (its backbone counted as N)
    update_actor   6·N·T · actor.ppo_epochs   forward + backward, every sequence once per epoch
    update_critic  6·N·T · critic.ppo_epochs

``--workload gsm8k-1.5b`` / ``gsm8k-0.5b`` (bench/gpu_workloads.py) replaces the config with a GRPO
run on Qwen2.5-1.5B / 0.5B shapes (random weights, kept as a model folder that the run loads as a real run
loads its pretrained model; a BPE tokenizer trained on the workload's text)
over 64 GSM8K-like prompts of 128 to 256 tokens x 8 samples, up to 512 new tokens (rows end at
different lengths), and adds: MFU per phase and per step by the project's and verl's counts, verl's
``perf/throughput``, one SIGKILL of the actor worker after the measured steps (the recovery's time
and the steps it replayed), and the same batch through the rollout engine and HF ``generate``
(dynamic and static cache) as ratios, with the engine's share of the decode roofline
(bench/gpu_generation.py; the run's rollout model, whose kept decode step the engine loads).
``--tiny`` runs the same workload at small dimensions, end to end, on the CPU when there is no GPU
(the decode step, the log-prob head, the norms, rotary embedding and SwiGLU compiled as on a GPU,
CUDA graphs aside).

On a machine without a CUDA device it prints one line saying so and exits 0.

    python bench/gpu.py                                # GRPO add, colocated, 1 GPU, 3 + 10 steps
    python bench/gpu.py model.hidden_size=2048 model.num_layers=16 model.num_heads=16 \\
        model.intermediate_size=8192 data.batch_size=64 rollout.n=4
    python bench/gpu.py --config resilient_rl/configs/ppo_copy.yaml actor.world_size=2
    python bench/gpu.py --peak-tflops 756 checkpoint.save_every=3    # H100 PCIe; checkpoint stalls
    python bench/gpu.py --workload gsm8k-1.5b --warmup 1 --steps 3
    python bench/gpu.py --workload gsm8k-0.5b --tiny                # any machine: the same path, small
    python bench/gpu.py --workload gsm8k-0.5b --short --warmup 1 --steps 1 --skip-generation
                                                                    # the real model, 4 short rows: minutes on a CPU
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import torch
import yaml

from gpu_generation import PATHS as GENERATION_PATHS
from gpu_report import format_report, matmul_params, peak_flops, utilization_summary
from gpu_workloads import WORKLOADS, prepare_data, workload_config, workload_lines

NO_GPU = ("bench/gpu.py: no CUDA device visible to torch on this machine; nothing to measure "
          "(bench/train.py runs on CPU)")
#: The exit status of a run its time limit stopped (as ``timeout`` reports one it ended).
TIMED_OUT = 124
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "resilient_rl" / "configs" / "grpo_add.yaml"
def gpus_used(cfg) -> int:
    """GPUs the Ray trainer takes: one pool of actor.world_size colocated, else one pool per role."""
    if cfg.trainer.placement == "colocated":
        return cfg.actor.world_size
    return (cfg.actor.world_size + cfg.rollout.world_size + cfg.ref.world_size
            + (cfg.critic.world_size if cfg.critic.enabled else 0))


# ------------------------------------------------------------------ measurement
class Sampling:
    """Reads ``sampler`` every ``interval_s`` seconds in a background thread while the block runs."""

    def __init__(self, sampler, interval_s: float) -> None:
        self.sampler, self.interval_s = sampler, interval_s
        self.readings: list[list] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-bench-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.readings.append(self.sampler.sample())
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> Sampling:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: the GRPO add config)")
    p.add_argument("--steps", type=int, default=10, help="measured steps (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default: 3)")
    p.add_argument("--sample-interval", type=float, default=0.2, help="seconds between NVML readings (default: 0.2)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense bf16 TFLOP/s per GPU for MFU (default: from the device name)")
    p.add_argument("--copy-repeats", type=int, default=20, help="plain copies timed (default: 20)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="a real-shaped GRPO workload instead of --config (bench/gpu_workloads.py)")
    p.add_argument("--skip-generation", action="store_true",
                   help="with --workload: skip the engine vs HF generate comparison")
    p.add_argument("--generation-paths", default=",".join(GENERATION_PATHS),
                   help="with --workload: the generation paths compared (default: all three)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_const", dest="size", const="tiny",
                      help="with --workload: the same workload at small dimensions (on the CPU without a GPU)")
    size.add_argument("--short", action="store_const", dest="size", const="short",
                      help="with --workload: the workload's model on 2 prompts x 2 samples of 48 + 8 tokens (on the "
                           "CPU without a GPU): what scales with the model, as the roles' builds and a recovery")
    p.add_argument("--models", default=str(Path(tempfile.gettempdir()) / f"rrl-bench-models-{os.getuid()}"),
                   help="with --workload: where the workloads' model folders are kept between runs "
                        "(default: %(default)s)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.batch_size=64")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.copy_repeats < 1 or args.sample_interval <= 0:
        p.error("--steps and --copy-repeats must be >= 1, --warmup >= 0, --sample-interval > 0")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    if args.size and not args.workload:
        p.error(f"--{args.size} needs --workload")
    unknown = set(args.generation_paths.split(",")) - set(GENERATION_PATHS)
    if unknown:
        p.error(f"--generation-paths: unknown {', '.join(sorted(unknown))} (known: {', '.join(GENERATION_PATHS)})")
    return args


def build_config(args: argparse.Namespace, output_dir: str, device: str):
    from resilient_rl.config.schema import load_config

    total = args.warmup + args.steps + (2 if args.workload else 0)  # a workload adds a recovery
    defaults = [f"trainer.output_dir={output_dir}", "trainer.progress_bar=false", f"trainer.total_steps={total}",
                f"trainer.device={device}", "actor.world_size=1", f"checkpoint.root={output_dir}/checkpoints",
                f"checkpoint.save_every={args.warmup + args.steps if args.workload else 0}"]
    if device == "cpu":  # the decode step, the log-prob head, the norms, rotary and SwiGLU compiled as on a GPU
        defaults += ["rollout.compile=true", "actor.compile_head=true", "actor.compile_elementwise=true",
                     "critic.compile_elementwise=true"]
    return load_config(args.config, defaults + list(args.overrides))


def count_params(cfg, vocab_size: int) -> int:
    """Matmul parameters of the actor, built on the meta device (no memory, no weights read)."""
    from resilient_rl.models.factory import build_causal_lm, model_vocab_size

    model = build_causal_lm(cfg.model, model_vocab_size(cfg.model, vocab_size), cfg.trainer.seed, empty=True)
    return matmul_params(model)


def workload(name: str, size: str | None = None):
    """Workload ``name`` (bench/gpu_workloads.py), or its ``tiny`` or ``short`` form."""
    return getattr(WORKLOADS[name], size)() if size else WORKLOADS[name]


def prepare_workload(name: str, tmp: str, models: str, size: str | None = None) -> str:
    """Write workload ``name``'s tokenizer, prompt file and config into ``tmp``, and its model's
    folder under ``models`` unless kept there already; returns the config's path."""
    w = workload(name, size)
    tokenizer, prompts = prepare_data(w, Path(tmp), 4 * w.prompts)
    path = Path(tmp) / f"{w.name}.yaml"
    path.write_text(yaml.safe_dump(workload_config(w, tokenizer, prompts, Path(models))))
    return str(path)


class _Measure:
    """Trainer hooks of the bench: GPU sampling over the measured steps, the checkpoint stalls,
    and (with a workload) one SIGKILL of the actor worker once the measured steps are done."""

    def __init__(self, args: argparse.Namespace, sampler):
        from resilient_rl.faults.injectors import FaultSchedule
        from resilient_rl.trainer.hooks import TrainerHook

        first, last = args.warmup + 1, args.warmup + args.steps
        self.sampling = Sampling(sampler, args.sample_interval) if sampler is not None else None
        self.stalls: list[tuple[int, float]] = []
        measure = self

        class Sample(TrainerHook):
            def on_step_start(self, trainer, step):
                if measure.sampling is not None and step == first:
                    measure.sampling.__enter__()
                if measure.sampling is not None and step == last + 1:
                    measure.sampling.__exit__()

        self.hooks = [Sample()]
        if args.workload:
            # After the snapshot of the step before it is sealed: the recovery's own cost.
            self.hooks.append(FaultSchedule().after_snapshot(last + 2).kill("actor", 0))
        self.first, self.last = first, last


class TimeUp(BaseException):
    """SIGTERM: the run's time limit (``timeout`` in bench/gpu_figures.sh, whose SIGKILL follows 20 s
    later). A BaseException, as KeyboardInterrupt is: no handler of the trainer's takes it for a
    worker's failure."""


def stop_at_sigterm() -> None:
    """From now on (after ``ray.init``, whose own handler exits at once and loses every figure not
    yet printed), SIGTERM stops the run where it is: its steps so far are reported."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the shutdown and the report must finish
        raise TimeUp()

    signal.signal(signal.SIGTERM, stop)


def run(args: argparse.Namespace, tmp: str, device: str, peak: float | None) -> dict:
    """Train ``--warmup`` + ``--steps`` (+ a recovery) steps through the trainer's own loop, printing
    each step and recovery event as it happens (bench/gpu_progress.py); returns what
    :func:`gpu_report.format_report` needs besides the copy time."""
    from gpu_progress import Progress
    from resilient_rl.runtime.cluster import connect, disconnect
    from resilient_rl.telemetry.device import GpuSampler
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = build_config(args, tmp, device)
    measure = _Measure(args, GpuSampler() if device == "cuda" else None)
    figures = None
    if args.workload:
        from train import summarize

        w = workload(args.workload, args.size)
        figures = lambda rows: workload_lines(w, summarize(rows), rows, peak, gpus_used(cfg),  # noqa: E731
                                              cfg.actor.ppo_epochs)
    progress = Progress(measure.first, measure.last, figures, out=lambda line: print(line, flush=True))
    owned = connect(cfg.ray)
    stop_at_sigterm()
    trainer, stopped = None, False
    try:
        try:
            trainer = PPOTrainer(cfg, hooks=measure.hooks + [progress])
            progress.attach(trainer.run_dir)
            trainer.run_dir.subscribe(lambda ev: measure.stalls.append((ev.step, ev.stall_s))
                                      if ev.kind == "checkpoint_started" else None)
            trainer.fit()
        except TimeUp:
            if trainer is None:  # stopped before the run began: nothing to report
                raise
            stopped = True
            print(f"\nstopped by the time limit (SIGTERM) after step {trainer.step}: the figures below are of the "
                  "steps done", flush=True)
        vocab = trainer.tokenizer.vocab_size
    finally:
        if measure.sampling is not None and measure.sampling._thread.is_alive():
            measure.sampling.__exit__()
        if trainer is not None:
            progress.finish(trainer.run_dir)
            trainer.shutdown()
        disconnect(owned)
    history = trainer.run_dir.read_metrics()
    rows = [r for r in history if measure.first <= r["step"] <= measure.last]
    return {"cfg": cfg, "rows": rows, "readings": measure.sampling.readings if measure.sampling else [],
            "stalls": measure.stalls, "n_params": count_params(cfg, vocab),
            "recovered": [e for e in trainer.run_dir.read_events() if e.get("event") == "recovered"],
            "history": history, "warm": [r for r in history if r["step"] < measure.first], "figures": figures,
            "vocab": vocab, "stopped": stopped}


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.size:
        print(NO_GPU)
        return 0
    device = "cuda" if cuda else "cpu"
    from train import plain_copy_s  # bench/train.py: this script's folder is first on sys.path

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("resilient_rl.runtime.pool.ray_roles").setLevel(logging.INFO)  # the memory plan's line
    logging.getLogger("resilient_rl.workers.compile_cache").setLevel(logging.INFO)  # what the comparison loaded
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(name)
    with tempfile.TemporaryDirectory(prefix="rrl-bench-gpu-") as tmp:
        if args.workload:
            args.config = prepare_workload(args.workload, tmp, args.models, args.size)
        r = run(args, tmp, device, peak)
        generation = None
        # While the run's folder (its kept decode step) is there; not after the time limit stopped the run.
        if args.workload and not args.skip_generation and not r["stopped"]:
            from gpu_generation import compare_generation

            generation = compare_generation(workload(args.workload, args.size), r["cfg"], r["vocab"],
                                            tuple(args.generation_paths.split(",")))
    cfg, rows = r["cfg"], r["rows"]
    nbytes = next((row["perf/weight_sync_bytes"] for row in rows if "perf/weight_sync_bytes" in row), None)
    # Timed after the workers are gone, so the copy has the device to itself: the floor.
    copy_s = plain_copy_s(int(nbytes), device, args.copy_repeats) if nbytes else None
    m = cfg.model
    print(f"\nconfig {args.config}: {cfg.trainer.placement}, model {m.kind} hidden={m.hidden_size} "
          f"layers={m.num_layers}; batch {cfg.data.batch_size} prompts x n={cfg.rollout.n}, "
          f"{cfg.rollout.max_new_tokens} new tokens; ppo_epochs={cfg.actor.ppo_epochs}; {args.warmup} warm-up steps")
    if not rows:
        print("no measured step was done")
        return TIMED_OUT if r["stopped"] else 1
    lines = format_report(rows, n_params=r["n_params"], ppo_epochs=cfg.actor.ppo_epochs,
                          need_ref=cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss,
                          critic_epochs=cfg.critic.ppo_epochs if cfg.critic.enabled else None,
                          device_name=name, peak=peak, n_gpus=gpus_used(cfg),
                          util=utilization_summary(r["readings"]), copy_s=copy_s, stalls=r["stalls"],
                          prompts=cfg.data.batch_size, samples=cfg.rollout.n)
    print("\n".join(lines))
    for row in r["warm"]:
        print(f"warm-up step {row['step']}: {row['timing/step_s']:.1f} s (generation {row.get('timing/gen_s', 0):.1f} s, "
              f"{row.get('perf/decode_compiles', 0):.0f} decode-step compiles)")
    if rows:
        total = {name: sum(row.get(f"perf/decode_{name}", 0.0) for row in rows)
                 for name in ("compiles", "graph_breaks", "cudagraph_skips", "compactions", "eager")}
        print(f"decode step in the measured steps: {total['compiles']:.0f} compiles, "
              f"{total['graph_breaks']:.0f} graph breaks, {total['cudagraph_skips']:.0f} CUDA-graph skips, "
              f"{total['compactions'] / len(rows):.1f} compactions per rollout, "
              f"eager fallback: {'yes' if total['eager'] else 'no'}")
        compiled_pieces = (("perf/head_eager", "log-prob head"),
                           ("perf/actor_elementwise_eager", "actor's norms, rotary and SwiGLU"),
                           ("perf/critic_elementwise_eager", "critic's norms, rotary and SwiGLU"))
        for key, what in compiled_pieces:
            if any(key in row for row in rows):
                eager = any(row[key] for row in rows if key in row)
                print(f"{what}: {'eager after a compiler failure (the log says why)' if eager else 'compiled'}")
    if args.workload:
        from gpu_progress import recovery_lines

        print("\n".join(r["figures"](rows)))  # the workload's figures, as printed during the run

        print("\n".join(recovery_lines(r["recovered"], r["history"], rows)))
        if generation is not None:
            from gpu_generation import generation_lines

            print("\n".join(generation_lines(workload(args.workload, args.size), generation, name)))
    return TIMED_OUT if r["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
