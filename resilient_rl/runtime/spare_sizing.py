"""``recovery.spares=auto``: how many warm spares each worker group keeps, and why.

A warm spare (:mod:`resilient_rl.runtime.spares`) takes a dead rank's place in a fraction of a
second instead of the seconds a new process needs (Python, torch and the worker's imports, then
its constructor). It reserves no accelerator: a GPU group's spare asks for no GPU and takes the
dead rank's devices when it takes the rank. What it costs is an idle process's host memory,
about :data:`SPARE_HOST_BYTES`, and a core for the seconds its start-up imports take.

``auto`` keeps one spare per node a group's ranks run on (a GPU spare serves the ranks of its own
node), where this node's available host memory holds every spare with headroom
(:data:`HEADROOM`) and its cores outnumber the run's processes on it with the spares. Where the
ranks already take every core, it keeps one spare, for the group with the most ranks on this
node: a spare costs a process start once (a few core-seconds, measured on a 2-core machine as
0.5-2.3 s more wall time for a whole 6-step run) and nothing while it waits, so one is worth it
on any machine, while a spare for every group starting beside the ranks slows the run (five ranks
and four spares made a chaos run's wall time 1.44x on 2 cores). Where memory is short, none. An
explicit number is kept as set (0 turns spares off). One line at start says what was chosen and
why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Host memory of an idle warm spare (Python, torch, Ray and the worker's imports; no model).
SPARE_HOST_BYTES = 1 << 30
#: Available memory must cover the spares this many times over.
HEADROOM = 2.0

_GIB = float(1 << 30)


@dataclass(frozen=True)
class SpareDecision:
    per_group: dict[str, int]
    line: str


def decide(setting, nodes_per_group: dict[str, int], available_bytes: int | None, cores: int | None = None,
           ranks_here: dict[str, int] | None = None) -> SpareDecision:
    """Spares per group for ``recovery.spares`` = ``setting`` (``"auto"`` or a count), given how
    many nodes each group's ranks span, this node's available host memory and cores (None:
    unknown) and how many processes of each group run on this node."""
    if setting != "auto":
        n = int(setting)
        return SpareDecision({g: n for g in nodes_per_group}, f"recovery.spares={n}: "
                             + (f"{n} warm spare(s) per worker group" if n else "no warm spares"))
    wanted = {g: max(1, nodes) for g, nodes in nodes_per_group.items()}
    ranks_here = {g: n for g, n in (ranks_here or {}).items() if n}
    processes_here = sum(ranks_here.values())
    if cores is not None and processes_here and cores < processes_here + len(ranks_here):
        # One spare, for the group most ranks here belong to (ties: the first named, as max keeps it).
        first = max(ranks_here, key=ranks_here.__getitem__)
        wanted = {g: int(g == first) for g in wanted}
        others = len(ranks_here) > 1
        why = (f"one warm spare, for {first}" + (" (the group with the most ranks on this node)" if others else "")
               + f": this node's {cores} core(s) already run the run's {processes_here} process(es), so "
               + ("a spare for every group would slow the run; a dead rank of another group waits for Ray to start "
                  "a new process" if others else "no more than one"))
    else:
        groups = ", ".join(f"{g}: {n}" for g, n in wanted.items())
        why = (f"one warm spare per node of each worker group ({groups}): a dead rank's place is taken at once "
               "instead of after a new process starts")
    total = sum(wanted.values())
    need = total * SPARE_HOST_BYTES * HEADROOM
    if available_bytes is not None and available_bytes < need:
        return SpareDecision({g: 0 for g in wanted},
                             f"recovery.spares=auto: no warm spares: {available_bytes / _GIB:.1f} GiB of host memory "
                             f"available on this node, less than the {need / _GIB:.1f} GiB {total} spare(s) need with "
                             f"headroom; a dead rank waits for Ray to start a new process (recovery.spares=N to force)")
    where = f"{available_bytes / _GIB:.1f} GiB available on this node" if available_bytes is not None \
        else "host memory not known here"
    return SpareDecision(wanted, f"recovery.spares=auto: {why}; a spare holds no accelerator and about "
                                 f"{SPARE_HOST_BYTES / _GIB:.0f} GiB of host memory ({where}; recovery.spares=0 "
                                 "turns them off)")


def cores_here() -> int | None:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def available_host_bytes() -> int | None:
    """This node's available memory (what a new process could take without swapping)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 -- unknown: decide without it
        return None
