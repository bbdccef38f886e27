"""Keeping the traced decode step with its compiled code, so that a new process skips tracing too.

A process that compiles the decode step again, with every kernel in its compile cache, still
traces the step from scratch: dynamo keeps no guards across processes. For 8 narrow layers on a
2-core CPU that tracing was 4.8 s of 8.2 s; on a GPU it is the host's share of every restart of a
rollout process.

torch's caching precompile (``torch._dynamo.config.caching_precompile``, experimental in torch
2.13) keeps it: while it is on, a compile records dynamo's traced bytecode and guards beside the
compiled code (a package); ``torch.compiler.save_cache_artifacts`` writes the package into the
local compile cache (``<inductor cache dir>/dynamo``) and into the artifacts it returns, and
``torch.compiler.load_cache_artifacts`` puts a saved one there. A later ``torch.compile`` of the
same function (by qualified name and first line; :func:`per_model` gives the decode step one name per
model) loads the package, refuses it when a source it
inlined has changed since, and runs its guards against the inputs instead of tracing; a guard that
fails compiles anew, as without it.

Guards that name an object by its identity (a function, module or class the traced code reached)
cannot hold in another process, and torch drops them, warning once per guard (over a hundred for
one decoder model): :func:`precompiling` counts those warnings instead of logging them. The
types, tensor shapes, dtypes, devices and constants the step read are still checked. It is turned
on only around the rollout engine's decode step, whose process runs one model, by the run's
compile cache (:mod:`resilient_rl.workers.compile_cache`; ``rollout.precompile``).
"""

from __future__ import annotations

import hashlib
import logging
import types
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import torch

__all__ = ["DROPPED_GUARDS", "per_model", "precompiling"]

#: Identity guards torch dropped while precompiling in this process, by kind (``CLOSURE_MATCH``...).
DROPPED_GUARDS: Counter = Counter()

_DROPPED = " is dropped with caching_precompile"


class _DroppedGuards(logging.Filter):
    """Counts torch's warning for each identity guard it drops, and keeps it out of the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _DROPPED not in str(record.msg):
            return True
        DROPPED_GUARDS[str(record.args[0]) if record.args else "guard"] += 1
        return False


_FILTER = _DroppedGuards()


@contextmanager
def precompiling(on: bool = True):
    """Compile (and save or load compiler artifacts) with torch's caching precompile on, when ``on``."""
    if not on:
        yield
        return
    logger = logging.getLogger("torch._dynamo.guards")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    with torch._dynamo.config.patch(caching_precompile=True):
        yield


def per_model(fn: Callable, model: torch.nn.Module) -> Callable:
    """``fn`` under a qualified name of its own for ``model``'s class and parameter shapes: the
    name keys the kept package, so models that differ keep apart packages (in one package every
    model's guards would pile up towards the compiler's recompile limit), and a run of the same
    model on the node finds the one its previous run kept."""
    shapes = [(name, tuple(p.shape), str(p.dtype), p.device.type) for name, p in model.named_parameters()]
    tag = hashlib.sha256(repr((type(model).__module__, type(model).__qualname__, shapes)).encode()).hexdigest()[:16]
    named = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    named.__qualname__ = f"{fn.__qualname__}.{tag}"
    return named
