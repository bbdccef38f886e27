"""``recovery.spares=auto``: one warm spare per node of each worker group where this node's host
memory and cores allow, one for the largest group where the ranks take every core
(runtime/spare_sizing.py)."""

from __future__ import annotations

from resilient_rl.config import load_config
from resilient_rl.runtime.spare_sizing import SPARE_HOST_BYTES, decide

GIB = 1 << 30


def test_auto_keeps_one_spare_per_node_of_each_group_where_memory_and_cores_allow():
    d = decide("auto", {"main": 2, "rollout": 1}, available_bytes=64 * GIB, cores=96, ranks_here={"main": 8})
    assert d.per_group == {"main": 2, "rollout": 1}
    assert d.line.startswith("recovery.spares=auto: one warm spare per node") and "64.0 GiB available" in d.line


def test_auto_keeps_none_where_host_memory_is_short():
    d = decide("auto", {"main": 1}, available_bytes=SPARE_HOST_BYTES, cores=96, ranks_here={"main": 8})
    assert d.per_group == {"main": 0} and "host memory" in d.line


def test_auto_keeps_one_spare_for_the_largest_group_where_the_ranks_take_every_core():
    d = decide("auto", {"actor": 1, "critic": 1, "rollout": 1, "ref": 1}, available_bytes=20 * GIB, cores=2,
               ranks_here={"actor": 2, "critic": 1, "rollout": 1, "ref": 1})
    assert d.per_group == {"actor": 1, "critic": 0, "rollout": 0, "ref": 0}
    assert "one warm spare, for actor" in d.line and "2 core(s)" in d.line and "5 process(es)" in d.line
    # The default run on a 2-core laptop: one group of colocated roles, two ranks.
    one = decide("auto", {"main": 1}, 20 * GIB, cores=2, ranks_here={"main": 2})
    assert one.per_group == {"main": 1} and "one warm spare, for main: " in one.line and "another group" not in one.line
    # Even that one needs its memory.
    assert decide("auto", {"main": 1}, SPARE_HOST_BYTES, cores=2, ranks_here={"main": 2}).per_group == {"main": 0}


def test_a_head_without_ranks_is_not_judged_by_its_cores():
    assert decide("auto", {"main": 2}, available_bytes=20 * GIB, cores=2, ranks_here={}).per_group == {"main": 2}


def test_an_explicit_count_is_kept_and_auto_is_the_default():
    assert decide(1, {"main": 3}, available_bytes=0).per_group == {"main": 1}
    assert decide(0, {"main": 3}, available_bytes=None).line == "recovery.spares=0: no warm spares"
    assert load_config(None, []).recovery.spares == "auto"
