"""A device that runs out of memory, for a CPU test: a Ray worker setup hook
(``runtime_env={"worker_process_setup_hook": ...}``) after which the processes of the cluster's
workers raise ``torch.OutOfMemoryError`` where a GPU would, with CUDA's message."""

from __future__ import annotations

import torch

#: CUDA's message (torch 2.11 on an 80 GB device), as an update pass planned too large meets it.
CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 18.55 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "3.12 GiB is free. Including non-PyTorch memory, this process has 76.05 GiB memory in use. Of the "
                "allocated memory 70.21 GiB is allocated by PyTorch, and 4.93 GiB is reserved by PyTorch but "
                "unallocated.")


def actor_updates_run_out_of_memory() -> None:
    """Every policy update of this process raises ``torch.OutOfMemoryError`` at its start."""
    from resilient_rl.workers.policy import PolicyEngine

    def update(self, data, step):
        raise torch.OutOfMemoryError(CUDA_MESSAGE)

    PolicyEngine.update = update
