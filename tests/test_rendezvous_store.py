"""The rendezvous store of a process-group generation (``controller/rendezvous.py``), in threads
of one process: ranks that arrive before rank 0 hosts the store wait for it and join, a called-off
generation ends the wait of every rank still there, and a generation whose peer never comes times out."""

from __future__ import annotations

import threading
import time

import pytest

from resilient_rl.runtime import rendezvous
from resilient_rl.errors import CollectiveError
from resilient_rl.runtime.master_env import free_port


def _join_all(generation: int, world: int, port: int, host_delay_s: float, timeout_s: float = 20.0):
    """Each rank of ``world`` joins in a thread of its own, rank 0 after ``host_delay_s``; rank -> result."""
    results: dict[int, object] = {}

    def join(rank: int) -> None:
        if rank == 0:
            time.sleep(host_delay_s)
        try:
            results[rank] = rendezvous.join_store(generation, "127.0.0.1", port, rank, world, timeout_s)
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    return threads, results


def test_ranks_that_arrive_before_rank_0_hosts_the_store_join_it():
    threads, results = _join_all(generation=101, world=3, port=free_port("127.0.0.1"), host_delay_s=0.3)
    for t in threads:
        t.join(30)
    stores = [results[r] for r in range(3)]
    assert not [s for s in stores if isinstance(s, Exception)], stores
    stores[1].set("from-rank-1", b"hello")
    assert stores[0].get("from-rank-1") == b"hello" and stores[2].add("rrl/arrived", 0) == 3


def test_a_called_off_generation_ends_the_wait_for_a_peer_that_never_comes(monkeypatch):
    monkeypatch.setitem(rendezvous._CALLED_OFF, "generation", -1)  # put back after the test
    # Rank 2 never comes: ranks 0 and 1 wait in the store until the generation is called off.
    port = free_port("127.0.0.1")
    results: dict[int, object] = {}

    def join(rank: int) -> None:
        try:
            results[rank] = rendezvous.join_store(102, "127.0.0.1", port, rank, 3, timeout_s=60.0)
        except CollectiveError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert not results, "nobody may pass the barrier without rank 2"
    rendezvous.call_off(102)
    for t in threads:
        t.join(10)
    assert all(isinstance(results[r], CollectiveError) and "called off" in str(results[r]) for r in (0, 1)), results


def test_a_rank_whose_store_never_appears_times_out_with_the_address():
    with pytest.raises(CollectiveError, match=r"timed out .* rank 0's store at 127\.0\.0\.1"):
        rendezvous.join_store(103, "127.0.0.1", free_port("127.0.0.1"), 1, 2, timeout_s=0.5)
