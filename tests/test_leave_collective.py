"""A rank dies inside a gloo all-reduce: every survivor leaves the collective while the others
are still alive, instead of one waiting out the group's timeout (runtime/leave_collective.py).

Four gloo ranks in spawned processes; rank 3 exits while ranks 0-2 are inside an all-reduce
called through a ``@register``-ed method (the path of every worker call). Each survivor, once
its call has raised, marks itself done and keeps its process (and sockets) alive until every
survivor is done or ``hold_s`` passes, as a Ray worker does: its process lives on after a
failed call. Without leaving, a survivor that only exchanges bytes with live peers stays blocked
until those exit (the premise, checked with the cascade switched off).
"""

from __future__ import annotations

import pytest

from resilient_rl.testing.ranks import run_ranks

WORLD = 4


def _rank(rank: int, port: int, out, done, hold_s: float, cascade: bool) -> None:
    import os
    import time

    import torch
    import torch.distributed as dist

    from resilient_rl.runtime import dispatch, leave_collective
    from resilient_rl.testing.ranks import join_gloo

    with leave_collective.recording():
        join_gloo(rank, port, WORLD)
    t = torch.ones(1 << 18)
    dist.all_reduce(t)  # every pair connected
    if rank == WORLD - 1:
        out.put((rank, leave_collective.owned(), None))
        out.close()
        out.join_thread()
        time.sleep(1.0)
        os._exit(9)  # dies while its peers are inside the next all-reduce
    if not cascade:
        dispatch.leave_collective.leave_collectives = lambda reason="": 0

    class Ranked:
        @dispatch.register()
        def reduce(self):
            dist.all_reduce(t)

    try:
        Ranked().reduce()
        error = None
    except Exception as exc:  # noqa: BLE001 -- the peer's death
        error = type(exc).__name__
    done[rank].set()
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline and not all(e.is_set() for e in done[:WORLD - 1]):
        time.sleep(0.01)
    out.put((rank, all(e.is_set() for e in done[:WORLD - 1]), error))
    out.close()
    out.join_thread()  # the result is sent before the process ends without tearing the group down
    os._exit(0)


def _run(cascade: bool, hold_s: float) -> dict:
    import torch.multiprocessing as mp

    done = [mp.get_context("spawn").Event() for _ in range(WORLD)]
    return run_ranks(_rank, WORLD, args=(done, hold_s, cascade), timeout_s=120)


def test_every_survivor_leaves_while_the_others_are_alive():
    results = _run(cascade=True, hold_s=60.0)
    assert results[WORLD - 1][0] >= WORLD - 1, "the dying rank's group connections were recorded"
    for rank in range(WORLD - 1):
        all_done, error = results[rank]
        assert error == "CollectiveError", f"rank {rank}'s all-reduce raised, typed where torch raised it: {error}"
        assert all_done, f"rank {rank}: every survivor left the collective while the others were alive"


@pytest.mark.slow
def test_without_leaving_a_survivor_waits_for_its_live_peers():
    """The premise: with the cascade off, some survivor is still blocked when ``hold_s`` ends."""
    results = _run(cascade=False, hold_s=3.0)
    assert not all(results[rank][0] for rank in range(WORLD - 1)), results


def _channel_rank(rank: int, port: int, out, ready, done) -> None:
    """A weight channel of two ranks (actor rank 0, one rollout rank); the rollout rank waits in a
    bucket's broadcast, and actor rank 0 leaves its collectives, as it does when told to or when its
    own group's collective failed mid-sync, then stays alive (as a Ray worker does) for a while."""
    import os
    import time

    import torch

    from resilient_rl.runtime import leave_collective
    from resilient_rl.workers import weight_channel

    torch.set_num_threads(1)
    weight_channel.join(1, "127.0.0.1", port, rank, 2, "gloo", timeout_s=600.0)  # a wait no test outlasts
    if rank == 1:
        ready.set()
        try:
            weight_channel._broadcast(torch.empty(1 << 10))
            error = None
        except Exception as exc:  # noqa: BLE001 -- the channel ended
            error = type(exc).__name__
        done.set()
        out.put((rank, error))
    else:
        ready.wait(60)
        time.sleep(0.5)  # the rollout rank inside its broadcast
        closed = leave_collective.leave_collectives("a peer of the actor died")
        out.put((rank, closed, done.wait(30)))  # whether the rollout rank raised while this one lived
    out.close()
    out.join_thread()
    os._exit(0)


def test_leaving_ends_the_weight_channel_s_waits_too():
    """The channel between actor rank 0 and the rollout is a group of its own: a process leaving
    its collectives ends it too, so the other side of a sync raises at once instead of waiting out
    the channel's timeout (NCCL channels are aborted the same way)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = run_ranks(_channel_rank, 2, args=(ctx.Event(), ctx.Event()), timeout_s=120)
    closed, raised_while_alive = results[0]
    assert closed >= 1, "actor rank 0 shut the channel's connections down"
    assert raised_while_alive and results[1] == ("CollectiveError",), results


def test_a_process_has_left_until_it_joins_again_each_group_on_its_own():
    """What a rank's health reply says after leaving (``WorkerInfo.left``): recovery rejoins the
    worker group of every process that left, whichever group's failure it left for. Joining one
    group again (the process group's rendezvous, a new weight channel) clears only that group."""
    import socket

    from resilient_rl.runtime import leave_collective
    from resilient_rl.workers.weight_channel import CHANNEL

    leave_collective.forget()  # what other tests of this process left behind
    server = socket.create_server(("127.0.0.1", 0))
    peers = []
    try:
        assert not leave_collective.has_left()
        assert leave_collective.leave_collectives("nothing joined") == 0
        assert not leave_collective.has_left(), "a process with no group has nothing to leave"
        for group in (leave_collective.PROCESS_GROUP, CHANNEL):
            with leave_collective.recording(group):
                client = socket.create_connection(server.getsockname())
            peers += [client, server.accept()[0]]
        assert leave_collective.owned() == 2
        assert leave_collective.leave_collectives("a peer died") == 2
        assert leave_collective.has_left()
        leave_collective.forget(leave_collective.PROCESS_GROUP)  # its rendezvous: the channel is still left
        assert leave_collective.has_left() and leave_collective.owned() == 1
        leave_collective.forget(CHANNEL)
        assert not leave_collective.has_left() and leave_collective.owned() == 0

        leave_collective.abort_on_leave(CHANNEL, lambda: None)  # an NCCL channel: no socket of its own
        try:
            leave_collective.leave_collectives("a peer died")
            assert leave_collective.has_left()
        finally:
            leave_collective.abort_on_leave(CHANNEL, None)
            leave_collective.forget()
        assert not leave_collective.has_left()
    finally:
        for s in peers + [server]:
            s.close()
