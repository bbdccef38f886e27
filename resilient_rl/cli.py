"""The ``resilient-rl`` command line.

    resilient-rl train [--config FILE] [key=value ...]
"""

from __future__ import annotations

import argparse
import logging
import sys

from resilient_rl import env
from resilient_rl.errors import RRLError


def _setup_logging(quiet: bool) -> None:
    level = logging.WARNING if quiet else getattr(logging, env.log_level(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def cmd_train(args: argparse.Namespace) -> int:
    from resilient_rl.trainer.cluster import connect, disconnect
    from resilient_rl.trainer.config import load_config
    from resilient_rl.trainer.ppo import PPOTrainer, reward_summary

    cfg = load_config(args.config, args.overrides)
    trainer = PPOTrainer(cfg)
    started = connect(cfg.ray)
    try:
        history = trainer.fit()
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {trainer.step}; stopping workers", file=sys.stderr)
        return 130
    finally:
        trainer.shutdown()
        disconnect(started)
    first, last = reward_summary(history)
    ratio = last / first if first > 0 else float("inf")
    print(f"run folder: {trainer.run_dir.path}")
    print(f"mean reward: first 10% of steps {first:.4f}, last 10% {last:.4f} (x{ratio:.1f})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilient-rl", description="Fault-tolerant RL (PPO/GRPO) for language models.")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on the console")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with PPO/GRPO")
    t.add_argument("--config", default=None, help="YAML config file (defaults are the built-in PPO reverse task)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=50")
    t.set_defaults(func=cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.quiet)
    try:
        return args.func(args)
    except RRLError as exc:
        print(f"resilient-rl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
