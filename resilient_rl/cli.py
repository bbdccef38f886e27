"""The ``resilient-rl`` command line.

    resilient-rl train  [--config FILE] [key=value ...]
    resilient-rl resume [--config FILE] [key=value ...]      train with checkpoint.resume=auto
    resilient-rl checkpoints list   RUN [--root ROOT]
    resilient-rl checkpoints verify RUN [--root ROOT] [--step N]
    resilient-rl export CHECKPOINT --out DIR [--role actor] [--step N] [--config FILE]
    resilient-rl status RUN [--json] [--output-dir runs] [--root ROOT]
    resilient-rl plot   RUN [--out FILE.png] [--output-dir runs]

RUN and CHECKPOINT are a run name (under ``--root``, default ``checkpoints``), a run folder URL
or a step folder URL; the logic lives in :mod:`resilient_rl.checkpoint.inspect` and
:mod:`resilient_rl.checkpoint.export`. For ``status`` and
``plot``, RUN is a run name under ``--output-dir`` (default ``runs``) or a run folder path; their
logic lives in :mod:`resilient_rl.run_status` and :mod:`resilient_rl.plot`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from resilient_rl import env
from resilient_rl.errors import (CheckpointCorruptError, CheckpointError, CheckpointTimeoutError, ConfigError,
                                 NoCapacityError, Preempted, RecoveryError, RRLError, RunFolderError, StorageError)

# Exit codes (documented in README.md, "Exit codes"): one meaning each, stable for scripts.
EXIT_OK = 0
#: A checkpoint is damaged (``checkpoints verify`` of a corrupt or uncommitted one, or any
#: command that met a damaged checkpoint); the message reads ``corrupt: <file>: <why>``.
EXIT_CORRUPT = 1
#: Bad input: command-line usage (argparse exits 2 too), config, a run/checkpoint named that does not
#: exist or does not fit the config.
EXIT_ERROR = 2
#: Training stopped because recovery gave up (failure budget spent, or a failure it cannot recover from).
EXIT_RECOVERY = 3
#: Any other resilient-rl error at run time: storage, cluster, worker, telemetry.
EXIT_RUNTIME = 4
#: An unexpected exception (a bug): the traceback is printed. 70 is EX_SOFTWARE of sysexits.h.
EXIT_INTERNAL = 70
#: Lost ranks' node gone and no node can take their place (NoCapacityError); the run is intact,
#: and the same command continues it once the cluster has the capacity. 75 is EX_TEMPFAIL.
EXIT_NO_CAPACITY = 75
#: Interrupted (Ctrl-C), 128 + SIGINT.
EXIT_INTERRUPTED = 130
#: Preempted (SIGTERM, or Slurm's early SIGUSR1), 128 + SIGTERM: the run stopped at a safe point
#: with its last completed step committed where it could; the same command continues it.
EXIT_PREEMPTED = 143


def exit_code(exc: BaseException) -> int:
    """The exit code for an error that ended a command (see the constants above)."""
    if isinstance(exc, Preempted):
        return EXIT_PREEMPTED
    if isinstance(exc, CheckpointCorruptError):
        return EXIT_CORRUPT
    if isinstance(exc, NoCapacityError):
        return EXIT_NO_CAPACITY
    if isinstance(exc, RecoveryError):
        return EXIT_RECOVERY
    if isinstance(exc, (StorageError, CheckpointTimeoutError)):
        return EXIT_RUNTIME
    if isinstance(exc, (ConfigError, CheckpointError, RunFolderError)):  # e.g. weights that do not fit the config
        return EXIT_ERROR
    if isinstance(exc, RRLError):
        return EXIT_RUNTIME
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_INTERNAL


def _setup_logging(quiet: bool) -> None:
    from resilient_rl.run.log import setup_console

    setup_console(logging.WARNING if quiet else getattr(logging, env.log_level(), logging.INFO))


def _fit(cfg) -> int:
    """Run the trainer on ``cfg`` to ``trainer.total_steps``; shared by train and resume."""
    from resilient_rl.runtime.cluster import check_reachable, cluster_address, connect, disconnect

    address, source = cluster_address(cfg.ray)
    if address:  # a wrong address fails here, in seconds, before a run folder or a worker exists
        check_reachable(address, source, cfg.ray.connect_timeout_s)

    from resilient_rl.run.info import reward_summary
    from resilient_rl.trainer.ppo import PPOTrainer
    from resilient_rl.trainer.preemption import end_while_stuck
    from resilient_rl.run.log import RunLog

    trainer = PPOTrainer(cfg)
    log_path = trainer.run_dir.path / "train.log"
    try:  # the run's leases first: a refused controller starts nothing and writes nothing
        trainer.claim()
    except BaseException:
        trainer.shutdown()
        raise
    with RunLog(log_path):  # Ray's start-up notices and the workers' output land here, off the console
        owned = connect(cfg.ray)
        # After ray.init, whose SIGTERM handler would exit at once. A signal that lands while the
        # main thread is stuck in a call into Ray's control plane (gone with the job) ends the
        # run from another thread.
        trainer.preemption.install(when_stuck=lambda: end_while_stuck(trainer), exit_code=EXIT_PREEMPTED)
        try:
            history = trainer.fit()
        except KeyboardInterrupt:
            print(f"\ninterrupted at step {trainer.step}; stopping workers", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Preempted as exc:
            print(f"resilient-rl: {exc}", file=sys.stderr)
            trainer.preemption.exit_if_stuck(EXIT_PREEMPTED)  # Ray's cluster may go down during the shutdown
            return EXIT_PREEMPTED
        except RRLError:
            print(f"resilient-rl: the full log, with the workers' output, is in {log_path}", file=sys.stderr)
            raise
        finally:
            trainer.shutdown()  # releases the leases, preempted or not
            trainer.preemption.restore()
            disconnect(owned)
            trainer.preemption.ignore_after_shutdown()
            trainer.preemption.shutdown_ended()
    print(f"run folder: {trainer.run_dir.path}")
    if not history:
        print(f"nothing to train: the run is at step {trainer.step} of trainer.total_steps={cfg.trainer.total_steps}")
        return 0
    # From the run folder: the whole history (also the steps before a resume), not the in-memory window.
    print(reward_line(*reward_summary(trainer.run_dir.read_column("reward/mean"))))
    return 0


def reward_line(first: float, last: float) -> str:
    """The end-of-run line: mean reward of the first and last 10% of steps, and the change as a
    factor where one means something (a positive start), else as a difference (a start at 0
    printed ``xinf``, a negative one a factor of the wrong sign)."""
    change = f"x{last / first:.1f}" if first > 0 else f"{last - first:+.4f}"
    return f"mean reward: first 10% of steps {first:.4f}, last 10% {last:.4f} ({change})"


def cmd_train(args: argparse.Namespace) -> int:
    from resilient_rl.config.schema import load_config

    return _fit(load_config(args.config, args.overrides))


def cmd_resume(args: argparse.Namespace) -> int:
    from resilient_rl.checkpoint.inspect import require_committed
    from resilient_rl.config.schema import load_config

    for item in args.overrides:
        key, _, value = item.partition("=")
        if key.strip() == "checkpoint.resume" and value.strip() != "auto":
            raise ConfigError(f"resume always uses checkpoint.resume=auto, got {item!r}; to start from a given "
                              "checkpoint use `resilient-rl train checkpoint.resume=path:<step folder URL>`")
    cfg = load_config(args.config, [*args.overrides, "checkpoint.resume=auto"])
    step = require_committed(cfg.checkpoint.root, cfg.trainer.run_name, cfg.checkpoint.storage_options)
    print(f"resuming run {cfg.trainer.run_name!r} from its newest checkpoint (step {step} under "
          f"{cfg.checkpoint.root}, unless its files do not verify: the restore then takes an older one and "
          f"says so)", file=sys.stderr)
    return _fit(cfg)


def _storage_options(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--storage-options must be a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"--storage-options must be a JSON object, got {text!r}")
    return value


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from resilient_rl.checkpoint.inspect import describe_status, inspect_run, locate, verify_problem

    deep = args.action == "verify"
    loc = locate(args.run, args.root, getattr(args, "step", None))
    if not deep:
        loc = dataclasses.replace(loc, step=None)  # list shows the whole run, even for a step folder URL
    report = inspect_run(loc, deep=deep, storage_options=_storage_options(args.storage_options))
    print(report.format_table())
    if not deep:
        return 0
    problem = verify_problem(report)
    if problem is not None:
        print(f"resilient-rl: {problem}", file=sys.stderr)
        return EXIT_CORRUPT
    for row in report.rows:
        if row.status.startswith("corrupt"):  # older than the one a resume would load
            print(f"resilient-rl: warning: {describe_status(report.manager, row.step, row.status)}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from resilient_rl.checkpoint.export import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.out, role=args.role, root=args.root, step=args.step,
                               config_path=args.config, output_dir=args.output_dir,
                               storage_options=_storage_options(args.storage_options))
    print(f"exported {result.role} of {result.source} (step {result.step}, {result.num_tensors} tensors"
          f"{', model.kind=' + result.model_kind if result.model_kind else ''}) to {result.out_dir}: "
          f"{', '.join(result.files)}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from resilient_rl.run_status import gather_status

    status = gather_status(args.run, args.output_dir, args.root)
    print(json.dumps(status.to_json(), indent=1) if args.json else status.format_text())
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from resilient_rl.plot import write_plot  # matplotlib is loaded only here

    print(f"wrote {write_plot(args.run, args.out, args.output_dir)}")
    return 0


def _location_args(p: argparse.ArgumentParser, what: str, step_help: str | None) -> None:
    p.add_argument("--root", default=None,
                   help=f"checkpoint root of a {what} given by name (default: checkpoints)")
    if step_help:
        p.add_argument("--step", type=int, default=None, help=step_help)
    p.add_argument("--storage-options", default=None, metavar="JSON",
                   help="fsspec storage options as a JSON object (e.g. an S3 endpoint)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilient-rl", description="Fault-tolerant RL (PPO/GRPO) for language models.")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on the console")
    sub = p.add_subparsers(dest="command", required=True)
    for name, func, text in (("train", cmd_train, "train with PPO/GRPO"),
                             ("resume", cmd_resume, "continue a run from its newest valid checkpoint "
                                                    "(train with checkpoint.resume=auto)")):
        t = sub.add_parser(name, help=text)
        t.add_argument("--config", default=None, help="YAML config file (defaults are the built-in PPO copy task)")
        t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=50")
        t.set_defaults(func=func)

    c = sub.add_parser("checkpoints", help="list or verify a run's checkpoints")
    csub = c.add_subparsers(dest="action", required=True)
    run_help = "run name (under --root) or run folder URL, e.g. checkpoints/ppo-copy"
    ls = csub.add_parser("list", help="step, commit state, size, age and a size check of each checkpoint")
    ls.add_argument("run", metavar="RUN", help=run_help)
    _location_args(ls, "run", None)
    ls.set_defaults(func=cmd_checkpoints)
    vf = csub.add_parser("verify", help="check every file's sha256; exit 1 if the latest checkpoint "
                                        "(or --step) is corrupt")
    vf.add_argument("run", metavar="RUN", help=run_help + ", or a step folder URL")
    _location_args(vf, "run", "verify only this step")
    vf.set_defaults(func=cmd_checkpoints)

    e = sub.add_parser("export", help="write a checkpoint's model as model.safetensors + config.json")
    e.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="step folder URL (checkpoints/ppo-copy/step_00000020), or a run name or run folder "
                        "URL (then --step, default the newest committed step)")
    e.add_argument("--out", required=True, help="local folder to write model.safetensors and config.json to")
    e.add_argument("--role", default="actor", help="role to export (default actor; other roles get weights only)")
    e.add_argument("--config", default=None,
                   help="the run's config.yaml (default: {--output-dir}/{run}/config.yaml)")
    e.add_argument("--output-dir", default="runs", help="the run's trainer.output_dir (default: runs)")
    _location_args(e, "run", "step to export when CHECKPOINT is a run")
    e.set_defaults(func=cmd_export)

    folder_help = "run name (under --output-dir) or run folder path, e.g. runs/ppo-copy"
    st = sub.add_parser("status", help="is the run alive, its step and rate, last checkpoint, failures, goodput, "
                                       "metrics endpoint")
    st.add_argument("run", metavar="RUN", help=folder_help)
    st.add_argument("--json", action="store_true", help="print the status as JSON (for scripts)")
    st.add_argument("--output-dir", default=None, help="the run's trainer.output_dir (default: runs)")
    st.add_argument("--root", default=None, help="checkpoint root (default: the run's checkpoint.root)")
    st.set_defaults(func=cmd_status)
    pl = sub.add_parser("plot", help="PNG of reward, step time and KL over steps with failures, recoveries "
                                     "and checkpoints marked")
    pl.add_argument("run", metavar="RUN", help=folder_help)
    pl.add_argument("--out", default=None, help="PNG file to write (default: RUN folder/plot.png)")
    pl.add_argument("--output-dir", default=None, help="the run's trainer.output_dir (default: runs)")
    pl.set_defaults(func=cmd_plot)

    m = sub.add_parser("chaos", help="chaos monkey: kill or hang a random worker of a live run now and then")
    m.add_argument("run", metavar="RUN", help="the run's trainer.run_name (its actors are named rrl_RUN_...)")
    m.add_argument("--address", default="auto", help="Ray cluster to attach to (default: auto)")
    m.add_argument("--every", type=float, default=10.0, metavar="MINUTES", help="minutes between faults (default 10)")
    m.add_argument("--faults", type=int, default=3, metavar="M", help="stop after M faults (default 3)")
    m.add_argument("--kinds", default="sigkill,sigstop", help="comma-separated: sigkill, sigstop")
    m.add_argument("--seed", type=int, default=None, help="random seed (printed, to replay a session)")
    m.add_argument("--dry-run", action="store_true", help="print what would be done, touch nothing")
    m.add_argument("--connect-timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for the cluster's GCS (default: ray.connect_timeout_s's default)")
    m.set_defaults(func=cmd_chaos)
    return p


def cmd_chaos(args: argparse.Namespace) -> int:
    import ray

    from resilient_rl.config.runtime import RayConfig
    from resilient_rl.faults.monkey import ChaosMonkey
    from resilient_rl.runtime.cluster import join

    timeout_s = args.connect_timeout if args.connect_timeout is not None else RayConfig().connect_timeout_s
    join(args.address, "--address", timeout_s, log_to_driver=False)
    try:
        monkey = ChaosMonkey(args.run, interval_s=args.every * 60, max_faults=args.faults,
                             kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()), seed=args.seed,
                             dry_run=args.dry_run)
        monkey.run()
    finally:
        ray.shutdown()
    return 0


def redact_text(text: str) -> str:
    """:func:`resilient_rl.config.secrets.redact_text`, imported when an error is printed (the
    config package is not needed to start the CLI)."""
    from resilient_rl.config.secrets import redact_text as redact

    return redact(text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.quiet)
    try:
        return args.func(args)
    except CheckpointCorruptError as exc:  # messages are redacted: a library's error may quote a credential
        print(redact_text(f"resilient-rl: corrupt: {exc}"), file=sys.stderr)
        return EXIT_CORRUPT
    except RRLError as exc:
        print(redact_text(f"resilient-rl: error: {exc}"), file=sys.stderr)
        return exit_code(exc)
    except Exception as exc:  # noqa: BLE001 -- a bug: say so, with the traceback, under its own code
        import traceback

        print(redact_text(traceback.format_exc()), file=sys.stderr, end="")
        print(redact_text(f"resilient-rl: internal error ({type(exc).__name__}: {exc}); please report it with the "
                          "traceback above"), file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
