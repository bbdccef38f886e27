"""Liveness on a local Ray cluster: a long call that advances is healthy, a rank that stops
advancing or is SIGSTOPped is named, and killing a stalled rank frees its peer from the collective."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import cloudpickle
import pytest
import ray
import torch
import torch.distributed as dist

from resilient_rl import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register
from resilient_rl.runtime import progress
from resilient_rl.runtime.health import HEALTH_GROUPS, process_gone, replaced
from resilient_rl.errors import CollectiveError, WorkerError, WorkerTimeoutError
from resilient_rl.runtime import health

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.ray

HANG_S = 3.0
HEALTH_S = 1.5


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class LoopWorker(Worker):
    answers_during_calls = True

    def __init__(self):
        super().__init__()
        self.released = threading.Event()

    @ray.method(concurrency_group="health")
    def health(self):
        return self.ping()

    @ray.method(concurrency_group="health")
    def call_off_rendezvous(self, generation: int) -> None:
        super().call_off_rendezvous(generation)

    @ray.method(concurrency_group="health")
    def release(self):
        """End a stalled loop (from the health thread, since the main one is busy in it)."""
        self.released.set()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def work(self, seconds: float, tick_s: float, stall_rank: int = -1):
        """Loop for ``seconds`` (or until released), advancing every ``tick_s``; ``stall_rank`` never advances."""
        self.released.clear()
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.released.is_set():
            time.sleep(tick_s)
            if self.rank != stall_rank:
                progress.advance("tick")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stall_or_reduce(self, stall_rank: int):
        """``stall_rank`` stops advancing (an endless loop); the others advance, then wait for it in a collective."""
        if self.rank == stall_rank:
            self.released.clear()
            while not self.released.wait(0.2):
                pass
            return self.rank
        # Advance well after the stalled rank entered its call (the two calls may start a good
        # fraction of a second apart on a loaded machine), so the stalled rank is the one that
        # stopped first, as in a real stall; still well inside the hang timeout.
        time.sleep(1.5)
        progress.advance("before collective")
        t = torch.ones(1)
        try:
            dist.all_reduce(t)
        except Exception as exc:
            raise CollectiveError(f"rank {self.rank}: {exc}", rank=self.rank, cause="collective") from exc
        return self.rank


def make_group(prefix: str, **kw) -> RayWorkerGroup:
    pool = RayResourcePool([2], use_gpu=False, name_prefix=prefix, cpus_per_bundle=0.1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(LoopWorker), hang_timeout_s=HANG_S, health_timeout_s=HEALTH_S,
                          **kw)


@pytest.fixture(scope="module")
def group(ray_cluster):
    wg = make_group("live", call_timeout_s=60)
    try:
        yield wg
    finally:
        wg.shutdown()


def test_a_long_call_that_keeps_advancing_is_not_a_hang(group):
    # Twice the hang timeout in total; no gap between advances comes near it.
    assert group.work(2.5 * HANG_S, 0.25) == [0, 1]
    info = group.ping()
    assert all(i.call is None and i.advances > 0 for i in info)


def test_the_ceiling_still_bounds_a_whole_call(ray_cluster):
    wg = make_group("ceiling", call_timeout_s=2.0)
    try:
        with pytest.raises(WorkerTimeoutError) as err:
            wg.work(4.0, 0.2)
        assert err.value.cause == "timeout"
        assert "rank(s) [0, 1] did not finish within the 2s ceiling" in str(err.value), err.value
    finally:
        wg.shutdown()


def test_a_rank_that_stops_advancing_is_named(group):
    refs = group.execute_all_async("work", 30.0, 0.2, 1)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerTimeoutError) as err:
            group.get(refs)
        waited = time.monotonic() - t0
        print(f"stalled rank detected after {waited:.1f}s (hang_timeout_s={HANG_S:g})")
        assert err.value.cause == "hang" and err.value.hang_kind == "stalled" and err.value.rank == 1
        assert err.value.pid == ray.get(group.workers[1].health.remote(), timeout=10).pid
        assert "'work'" in str(err.value) and "hang_timeout_s" in str(err.value)
        # Liveness, not the end of the call, ended the wait: both 30 s loops are still running.
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        assert ready == [], "the wait ended only when the call did"
    finally:
        ray.get([w.release.remote() for w in group.workers], timeout=30)
        assert ray.get(refs, timeout=60) == [0, 1]  # both loops end; the group is idle again


def test_killing_a_stalled_rank_frees_its_peer_for_the_next_rendezvous(ray_cluster):
    wg = make_group("stallpeer", call_timeout_s=60, max_restarts=1)
    try:
        wg.init_process_group(generation=1, backend="gloo", timeout_s=20, collective_timeout_s=120)
        infos = wg.ping()
        pids = [i.pid for i in infos]
        refs = wg.execute_all_async("stall_or_reduce", 1)
        with pytest.raises(WorkerTimeoutError) as err:
            wg.get(refs)
        # Rank 0 waits in the collective and stops advancing too, but rank 1 stopped first.
        assert err.value.rank == 1 and err.value.hang_kind == "stalled" and err.value.pid == pids[1]
        health.kill_rank(wg, 1, pids[1], infos[1].node_id)
        # The survivor's collective fails at once (not after the group's 120 s timeout), so the
        # rendezvous of the next generation does not queue behind its call.
        with pytest.raises(WorkerError) as peer:
            wg.get([refs[0]], timeout_s=30)
        assert peer.value.cause in ("collective", "exception")
        health.wait_alive(wg, 60)
        # The old process is gone, but the rank is not: Ray runs it in a new process, whose
        # answer a probe waits for (it is not reported dead).
        assert process_gone(pids[1], infos[1].node_id) and replaced(wg.workers[1], pids[1])
        assert not replaced(wg.workers[0], pids[0])
        probe = health.probe(wg, timeout_s=10, gone=lambda rank: process_gone(pids[rank], infos[rank].node_id)
                         and not replaced(wg.workers[rank], pids[rank]))
        assert probe[1].pid != pids[1]
        wg.init_process_group(generation=2, backend="gloo", timeout_s=20)
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
        assert wg.ping()[1].pid != pids[1]
    finally:
        wg.shutdown()


def test_a_rendezvous_a_peer_never_joins_is_called_off_and_the_next_one_forms(ray_cluster):
    wg = make_group("calloff", call_timeout_s=60)
    try:
        addr, port = ray.get(wg.workers[0].get_master_addr_port.remote(), timeout=30)
        waiting = wg.workers[0].rendezvous.remote(5, addr, port, "gloo", 120.0)  # rank 1 never comes
        assert ray.wait([waiting], timeout=1.0)[0] == [], "rank 0 waits for its peer"
        t0 = time.monotonic()
        wg.call_off_rendezvous(5)
        with pytest.raises(ray.exceptions.RayTaskError, match="called off"):
            ray.get(waiting, timeout=30)
        assert time.monotonic() - t0 < 20.0  # not the rendezvous' 120 s
        # The rank is free again: the next generation forms at once (it does not queue behind).
        assert wg.init_process_group(generation=6, backend="gloo", timeout_s=20) == 6
        assert wg.all_reduce_check(1.0) == [3.0, 3.0]
    finally:
        wg.shutdown()


def test_a_sigstopped_rank_is_named(ray_cluster):
    wg = make_group("sigstop", call_timeout_s=60)
    stopped = None
    try:
        # Stopped once started up: a process still importing at start gets recovery.warmup_timeout_s.
        ray.get([w.warmed_up.remote() for w in wg.workers])
        pid = wg.ping()[1].pid
        refs = wg.execute_all_async("work", 30.0, 0.2)
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)
        stopped = pid
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as err:
            wg.get(refs)
        print(f"stopped rank detected after {time.monotonic() - t0:.1f}s (health_timeout_s={HEALTH_S:g})")
        assert err.value.cause == "hang" and err.value.hang_kind == "unresponsive" and err.value.rank == 1
        assert "health_timeout_s" in str(err.value)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
            os.kill(stopped, signal.SIGKILL)
        wg.shutdown()


def test_a_rank_heard_of_only_while_starting_up_is_asked_again(ray_cluster):
    """The group's first ping finds its processes starting up, and calls shorter than the poll
    interval end before any health call: the waits ask those ranks whether they still are, so a
    stop after start-up is judged by ``health_timeout_s``, not by the start-up allowance or the
    call's ceiling."""
    wg = make_group("stale", call_timeout_s=20, warmup_timeout_s=60)
    stopped = None
    try:
        ray.get([w.warmed_up.remote() for w in wg.workers])  # not through the group: it still holds "starting"
        assert wg.ranks.is_warming(1)
        for _ in range(3):
            wg.work(0.05, 0.01)  # short calls
        assert not any(wg.ranks.is_warming(r) for r in range(wg.world_size))
        pid = ray.get(wg.workers[1].ping.remote()).pid  # not through the group
        refs = wg.execute_all_async("work", 30.0, 0.2)
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)
        stopped = pid
        with pytest.raises(WorkerTimeoutError) as err:
            wg.get(refs)
        assert err.value.cause == "hang" and err.value.rank == 1 and "health_timeout_s" in str(err.value)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
            os.kill(stopped, signal.SIGKILL)
        wg.shutdown()
