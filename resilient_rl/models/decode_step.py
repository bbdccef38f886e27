"""The rollout engine's decode step, compiled once per process, and what it costs.

:func:`decode` is one step of the engine: a plain function of its inputs (the model and the cache
buffers among them), so one compiled version serves every call. :class:`DecodeStep` compiles it
(``torch.compile``; on a GPU with ``mode="reduce-overhead"``, which captures a CUDA graph per input
shape) and keeps the compiled function for the life of the process, so compiled code and captured
graphs outlive one rollout. Batch sizes come from a small fixed set of buckets
(:func:`row_buckets`), and the batch dimension is compiled as a symbol, as is the span of cache
columns a step reads: one compile serves every bucket and span (on a GPU a CUDA graph is still
captured per bucket and span) instead of one compile per bucket.
One compile of Qwen2.5-0.5B's 24 layers took 45-55 s on an H200's host (the first rollout's extra
time); on a 2-core CPU, 24 narrow layers took 66.5 s with an empty compile cache, once for every
bucket and span (``python bench/decode_compile.py --layers 24``; the README has the comparisons).

With the inductor back end the step is compiled ahead of time and kept
(:mod:`resilient_rl.models.decode_kept`): the run's other processes load it instead of tracing it.

What compiling costs is counted, not assumed: :class:`DecodeStats` reads the compiler's own
counters (graphs compiled, graph breaks) around a generation. A compiled step that raises is an
event, not a silent slowdown: the process then decodes eagerly (the same results, the same
kernels as uncompiled) and every later generation reports ``eager_fallback`` with the reason. An
out of memory error is not a compiler failure: it reaches the rollout's pass, which says what to
change (:mod:`resilient_rl.workers.out_of_memory`), and the step stays compiled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from resilient_rl.models.cache_attention import EngineStep
from resilient_rl.models.compile_fallback import allow_recompiles
from resilient_rl.models.decode_kept import kept_steps, unkeepable
from resilient_rl.models.sampling import pick_tokens

__all__ = ["DecodeStats", "DecodeStep", "decode", "row_buckets"]

log = logging.getLogger(__name__)

#: Batch sizes a generation decodes at, at most (one compiled graph each).
BUCKET_LEVELS = 4


def row_buckets(batch: int, floor: int = 1, levels: int = BUCKET_LEVELS) -> list[int]:
    """Batch sizes the engine decodes at, largest first: ``batch``, then halvings rounded up to a
    multiple of ``floor`` (at most ``levels`` sizes in all, none below ``floor``)."""
    sizes = [batch]
    while len(sizes) < levels:
        half = -(-sizes[-1] // 2)  # half, rounded up
        half = -(-half // floor) * floor  # to a multiple of floor
        if half < floor or half >= sizes[-1]:
            break
        sizes.append(half)
    return sizes


def decode(forward: Callable, model, keys, values, tokens, position, column, key_valid, draw, temperature: float,
           top_p: float) -> torch.Tensor:
    """One decode step: feed ``tokens`` ``[B]`` at ``position`` ``[B, 1]`` into cache column
    ``column`` ``[1]`` and pick the next tokens ``[B]`` from the logits with the uniform numbers
    ``draw`` ``[B, 1]`` (None: greedy)."""
    step = EngineStep(keys, values, column, key_valid=key_valid)
    return pick_tokens(forward(model, tokens[:, None], position, step), temperature, top_p, draw)


@dataclass
class DecodeStats:
    """Counters of one generation: decode steps run, batch sizes used, compactions, and the
    compiler's work during it (graphs compiled, graph breaks, graphs inductor ran without the CUDA
    graphs asked for), plus the eager fallback if any, and the seconds of its two parts."""

    compiled: bool = False
    steps: int = 0
    compactions: int = 0
    buckets: list[int] = field(default_factory=list)
    compiles: int = 0
    graph_breaks: int = 0
    #: Graphs inductor left out of CUDA graphs (``reduce-overhead``; its log says why): they run,
    #: correct but slower.
    cudagraph_skips: int = 0
    eager_fallback: str | None = None
    #: Whether the compiled step ran a version kept for other processes (see :mod:`.decode_kept`).
    kept: bool = False
    #: Seconds of the prompts' forward (prefill) and of the decode loop after it, each ended by a
    #: device synchronisation: the loop's seconds over ``steps`` is the step's time in place, its
    #: host work between the compiled steps included.
    prefill_s: float = 0.0
    loop_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _compiler_counts() -> tuple[int, int, int]:
    """The process's graphs compiled, graph breaks and CUDA-graph skips so far."""
    from torch._dynamo.utils import counters

    return (int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values())),
            int(counters["inductor"]["cudagraph_skips"]))


class DecodeStep:
    """The decode step as this process runs it: compiled (see the module docstring) or eager."""

    _compiled: dict[str, Callable] = {}
    #: The compiler back end (a test may wrap inductor to read the graphs it is given).
    backend: str | Callable = "inductor"
    #: Why compiling failed in this process (None: it did not); once set, decoding stays eager.
    failure: str | None = None

    #: Why this process could not compile the step to keep it (None: it could); once set, the step
    #: is compiled as before, and a new process traces it again.
    kept_failure: str | None = None

    def __init__(self, compile: bool, cuda_graphs: bool, key: str | None = None):
        """``key``: the model's :func:`~resilient_rl.models.decode_kept.step_key` (None: the step is
        not kept for other processes)."""
        self.compile = compile and DecodeStep.failure is None
        self.mode = "reduce-overhead" if cuda_graphs else None
        self.key = key
        self.stats = DecodeStats(compiled=self.compile, eager_fallback=DecodeStep.failure)
        self._start = _compiler_counts()

    def _keeps(self) -> bool:
        """Whether this call runs a kept version of the step (the inductor back end, a model key, a
        torch that can keep it, and no failure of a kept version in this process yet)."""
        if self.key is None or DecodeStep.backend != "inductor" or DecodeStep.kept_failure is not None:
            return False
        reason = unkeepable()
        if reason is not None:
            DecodeStep.kept_failure = reason
            log.info("rollout engine: %s; the decode step is traced in every new process", reason)
        return reason is None

    def _drop_kept(self, exc: Exception, what: str) -> None:
        """Stop keeping the step in this process: it is compiled as before from now on."""
        DecodeStep.kept_failure = f"{type(exc).__name__}: {exc}"[:500]
        self.stats.kept = False
        log.warning("rollout engine: the kept decode step %s (%s); this process compiles the step as before, and "
                    "a new process traces it again", what, DecodeStep.kept_failure)

    def _kept_version(self, args) -> Callable | None:
        """The kept version of the step for ``args``, compiled now if none is held yet (None: the
        step is not kept in this process)."""
        if not self._keeps():
            return None
        kept = kept_steps(self.key, self.mode)
        fn = kept.find(args)
        if fn is None:
            try:
                fn = kept.compile(decode, args, _mark_dynamic)
            except Exception as exc:  # noqa: BLE001 -- the step compiled as before is as correct
                self._drop_kept(exc, "could not be compiled")
                return None
        self.stats.kept = True
        return fn

    def _run(self, args) -> torch.Tensor:
        fn = self._kept_version(args)
        if fn is None:
            _mark_dynamic(args)
            fn = self._function()
        if self.mode == "reduce-overhead":
            # Each call is a new step of the CUDA graphs: the tokens it returns live in the
            # graph's memory, overwritten by the next replay, so they are copied out (B ids)
            # before they are fed back in.
            torch.compiler.cudagraph_mark_step_begin()
            return fn(*args).clone()
        return fn(*args)

    def _compiled_step(self, args) -> torch.Tensor:
        """The compiled step: a kept version, or where that fails, the step compiled as before. A
        failed call may be repeated: a decode step only overwrites one cache column and returns
        logits. (Where the step compiled as before fails, :meth:`__call__` decodes eagerly.)"""
        try:
            return self._run(args)
        except torch.OutOfMemoryError:  # the device's, not the kept version's: any version needs the memory
            raise
        except Exception as exc:  # noqa: BLE001 -- the step compiled as before is as correct
            if not self._keeps():
                raise
            self._drop_kept(exc, "failed")
        return self._run(args)

    def _function(self) -> Callable:
        key = str(self.mode)
        if key not in DecodeStep._compiled:
            allow_recompiles(BUCKET_LEVELS * 4)
            mode = {"mode": self.mode} if DecodeStep.backend == "inductor" else {}
            # dynamic=None: only the dimensions marked in __call__ (the batch) are symbols.
            DecodeStep._compiled[key] = torch.compile(decode, backend=DecodeStep.backend, dynamic=None, **mode)
        return DecodeStep._compiled[key]

    def __call__(self, *args) -> torch.Tensor:
        self.stats.steps += 1
        batch = int(args[4].shape[0])
        if not self.stats.buckets or self.stats.buckets[-1] != batch:
            self.stats.buckets.append(batch)
        if not self.compile:
            return decode(*args)
        try:
            return self._compiled_step(args)
        except torch.OutOfMemoryError:  # not a compiler failure: the run learns what to change
            raise
        except Exception as exc:  # noqa: BLE001 -- any compiler failure: the eager step is correct too
            DecodeStep.failure = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("rollout engine: the compiled decode step failed (%s); this process decodes eagerly "
                        "from now on", DecodeStep.failure)
            self.compile = False
            self.stats.eager_fallback = DecodeStep.failure
            return decode(*args)

    def finish(self) -> dict:
        """The generation's :class:`DecodeStats` as a dict (the compiler's counts since the start)."""
        now = _compiler_counts()
        self.stats.compiles, self.stats.graph_breaks, self.stats.cudagraph_skips = (
            n - start for n, start in zip(now, self._start))
        return self.stats.as_dict()


def _mark_dynamic(args) -> None:
    """Compile the batch dimension of :func:`decode`'s row inputs (the cache's keys and values,
    tokens, positions, key mask, draws) and the cache columns read (keys, values, key mask) as
    symbols, so that compaction to a smaller bucket and a longer span of columns reuse the compiled
    step. ``maybe``: a size the compiler must specialise (a single row) recompiles once instead of
    failing."""
    keys, values, tokens, position, _, key_valid, draw = args[2:9]
    for t in (*keys, *values, tokens, position, key_valid, draw):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    for t in (*keys, *values):
        torch._dynamo.maybe_mark_dynamic(t, 2)
    torch._dynamo.maybe_mark_dynamic(key_valid, 1)
