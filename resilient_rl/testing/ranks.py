"""Ranks as spawned processes for tests of collectives (gloo on CPU), without Ray.

:func:`run_ranks` starts ``world`` processes running ``target(rank, port, out, *args)`` (``port``
free on the loopback for the rank-0 store, ``out`` a queue); each puts one tuple whose first item
is its rank. Returns ``{rank: the rest of its tuple}`` once every rank has reported, and ends every
process either way (a rank that hangs is killed).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["join_gloo", "run_ranks"]


def run_ranks(target: Callable[..., None], world: int, args: tuple = (), timeout_s: float = 180.0) -> dict[int, Any]:
    import torch.multiprocessing as mp

    from resilient_rl.runtime.master_env import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=target, args=(rank, port, out, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return {r[0]: r[1:] for r in (out.get(timeout=timeout_s) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def join_gloo(rank: int, port: int, world: int, local_world: int | None = None) -> None:
    """In a spawned rank: the environment the worker group sets for a rank of ``world`` ranks,
    ``local_world`` to a node (``resilient_rl.runtime.worker_group``), one CPU thread, and the
    default gloo group over a TCP store on ``port`` (hosted by rank 0)."""
    import os

    import torch
    import torch.distributed as dist

    local = local_world or world
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local),
                      LOCAL_WORLD_SIZE=str(local))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
