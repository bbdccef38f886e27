"""Rebuilding a rank's models before a restore: initialised (random weights, then overwritten)
against empty (parameters allocated on the device, never initialised; ``init_model(empty=True)``).

What a rank that rejoins after a failure does for each role of its process: build the engine
(model, FSDP wrap, optimizer), then load the state it restores. Measured in this process for
actor, critic and rollout (the ref always gets its initial weights), at a model size where
initialisation shows (the default is about 0.13 B parameters per role; ``model.*`` overrides
change it); the state loaded is the initialised engine's own, so both paths end with the same
weights (checked). Printed: seconds per role, each way, and the empty/initialised ratio of the
total. Alternated ``--repeats`` times; medians.

    python bench/model_init.py
    python bench/model_init.py --repeats 5 model.num_layers=16 model.hidden_size=2048
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from resilient_rl.config.schema import load_config
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.workers.rollout import RolloutEngine
from resilient_rl.workers.value import ValueEngine

DEFAULTS = ("model.hidden_size=1024", "model.num_layers=8", "model.num_heads=8", "model.intermediate_size=4096",
            "model.max_seq_len=512")
VOCAB = 32000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="alternated rounds (initialised, empty); medians")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.num_layers=4")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def builders(cfg, plan):
    """role -> build(empty) for the roles a restore fills."""
    steps, seed = cfg.trainer.total_steps, cfg.trainer.seed
    return {
        "actor": lambda empty: PolicyEngine(cfg.model, VOCAB, seed, plan, actor_cfg=cfg.actor, total_steps=steps,
                                            empty=empty),
        "critic": lambda empty: ValueEngine(cfg.model, cfg.critic, VOCAB, seed + 1, plan, total_steps=steps,
                                            empty=empty),
        "rollout": lambda empty: RolloutEngine(cfg.model, cfg.rollout, VOCAB, seed, plan, 1, 0, empty=empty),
    }


def rebuild_s(build, empty: bool, state: dict, plan) -> float:
    """Seconds to build the engine and load ``state`` into its model."""
    gc.collect()
    if plan.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine = build(empty)
    engine.model.load_state_dict(state)
    if plan.device.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    for name, value in engine.model.state_dict().items():
        if not torch.equal(value, state[name]):
            raise SystemExit(f"bench/model_init.py: {name} differs after the load (empty={empty})")
    return took


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = load_config(None, [*DEFAULTS, *args.overrides])
    plan = plan_device(cfg.trainer.device, cfg.model.dtype)
    torch.set_num_threads(1)  # as in a CPU worker
    times: dict[tuple[str, bool], list[float]] = {}
    params = {}
    for role, build in builders(cfg, plan).items():
        reference = build(False)
        params[role] = sum(p.numel() for p in reference.model.parameters())
        state = {k: v.detach().clone() for k, v in reference.model.state_dict().items()}
        del reference
        for _ in range(args.repeats):
            for empty in (False, True):
                times.setdefault((role, empty), []).append(rebuild_s(build, empty, state, plan))
        del state
    print(f"bench/model_init.py on {plan.device}, {args.repeats} rounds, medians; "
          f"model {cfg.model.hidden_size}h x {cfg.model.num_layers} layers, vocab {VOCAB}")
    print(f"{'role':8} {'params':>10} {'initialised':>12} {'empty':>8} {'ratio':>7}")
    total = {False: 0.0, True: 0.0}
    for role in params:
        init_s, empty_s = (statistics.median(times[(role, e)]) for e in (False, True))
        total[False] += init_s
        total[True] += empty_s
        print(f"{role:8} {params[role] / 1e6:9.1f}M {init_s:11.3f}s {empty_s:7.3f}s {empty_s / init_s:6.2f}x")
    print(f"{'all':8} {sum(params.values()) / 1e6:9.1f}M {total[False]:11.3f}s {total[True]:7.3f}s "
          f"{total[True] / total[False]:6.2f}x  (rebuild + load, empty / initialised)")


if __name__ == "__main__":
    main()
