"""A compiled function that falls back to its eager form for the rest of the process when the
compiler fails, so that a compiler error costs no step: the eager values are as correct; and how
many versions of a compiled function the compiler keeps before it would run it eagerly unasked."""

from __future__ import annotations

import logging

import torch

__all__ = ["allow_recompiles", "compiled_or_eager"]


def compiled_or_eager(failure: dict[str, str | None], log: logging.Logger, what: str, setting: str, compiled, eager,
                      *args):
    """``compiled(*args)`` while ``failure["reason"]`` is None; at a compiler failure (at a graph's
    first call) record why in ``failure``, warn once on ``log`` (``what`` failed; ``setting``=false
    skips the compile) and return ``eager(*args)``, as every later call does. Only the compiler's
    own errors are caught: an out-of-memory error passes through."""
    if failure["reason"] is None:
        try:
            return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # inductor's and Triton's errors too
            failure["reason"] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("%s failed (%s); this process runs them eagerly from now on (%s=false skips the compile)",
                        what, failure["reason"], setting)
    return eager(*args)


def allow_recompiles(count: int) -> None:
    """Let the compiler keep ``count`` versions of each compiled function (its default is 8) before
    it gives up and runs the function eagerly, which it does without an error: a silent slowdown."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), count))
            return
