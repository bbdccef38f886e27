"""A GPU that a killed rank's process still holds, for a CPU test of
:mod:`resilient_rl.workers.held_memory`.

A Ray worker setup hook (``runtime_env={"worker_process_setup_hook": ...}``, with the path of a
file in ``$RRL_TEST_HELD_MEMORY``): when a test kills rank ``R`` it names the rank in that file
(:func:`hold`). A process serving rank ``R`` then reads its device as CUDA would show an 80 GiB GPU
with 76 GiB held by another process, and its model builds raise ``torch.OutOfMemoryError`` with
CUDA's message, until ``seconds`` after the first build it refused: then the memory is free.
Each refused and each completed build is appended to ``<file>.log`` as ``refused R`` or
``built R``. Only the device's memory and the allocation failure are faked: the builds, the
recovery and the wait around them are the real ones.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

ENV = "RRL_TEST_HELD_MEMORY"
GIB = 2**30
TOTAL = 80 * GIB
HELD = 76 * GIB

#: CUDA's message as a build on a GPU another process fills meets it.
CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 1.86 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "3.25 GiB is free. Process 4711 has 75.94 GiB memory in use. Including non-PyTorch memory, this "
                "process has 512.00 MiB memory in use.")


def hold(path: str | Path, rank: int, seconds: float, until: float | None = None) -> None:
    """Rank ``rank``'s GPU is held by its dead process until ``seconds`` after the first build it
    refuses (``until``: that time, once known)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"rank": rank, "seconds": seconds, "until": until}))
    os.replace(tmp, path)


def builds(path: str | Path) -> list[str]:
    """The log of refused and completed builds (``refused R``, ``built R``), in order."""
    log = Path(f"{path}.log")
    return log.read_text().split("\n")[:-1] if log.exists() else []


def _held_here(refusing: bool = False) -> int | None:
    """This process's rank when its GPU is held now, else None; ``refusing``: a build is about to
    be refused (the first one starts the clock of the release)."""
    try:
        state = json.loads(Path(os.environ[ENV]).read_text())
    except (KeyError, OSError, ValueError):
        return None
    rank = int(os.environ.get("RANK", "-1"))
    if rank != state["rank"] or (state["until"] is not None and time.time() >= state["until"]):
        return None
    if refusing and state["until"] is None:
        hold(os.environ[ENV], rank, state["seconds"], until=time.time() + state["seconds"])
    return rank


def _note(line: str) -> None:
    with open(f"{os.environ[ENV]}.log", "a") as f:
        f.write(line + "\n")


def dead_rank_holds_its_gpu() -> None:
    """The setup hook (see the module docs)."""
    from resilient_rl.workers import held_memory
    from resilient_rl.workers.policy import PolicyEngine
    from resilient_rl.workers.rollout import RolloutEngine
    from resilient_rl.workers.value import ValueEngine

    def reading(device):
        held = _held_here() is not None
        return held_memory.DeviceMemory(free=TOTAL - HELD - GIB // 2 if held else TOTAL - GIB // 2, total=TOTAL,
                                        reserved=0)

    held_memory.device_memory = reading

    for cls in (PolicyEngine, RolloutEngine, ValueEngine):
        def init(self, *args, _init=cls.__init__, **kwargs):
            rank = _held_here(refusing=True)
            if rank is not None:
                _note(f"refused {rank}")
                raise torch.OutOfMemoryError(CUDA_MESSAGE)
            _init(self, *args, **kwargs)
            _note(f"built {os.environ.get('RANK', '-1')}")

        cls.__init__ = init
