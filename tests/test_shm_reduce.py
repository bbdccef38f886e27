"""Averaging replicas' gradients through shared memory (workers/shm_reduce.py) and the pipe barrier
it waits at (workers/pipe_barrier.py): real processes in a real gloo group, real pipes."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resilient_rl.errors import CollectiveError
from resilient_rl.testing.monitoring import free_port
from resilient_rl.workers.pipe_barrier import PipeBarrier, create_fifos

ROUNDS = 5  # more than the two sets of slots: each is reused


def _grads(rank: int, round_: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    return [torch.randn(3, 4, generator=g), torch.randn(3, generator=g)]


def _rank(rank: int, world: int, port: int, shm_dirs: list[str], mode: str, out) -> None:
    from resilient_rl.workers import fsdp, shm_reduce

    torch.set_num_threads(1)
    shm_reduce.SHM_DIR = shm_dirs[rank]  # a rank given another directory stands for another host
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        model = torch.nn.Linear(4, 3)  # a [3, 4] weight and a [3] bias, the shapes of _grads
        params = list(model.parameters())
        results = []
        for r in range(ROUNDS if mode != "peer_dies" else 1):
            for p, g in zip(params, _grads(rank, r)):
                p.grad = g.clone()
            fsdp.all_reduce_gradients(model)
            # Plain lists: a tensor put on the queue lives in its sender's shared memory, gone with it.
            results.append([p.grad.tolist() for p in params])
        reducer = fsdp._REDUCERS.get(15, torch.float32)
        out.put((rank, "ok", results, reducer is not None))
        if mode == "peer_dies":
            if rank == 1:
                out.close()
                out.join_thread()
                os._exit(0)  # gone without a word, as a SIGKILLed rank
            t0 = time.monotonic()
            try:
                fsdp.all_reduce_gradients(model)
                out.put((rank, "no error", None, time.monotonic() - t0))
            except CollectiveError as exc:
                out.put((rank, str(exc), None, time.monotonic() - t0))
    finally:
        if mode != "peer_dies" or rank == 0:
            dist.destroy_process_group()


def _tensors(results: list) -> list[list[torch.Tensor]]:
    return [[torch.tensor(t) for t in r] for r in results]


def _run(world: int, shm_dirs: list[str], mode: str = "average") -> list[tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, shm_dirs, mode, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        n = world + (1 if mode == "peer_dies" else 0)
        return [out.get(timeout=120) for _ in range(n)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _expected(world: int) -> list[list[torch.Tensor]]:
    return [[sum(_grads(rank, r)[i] for rank in range(world)) / world for i in range(2)] for r in range(ROUNDS)]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_on_one_host_average_through_shared_memory(tmp_path, world):
    replies = {rank: (_tensors(results), shared) for rank, _, results, shared in _run(world, [str(tmp_path)] * world)}
    assert all(shared for _, shared in replies.values())  # the shared-memory path served every rank
    for r, want in enumerate(_expected(world)):
        for rank in range(world):
            for got, w in zip(replies[rank][0][r], want):
                assert torch.allclose(got, w, atol=1e-6)
            # Every rank holds the same bits: the replicas stay identical.
            assert all(torch.equal(a, b) for a, b in zip(replies[rank][0][r], replies[0][0][r]))
    assert os.listdir(tmp_path) == []  # the segment and the pipes went once every rank had them open


def test_a_rank_that_cannot_see_the_segment_sends_the_group_to_all_reduce(tmp_path):
    dirs = [str(tmp_path / "host0"), str(tmp_path / "host1")]
    for d in dirs:
        os.makedirs(d)
    replies = {rank: (_tensors(results), shared) for rank, _, results, shared in _run(2, dirs)}
    assert not any(shared for _, shared in replies.values())
    for r, want in enumerate(_expected(2)):
        for rank in range(2):
            for got, w in zip(replies[rank][0][r], want):
                assert torch.allclose(got, w, atol=1e-6)
    assert os.listdir(dirs[0]) == [] and os.listdir(dirs[1]) == []


def test_a_peer_that_dies_is_named_at_once_not_after_the_timeout(tmp_path):
    replies = _run(2, [str(tmp_path)] * 2, mode="peer_dies")
    assert all(shared for _, status, _, shared in replies if status == "ok")
    (_, message, _, seconds), = [r for r in replies if r[1] != "ok"]
    assert "rank 1 left the group" in message
    assert seconds < 60  # the group's timeout is torch's default (30 min)


# ---------------------------------------------------------------- the pipe barrier in one process
def _barriers(tmp_path, world: int, timeout_s: float = 5.0) -> list[PipeBarrier]:
    prefix = str(tmp_path / "b")
    create_fifos(prefix, world)
    barriers = [PipeBarrier(prefix, r, world, timeout_s) for r in range(world)]
    assert all(b.open_readers() for b in barriers)
    assert all(b.open_writers() for b in barriers)
    return barriers


def test_pipe_barrier_releases_every_rank_once_all_arrive(tmp_path):
    barriers = _barriers(tmp_path, 3)
    order: list[tuple[int, int]] = []

    def rank(b: PipeBarrier) -> None:
        for round_ in range(4):
            time.sleep(0.01 * b.rank)  # arrivals in a different order each rank
            order.append((round_, b.rank))
            b.wait()

    threads = [threading.Thread(target=rank, args=(b,)) for b in barriers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [r for r, _ in order] == sorted(r for r, _ in order)  # nobody started round k+1 before all arrived at k
    for b in barriers:
        b.close()


def test_pipe_barrier_names_a_peer_that_never_arrives(tmp_path):
    b0, b1 = _barriers(tmp_path, 2, timeout_s=0.2)
    with pytest.raises(CollectiveError, match=r"rank\(s\) \[1\] did not arrive within 0.2s"):
        b0.wait()
    b0.close()
    b1.close()


def test_pipe_barrier_names_a_peer_whose_process_ended(tmp_path):
    b0, b1 = _barriers(tmp_path, 2)
    b1.close()  # what the kernel does to a dead process's pipes
    with pytest.raises(CollectiveError, match="rank 1 left the group"):
        b0.wait()
    b0.close()


def test_a_missing_pipe_fails_the_open_not_the_run(tmp_path):
    assert not PipeBarrier(str(tmp_path / "none"), 0, 2, 1.0).open_readers()
