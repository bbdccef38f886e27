"""``trainer.deterministic``: the same step gives the same bits on a GPU too.

On CPU a step is already bit-identical run after run: one intra-op thread per worker and seeded
RNG fix the order of every reduction. On a GPU, some kernels are not: cuBLAS splits reductions
by workspace and stream, atomics-based kernels (``index_add``, scatter, some backward passes)
add in arrival order, and cuDNN autotuning may pick a different algorithm per process. So a
replayed step after a recovery, or a re-run of a run, can differ in the last bits.

:func:`apply_deterministic` turns that off in a worker process before it touches CUDA:
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reads it when its first handle is created, so it must
be set before the first CUDA call), ``torch.use_deterministic_algorithms(True)`` (an op without a
deterministic kernel raises instead of silently differing), cuDNN deterministic and no
benchmarking. It costs speed: deterministic kernels are slower, and cuBLAS keeps a larger
workspace per stream.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

#: The cuBLAS workspace setting documented by NVIDIA and PyTorch for reproducible GEMMs.
CUBLAS_WORKSPACE = ":4096:8"
CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"


def apply_deterministic(enabled: bool) -> bool:
    """Make this process's kernels deterministic when ``enabled``; returns whether it did.

    Call it before the process initialises CUDA (a worker's constructor): once cuBLAS has a
    handle, the workspace setting no longer applies, which is logged."""
    if not enabled:
        return False
    if os.environ.get(CUBLAS_ENV) not in (CUBLAS_WORKSPACE, ":16:8"):
        if torch.cuda.is_initialized():  # does not itself initialise CUDA
            logger.warning("trainer.deterministic: CUDA was initialised before %s could be set; cuBLAS may "
                           "still be non-deterministic in this process", CUBLAS_ENV)
        os.environ[CUBLAS_ENV] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return True
