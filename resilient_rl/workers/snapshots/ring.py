"""Where a rank's snapshot copy is kept: the ring of holders, by node first, then by process.

A stateful rank's copy is held by a rank of another node where there is one (so losing a node
loses no copy), else by another process on its node (so losing a process loses none); the
ranks are keyed by the process they live in (colocated roles share one).
"""

from __future__ import annotations

from typing import Any


def ring_holders(places: list[tuple[Any, Any]]) -> list[int]:
    """For each stateful rank (``places[i]``: its (pid, node)), the index of the rank that keeps
    its peer copy.

    With ranks on two or more known nodes the ring goes by node: the j-th rank of a node hands its
    copy to the j-th rank (modulo) of the next node, so every node's copies are on another node,
    spread evenly over its ranks (a rank of a role across nodes keeps one peer copy, not all of
    a node's), and losing one node loses no snapshot. A rank whose node is unknown, or all ranks
    on one node: the next in ring order on another node, else the next in another process
    (colocated roles share one), else itself (its copies are then its own and the object store's)."""
    n = len(places)
    by_node: dict[Any, list[int]] = {}
    for i, (_, node) in enumerate(places):
        if node is not None:
            by_node.setdefault(node, []).append(i)
    order = list(by_node)  # nodes in the order of their first rank
    holders = []
    for i, (pid, node) in enumerate(places):
        if node is not None and len(order) > 1:
            k = order.index(node)
            mine, nxt = by_node[node], by_node[order[(k + 1) % len(order)]]
            holders.append(nxt[mine.index(i) % len(nxt)])
            continue
        others = [(i + k) % n for k in range(1, n)]
        off_node = [h for h in others if places[h][1] is None or places[h][1] != node]
        off_process = [h for h in others if places[h][0] != pid]
        holders.append((off_node or off_process or [i])[0])
    return holders


def process_key(key: tuple[str, int], places: dict) -> Any:
    """Which process hosts ``key`` = (role, rank): its (pid, node, rank), or the key itself where
    the process is unknown (then it is taken on its own)."""
    pid, node = places.get(key, (None, None))
    return key if pid is None else (pid, node, key[1])


def processes(ranks: list[tuple[str, int]], places: dict) -> dict[Any, list[tuple[str, int]]]:
    """The stateful (role, rank)s grouped by the process hosting them (colocated roles share
    one), in ``ranks`` order."""
    out: dict[Any, list[tuple[str, int]]] = {}
    for key in ranks:
        out.setdefault(process_key(key, places), []).append(key)
    return out
