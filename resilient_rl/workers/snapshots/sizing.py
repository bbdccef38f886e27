"""``recovery.snapshot_every=auto``: how often to snapshot, and where, from what each node can hold.

After the first step (the optimizer has its state then, so a copy has its final size) every
process hosting stateful ranks reports the bytes of one copy of each and its node's room
(:func:`resilient_rl.workers.snapshots.node_capacity.measure`). For each node::

    ring  = KEEP x (sum of the copy bytes of the stateful ranks on the node)
    need  = HEADROOM x ring
    every step, in node memory   when need <= tmpfs free + kept, need <= RAM available + kept
                                 and need <= cgroup limit - usage (where limited), on every node
    every FALLBACK_EVERY steps,  when a node's tmpfs cannot hold it (or there is none) but its
      in process memory + the    memory can hold the copies in the processes plus the object
      object store               store's: HEADROOM x (KEEP + 1) / KEEP x ring
    off                          otherwise

``kept``: the node memory that runs whose controller is gone keep there for their next
controller; a ring that needs the room takes it when it is reserved
(:func:`resilient_rl.workers.snapshots.node_memory.make_room`). The object-store path costs a
copy through Ray per snapshot (node memory does not), hence the longer interval. :func:`decide` returns the decision and the one line the controller logs, which
gives the formula with the numbers and, where the tmpfs was too small, how to enlarge it.
"""

from __future__ import annotations

import dataclasses

#: Factor over the rings' bytes the node must have free (the tmpfs is shared with Ray's object
#: store and other processes; RAM with everything else).
HEADROOM = 1.5
#: The interval where node memory cannot hold the rings but process memory can.
FALLBACK_EVERY = 5
#: How to give a container a larger /dev/shm.
ENLARGE = ("enlarge it (Docker: --shm-size=<bytes>; Kubernetes: mount an emptyDir with medium: Memory "
           "and a sizeLimit at /dev/shm) or set recovery.snapshot_node_dir to a larger tmpfs")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``auto`` resolved to: ``every`` (0: off), whether copies go to node memory, the log line."""

    every: int
    node_memory: bool
    line: str


def _mib(n: float | None) -> str:
    return "unlimited" if n is None else f"{n / 2**20:.1f} MiB"


def decide(reports: list[dict], keep: int, node_dir: str) -> Decision:
    """The decision for ``reports`` (each process's :meth:`snapshot_sizing` answer: ``node``,
    ``bytes`` per role, ``room``), with ``keep`` copies per rank and node memory at ``node_dir``
    ("" for none)."""
    per_node: dict[str, dict] = {}
    for rep in reports:
        node = per_node.setdefault(rep["node"], {"bytes": 0, "room": rep["room"]})
        node["bytes"] += sum(int(b) for b in rep["bytes"].values())
    if not per_node:
        return Decision(0, False, "recovery.snapshot_every=auto: off (no stateful rank to snapshot)")
    tmpfs_ok, mem_ok, short = True, True, []
    for node, info in sorted(per_node.items()):
        room, ring = info["room"], keep * info["bytes"]
        need = HEADROOM * ring
        cgroup = [room["cgroup_free"]] if room.get("cgroup_free") is not None else []
        limits = [room["mem_available"]] + cgroup
        taken = room.get("reclaimable") or 0  # freed by the rings' reservation where they need it
        if not node_dir or room.get("tmpfs_free") is None or need > room["tmpfs_free"] + taken \
                or need > min([room["mem_available"] + taken] + cgroup):
            tmpfs_ok = False
            short.append((node, need, room))
        if HEADROOM * ring * (keep + 1) / keep > min(limits):
            mem_ok = False
    worst = max(per_node.items(), key=lambda kv: kv[1]["bytes"])
    node, info = worst
    room = info["room"]
    formula = (f"{HEADROOM:g} x {keep} copies x {_mib(info['bytes'])} per node = {_mib(HEADROOM * keep * info['bytes'])} "
               f"against tmpfs {node_dir or '(none)'} free {_mib(room.get('tmpfs_free')) if node_dir else 'n/a'}, "
               f"RAM available {_mib(room['mem_available'])}, cgroup free {_mib(room.get('cgroup_free'))}"
               + (f", {_mib(room['reclaimable'])} kept there for the next controllers of runs whose controller is gone"
                  if room.get("reclaimable") else "")
               + f" (largest node {node[:8]}, {len(per_node)} node(s))")
    if tmpfs_ok:
        return Decision(1, True, f"recovery.snapshot_every=auto: every step, in node memory: {formula}")
    node, need, room = short[0]
    if not node_dir:
        why = "recovery.snapshot_node_dir is empty"
    elif room.get("tmpfs_free") is None:
        why = f"{node_dir} does not exist on node {node[:8]}"
    else:
        why = (f"{node_dir} on node {node[:8]} has {_mib(room['tmpfs_free'])} free of {_mib(room['tmpfs_size'])}, "
               f"the rings need {_mib(need)}; {ENLARGE}")
    if mem_ok:
        return Decision(FALLBACK_EVERY, False,
                        f"recovery.snapshot_every=auto: every {FALLBACK_EVERY} steps, in process memory and the "
                        f"object store ({why}): {formula}")
    return Decision(0, False, f"recovery.snapshot_every=auto: off, memory cannot hold the copies ({why}): {formula}")
