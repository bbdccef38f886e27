"""The controller's side of one SIGKILL recovery, function by function.

A short run with the default config (CPU, Ray) in which actor rank ``--rank`` is SIGKILLed inside
its ``--in-call`` (default ``update_actor``) of step ``--fault-step``; the trainer recovers by itself. Every function of
the package that the controller's main thread calls from the failed call's classification
(``classify_error``) to the failed step's retry (the next ``train_step``) is recorded
(``sys.setprofile``), in the order of its first call; the fault hook's own functions are left out. Prints how many distinct functions in how
many modules, the count per module, and with ``--list`` every function: the measure of how long
the recovery path is, which ``docs/architecture.md`` walks.

    python bench/recovery_path.py
    python bench/recovery_path.py --list
    python bench/recovery_path.py --walk    # the functions per part of the recovery, as docs/architecture.md
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path


def record(steps: int, fault_step: int, rank: int, in_call: str, overrides: list[str]) -> list[str]:
    """``module:qualname`` of every package function the main thread called from the failure's
    classification to the failed step's retry, each once, in the order of its first call."""
    from resilient_rl.config.schema import load_config
    from resilient_rl.faults.injectors import FaultSchedule
    from resilient_rl.runtime.cluster import connect, disconnect
    from resilient_rl.trainer.ppo import PPOTrainer

    calls: list[tuple[str, str]] = []
    started = [False]

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("resilient_rl") or module.startswith("resilient_rl.faults"):
            return  # the fault hook that strikes is this measure's, not the recovery's
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        started[0] = started[0] or name == "classify_error"
        if started[0]:
            calls.append((module, name))

    with tempfile.TemporaryDirectory(prefix="rrl-recovery-path-") as tmp:
        cfg = load_config(None, [f"trainer.output_dir={tmp}", "trainer.run_name=path", f"trainer.total_steps={steps}",
                                 "trainer.progress_bar=false", f"checkpoint.root={tmp}/checkpoints",
                                 "telemetry.enabled=false", *overrides])
        owned = connect(cfg.ray)
        try:
            trainer = PPOTrainer(cfg, hooks=[FaultSchedule().at_step(fault_step).kill("actor", rank, in_call=in_call)])
            sys.setprofile(profile)
            try:
                trainer.fit()
            finally:
                sys.setprofile(None)
                trainer.shutdown()
        finally:
            disconnect(owned)
        events = [json.loads(line)["event"] for line in open(Path(tmp) / "path" / "events.jsonl")]
    if "recovered" not in events:
        raise SystemExit("recovery_path: the run recorded no recovery (the fault did not strike?)")
    seen: dict[str, None] = {}
    handled = False
    for module, name in calls:
        if handled and name.endswith("train_step"):
            break
        handled = handled or name.endswith("Recovery.handle")
        seen.setdefault(f"{module}:{name}")
    return list(seen)


#: Code objects that are not functions of the source: comprehensions, lambdas, dataclass methods.
UNNAMED = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>", "__create_fn__")
#: Where each part of the walk begins: the first call of these (the rest of the failed step's
#: handling, the states of the recovery, then the loop going on).
PHASES = (("the failure", "classify_error"), ("RECOVERING", "Recovering.enter"), ("REJOINING", "Rejoining.enter"),
          ("RESTORING", "Restoring.enter"), ("recovered, the loop goes on", "state_seconds"))


def walk(functions: list[str]) -> str:
    """The named functions as Markdown: per part of the recovery (:data:`PHASES`), each module in the
    order it is first reached, with its functions in the order of their first call."""
    parts: list[tuple[str, dict[str, list[str]]]] = []
    for f in functions:
        module, name = f.split(":", 1)
        if any(mark in name for mark in UNNAMED):
            continue
        for title, first in PHASES:
            if name.endswith(first) and title not in (t for t, _ in parts):
                parts.append((title, {}))
        parts[-1][1].setdefault(module.removeprefix("resilient_rl."), []).append(name)
    lines = []
    for title, modules in parts:
        lines.append(f"**{title}** ({sum(map(len, modules.values()))} functions)\n")
        lines += [f"- `{m}`: " + ", ".join(f"`{n}`" for n in names) for m, names in modules.items()]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--in-call", default="update_actor", help="the actor call the kill strikes in")
    p.add_argument("--list", action="store_true", help="print every function")
    p.add_argument("--walk", action="store_true", help="print the named functions per part of the recovery (Markdown)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    functions = record(args.steps, args.fault_step, args.rank, args.in_call, args.overrides)
    modules = collections.Counter(f.split(":")[0] for f in functions)
    print(f"one SIGKILL recovery: {len(functions)} functions in {len(modules)} modules on the controller")
    named = [f for f in functions if not any(mark in f for mark in UNNAMED)]
    print(f"  of them {len(named)} written as functions in {len(collections.Counter(f.split(':')[0] for f in named))} "
          "modules (comprehensions, lambdas and generated dataclass methods left out)")
    for module, n in modules.most_common():
        print(f"  {n:4d}  {module}")
    if args.list:
        print("\n".join(functions))
    if args.walk:
        print(walk(functions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
