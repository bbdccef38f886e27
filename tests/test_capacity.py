"""Whether a lost node's placement group can be placed again (runtime/capacity.py), and the exit
code of a run stopped for want of capacity."""

from __future__ import annotations

import pytest

from resilient_rl.cli import EXIT_NO_CAPACITY, EXIT_RECOVERY, exit_code
from resilient_rl.errors import NoCapacityError, RecoveryError
from resilient_rl.runtime.capacity import shortfall

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


@pytest.mark.parametrize("exc, code", [(NoCapacityError("no node"), EXIT_NO_CAPACITY),
                                       (RecoveryError("budget spent"), EXIT_RECOVERY)])
def test_no_capacity_has_its_own_exit_code(exc, code):
    assert exit_code(exc) == code and EXIT_NO_CAPACITY == 75
