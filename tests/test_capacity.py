"""Whether a lost node's placement group can be placed again (runtime/capacity.py), and the exit
code of a run stopped for want of capacity."""

from __future__ import annotations

import pytest

from resilient_rl.cli import EXIT_NO_CAPACITY, EXIT_RECOVERY, exit_code
from resilient_rl.errors import NoCapacityError, RecoveryError
from resilient_rl.runtime.capacity import Shortfall, shortfall
from resilient_rl.runtime.pool import unplaced
from resilient_rl.runtime.worker import WorkerInfo

B = {"CPU": 0.05}
GPU_B = {"CPU": 0.05, "GPU": 1.0}


def test_bundles_fit_a_spare_node():
    nodes = {"a": {"CPU": 8.0}, "spare": {"CPU": 8.0}}
    assert shortfall(1, [B, B], "STRICT_PACK", nodes, excluded={"a"}) is None


def test_no_other_alive_node_is_a_shortfall_naming_what_is_missing():
    nodes = {"a": {"CPU": 8.0}}
    short = shortfall(1, [B, B], "STRICT_PACK", nodes, excluded={"a"})
    assert short is not None and short.largest == {}
    assert "CPU=0.1 on one node" in short.describe() and "no other alive node" in short.describe()


def test_a_node_too_small_for_the_packed_bundles_is_a_shortfall():
    nodes = {"a": {"CPU": 8.0, "GPU": 8.0}, "small": {"CPU": 8.0, "GPU": 1.0}}
    short = shortfall(1, [GPU_B, GPU_B], "STRICT_PACK", nodes, excluded={"a"})
    assert short is not None
    assert "GPU=2" in short.describe() and "GPU=1" in short.describe()


def test_strict_spread_needs_a_node_per_bundle_and_pack_may_split():
    nodes = {"x": {"CPU": 1.0}, "y": {"CPU": 1.0}}
    assert shortfall(0, [{"CPU": 1.0}] * 3, "STRICT_SPREAD", nodes, excluded=set()) is not None
    assert shortfall(0, [{"CPU": 1.0}] * 2, "STRICT_SPREAD", nodes, excluded=set()) is None
    assert shortfall(0, [{"CPU": 1.0}] * 2, "PACK", nodes, excluded=set()) is None
    assert shortfall(0, [{"CPU": 1.0}] * 2, "STRICT_PACK", nodes, excluded=set()) is not None


def test_nothing_waiting_is_no_shortfall():
    assert shortfall(0, [], "STRICT_PACK", {}, excluded=set()) is None


class _Pg:
    def __init__(self, pid: str) -> None:
        self.id = pid


class _Pool:
    """Two placement groups of two bundles: ranks 0, 1 on node "a", ranks 2, 3 on node "b"."""

    def __init__(self) -> None:
        self.pgs = [_Pg("pg0"), _Pg("pg1")]

    def unplaced(self) -> bool:
        return True

    def bundle_slots(self):
        return [(pg, i, i, 2) for pg in self.pgs for i in range(2)]


class _Group:
    name_prefix = "actor"
    resource_pool = _Pool()


def test_no_capacity_names_the_ranks_whose_bundles_wait_whatever_their_last_reply_said(monkeypatch):
    """Ranks 2 and 3 were lost with node "b"; the last reply read for rank 2 came from a process on
    node "a" (a spare that had answered in its place), so only the placement group says it waits."""
    waiting = Shortfall(1, [B, B], "STRICT_PACK", {}, indices=(0, 1))
    monkeypatch.setattr(unplaced, "unplaceable", lambda pool: [waiting])
    monkeypatch.setattr(unplaced, "nodes_launching", lambda: 0)
    monkeypatch.setattr(unplaced, "alive_nodes", lambda: {"a": {"CPU": 8.0}})
    known = {("actor", r): WorkerInfo(r, 4, 0, 100 + r, node) for r, node in enumerate("aaab")}
    with pytest.raises(NoCapacityError) as err:
        unplaced.yield_to_unplaced([_Group()], {}, known, {"actor": ("actor",)})
    message = str(err.value)
    assert "actor ranks [2, 3] were lost with node b " in message, message
    assert "placement group 1: 2 bundle(s) need CPU=0.1 on one node" in message, message


@pytest.mark.parametrize("exc, code", [(NoCapacityError("no node"), EXIT_NO_CAPACITY),
                                       (RecoveryError("budget spent"), EXIT_RECOVERY)])
def test_no_capacity_has_its_own_exit_code(exc, code):
    assert exit_code(exc) == code and EXIT_NO_CAPACITY == 75
